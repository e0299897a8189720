"""``--transformer-impl transformer_engine``: the block's linears, fused LayerNorm-linears and
attention from NVIDIA transformer-engine (TE), sharded exactly as megalite's own layers.

What each local layer becomes (TE 2.x, ``transformer_engine.pytorch``):

| local (``--transformer-impl local``)      | transformer-engine                               |
|-------------------------------------------|--------------------------------------------------|
| norm + ``ColumnParallelLinear`` (qkv, fc1) | ``LayerNormLinear(parallel_mode="column")``      |
| ``RowParallelLinear`` (proj, fc2)          | ``Linear(parallel_mode="row")``                  |
| ``attention()`` core                       | ``DotProductAttention(qkv_format="sbhd")``       |
| final norm, MoE layers' MLP norm           | ``LayerNorm`` / ``RMSNorm`` (``layers.norms``)   |

TE does the same tensor/sequence-parallel communication as megalite's conjugate pairs, along
dim 0 of the (s, b, h) activations: a column layer all-gathers its input under SP (identity
forward, all-reduce of the input gradient without SP); a row layer reduce-scatters (SP) or
all-reduces its output, then adds the full bias. Sizes given to TE are the full ones; it
divides by the TP size itself.

**Same parameters, same names.** Each TE parameter carries megalite's TP split
(``mark_tensor_parallel``): column weights and biases are cut along dim 0 (by sections for
SwiGLU's [gate; up]), row weights along dim 1, and replicated parameters that see a sequence
shard under SP are marked for the TP all-reduce of their gradients (TE itself never reduces
them). A LayerNormLinear's ``layer_norm_weight``/``layer_norm_bias`` are also registered, first,
under the local norm's name (``layers.N.attn_norm.weight``) by :class:`FusedNormParameters`, so
``named_parameters()`` (which lists a shared parameter once, by its first name) gives the local
names: initialization, checkpoints, resume, reshard and Hugging Face export are unchanged, and a
checkpoint moves between the two implementations as it is. Initialization is megalite's (TE's
``init_method`` is a no-op), so the same seed gives the same model.

``--tp-comm-overlap`` (Megatron's flag) hands TE the TP communication of the sequence-parallel
linears to overlap with their GEMMs through its userbuffers: the column layers (qkv, fc1) all-
gather their input chunk by chunk inside the forward GEMM and overlap their backward's
reduce-scatter and weight-gradient GEMM ("bulk" dgrad/wgrad); the row layers (proj, fc2)
reduce-scatter their output inside the GEMM and all-gather the output gradient inside the
backward's. :func:`tp_comm_overlap` sets up (and afterwards frees) the buffers, sized for one
micro-batch's (s b / CP, h) tokens, on TP groups of consecutive ranks, as the grid's are.

Under context parallelism the attention core is megalite's ring attention (on
``--attention-backend``), between TE's linears; an explicit ``--attention-backend
triton|flash|torch`` also keeps megalite's attention, ``auto`` takes TE's.

FP8 (``--fp8-format``, delayed scaling) is in :mod:`megalite.layers.fp8`. transformer-engine
needs a CUDA GPU with cuDNN: without it every flag here is refused with what is missing.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.errors import ConfigError
from megalite.layers.backends import te_missing
from megalite.layers.part_shape import SelfAttentionShape
from megalite.parallel.comm import group_rank, group_size
from megalite.parallel.random import get_rng_tracker
from megalite.parallel.sharding import TPSplit, mark_sequence_parallel, mark_tensor_parallel

TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("e4m3", "hybrid")
AMAX_ALGOS = ("most_recent", "max")
FP8_ALIGN = 16  # TE's FP8 GEMMs need every weight dimension a multiple of 16


def uses_te(cfg) -> bool:
    return cfg.transformer_impl == "transformer_engine"


def check_transformer_impl(m, tp: int = 1) -> None:
    """Raise ConfigError for a setting that cannot run here (called by config.validate with the
    tensor-parallel size ``tp``: FP8 needs the per-rank weight sizes aligned)."""
    if m.transformer_impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"--transformer-impl {m.transformer_impl!r} is unknown. Fix: local or transformer_engine.")
    if m.fp8_format is not None:
        if m.fp8_format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format {m.fp8_format!r} is unknown. Fix: e4m3 (forward and backward) or "
                              f"hybrid (e4m3 forward, e5m2 gradients).")
        if m.fp8_amax_compute_algo not in AMAX_ALGOS or m.fp8_amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-compute-algo {m.fp8_amax_compute_algo!r} / --fp8-amax-history-len "
                              f"{m.fp8_amax_history_len}: Fix: most_recent or max, and a history of at least 1.")
        if m.transformer_impl != "transformer_engine":
            raise ConfigError(f"--fp8-format {m.fp8_format} trains in FP8 through transformer-engine's layers. "
                              f"Fix: add --transformer-impl transformer_engine (on a GPU with transformer-engine "
                              f"installed), or drop --fp8-format.")
    if m.transformer_impl != "transformer_engine":
        return
    why = te_missing()
    if why:
        raise ConfigError(f"--transformer-impl transformer_engine cannot run: {why}. Fix: install it on a "
                          f"GPU machine, or use --transformer-impl local (megalite's own layers).")
    if m.fp8_format is not None:
        _check_fp8_shapes(m, tp)


def check_tp_comm_overlap(m, tp: int, sequence_parallel: bool, half_precision: bool) -> None:
    """Raise ConfigError where ``--tp-comm-overlap`` cannot run (called by config.validate)."""
    if not m.tp_comm_overlap:
        return
    rules = [
        (m.transformer_impl == "transformer_engine", "overlaps the TP communication inside transformer-engine's "
         "linears (userbuffers)", "add --transformer-impl transformer_engine"),
        (tp > 1, "has nothing to overlap at --tensor-model-parallel-size 1", "drop --tp-comm-overlap, or use TP > 1"),
        (sequence_parallel, "overlaps the all-gathers and reduce-scatters of sequence parallelism",
         "add --sequence-parallel"),
        (half_precision, "keeps its buffers in bf16/fp16 (or FP8)", "add --bf16"),
        (not m.num_experts, "covers the dense layers' linears, and MoE layers' experts are megalite's own",
         "drop --tp-comm-overlap for an MoE model"),
        (m.tp_comm_bootstrap_backend in ("nccl", "mpi", "gloo"),
         f"bootstraps with nccl, mpi or gloo, not {m.tp_comm_bootstrap_backend!r}",
         "--tp-comm-bootstrap-backend nccl"),
    ]
    for ok, why, fix in rules:
        if not ok:
            raise ConfigError(f"--tp-comm-overlap {why}. Fix: {fix}.")


def tp_comm_overlap(config):
    """Set up TE's userbuffers for ``--tp-comm-overlap`` (after the process group, before the
    first forward); returns the function that frees them (a no-op without the flag)."""
    m, t, p = config.model, config.train, config.parallel
    if not m.tp_comm_overlap:
        return lambda: None
    te = _te()
    base = te.module.base
    tokens = m.seq_length * t.micro_batch_size // p.context_parallel_size  # one micro-batch, all TP ranks
    base.initialize_ub(shape=[tokens, m.hidden_size], tp_size=p.tensor_model_parallel_size,
                       use_fp8=m.fp8_format is not None, dtype=torch.bfloat16 if t.bf16 else torch.float16,
                       bootstrap_backend=m.tp_comm_bootstrap_backend)
    return base.destroy_ub


def _overlap(cfg, ub_name: str | None, column: bool) -> dict:
    """The userbuffer arguments of one TE linear under ``--tp-comm-overlap`` (Megatron's choice)."""
    if not getattr(cfg, "tp_comm_overlap", False) or ub_name is None:
        return {}
    if column:  # input all-gather in the forward GEMM; dgrad reduce-scatter and wgrad overlapped in bulk
        return dict(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name=ub_name)
    return dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name=ub_name)  # output reduce-scatter; dgrad all-gather


