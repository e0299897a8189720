"""Self-attention, the default attention part of a layer (``attention_kind`` "self").

Causal softmax attention over grouped query heads, split over TP by key/value groups. The
fused ``qkv`` weight has ``groups * (heads_per_group + 2) * head_dim`` rows ordered by group
(the group's query heads, its key head, its value head), so TP's contiguous row chunks give each
rank whole groups. A variant (another scoring rule, say) subclasses it and overrides
:meth:`SelfAttention.score_inputs` and its shape (:class:`megalite.layers.part_shape.PartShape`),
then registers itself in :mod:`megalite.model.parts`.

The head size d is ``cfg.head_dim`` (``--kv-channels``, default hidden/heads), so the attention
width ``heads * d`` may differ from the hidden size h: ``qkv`` maps h to (heads + 2 groups) d and
``proj`` maps heads d back to h (Qwen3-0.6B: h 1024, 16 heads of 128, width 2048).

QK-norm (``--qk-layernorm``, Qwen3): before RoPE each head's query and key are normalized over
their d elements, ``q_i <- w_q * q_i / sqrt(mean(q_i^2) + eps)`` (the model's ``--normalization``,
RMSNorm for Qwen3; eps ``--norm-epsilon``) with one weight ``w_q`` of size d shared by every
query head, and ``w_k`` by every key head. Under TP the weights are replicated and each rank
normalizes its own heads; the column-parallel ``qkv`` has gathered the sequence already (under
SP too), so each rank sees every position but only its heads. The gradient of a shared weight
is then a partial sum over this rank's heads: it needs a sum over the TP group, the reduction
SP norms get, so the weights carry the same mark (``param.sequence_parallel``) whenever TP > 1,
with or without SP.

The softmax scale is :func:`megalite.layers.rotary.softmax_scale` (1/sqrt(d), times YaRN's
mscale(s, mscale_all_dim)^2): q is multiplied by ``softmax_scale * sqrt(d)`` before the core
attention (:meth:`SelfAttention.scaled_for_softmax`), so every backend keeps dividing by sqrt(d).
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.context_parallel.attention import ContextParallelGroups, context_parallel_attention
from megalite.layers import transformer_engine as te_layers
from megalite.layers.attention import attention
from megalite.layers.documents import Documents
from megalite.layers.kv_cache import cached_attention
from megalite.layers.norms import build_norm
from megalite.layers.part_shape import SelfAttentionShape
from megalite.layers.rotary import apply_rotary, softmax_scale
from megalite.model.linears import linears_for, mark_residual_output
from megalite.parallel import comm
from megalite.parallel.random import get_rng_tracker
from megalite.parallel.sharding import mark_sequence_parallel
from megalite.model.recompute import checkpointed


class SelfAttention(nn.Module, SelfAttentionShape):
    """Causal self-attention, split over TP by key/value groups (with their query heads).

    Under context parallelism (``cp_group`` of 2+ ranks) the core attention is exchanged over
    the CP group the way ``cfg.cp_comm_type`` says; ``cp_hierarchy`` = (inner, outer) are the
    all-to-all and ring groups of the hierarchical type (``ProcessGrid.cp_hierarchy``). Its
    parameters, FLOPs and activations: :class:`megalite.layers.part_shape.SelfAttentionShape`."""

    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 cp_hierarchy: tuple = (None, None)):
        super().__init__()
        self.cfg = cfg
        self.cp_group = cp_group if comm.group_size(cp_group) > 1 else None
        self.cp_groups = ContextParallelGroups(self.cp_group, *cp_hierarchy)
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.local_heads = cfg.num_attention_heads // comm.group_size(tp_group)
        self.logit_max = None  # QK-clip: a (local heads,) max the training forwards raise (megalite.model.qk_clip)
        linears = linears_for(cfg)
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        qkv, proj = self.linears(cfg)
        self.qkv = linears.column(cfg, qkv.in_features, qkv.out_features, bias=qkv.bias, norm_inside=True,
                                  name="qkv", **par)
        self.proj = mark_residual_output(linears.row(cfg, proj.in_features, proj.out_features, bias=proj.bias,
                                                     name="proj", **par))
        self.te_core = te_layers.te_attention_core(cfg, tp_group, self.cp_group)  # None: megalite's attention
        if cfg.qk_layernorm:  # one weight of size head_dim each, shared by the heads (module docstring)
            self.q_norm = build_norm(cfg.normalization, cfg.head_dim, cfg.norm_epsilon, fused=cfg.fused_kernels)
            self.k_norm = build_norm(cfg.normalization, cfg.head_dim, cfg.norm_epsilon, fused=cfg.fused_kernels)
            if comm.group_size(tp_group) > 1:  # partial sums over this rank's heads: summed over TP
                for p in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                    mark_sequence_parallel(p)

    @property
    def input_linear(self) -> nn.Module:
        """The linear the block's norm feeds (transformer-engine may fuse the norm into it)."""
        return self.qkv

    # -- forward ----------------------------------------------------------------------------------
    def score_inputs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q (b, local heads, s, d) and k (b, local groups, s, d) the scores are taken from,
        as ``softmax(q k^T / sqrt(d))``: as they come here; a variant reshapes the scores here."""
        return q, k

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache=None, documents: Documents | None = None) -> torch.Tensor:
        d, hpg = self.cfg.head_dim, self.heads_per_group
        qkv = self.qkv(x)  # (s, b, local groups * (hpg + 2) * d): whole groups of this rank
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, hpg + 2, d).permute(1, 2, 3, 0, 4)  # (b, groups, hpg + 2, s, d)
        q = qkv[:, :, :hpg].reshape(b, -1, s, d)  # (b, heads, s, d), grouped by kv group
        k, v = qkv[:, :, hpg], qkv[:, :, hpg + 1]  # (b, groups, s, d)
        if self.cfg.qk_layernorm:  # each head over its d elements, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if rope is not None or self.cfg.qk_layernorm:
            # q and k are new tensors now; saved for backward, the view v would keep all of qkv
            # alive (heads + groups head dims per token more than q, k, v need): copy it out.
            # (The q/k norms keep their inputs, views of qkv, so with them qkv lives on anyway;
            # the copy is still what a kernel needing a contiguous v would make and keep.)
            v = v.contiguous()
        q, k = self.score_inputs(q, k)
        q = self.scaled_for_softmax(q)
        dropout_p = self.cfg.attention_dropout if self.training else 0.0
        if cache is not None:  # generation: these positions attend over every position so far
            out = cached_attention(q, *cache.extend(k, v))
        elif self.cfg.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpointed(self.core_attention, q, k, v, dropout_p, documents)  # s^2 memory, few FLOPs
        else:
            out = self.core_attention(q, k, v, dropout_p, documents)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def scaled_for_softmax(self, q: torch.Tensor) -> torch.Tensor:
        """q times softmax_scale(cfg, d) * sqrt(d) (megalite.layers.rotary.softmax_scale; 1 but with
        YaRN's mscale_all_dim): every backend (torch, triton, flash, context parallel, the KV cache,
        transformer-engine) divides the scores by its default sqrt(d), so the model's scale reaches
        them all through q: (c q) k^T / sqrt(d) = q k^T * softmax_scale."""
        d = q.shape[-1]
        correction = softmax_scale(self.cfg, d) * d ** 0.5
        return q if correction == 1.0 else q * correction

    def core_attention(self, q, k, v, dropout_p: float, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: packed documents of the whole sequence (a token sees its own only).
        While training with QK-clip each call raises ``logit_max`` to its heads' largest logits."""
        logit_max = getattr(self, "logit_max", None) if self.training else None  # (MLA shares this method)
        if self.cp_group is not None:
            # This rank holds a shard of the sequence: attend over all of it (ring, all-to-all, ...).
            return context_parallel_attention(q, k, v, self.cp_groups, self.cfg.cp_comm_type, causal=True,
                                              backend=self.cfg.attention_backend, documents=documents,
                                              logit_max=logit_max)
        if self.te_core is not None and documents is None:  # TE's core is given no document mask: megalite's runs
            return self.te_core(q, k, v)  # transformer-engine's, dropout on the TP stream inside
        if dropout_p > 0:
            # Attention probabilities belong to this rank's heads: a TP-split tensor.
            with get_rng_tracker().fork():
                return attention(q, k, v, causal=True, dropout_p=dropout_p, backend=self.cfg.attention_backend,
                                 documents=documents, logit_max=logit_max)
        return attention(q, k, v, causal=True, backend=self.cfg.attention_backend, documents=documents,
                         logit_max=logit_max)
