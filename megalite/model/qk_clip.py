"""QK-clip (``--qk-clip``; MuonClip = Muon + QK-clip, Kimi K2): after each optimizer step,
shrink the query and key weights of every head whose attention logits grew past a threshold.

**The statistic.** For query head h of a layer, ``S_h`` is the largest logit the softmax saw in
the step: ``S_h = max over micro-batches, batch rows, visible pairs (i, j) of q_i . k_j / sqrt(d)``,
with q and k after QK-norm and RoPE, q times the model's softmax correction (YaRN), masked pairs
(causal, packed documents) excluded. Each :class:`megalite.model.attention.SelfAttention`
keeps a float32 ``logit_max`` (its local heads,) on the device during the step, raised in place
by every core-attention call (:func:`megalite.layers.attention.attention`'s ``logit_max``: the
Triton kernel writes its running row max, the torch backend computes the scores' max apart,
context parallelism folds each block's): no host read anywhere. Recomputation runs the forward
again; a max is idempotent, so it changes nothing.

**The reduction.** Before the rescale, one all-reduce MAX over the DP x CP group of all this
rank's layers' vectors, concatenated (4 bytes per local head per layer): DP ranks saw other
sequences, CP ranks other positions (or, under all-to-all CP, other heads: a rank's other
slices are -inf) of the same heads. Over TP the heads are disjoint and over PP the layers, so
neither needs it; the logged model-wide max is one more scalar all-reduce MAX over TP x PP.

**The rescale** (Megatron-LM's rule, ``--qk-clip-threshold`` tau, ``--qk-clip-alpha`` a,
default 0.5). Grouped-query attention shares a key head among the ``r`` query heads of its
group, so the factor is per group g: ``S_g = max_{h in g} S_h`` and

    eta_g = tau / S_g  if S_g > tau (and finite), else 1,
    W_q^h <- eta_g^a W_q^h  for every query head h of g,    W_k^g <- eta_g^(1-a) W_k^g,

so every logit of the group's heads is multiplied by eta_g <= tau / S_h: after the step none
would exceed tau (heads of the group that stayed below tau shrink with it). With a = 1/2 both
sides take ``sqrt(tau / S)``. A query/key bias (``--add-qkv-bias``) takes its rows' factor too,
so the whole projection (not only its weight) scales. Values are untouched. In the fused
``qkv`` weight the rows are laid out per group as [r query heads, key head, value head] of d
rows each (:mod:`megalite.model.attention`), so the factors form one (rows,) vector per layer
(:func:`qkv_row_factors`), TP-local (a rank holds whole groups).

**MLA** (:mod:`megalite.model.mla`, Kimi K2's rule; Megatron-LM's too): each head has its own
key, so eta_h = tau / S_h per head. The logit is ``q_n . k_n + q_r . k_r`` with the RoPE key k_r
shared by every head, so k_r stays and the head's RoPE query takes all of eta:

    W_uq rows of q_n,h (d_n) <- eta_h^a,   W_uq rows of q_r,h (d_r) <- eta_h,
    W_ukv rows of k_n,h (d_n) <- eta_h^(1-a),   W_ukv rows of v_h (d_v) and W_dkv unchanged

(W_q in place of W_uq without a query latent): the head's logit is multiplied by eta_h
(:func:`mla_row_factors`).

**Where it lands.** The factors multiply the fp32 master weights in the optimizer's flat
shards, wherever ZeRO put each row (``DistributedOptimizer.scale_rows``), and the buckets holding
the scaled parameters (the qkv weights and biases; MLA's query and key/value up-projections) are
published again, the others not: a copy without ZeRO; under ZeRO 1-2 one more all-gather per step
of those buckets' weights, in the model dtype, (n - 1)/n of their bytes on the wire per rank,
every step (the factors stay on the device, so whether anything was clipped is not known on the
host). The model's weights are the masters cast, as after any step, so checkpoints and resumes
stay exact. It is an independent post-step, so it works after AdamW and after Muon.

Refused (``megalite.config``'s ``_check_qk_clip``): QK-norm (the norm undoes any scale of the
projection), transformer-engine attention and flash-attn (neither gives
the max), an offloaded optimizer (the factors would cross to the host), tau <= 0, a outside (0, 1).
"""
from __future__ import annotations

import torch

from megalite.model.attention import SelfAttention
from megalite.model.mla import MultiLatentAttention
from megalite.parallel import comm


def enabled(t) -> bool:
    """The step tracks the max logit: QK-clip, or only its log (``--log-max-attention-logit``)."""
    return bool(t.qk_clip or t.log_max_attention_logit)


