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

**Generation cache** (:meth:`MLAShape.cache_buffers`, :mod:`megalite.layers.kv_cache`): a token
leaves only ``[c ; k_r]`` (the normed latent and the rotated RoPE key), r_kv + d_r elements per
layer, in one buffer (b, 1, positions, r_kv + d_r); keys and values are W_ukv c. Against
grouped-query attention's 2 g d (keys and values of g groups) and uncompressed MLA's
a (d_qk + d_v): DeepSeek-V3 (r_kv 512, d_r 64) caches 576 elements, 1152 bytes in bf16, per token
per layer, where its 128 heads of 192/128 would take 128 x (192 + 128) = 40960 and a
Llama-3-8B-shaped GQA layer (8 groups of 128) takes 2048. Under TP each rank caches the whole
latent (it is replicated; each rank up-projects it for its own heads), so the cache is not
divided by TP as GQA's groups are; generation (``megalite.model.generation``, ``tools/generate.py``)
runs the model whole (TP 1). Two ways to attend over the cache, equal up to rounding:

- expanded (``absorbed = False``): ``[k_n ; v] = W_ukv c`` for every cached position at each
  step, then attention as in training;
- absorbed (the default, ``absorbed = True``): with W_ukv's per head blocks W_uk (d_n x r_kv)
  and W_uv (d_v x r_kv), ``q_n,i . k_n,ij = (W_uk,i^T q_n,i) . c_j`` and
  ``sum_j p_ij v_ij = W_uv,i sum_j p_ij c_j``: each head's query becomes
  ``[W_uk,i^T q_n,i ; q_r,i]`` (r_kv + d_r) and attends over the cache itself as one shared
  key/value head (keys ``[c ; k_r]``, values ``c``) with the scale of d_qk = d_n + d_r; W_uv,i
  maps the head's latent output to its d_v. No cached position is up-projected, and the cache is
  read once for all heads (``kv_cache.shared_head_attention`` folds the heads into the query rows).

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
from megalite.layers.kv_cache import cached_attention, shared_head_attention
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
        self.local_heads = cfg.num_attention_heads // comm.group_size(tp_group)
        self.logit_max = None  # QK-clip: a (local heads,) max the training forwards raise (megalite.model.qk_clip)
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

    def entered(self, x: torch.Tensor) -> torch.Tensor:
        """x (s, b, h) in the TP region: the whole sequence (under SP gathered), replicated."""
        if self.sequence_parallel:
            return comm.gather_from_sp(x, self.tp_group)  # the down-projections see the whole sequence
        return comm.copy_to_tp(x, self.tp_group)

    def queries(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q_n (b, local heads, s, d_n) and the rotated q_r (b, local heads, s, d_r) from the entered x."""
        dn, dr = self.cfg.qk_head_dim, self.cfg.qk_pos_emb_head_dim
        s, b = x.shape[:2]
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_down is not None else self.q_proj(x)
        q = q.view(s, b, -1, dn + dr).permute(1, 2, 0, 3)  # (b, heads, s, d_n + d_r)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        return q_nope, (apply_rotary(q_rope, *rope) if rope is not None else q_rope)

    def latent(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed latent c (s, b, r_kv) and the rotated RoPE key k_r (b, 1, s, d_r), shared by
        the heads, from the entered x."""
        rkv = self.cfg.kv_lora_rank
        latent = self.kv_down(x)
        k_rope = latent[..., rkv:].permute(1, 0, 2)[:, None]  # (b, 1, s, d_r): one key shared by the heads
        return self.kv_norm(latent[..., :rkv]), (apply_rotary(k_rope, *rope) if rope is not None else k_rope)

    def keys_values(self, c: torch.Tensor, k_rope: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k (b, heads, s, d_n + d_r) and v (b, heads, s, d_v) from c (s, b, r_kv) and k_r (b, 1, s, d_r)."""
        dn, dv = self.cfg.qk_head_dim, self.cfg.v_head_dim
        s, b = c.shape[:2]
        kv = self.kv_up(c).view(s, b, -1, dn + dv).permute(1, 2, 0, 3)  # (b, heads, s, d_n + d_v)
        k = torch.cat([kv[..., :dn], k_rope.expand(-1, heads, -1, -1)], dim=-1)
        return k, kv[..., dn:].contiguous()

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (b, local heads, s, d_n + d_r) and v (b, local heads, s, d_v) from x (s, b, h)."""
        x = self.entered(x)
        q_nope, q_rope = self.queries(x, rope)
        k, v = self.keys_values(*self.latent(x, rope), q_nope.shape[1])
        return torch.cat([q_nope, q_rope], dim=-1), k, v

    # -- generation ---------------------------------------------------------------------------------
    absorbed = True  # attend over the cache in the absorbed form (module docstring); False: expanded

    def cached(self, x: torch.Tensor, rope, cache) -> torch.Tensor:
        """The new positions x (s, b, h) attend over every cached one; their [c ; k_r] join the cache
        (module docstring: the expanded or the absorbed form)."""
        rkv, dn = self.cfg.kv_lora_rank, self.cfg.qk_head_dim
        x = self.entered(x)
        s, b = x.shape[:2]
        q = self.scaled_for_softmax(torch.cat(self.queries(x, rope), dim=-1))  # the softmax scale of d_qk
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        c, k_rope = self.latent(x, rope)
        (entries,) = cache.extend(torch.cat([c.permute(1, 0, 2)[:, None], k_rope], dim=-1))  # (b, 1, n, r_kv + d_r)
        heads = q.shape[1]
        if not self.absorbed:
            k, v = self.keys_values(entries[:, 0, :, :rkv].transpose(0, 1), entries[..., rkv:], heads)
            out = cached_attention(q, k, v)
        else:
            w = self.kv_up.weight.view(heads, -1, rkv)  # per head [W_uk (d_n rows) ; W_uv (d_v rows)]
            q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w[:, :dn])  # W_uk,i^T q_n,i
            latent_out = shared_head_attention(torch.cat([q_latent, q_rope], dim=-1), entries, entries[..., :rkv],
                                               scale=q.shape[-1] ** -0.5)
            out = torch.einsum("bhsr,hvr->bhsv", latent_out, w[:, dn:])  # W_uv,i times the head's latent output
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache=None, documents: Documents | None = None) -> torch.Tensor:
        if cache is not None:  # generation: over every cached position
            return self.cached(x, rope, cache)
        s, b = x.shape[0] * (comm.group_size(self.tp_group) if self.sequence_parallel else 1), x.shape[1]
        q, k, v = self.project(x, rope)
        q = self.scaled_for_softmax(q)  # 1/sqrt(d_qk), times YaRN's mscale(S, mscale_all_dim)^2
        dropout_p = self.cfg.attention_dropout if self.training else 0.0
        if self.cfg.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpointed(self.core_attention, q, k, v, dropout_p, documents)
        else:
            out = self.core_attention(q, k, v, dropout_p, documents)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