def _check_fp8_shapes(m, tp: int) -> None:
    if m.recompute_granularity == "full":
        raise ConfigError("--recompute-granularity full with --fp8-format: a recomputed FP8 layer must reuse "
                          "the forward's scaling factors (transformer-engine's own checkpoint function), which "
                          "megalite's full recompute does not do. Fix: --recompute-granularity selective, or "
                          "drop one of the two.")
    qkv, proj = SelfAttentionShape.linears(m)  # TE's attention is megalite's self-attention
    per_rank = "" if tp == 1 else f" per TP rank (TP {tp})"
    dims = {"hidden size": m.hidden_size, f"FFN size{per_rank}": m.ffn_hidden_size // tp,
            f"qkv width{per_rank}": qkv.out_features // tp,
            f"attention width (heads x head dim){per_rank}": proj.in_features // tp}
    bad = {k: v for k, v in dims.items() if v % FP8_ALIGN}
    if bad:
        listed = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise ConfigError(f"--fp8-format: transformer-engine's FP8 GEMMs need every weight dimension (as split "
                          f"over TP) divisible by {FP8_ALIGN}; {listed} is not. Fix: choose sizes that are "
                          f"multiples of {FP8_ALIGN} x TP, or drop --fp8-format.")


def _te():
    why = te_missing()
    if why:
        raise RuntimeError(f"transformer-engine layers were asked for but cannot run: {why}. "
                           f"Fix: install it on a GPU machine, or use --transformer-impl local.")
    import transformer_engine.pytorch as te

    return te


def _no_init(weight: torch.Tensor) -> None:
    """TE's ``init_method``: nothing; megalite draws every weight from (seed, name) itself."""


def _common(tp_group, sequence_parallel: bool) -> dict:
    """The arguments every TE linear takes: its TP group, SP, fp32 parameters on the device
    the model is being built on (meta under ``build_model_chunks``: TE defers its init)."""
    return dict(tp_group=tp_group, tp_size=group_size(tp_group), sequence_parallel=sequence_parallel,
                params_dtype=torch.get_default_dtype(), device=torch.get_default_device(), init_method=_no_init)


def _mark_column(module, in_features: int, out_features: int, sections: int, tp_group) -> None:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    mark_tensor_parallel(module.weight, (out_features, in_features), TPSplit(0, sections), rank, tp)
    if _has_bias(module):
        mark_tensor_parallel(module.bias, (out_features,), TPSplit(0, sections), rank, tp)


def _has_bias(module) -> bool:
    # TE keeps ``bias`` as an empty plain tensor when built with bias=False.
    return isinstance(getattr(module, "bias", None), nn.Parameter)


def column_parallel_linear(cfg, in_features: int, out_features: int, *, bias: bool, sections: int = 1,
                           norm_inside: bool = False, name: str | None = None, tp_group=None,
                           sequence_parallel: bool = False):
    """A TE column-parallel linear y = x W^T (+ b), W cut along its rows over TP.

    ``norm_inside``: the block's norm before it runs inside (``LayerNormLinear``), with
    ``cfg.normalization`` and ``cfg.norm_epsilon``; its parameters join this module
    (``layer_norm_weight``, and ``layer_norm_bias`` for LayerNorm). ``name``: its role (qkv, fc1),
    which names its userbuffers under ``--tp-comm-overlap``."""
    te = _te()
    common = {**_common(tp_group, sequence_parallel), **_overlap(cfg, name, column=True)}
    if norm_inside:
        module = te.LayerNormLinear(in_features, out_features, eps=cfg.norm_epsilon, bias=bias,
                                    normalization=cfg.normalization, parallel_mode="column", **common)
        if sequence_parallel:
            for p in _norm_parameters(module):
                mark_sequence_parallel(p)
    else:
        module = te.Linear(in_features, out_features, bias=bias, parallel_mode="column", **common)
    _mark_column(module, in_features, out_features, sections, tp_group)
    return module


def row_parallel_linear(cfg, in_features: int, out_features: int, *, bias: bool, name: str | None = None,
                        tp_group=None, sequence_parallel: bool = False):
    """A TE row-parallel linear: W cut along its columns, the partial products all-reduced
    (reduce-scattered under SP), then the full bias added."""
    te = _te()
    module = te.Linear(in_features, out_features, bias=bias, parallel_mode="row",
                       **_common(tp_group, sequence_parallel), **_overlap(cfg, name, column=False))
    mark_tensor_parallel(module.weight, (out_features, in_features), TPSplit(1), group_rank(tp_group),
                         group_size(tp_group))
    if _has_bias(module) and sequence_parallel:
        mark_sequence_parallel(module.bias)  # added to a sequence shard only
    return module


def _norm_parameters(module) -> list[nn.Parameter]:
    params = [module.layer_norm_weight]
    if isinstance(getattr(module, "layer_norm_bias", None), nn.Parameter):
        params.append(module.layer_norm_bias)
    return params


class FusedNormParameters(nn.Module):
    """The norm that runs inside the next TE ``LayerNormLinear``: identity here; it holds that
    module's norm parameters as ``weight`` (and ``bias``), so they are named as the local norm's
    (registered before the linear, this is the name ``named_parameters()`` gives them)."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        params = _norm_parameters(fused)
        self.weight = params[0]
        if len(params) > 1:
            self.bias = params[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def has_norm_inside(linear: nn.Module) -> bool:
    return isinstance(getattr(linear, "layer_norm_weight", None), nn.Parameter)


class TECoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d), causal) v by TE's ``DotProductAttention`` (it picks its flash,
    cuDNN or unfused kernel), on this rank's heads. Takes and returns megalite's (b, heads, s, d)
    layout; TE's own is (s, b, heads, d). Attention dropout draws from the tensor-parallel RNG
    stream (TE forks megalite's tracker), as the local attention does."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        te = _te()
        tracker = get_rng_tracker if cfg.attention_dropout > 0 else None
        self.attention = te.DotProductAttention(
            cfg.num_attention_heads, cfg.head_dim, num_gqa_groups=cfg.num_query_groups,
            attention_dropout=cfg.attention_dropout, qkv_format="sbhd", attn_mask_type="causal",
            tp_size=group_size(tp_group), tp_group=tp_group, get_rng_state_tracker=tracker)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, s, d = q.shape
        q, k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (q, k, v))
        out = self.attention(q, k, v)  # (s, b, h * d)
        return out.view(s, b, h, d).permute(1, 2, 0, 3)


def te_attention_core(cfg, tp_group, cp_group) -> TECoreAttention | None:
    """TE's attention for this block, or None where megalite's runs (CP, or an explicit backend)."""
    if not uses_te(cfg) or cp_group is not None or cfg.attention_backend != "auto":
        return None
    return TECoreAttention(cfg, tp_group)
