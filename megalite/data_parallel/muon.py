"""Muon: momentum, then the update of each hidden weight matrix orthogonalised by Newton-Schulz.

For a matrix parameter ``W`` (m x n) with gradient ``G`` (divided by ``grad_scale``: the clip
coefficient, as AdamW's), momentum ``beta`` (``--muon-momentum``), learning rate ``lr`` and
decoupled weight decay ``wd`` (``--weight-decay``)::

    M <- beta M + (1 - beta) G                        one fp32 momentum buffer per matrix
    U  = (1 - beta) G + beta M   with --muon-use-nesterov, else  U = M
    O  = NS_k(U)                                      k = --muon-num-ns-steps (5)
    W <- W (1 - lr wd) - lr * s(m, n) * f * O         f = --muon-extra-scale-factor

NS_k, the quintic Newton-Schulz iteration towards the orthogonal factor ``U V^T`` of ``U = U S V^T``
(its singular values driven into roughly [0.7, 1.2], not exactly 1: cheap and good enough)::

    X_0 = U / (||U||_F + 1e-7)          (transposed first when m > n: X X^T is the small Gram)
    A   = X X^T;   X <- a X + (b A + c A A) X,     (a, b, c) = (3.4445, -4.7750, 2.0315)

``s(m, n)``, ``--muon-scale-mode`` (Megatron-LM's names): ``spectral`` sqrt(max(m, n)) (with f = 0.2
the update's RMS matches AdamW's, so AdamW's learning rate and weight decay carry over: Moonlight),
``unit_rms_norm`` sqrt(m / n), ``shape_scaling`` sqrt(max(1, m / n)) (Keller Jordan's). The
products run under ``torch.set_float32_matmul_precision(--muon-fp32-matmul-prec)``.

**Logical matrices, not storage.** NS is applied per matrix the model multiplies by, with
``(m, n)`` its shape (its full, TP=1 shape, in every TP mode), the fused weights cut by the one
table the planner counts by too (:mod:`megalite.layers.logical_matrices`, by linear name):

- a fused QKV weight (rows by KV group: heads-per-group query heads, one key, one value head)
  per q, k and v (each gathered over the groups, as Megatron's split QKV); ``--muon-no-split-qkv``:
  as one matrix;
- SwiGLU's fused [gate; up] fc1 (TP-split in sections: ``TPSplit(0, 2)``) per half;
- stacked MoE experts (E, rows, cols) per expert, and per [gate; up] half of a SwiGLU w1.

**Which parameters** (:func:`takes_muon`): the 2-D weights of the transformer layers (attention
and MLP projections, MLA's down/up projections, MTP's projection) and the 3-D stacked experts.
AdamW (:mod:`megalite.data_parallel.adamw`, ``--adam-*``) for the rest:

- embeddings (word, position): a lookup table, each row updated only by its token's gradient: a
  row-sparse gradient whose orthogonalisation would spread one token's signal over all rows;
- the output layer (and its tied copy): the logits' scale is what the loss measures; Muon's
  fixed-norm update has no per-vocabulary-row adaptivity (Moonlight and Megatron keep AdamW);
- norm weights and biases (1-D): vectors, not matrices: nothing to orthogonalise;
- the MoE router (E x h): a small classifier over experts whose rows' scales are the routing
  decision; orthogonalising would equalise them (Megatron keeps it on AdamW);
- the expert bias (DeepSeek-V3's aux-loss-free balancing): a buffer moved by its own rule
  (:mod:`megalite.moe.balancing`), not a trained parameter.

**Tensor parallelism** (``--muon-tp-mode``): ``duplicated`` all-gathers U over TP (the split
metadata ``tp_split`` says how: :func:`megalite.parallel.sharding.gather_full`), every TP rank runs
NS on the logical matrices of the full tensor and keeps its shard: equal to one process; its
bytes per step are each TP-split matrix's (tp - 1)/tp fp32 elements gathered per rank.
``blockwise`` runs NS on the logical matrices of each rank's shard (no communication): a
different update from one process's, Megatron's default. ``distributed`` keeps each rank's block and
runs NS on it with the Gram all-reduced over TP (:func:`newton_schulz_distributed`): equal to one
process, the gather and the duplicated NS work avoided; per logical matrix and step, k + 1
all-reduces over TP: k Grams (the uncut dimension squared, fp32; for a Megatron layer h x h)
and the Frobenius norm's scalar.

**ZeRO 1 and 2** (:class:`FlatMuon`): the flat shards cut across matrices, so each bucket's
matrices are owned by its DP ranks, balanced by NS cost m n min(m, n) (:func:`owners`); U's
shards are all-gathered, owners orthogonalise, updates are reduce-scattered: per step two
collectives of the bucket's fp32 elements (4 bytes per parameter each) beside AdamW's none (both
then all-gather the new weights, in the model dtype). ZeRO-3 and offload are refused by
``validate()``.

**State**, per parameter class (the rule's ``takes_matrix`` is :func:`takes_muon`, its
``matrix_state`` the momentum): ``momentum`` over every parameter (Muon's M over the matrices,
AdamW's first moment over the rest) and ``exp_avg_sq`` (AdamW's second moment) over the
AdamW-stepped parameters only, a compact tensor per shard
(:class:`~megalite.data_parallel.rule_types.StateLayout`). So a Muon matrix holds 8 bytes per
parameter (fp32 master + momentum) and every other parameter 12, as Megatron's Muon: what the
allocation, the memory accounting, the planners and preflight count
(:meth:`~megalite.data_parallel.rule_types.UpdateRule.bytes_of`). A checkpoint holds
``weight`` and ``momentum`` of every parameter and ``exp_avg_sq`` of the AdamW-stepped ones (its
rule record marks that state ``"held_by": "non-matrix"``); one written before this split (an
``exp_avg_sq`` piece for every parameter, all zero on the matrices) still loads: a load reads
only the pieces the run keeps.
"""
from __future__ import annotations

