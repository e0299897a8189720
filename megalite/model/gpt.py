"""A GPT decoder that reads as serial code.

Default architecture is exactly GPT-2: learned absolute positions, pre-LayerNorm blocks,
a GELU MLP of 4h, input and output embeddings tied, biases everywhere. Options give the
Llama-style variant: rotary positions, RMSNorm, SwiGLU, grouped-query attention and an
untied output layer.

Weight layout (what a checkpoint or a tensor-parallel shard refers to):
- ``qkv.weight`` has ``groups * (heads_per_group + 2) * head_dim`` rows ordered by
  key/value group: the group's query heads, then its key head, then its value head.
  Splitting the rows into TP contiguous chunks therefore gives each rank whole groups.
- SwiGLU fuses the gate and up projections into ``fc1.weight`` = [gate; up]; under TP each
  rank holds its chunk of each half (``TPSplit(0, sections=2)``).
- Layers are named by their *global* index (``layers.7``) whatever pipeline stage
  holds them, so names do not depend on the layout.

Mixture of experts (``--num-experts``): the MLP of the layers ``moe_layers(cfg)`` picks is a
:class:`megalite.moe.block.MoEMLP` (router, experts spread over the expert-parallel group,
the aux losses entering backward on their own); the block reads the same.

Parallelism enters only through the layers (``megalite.layers.tensor_parallel``): with
a TP group of one rank they are plain linears and embeddings. Activations inside the
model are sequence-first, (s, b, h); under sequence parallelism the residual stream holds
this rank's s/TP positions.

Initialization is GPT-2's (N(0, 0.02), output projections of each residual branch
scaled by 1/sqrt(2 * layers), biases 0, norms 1), drawn per parameter from
``(seed, name)`` in full and then sliced: see ``megalite.parallel.random``.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.layers.attention import attention
from megalite.layers.documents import Documents
from megalite.layers.kv_cache import cached_attention
from megalite.layers.fp8 import fp8_autocast
from megalite.layers.norms import build_norm
from megalite.layers import transformer_engine as te_layers
from megalite.layers.rotary import apply_rotary, rotary_angles
from megalite.layers.weight_grad import embedding, linear, mark_deferred
from megalite.moe.block import MoEMLP
from megalite.moe.settings import moe_layers
from megalite.layers.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             sequence_parallel_linear, vocab_parallel_cross_entropy)
from megalite.context_parallel.attention import ContextParallelGroups, context_parallel_attention
from megalite.parallel import comm
from megalite.parallel.random import get_rng_tracker, init_full_tensor
from megalite.parallel.sharding import mark_sequence_parallel
from megalite.recompute import checkpointed, run_layers


class ParallelDropout(nn.Dropout):
    """Dropout on the residual stream. Replicated over TP (same mask on every TP rank, the
    default RNG stream), except under sequence parallelism, where each TP rank holds
    different positions and draws from the tensor-parallel stream."""

    def __init__(self, p: float, sequence_parallel: bool):
        super().__init__(p)
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        if self.sequence_parallel and self.training and self.p > 0:
            with get_rng_tracker().fork():
                return self._drop(x)
        return self._drop(x)

    def _drop(self, x):
        if x.device.type == "meta" and self.training and self.p > 0:
            # A dry run measures a GPU's memory: there F.dropout is the fused kernel, keeping a
            # 1-byte mask (the composite path the meta device would take keeps one of x's dtype).
            return torch.ops.aten.native_dropout(x, self.p, True)[0]
        return super().forward(x)


def _norm(cfg: ModelConfig, sequence_parallel: bool) -> nn.Module:
    fused = "te" if te_layers.uses_te(cfg) else cfg.fused_kernels
    norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, fused=fused)
    if sequence_parallel:
        for p in norm.parameters():
            mark_sequence_parallel(p)
    return norm


def _norm_before(linear: nn.Module, cfg: ModelConfig, sequence_parallel: bool) -> nn.Module:
    """The norm in front of ``linear``; with transformer-engine it runs inside the linear
    (LayerNormLinear), and this module only names its parameters as the local norm's."""
    if te_layers.has_norm_inside(linear):
        return te_layers.FusedNormParameters(linear)
    return _norm(cfg, sequence_parallel)


def _column(cfg: ModelConfig, in_features: int, out_features: int, *, bias: bool, sections: int = 1,
            norm_inside: bool = False, name: str | None = None, **par) -> nn.Module:
    """megalite's ColumnParallelLinear, or transformer-engine's (``norm_inside``: its
    LayerNormLinear, the norm before it fused in; the local layer keeps the norm apart;
    ``name``: the layer's role, naming TE's communication buffers)."""
    if te_layers.uses_te(cfg):
        return te_layers.column_parallel_linear(cfg, in_features, out_features, bias=bias, sections=sections,
                                                norm_inside=norm_inside, name=name, **par)
    return ColumnParallelLinear(in_features, out_features, bias=bias, sections=sections, **par)


