"""Per-layer memory of one micro-batch, the planner's building blocks: what a layer keeps for
its backward (:func:`layer_activation_bytes`), and under a zero-bubble schedule what its
deferred weight gradients keep between B and W (the W inputs, :func:`w_input_layer_bytes`) and
what a running W holds (:func:`w_gradient_chunk_bytes`); see :mod:`megalite.planner` and
:mod:`megalite.planner.pipeline` for how they add up per rank. Below both (no planner import).
"""
from __future__ import annotations

from megalite.config import ModelConfig
from megalite.layers.part_shape import MLPShape
from megalite.model.counting import layer_activation_bytes  # noqa: F401  (the parts' activations, re-exported)
from megalite.model.parts import attention_part
from megalite.moe import planning as moe_planning
from megalite.planner.types import Precision


def chunk_moe_flags(m: ModelConfig, chunks: int, g: int) -> list[bool]:
    """For each layer of global chunk ``g`` of ``chunks``, whether it is MoE (cached per model shape)."""
    if not m.num_experts:
        return [False] * (m.num_layers // chunks)
    key = (m.num_layers, repr(m.moe_layer_freq), chunks, g)
    if key not in _MOE_FLAGS:
        _MOE_FLAGS[key] = tuple(moe_planning.stage_moe_flags(m, chunks, g))
    return list(_MOE_FLAGS[key])


_MOE_FLAGS: dict[tuple, tuple[bool, ...]] = {}


def w_input_layer_bytes(m: ModelConfig, micro: int, tp: int = 1, sp: bool = False, cp: int = 1,
                        act_bytes: int = 2, moe: bool = False) -> float:
    """Wi: the bytes one layer keeps between B and W for one micro-batch (the deferred weight
    gradient's inputs: every linear's input x and its output's gradient dy), with s = seq/CP
    tokens, b micro batch, h hidden, t = TP, q = heads x head dim, kv = 2 x key/value groups x
    head dim, f the FFN size, k = 2 with SwiGLU else 1, e = ``act_bytes``::

        x:   QKV s b h (/t under SP)   proj s b q / t   fc1 s b h (/t under SP)   fc2 s b f / t
        dy:  QKV s b (q + kv) / t      proj s b h       fc1 s b k f / t           fc2 s b h
        Wi = e x (sum of these)

    The row-parallel linears' (proj, fc2) output gradients are whole ``s b h`` on every TP rank,
    so Wi shrinks less with TP than the activations: at t = 8 (GPT, f = 4h) Wi = 7.5 s b h bytes
    against the activations' 34 s b h / 8. Recomputation does not change it (it runs in B).
    An MoE layer (``moe``) has, in place of the dense MLP, its experts' fc1 and fc2 on the
    N = k_route T rows it routes (T = s b, /t under SP; experts are not split over TP) and the
    shared expert as a dense MLP; the router's weight gradient stays in B."""
    s, b = m.seq_length / cp, micro
    attention = attention_part(m).w_input_elements(m, s * b, tp, sp)  # the parts' linears (PartShape)
    if moe:
        rows = moe_planning.routed_tokens(m, micro, tp, sp, cp) * m.moe_router_topk
        mlp = MLPShape.w_input_elements(m, rows, 1, False, m.moe_ffn_hidden_size)
        mlp += MLPShape.w_input_elements(m, s * b, tp, sp, m.moe_shared_expert_intermediate_size or 0)
    else:
        mlp = MLPShape.w_input_elements(m, s * b, tp, sp, m.ffn_hidden_size)
    return act_bytes * (attention + mlp)


def w_input_chunk_bytes(m: ModelConfig, chunks: int, g: int, micro: int, tp: int, sp: bool, cp: int,
                        act_bytes: int) -> float:
    """Wi of global chunk ``g`` of ``chunks``: its layers', plus on chunk 0 the word embedding's
    (dy, s b h, and the token ids, 8 s b) and on the last chunk the output layer's (x, s b h /t
    under SP, and dy, the logits' gradient s b V / t, in the activations' dtype)."""
    s, b = m.seq_length / cp, micro
    flags = chunk_moe_flags(m, chunks, g)
    args = dict(micro=micro, tp=tp, sp=sp, cp=cp, act_bytes=act_bytes)
    moe = sum(flags)
    total = (len(flags) - moe) * w_input_layer_bytes(m, **args)
    total += moe * w_input_layer_bytes(m, moe=True, **args) if moe else 0.0
    if g == 0:
        total += s * b * (act_bytes * m.hidden_size + 8)
    if g == chunks - 1:
        total += act_bytes * s * b * (m.hidden_size / (tp if sp else 1) + m.padded_vocab_size(tp) / tp)
    return total


def _linear_weights(m: ModelConfig, ffn: int, tp: int) -> list[float]:
    """Elements of each linear weight of an MLP of FFN size ``ffn`` on one TP rank: fc1 ``k f h / t``
    and fc2 ``f h / t`` (none without an MLP)."""
    return [linear.weight / tp for linear in MLPShape.linears(m, ffn)]


def w_gradient_chunk_bytes(m: ModelConfig, chunks: int, g: int, micro: int, tp: int, cp: int, ep: int,
                           prec: Precision, w_inputs: float) -> float:
    """G_c: the most a running W of global chunk ``g`` holds beyond what the rank held before it
    (that micro-batch's W inputs ``w_inputs`` included). :meth:`WeightGradStore.run` takes the
    chunk's deferred weights in B's order (the last layer first; the output layer first on the
    last chunk, the word embedding last on the first) and accumulates each dW (the weight's
    dtype, e = ``prec.weight_bytes``) into its parameter as soon as it is computed, dropping its
    inputs then; AccumulateGrad copies it (the store still refers to it) before the gradient
    hook moves it into the bucket. So, with D = the largest weight (elements) of the chunk's
    linears (the last chunk's output layer, V/t x h, among them), E = the word embedding (first
    chunk), Wi = ``w_inputs``, e_E = the embedding's own W inputs (s b (e_a h + 8))::

        G_c = max(2 e D,                    any dW while the chunk's W inputs are all held
                  2 e E - (Wi - e_E))       the embedding's, its chunk's other inputs gone

    MoE layers with the loop of experts (not --moe-grouped-gemm): each expert's weight is an
    ``unbind`` of the stacked parameter, so its dW waits for one final backward with every
    other: then the chunk's expert gradients (e X, X its expert parameters) and the stack of the
    largest stacked weight (e S, which AccumulateGrad takes without a copy) are held, the W
    inputs all gone: ``e X + e S - Wi``. With --moe-grouped-gemm the stacked weight is one
    deferred weight (S in D). The dry run of a 13B at TP 2 x PP 2 shows 2 e D within 0.1 GiB of
    what W adds (the dW computed, its inputs dropped, the copy: 0.37 GiB for the 0.24 GiB output
    layer); that of a 4-layer MoE (8 experts over EP 2, h 1024, SwiGLU f 4096) e X + e S - Wi
    within 0.01 GiB (0.09 against 0.10)."""
    h = m.hidden_size
    e = prec.weight_bytes
    flags = chunk_moe_flags(m, chunks, g)
    attention = [linear.weight / tp for linear in attention_part(m).linears(m)]  # QKV, proj
    largest, experts, stacked = max(attention), 0.0, 0.0
    if not all(flags):  # a dense layer
        largest = max([largest] + _linear_weights(m, m.ffn_hidden_size, tp))
    if any(flags):
        largest = max([largest] + _linear_weights(m, m.moe_shared_expert_intermediate_size or 0, tp))
        local, f, sections = m.num_experts // ep, m.moe_ffn_hidden_size, 2 if m.swiglu else 1
        stacked = local * sections * f * h  # w1 of one MoE layer: E/EP experts' fc1
        if m.moe_grouped_gemm:
            largest = max(largest, stacked)
        else:
            experts = sum(flags) * moe_planning.expert_parameters(m) * local
    vocab = m.padded_vocab_size(tp) * h / tp
    if g == chunks - 1:  # the output layer (or the last chunk's copy of a tied embedding), first in W
        largest = max(largest, vocab)
    options = [2 * e * largest]
    if g == 0:  # the word embedding, last in W
        s, b = m.seq_length / cp, micro
        options.append(2 * e * vocab - (w_inputs - s * b * (prec.act_bytes * h + 8)))
    if experts:
        options.append(e * experts + e * stacked - w_inputs)
    return max(options)
