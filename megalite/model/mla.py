"""Multi-head Latent Attention (DeepSeek-V2/V3), the attention part of ``--multi-latent-attention``.

Heads a, hidden h; per head a RoPE-free query/key part of d_n (``--qk-head-dim``), a RoPE part of
d_r (``--qk-pos-emb-head-dim``) and a value of d_v (``--v-head-dim``); latent ranks r_q
(``--q-lora-rank``, None: no query latent) and r_kv (``--kv-lora-rank``). For a token x (size h)::

    c_q  = Norm(W_dq x)                      (r_q)      without a query latent: q = W_q x
    q    = W_uq c_q = per head [q_n (d_n) ; q_r (d_r)],  q_r <- RoPE(q_r)
    [c ; k_r] = W_dkv x                      (r_kv + d_r: the key/value latent and the RoPE key)
    c    = Norm(c),  k_r <- RoPE(k_r)        one RoPE key shared by every head
    [k_n ; v] = W_ukv c = per head [k_n (d_n) ; v (d_v)]
    k    = per head [k_n ; k_r]
    o_i  = softmax(q_i k_i^T / sqrt(d_n + d_r) + causal) v_i          (d_qk = d_n + d_r != d_v)
    y    = W_o [o_1 ... o_a]                 (a d_v -> h; the residual output)

Norm is the model's ``--normalization`` (RMSNorm in DeepSeek-V3) with eps ``--norm-epsilon``.
RoPE rotates d_r (``ModelConfig.rotary_dim``): the model builds its angles at that size.

**Generation cache** (not built yet: ``cache`` is refused): a token needs only c and the rotated
k_r, r_kv + d_r elements per layer (k_n and v are W_ukv c, and W_uk can be folded into the
query), against grouped-query attention's 2 g d (keys and values of g groups). DeepSeek-V3
(r_kv 512, d_r 64): 576 elements, 1152 bytes in bf16, per token per layer; the 128 heads of 192/128
uncompressed would be 128 x (192 + 128) = 40960.

**Tensor parallelism**: heads are split over TP. Column-parallel (a rank's whole heads):
W_uq (or W_q) and W_ukv; row-parallel: W_o. Replicated on every TP rank: W_dq, W_dkv and the two
latent norms. The input enters the TP region once (``copy_to_tp``: identity, backward all-reduce;
under SP ``gather_from_sp``: the down-projections see the gathered sequence, backward
reduce-scatter), and the up-projections take the replicated latents without another entry. Each
rank's latent gradient then comes from its own heads only: a partial sum, so the replicated
weights' gradients are marked like SP norms (``param.sequence_parallel``: summed over TP) when
TP > 1, and the input's partial gradient is summed by the entry's backward.

**Context parallelism**: the core attention is the SelfAttention one (every CP comm type takes
d_v != d_qk); the projections are per token.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.context_parallel.attention import ContextParallelGroups
from megalite.layers.documents import Documents
from megalite.layers.norms import build_norm
from megalite.layers.part_shape import MLAShape
from megalite.layers.rotary import apply_rotary
from megalite.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.layers.weight_grad import linear
from megalite.model.attention import SelfAttention
from megalite.model.linears import mark_residual_output
from megalite.model.recompute import checkpointed
from megalite.parallel import comm
from megalite.parallel.sharding import mark_sequence_parallel

MLA_KIND = "mla"


class HeadsLinear(ColumnParallelLinear):
    """A column-parallel linear whose input is already in the TP region (replicated, the whole
    sequence): it takes it as it is, with no entry of its own (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MultiLatentAttention(nn.Module, MLAShape):
    """Multi-head Latent Attention (module docstring), split over TP by heads. Its parameters,
    FLOPs and activations: :class:`megalite.layers.part_shape.MLAShape`."""

    core_attention = SelfAttention.core_attention  # CP, dropout and backends as self-attention's
    scaled_for_softmax = SelfAttention.scaled_for_softmax  # the softmax scale (YaRN's correction) through q

    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 cp_hierarchy: tuple = (None, None)):
        super().__init__()
        self.cfg, self.tp_group, self.sequence_parallel = cfg, tp_group, sequence_parallel
        self.cp_group = cp_group if comm.group_size(cp_group) > 1 else None
        self.cp_groups = ContextParallelGroups(self.cp_group, *cp_hierarchy)
        self.te_core = None  # megalite's core attention (transformer-engine's is refused by the config check)
        h, rq, rkv, dr = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        # Registration order is MLAShape.parameter_list's: the TP linears, then the replicated ones.
        q_up, kv_up, proj = self.linears(cfg)
        heads = dict(bias=False, tp_group=tp_group)
        if rq:
            self.q_up = HeadsLinear(q_up.in_features, q_up.out_features, **heads)
        else:
            self.q_proj = HeadsLinear(q_up.in_features, q_up.out_features, **heads)
        self.kv_up = HeadsLinear(kv_up.in_features, kv_up.out_features, **heads)
        self.proj = mark_residual_output(RowParallelLinear(proj.in_features, proj.out_features, bias=proj.bias,
                                                           tp_group=tp_group, sequence_parallel=sequence_parallel))
        self.q_down = nn.Linear(h, rq, bias=False) if rq else None
        self.kv_down = nn.Linear(h, rkv + dr, bias=False)
        norm = dict(fused=cfg.fused_kernels)
        self.q_norm = build_norm(cfg.normalization, rq, cfg.norm_epsilon, **norm) if rq else None
        self.kv_norm = build_norm(cfg.normalization, rkv, cfg.norm_epsilon, **norm)
        if comm.group_size(tp_group) > 1:  # gradients from this rank's heads only: summed over TP
            for module in (self.q_down, self.kv_down, self.q_norm, self.kv_norm):
                for p in (module.parameters() if module is not None else ()):
                    mark_sequence_parallel(p)

    @property
    def input_linear(self) -> nn.Module:
        """The linear the block's norm feeds (megalite's linears: the norm is a module of its own)."""
        return self.kv_down

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (b, local heads, s, d_n + d_r) and v (b, local heads, s, d_v) from x (s, b, h)."""
        cfg = self.cfg
        dn, dr, dv, rkv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if self.sequence_parallel:
            x = comm.gather_from_sp(x, self.tp_group)  # the down-projections see the whole sequence
        else:
            x = comm.copy_to_tp(x, self.tp_group)
        s, b = x.shape[:2]
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_down is not None else self.q_proj(x)
        q = q.view(s, b, -1, dn + dr).permute(1, 2, 0, 3)  # (b, heads, s, d_n + d_r)
        latent = self.kv_down(x)
        c, k_rope = latent[..., :rkv], latent[..., rkv:]
        kv = self.kv_up(self.kv_norm(c)).view(s, b, -1, dn + dv).permute(1, 2, 0, 3)  # (b, heads, s, d_n + d_v)
        k_rope = k_rope.permute(1, 0, 2)[:, None]  # (b, 1, s, d_r): one key shared by the heads
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        if rope is not None:
            q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        heads = q.shape[1]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([kv[..., :dn], k_rope.expand(-1, heads, -1, -1)], dim=-1)
        return q, k, kv[..., dn:].contiguous()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache=None, documents: Documents | None = None) -> torch.Tensor:
        if cache is not None:
            raise NotImplementedError("Multi-head Latent Attention has no generation cache yet (the latent "
                                      "cache is described in megalite.model.mla). Fix: generate with a model "
                                      "without --multi-latent-attention.")
        s, b = x.shape[0] * (comm.group_size(self.tp_group) if self.sequence_parallel else 1), x.shape[1]
        q, k, v = self.project(x, rope)
        q = self.scaled_for_softmax(q)  # 1/sqrt(d_qk), times YaRN's mscale(S, mscale_all_dim)^2
        dropout_p = self.cfg.attention_dropout if self.training else 0.0
        if self.cfg.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpointed(self.core_attention, q, k, v, dropout_p, documents)
        else:
            out = self.core_attention(q, k, v, dropout_p, documents)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