def _row(cfg: ModelConfig, in_features: int, out_features: int, *, bias: bool, name: str | None = None,
         **par) -> nn.Module:
    if te_layers.uses_te(cfg):
        return te_layers.row_parallel_linear(cfg, in_features, out_features, bias=bias, name=name, **par)
    return RowParallelLinear(in_features, out_features, bias=bias, **par)


class SelfAttention(nn.Module):
    """Causal self-attention, split over TP by key/value groups (with their query heads).

    Under context parallelism (``cp_group`` of 2+ ranks) the core attention is exchanged over
    the CP group the way ``cfg.cp_comm_type`` says; ``cp_hierarchy`` = (inner, outer) are the
    all-to-all and ring groups of the hierarchical type (``ProcessGrid.cp_hierarchy``)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 cp_hierarchy: tuple = (None, None)):
        super().__init__()
        self.cfg = cfg
        self.cp_group = cp_group if comm.group_size(cp_group) > 1 else None
        self.cp_groups = ContextParallelGroups(self.cp_group, *cp_hierarchy)
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        qkv_out = cfg.num_query_groups * (self.heads_per_group + 2) * cfg.head_dim
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.qkv = _column(cfg, cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear or cfg.add_qkv_bias,
                           norm_inside=True, name="qkv", **par)
        self.proj = _row(cfg, cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.add_bias_linear,
                         name="proj", **par)
        self.te_core = te_layers.te_attention_core(cfg, tp_group, self.cp_group)  # None: megalite's attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache=None, documents: Documents | None = None) -> torch.Tensor:
        d, hpg = self.cfg.head_dim, self.heads_per_group
        qkv = self.qkv(x)  # (s, b, local groups * (hpg + 2) * d): whole groups of this rank
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, hpg + 2, d).permute(1, 2, 3, 0, 4)  # (b, groups, hpg + 2, s, d)
        q = qkv[:, :, :hpg].reshape(b, -1, s, d)  # (b, heads, s, d), grouped by kv group
        k, v = qkv[:, :, hpg], qkv[:, :, hpg + 1]  # (b, groups, s, d)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            # q and k are new tensors now; saved for backward, the view v would keep all of qkv
            # alive (heads + groups head dims per token more than q, k, v need): copy it out.
            v = v.contiguous()
        dropout_p = self.cfg.attention_dropout if self.training else 0.0
        if cache is not None:  # generation: these positions attend over every position so far
            out = cached_attention(q, *cache.extend(k, v))
        elif self.cfg.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpointed(self.core_attention, q, k, v, dropout_p, documents)  # s^2 memory, few FLOPs
        else:
            out = self.core_attention(q, k, v, dropout_p, documents)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def core_attention(self, q, k, v, dropout_p: float, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: packed documents of the whole sequence (a token sees its own only)."""
        if self.cp_group is not None:
            # This rank holds a shard of the sequence: attend over all of it (ring, all-to-all, ...).
            return context_parallel_attention(q, k, v, self.cp_groups, self.cfg.cp_comm_type, causal=True,
                                              backend=self.cfg.attention_backend, documents=documents)
        if self.te_core is not None and documents is None:  # TE's core is given no document mask: megalite's runs
            return self.te_core(q, k, v)  # transformer-engine's, dropout on the TP stream inside
        if dropout_p > 0:
            # Attention probabilities belong to this rank's heads: a TP-split tensor.
            with get_rng_tracker().fork():
                return attention(q, k, v, causal=True, dropout_p=dropout_p, backend=self.cfg.attention_backend,
                                 documents=documents)
        return attention(q, k, v, causal=True, backend=self.cfg.attention_backend, documents=documents)