import contextlib
import math

import torch

from megalite.data_parallel.adamw import FlatAdamW
from megalite.data_parallel.rule_types import ADAMW, BucketLayout, DeviceStepCount, StateLayout, UpdateRule
from megalite.layers.logical_matrices import linear_name, row_block
from megalite.parallel import comm
from megalite.parallel.sharding import gather_full, is_expert, shard_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic iteration's (a, b, c)
NS_EPS = 1e-7
ADAMW_NAMES = ("word_embeddings", "position_embeddings", "output_layer", "router")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MOMENTUM = "momentum"  # Muon's M over the matrices, AdamW's first moment over the rest
SECOND_MOMENT = ADAMW.state_names[1]  # AdamW's second moment, by AdamW's rule's name for it


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """``s(m, n)`` of the module docstring."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown Muon scale mode {mode!r}: one of {', '.join(SCALE_MODES)}")


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """NS_k(u) of the module docstring, in fp32, for a 2-D ``u``."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def takes_muon(name: str, param) -> bool:
    """Muon for a 2-D hidden weight or stacked experts; AdamW for the kinds the module docstring lists."""
    if any(part in name for part in ADAMW_NAMES) or param.ndim < 2:
        return False
    if param.ndim == 3 and not is_expert(param):
        raise ValueError(f"Muon cannot classify parameter {name} of shape {tuple(param.shape)}: 3-D but not stacked "
                         f"experts. Fix: train it with --optimizer adam, or teach megalite.data_parallel.muon its "
                         f"logical matrices")
    return param.ndim in (2, 3)