def attention_parts(chunks) -> list:
    """This rank's attention modules (self-attention, MLA), in model order (every chunk, every layer)."""
    return [m for c in chunks for m in c.modules() if isinstance(m, (SelfAttention, MultiLatentAttention))]


def start_step(chunks, t) -> None:
    """Give each attention a fresh -inf (local heads,) max for this step's forwards (or none)."""
    if not enabled(t):
        return
    for part in attention_parts(chunks):
        device = next(part.parameters()).device
        part.logit_max = torch.full((part.local_heads,), float("-inf"), dtype=torch.float32, device=device)


def group_factors(head_max: torch.Tensor, heads_per_group: int, threshold: float) -> torch.Tensor:
    """eta_g (groups,) from the per-head maxima (heads,): tau / max_{h in g} S_h where that max
    exceeds tau and is finite, else 1 (module docstring)."""
    group_max = head_max.view(-1, heads_per_group).amax(dim=1)
    clip = torch.isfinite(group_max) & (group_max > threshold)
    return torch.where(clip, threshold / torch.where(clip, group_max, torch.ones_like(group_max)),
                       torch.ones_like(group_max))


def qkv_row_factors(eta: torch.Tensor, heads_per_group: int, head_dim: int, alpha: float) -> torch.Tensor:
    """The fused qkv rows' factors (groups * (r + 2) * d,): per group, r * d query rows eta^alpha,
    d key rows eta^(1 - alpha), d value rows 1."""
    groups = eta.shape[0]
    q = eta.pow(alpha)[:, None].expand(groups, heads_per_group * head_dim)
    k = eta.pow(1.0 - alpha)[:, None].expand(groups, head_dim)
    return torch.cat([q, k, torch.ones_like(k)], dim=1).reshape(-1)


def mla_row_factors(eta: torch.Tensor, dn: int, dr: int, dv: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's (query up-projection rows, key/value up-projection rows) factors from eta (heads,):
    per head [d_n rows eta^alpha ; d_r rows eta] and [d_n rows eta^(1 - alpha) ; d_v rows 1]."""
    heads = eta.shape[0]
    q = torch.cat([eta.pow(alpha)[:, None].expand(heads, dn), eta[:, None].expand(heads, dr)], dim=1)
    kv = torch.cat([eta.pow(1.0 - alpha)[:, None].expand(heads, dn), torch.ones_like(eta)[:, None].expand(heads, dv)],
                   dim=1)
    return q.reshape(-1), kv.reshape(-1)


def part_factors(part, head_max: torch.Tensor, t) -> dict:
    """{parameter: (rows,) factors} of one attention part from its heads' maxima."""
    cfg = part.cfg
    if isinstance(part, MultiLatentAttention):
        q, kv = mla_row_factors(group_factors(head_max, 1, t.qk_clip_threshold), cfg.qk_head_dim,
                                cfg.qk_pos_emb_head_dim, cfg.v_head_dim, t.qk_clip_alpha)
        query = part.q_up if part.q_down is not None else part.q_proj
        return {query.weight: q, part.kv_up.weight: kv}
    rows = qkv_row_factors(group_factors(head_max, part.heads_per_group, t.qk_clip_threshold),
                           part.heads_per_group, cfg.head_dim, t.qk_clip_alpha)
    factors = {part.qkv.weight: rows}
    if getattr(part.qkv, "bias", None) is not None:
        factors[part.qkv.bias] = rows
    return factors


def after_step(chunks, optimizer, grid, t) -> torch.Tensor | None:
    """The step's statistic reduced (DP x CP), the rescale applied (with ``--qk-clip``) to the
    optimizer's masters and the published weights; returns the model-wide max logit, a device
    scalar for the log (None when nothing is tracked). No host read."""
    if not enabled(t):
        return None
    parts = [p for p in attention_parts(chunks) if p.logit_max is not None]
    device = optimizer.device
    maxima = torch.cat([p.logit_max for p in parts]) if parts else torch.full((1,), float("-inf"), device=device)
    if grid is not None:  # the same heads, other tokens (module docstring)
        comm.all_reduce(maxima, grid.dp_cp_group, op=torch.distributed.ReduceOp.MAX)
    if t.qk_clip and parts:
        factors, offset = {}, 0
        for part in parts:
            factors.update(part_factors(part, maxima[offset: offset + part.local_heads], t))
            offset += part.local_heads
        optimizer.scale_rows(factors)
    for part in parts:
        part.logit_max = None
    model_max = maxima.amax().reshape(())
    if grid is not None:
        comm.all_reduce(model_max, grid.mp_group, op=torch.distributed.ReduceOp.MAX)
    return model_max