class MLP(nn.Module):
    """fc2(act(fc1(x))), split over TP along the FFN dimension (fc1 column-, fc2 row-parallel).
    ``ffn``: the FFN size (default ``cfg.ffn_hidden_size``; an MoE shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, sequence_parallel: bool = False, ffn: int | None = None,
                 norm_inside: bool = False):
        """``norm_inside``: with transformer-engine, the block's norm runs inside fc1."""
        super().__init__()
        self.swiglu = cfg.swiglu
        ffn = ffn or cfg.ffn_hidden_size
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        sections = 2 if cfg.swiglu else 1  # SwiGLU: fc1 = [gate; up]
        self.fc1 = _column(cfg, cfg.hidden_size, sections * ffn, bias=cfg.add_bias_linear, sections=sections,
                           norm_inside=norm_inside, name="fc1", **par)
        self.fc2 = _row(cfg, ffn, cfg.hidden_size, bias=cfg.add_bias_linear, name="fc2", **par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's gelu_new
        return self.fc2(h)


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); dropout on each branch output.

    Each norm is registered before the branch it feeds (with transformer-engine it lives
    inside the branch's first linear, and the first registration names its parameters)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 moe: bool = False, ep_group=None, token_group=None, cp_hierarchy: tuple = (None, None)):
        super().__init__()
        attn = SelfAttention(cfg, tp_group, sequence_parallel, cp_group, cp_hierarchy)
        self.attn_norm = _norm_before(attn.qkv, cfg, sequence_parallel)
        self.attn = attn
        if moe:
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp_norm = _norm(cfg, sequence_parallel)
            self.mlp = MoEMLP(cfg, tp_group, sequence_parallel, cp_group, ep_group, token_group,
                              shared_expert=MLP(cfg, tp_group, sequence_parallel, shared) if shared else None)
        else:
            mlp = MLP(cfg, tp_group, sequence_parallel, norm_inside=True)
            self.mlp_norm = _norm_before(mlp.fc1, cfg, sequence_parallel)
            self.mlp = mlp
        self.dropout = ParallelDropout(cfg.hidden_dropout, sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, cache=None, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, cache, documents))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """GPT over the layers ``layer_range`` (all by default).

    ``pre_process``: this module embeds tokens (first pipeline stage).
    ``post_process``: this module applies the final norm, output layer and loss (last stage).
    ``forward`` takes (b, s) tokens/positions/labels and returns per-token losses (b, s)
    when labels are given, else logits (b, s, vocab) over the real (unpadded) vocabulary;
    a middle stage returns its hidden states (s, b, h). ``documents``: packed documents (every
    token attends within its own; see megalite.layers.documents), whole-sequence arrays.
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: range | None = None, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, ep_group=None, token_group=None, amax_group=None,
                 cp_hierarchy: tuple = (None, None)):
        """``ep_group`` / ``token_group``: the expert-parallel group and the ranks holding one
        micro-batch together (TP x CP), for MoE layers (see megalite.moe.block).
        ``cp_hierarchy``: (inner, outer) groups of ``--cp-comm-type a2a+p2p``.
        ``amax_group``: the ranks that reduce FP8 amaxes together (the pipeline stage)."""
        super().__init__()
        self.cfg = cfg
        self.amax_group = amax_group
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_size = comm.group_size(cp_group)
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size or cfg.padded_vocab_size(comm.group_size(tp_group))
        self.layer_range = layer_range if layer_range is not None else range(cfg.num_layers)
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process or (post_process and tied):
            # A tied last stage that does not embed holds its own copy, kept equal to the
            # first stage's by the embedding-group all-reduce.
            self.word_embeddings = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, **par)
            if tied:
                self.word_embeddings.weight.tied_embedding = True
                if not pre_process:
                    self.word_embeddings.weight.embedding_copy = True
        if pre_process:
            if cfg.position_embedding_type == "learned_absolute":
                # On meta (as pretrain builds) nn.Embedding's own normal_ init is skipped: init_weights
                # draws every parameter, and normal_ on meta imports torch._dynamo (~1.3 s per process).
                shape = (cfg.max_position_embeddings, cfg.hidden_size)
                weight = torch.empty(shape) if torch.get_default_device().type == "meta" else None
                self.position_embeddings = nn.Embedding(*shape, _weight=weight)
                mark_deferred(self.position_embeddings.weight)
                if sequence_parallel:
                    mark_sequence_parallel(self.position_embeddings.weight)
            self.embedding_dropout = ParallelDropout(cfg.hidden_dropout, sequence_parallel)
        moe = moe_layers(cfg)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, **par, cp_group=cp_group, moe=moe[i],
                                                              ep_group=ep_group, token_group=token_group,
                                                              cp_hierarchy=cp_hierarchy)
                                     for i in self.layer_range})
        if post_process:
            self.final_norm = _norm(cfg, sequence_parallel)
            if not tied:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size,
                                                         bias=False, **par)

    # -- forward ---------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens.t())  # (s, b, h); under SP this rank's (s/TP, b, h)
        if self.cfg.position_embedding_type == "learned_absolute":
            positions = position_ids.t()
            if self.sequence_parallel:
                positions = comm.split_dim(positions, 0, self.tp_group)
            x = x + embedding(positions, self.position_embeddings.weight)
        return self.embedding_dropout(x)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, (s, b, V_padded / TP)."""
        if self.cfg.untie_embeddings_and_output_weights:
            return self.output_layer(x)
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.word_embeddings.weight, None, self.tp_group)
        return linear(comm.copy_to_tp(x, self.tp_group), self.word_embeddings.weight)

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden: torch.Tensor | None = None, kv_cache=None,
                documents: Documents | None = None):
        """``kv_cache`` (generation, :class:`megalite.layers.kv_cache.KVCache`): ``tokens`` are the
        next positions after the cached ones; their keys and values join the cache."""
        ref = tokens if tokens is not None else labels
        if position_ids is None and ref is not None:
            start = kv_cache.length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + ref.shape[1], device=ref.device).expand_as(ref)
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rotary_angles(position_ids, self.cfg.head_dim, self.cfg.rotary_base, self.cfg.rope_scaling)
        if kv_cache is not None:
            for name, layer in self.layers.items():
                x = layer(x, rope, kv_cache.layer(name))
            kv_cache.advance(position_ids.shape[1])
        else:
            layers = list(self.layers.values())
            if documents is not None:
                layers = [functools.partial(layer, documents=documents) for layer in layers]
            with fp8_autocast(self.cfg, self.amax_group, self):  # a no-op without --fp8-format
                x = run_layers(layers, x, rope, self.cfg.recompute_granularity,
                               self.cfg.recompute_method, self.cfg.recompute_num_layers, self.training)
        if not self.post_process:
            return x
        logits = self.output_logits(self.final_norm(x))
        if labels is None:  # full logits, for inspection and generation (not the loss path)
            full = comm.gather_from_tp(logits, self.tp_group)[..., : self.vocab_size]
            return full.transpose(0, 1)
        losses = vocab_parallel_cross_entropy(logits, labels.t(), self.vocab_size, self.tp_group,
                                              fused=self.cfg.fused_kernels)
        return losses.t()  # (b, s)

    # -- initialization --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init, reproducible per parameter from (seed, global name), layout-independent.

        Each full tensor is drawn on the CPU (one parameter at a time, so the whole model is
        never held there), sliced to this rank's shard and copied to the parameter's device:
        the same seed gives the same model on every device and under every layout. On meta
        there is nothing to draw."""
        std = self.cfg.init_method_std
        output_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if param.device.type == "meta" or getattr(param, "expert_parallel", False):
                continue  # experts: drawn per global expert index below
            leaf = name.rsplit(".", 1)[-1]
            full_shape = getattr(param, "full_shape", tuple(param.shape))
            if "norm" in name:
                full = torch.ones(full_shape) if leaf == "weight" else torch.zeros(full_shape)
            elif leaf == "bias":
                full = torch.zeros(full_shape)
            elif name in ("word_embeddings.weight", "output_layer.weight"):
                # Real rows from the seed, padding rows zero: independent of the padding
                # (which grows with TP). Tied copies on two stages share the name.
                real = init_full_tensor((self.vocab_size, full_shape[1]), seed,
                                        "word_embeddings.weight" if name.startswith("word") else name, std)
                full = torch.cat([real, torch.zeros(full_shape[0] - self.vocab_size, full_shape[1])])
            elif name.endswith("attn.proj.weight") or name.endswith("fc2.weight"):
                full = init_full_tensor(full_shape, seed, name, output_std)
            else:
                full = init_full_tensor(full_shape, seed, name, std)
            shard = param.shard_fn(full) if hasattr(param, "shard_fn") else full
            param.copy_(shard)
        for name, module in self.named_modules():
            if isinstance(module, MoEMLP):
                module.init_expert_weights(seed, f"{name}.", std, output_std)


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Give a module built on the meta device uninitialized storage on ``device``, keeping
    every Parameter's attributes (TP split, sequence-parallel marks): ``Module.to_empty``
    would make new Parameter objects without them. On meta, nothing to do."""
    device = torch.device(device)
    if device.type == "meta":
        return module
    done: dict = {}
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None or param.device == device:
                continue
            if param not in done:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                done[param] = new
            mod._parameters[name] = done[param]
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[name] = torch.empty_like(buf, device=device)
    return module


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full model (tied embedding counted once, real vocabulary)."""
    with torch.device("meta"):
        model = GPTModel(cfg, padded_vocab_size=cfg.vocab_size)
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token meets (for FLOPs): an MoE layer's token uses topk of its experts."""
    total = count_parameters(cfg)
    if not cfg.num_experts:
        return total
    per_expert = (3 if cfg.swiglu else 2) * cfg.hidden_size * cfg.moe_ffn_hidden_size
    return total - sum(moe_layers(cfg)) * (cfg.num_experts - cfg.moe_router_topk) * per_expert