def logical_pieces(name: str, param, shape: tuple, model, split_qkv: bool) -> list:
    """Selectors of the logical matrices of a tensor of ``shape`` (the parameter's full or local
    shape): functions tensor -> a view whose last dim is the matrix's columns. Stacked experts
    (E, rows, cols) per expert, then each weight's rows cut by the one table of fused linears
    (:func:`megalite.layers.logical_matrices.row_block`: q, k, v of a split qkv; SwiGLU's gate and up)."""
    rows, cols = shape[-2], shape[-1]
    block = row_block(linear_name(name), model, rows, split_qkv)
    size, starts = sum(block), [sum(block[:k]) for k in range(len(block))]
    experts = range(shape[0]) if param.ndim == 3 else [None]

    def select(e, a, w):
        def piece(t):
            matrix = t if e is None else t[e]
            return matrix.view(rows // size, size, cols)[:, a:a + w]
        return piece

    return [select(e, a, w) for e in experts for a, w in zip(starts, block)]


def newton_schulz_distributed(u: torch.Tensor, steps: int, split_dim: int, group) -> torch.Tensor:
    """NS_k of the full matrix whose ``split_dim`` is cut over ``group`` (``u``: this rank's
    block), without gathering it. The polynomial is odd, ``p(X) = q(X X^T) X = X q(X^T X)``, so
    the iteration takes the Gram over the cut dimension, a sum of the ranks' blocks' Grams: with
    columns cut, ``A = X X^T = sum_r X_r X_r^T`` and ``X_r <- a X_r + (b A + c A A) X_r``; with
    rows cut, ``A = X^T X = sum_r X_r^T X_r`` and ``X_r <- a X_r + X_r (b A + c A A)``. Per
    iteration one all-reduce of the Gram (the uncut dimension squared, fp32), and one scalar for
    the Frobenius norm."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    squares = comm.all_reduce(x.pow(2).sum().reshape(1), group)
    x = x / (squares.sqrt() + NS_EPS)
    for _ in range(steps):
        gram = comm.all_reduce(x @ x.T if split_dim == 1 else x.T @ x, group)
        poly = b * gram + c * gram @ gram
        x = a * x + (poly @ x if split_dim == 1 else x @ poly)
    return x


@contextlib.contextmanager
def matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def matrix_ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz FLOPs of one ``rows x cols`` matrix (:func:`newton_schulz`): with m = min and
    n = max (the iteration runs on the wide orientation, so its Gram is the small m x m one), each
    of ``steps`` iterations multiplies A = X X^T (2 m^2 n), A A (2 m^3) and (b A + c A A) X
    (2 m^2 n); the elementwise terms and the norm are O(m n). The planner's step time and
    tools/bench_optimizer.py count with it."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def tp_block_ns_flops(rows: int, cols: int, cut_dim: int | None, tp: int, mode: str, steps: int) -> int:
    """Newton-Schulz FLOPs one TP rank spends on a logical matrix whose block on the rank is
    ``rows x cols``, cut over ``tp`` ranks along ``cut_dim`` (0: rows, a column-parallel linear's;
    1: columns, a row-parallel one's; None: not split), under ``--muon-tp-mode`` ``mode``:
    ``blockwise`` NS on the block (:func:`matrix_ns_flops`); ``duplicated`` NS on the whole
    matrix, gathered; ``distributed`` (:func:`newton_schulz_distributed`) per step the block's
    Gram over the uncut dimension d (2 c d^2, c the block's cut extent), the Gram squared (2 d^3,
    on every rank) and the product with the block (2 c d^2): 4 c d^2 + 2 d^3."""
    if cut_dim is None or tp == 1 or mode == "blockwise":
        return matrix_ns_flops(rows, cols, steps)
    if mode == "duplicated":
        return matrix_ns_flops(rows * (tp if cut_dim == 0 else 1), cols * (tp if cut_dim == 1 else 1), steps)
    cut, d = (rows, cols) if cut_dim == 0 else (cols, rows)
    return steps * (4 * cut * d * d + 2 * d ** 3)


def matrix_cost(shape: tuple) -> int:
    """Newton-Schulz work of a weight of ``shape`` ((stack,) m, n), ~ m n min(m, n) per matrix:
    what ZeRO ownership balances (:func:`assign_owners`), for a built parameter or the planner's
    shape of one."""
    *stack, m, n = shape
    return math.prod(stack) * m * n * min(m, n)


def ns_cost(param) -> int:
    """Newton-Schulz work of a parameter (:func:`matrix_cost` of its shape on this rank)."""
    return matrix_cost(tuple(param.shape))


def assign_owners(costs: list[int], load: list) -> list[int]:
    """The rank of the group that orthogonalises each of a bucket's Muon matrices, given their
    ``costs`` (:func:`matrix_cost`) in the bucket's member order: the costliest first (ties: the
    earlier member), each to the least loaded rank (ties: the lower rank); ``load`` (NS cost per
    rank of the group) is updated, so it carries over the group's buckets. One rule, which the
    optimizer (:func:`owners`) and the planner (:mod:`megalite.planner.update_traffic`) both call."""
    owner = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        owner[k] = min(range(len(load)), key=lambda r: (load[r], r))
        load[owner[k]] += costs[k]
    return owner


def owners(members: list, load: list) -> list[int]:
    """The DP rank that orthogonalises each of ``members`` ((name, param, start), the Muon
    matrices of one bucket), by :func:`assign_owners` on their NS costs; the same on every rank."""
    return assign_owners([ns_cost(member[1]) for member in members], load)


class FlatMuon(DeviceStepCount):
    """Muon over the Muon matrices of the flat shards, AdamW (one :class:`FlatAdamW` over views of
    the shards) over the rest; one step count, shared (AdamW's bias correction reads it).

    The momentum and U are elementwise on this rank's shard. Without ZeRO every matrix is whole in
    the shard and orthogonalised here. Under ZeRO 1-2 (a sharded bucket) the matrices are owned
    by the bucket's DP ranks (:func:`owners`): U's shards are all-gathered over the bucket's
    group (the bucket's fp32 elements), each owner orthogonalises its matrices, and the updates
    are reduce-scattered back (each element nonzero on its owner only: the bucket's fp32 elements
    again), where AdamW's step gathers nothing: two fp32 bucket collectives per step beside the
    publish's all-gather, and the NS work divided over DP."""

    def __init__(self, masters, states, decay_ranges, t, *, geometry):
        super().__init__(masters)
        self.t, self.tp_group, self.model = t, geometry.tp_group, geometry.model
        self.masters, self.momentum = masters, states[MOMENTUM]
        layout = geometry.state_layout or StateLayout(MUON, geometry.places, [m.numel() for m in masters])
        self.buckets = geometry.buckets or tuple(  # a hand-made geometry (tests): each shard its own bucket
            BucketLayout(0, m.numel(), m.numel(), None, False,
                         tuple((pl.name, pl.param, pl.start) for pl in geometry.places if pl.shard == i))
            for i, m in enumerate(masters))
        self.muon_ranges = [[] for _ in masters]  # (a, z): this shard's Muon elements
        adam = {"w": [], "m": [], "v": [], "decay": [], "where": []}
        for place in geometry.places:
            i, a, z = place.shard, place.start, place.stop
            if takes_muon(place.name, place.param):
                self.muon_ranges[i].append((a, z))
                continue
            adam["w"].append(masters[i][a:z])
            adam["m"].append(states[MOMENTUM][i][a:z])
            adam["v"].append(layout.view(states[SECOND_MOMENT][i], SECOND_MOMENT, i, a, z))  # compact
            inside = any(lo <= a and z <= hi for lo, hi in decay_ranges[i])
            adam["decay"].append([(0, z - a)] if inside else [])
            adam["where"].append((i, a, z))
        self.owned, loads = [], {}  # per bucket: the (name, param, start) this rank orthogonalises
        for bucket in self.buckets:
            muon = [m for m in bucket.members if takes_muon(m[0], m[1])]
            if bucket.sharded:
                load = loads.setdefault(id(bucket.group), [0] * comm.group_size(bucket.group))
                mine = comm.group_rank(bucket.group)
                muon = [m for m, r in zip(muon, owners(muon, load)) if r == mine]
            self.owned.append(muon)
        self.has_muon = [any(takes_muon(m[0], m[1]) for m in b.members) for b in self.buckets]
        self.adam = FlatAdamW(adam["w"], adam["m"], adam["v"], adam["decay"], betas=(t.adam_beta1, t.adam_beta2),
                              eps=t.adam_eps, weight_decay=t.weight_decay)
        self.adam.steps = self.steps  # one count
        self.adam_where = adam["where"]

    @torch.no_grad()
    def step(self, grads, lr: float, grad_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        keep = None if found_inf is None else (found_inf == 0).to(self.steps.device)
        with matmul_precision(self.t.muon_fp32_matmul_prec):
            for i, bucket in enumerate(self.buckets):
                if self.has_muon[i]:
                    self._step_bucket(i, bucket, grads[i], lr, grad_scale, keep)
        self.adam.step([grads[i][a:z] for i, a, z in self.adam_where], lr, grad_scale, found_inf)

    def _step_bucket(self, i, bucket, grad, lr, grad_scale, keep) -> None:
        t, beta = self.t, self.t.muon_momentum
        device = self.masters[i].device
        u_local, new_ms = torch.zeros(bucket.hi - bucket.lo, device=device), []
        for a, z in self.muon_ranges[i]:
            g = grad[a:z].float()
            if grad_scale is not None:
                g = g / grad_scale
            new_m = torch.lerp(self.momentum[i][a:z], g, 1 - beta)
            u_local[a:z] = torch.lerp(g, new_m, beta) if t.muon_use_nesterov else new_m
            new_ms.append(new_m)
        u_full = torch.zeros(bucket.numel, device=device)
        if bucket.sharded:
            comm.all_gather_async(u_full, u_local, bucket.group).wait()
        else:
            u_full[bucket.lo:bucket.hi] = u_local
        o_full = torch.zeros(bucket.numel, device=device)
        for name, p, start in self.owned[i]:
            u = u_full[start:start + p.numel()].view(p.shape)
            o_full[start:start + p.numel()] = self.orthogonalised(name, p, u).reshape(-1)
        if bucket.sharded:
            o_shard = torch.empty(bucket.hi - bucket.lo, device=device)
            comm.reduce_scatter_async(o_shard, o_full, bucket.group).wait()
        else:
            o_shard = o_full[bucket.lo:bucket.hi]
        for (a, z), new_m in zip(self.muon_ranges[i], new_ms):
            m, w = self.momentum[i][a:z], self.masters[i][a:z]
            new_w = w * (1 - lr * t.weight_decay) - lr * t.muon_extra_scale_factor * o_shard[a:z]
            if keep is None:
                m.copy_(new_m)
                w.copy_(new_w)
            else:
                m.copy_(torch.where(keep, new_m, m))
                w.copy_(torch.where(keep, new_w, w))

    def orthogonalised(self, name: str, p, u: torch.Tensor) -> torch.Tensor:
        """s(m, n) NS_k(U) per logical matrix of ``u`` (this rank's TP part of parameter ``p``)."""
        t = self.t
        split, tp = getattr(p, "tp_split", None), comm.group_size(self.tp_group)
        gathered = split is not None and tp > 1 and t.muon_tp_mode == "duplicated"
        whole = gather_full(u, split, self.tp_group) if gathered else u
        cut = split is not None and tp > 1 and not gathered  # blockwise or distributed: this rank's block
        widen = tp if cut else 1  # the scale is the full matrix's
        distributed = cut and t.muon_tp_mode == "distributed"
        out = torch.empty_like(whole)
        for select in logical_pieces(name, p, tuple(whole.shape), self.model, t.muon_split_qkv):
            piece, target = select(whole), select(out)
            matrix = piece.reshape(-1, piece.shape[-1])
            rows, cols = matrix.shape
            full_rows, full_cols = (rows * widen, cols) if split is None or split.dim == 0 else (rows, cols * widen)
            scale = scale_factor(full_rows, full_cols, t.muon_scale_mode)
            ns = (newton_schulz_distributed(matrix, t.muon_num_ns_steps, split.dim, self.tp_group) if distributed
                  else newton_schulz(matrix, t.muon_num_ns_steps))
            target.copy_((ns * scale).view(target.shape))
        return shard_tensor(out, split, comm.group_rank(self.tp_group), tp) if gathered else out


def _build_muon(masters, states, decay_ranges, t, *, geometry) -> FlatMuon:
    return FlatMuon(masters, states, decay_ranges, t, geometry=geometry)


MUON = UpdateRule("muon", (MOMENTUM, SECOND_MOMENT), _build_muon, state_label="Muon/Adam state",
                  wants_geometry=True, takes_matrix=takes_muon, matrix_state=(MOMENTUM,))
