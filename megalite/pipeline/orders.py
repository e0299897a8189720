"""The order in which a pipeline rank runs its operations, one function per schedule.

An operation is (kind, micro-batch m, local model chunk c):

- ``F``: forward of the chunk;
- ``B``: backward to the chunk's *input* only (what the previous chunk waits for);
- ``W``: the chunk's *weight* gradients (nobody waits for them), deferred from B;
- ``BW``: B and W at once, the classical backward.

Every order function has the signature ``order(P, M, rank, V) -> list[Op]`` (V: chunks per
rank), so the schedule table (:mod:`megalite.pipeline.schedule_kinds`) names a schedule's order
by the function itself and nothing dispatches on schedule names:

- :func:`gpipe_order`: all M forwards, then all M backwards (M micro-batches in flight).
- :func:`one_f_one_b_order`: min(P-p-1, M) warm-up forwards, then one forward and one backward
  in turn, then the remaining backwards: at most P - p micro-batches in flight on rank p.
- :func:`zb_h1_order`: 1F1B's order of F and B; rank p runs W of micro-batch j - p right after
  B of micro-batch j, and the rest after its last B (Qi et al., "Zero Bubble Pipeline
  Parallelism", 2024). With F = B = W = t the idle time per rank is (P-1)(F+B-W) = (P-1) t.
- :func:`interleaved_order`: V chunks per rank; micro-batches go round the ring V times in
  groups of P, chunks in order going forward and in reverse going backward; the bubble shrinks
  to (P-1)/(V*M+P-1). Needs M % P == 0.
- :func:`zbv_order`: two chunks per rank in a V, from a greedy list schedule (:func:`zbv_ops`).
- :func:`forward_only_order`: evaluation, every micro-batch through the rank's chunks in model
  order, no backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W" or "BW" (B and W fused, the classical backward)
    micro: int
    chunk: int  # local chunk index on its rank


def one_f_one_b_ops(P: int, M: int, rank: int, split: bool = False) -> list[Op]:
    """1F1B (module docstring); ``split``: the zb-h1 order."""
    warmup = min(P - rank - 1, M)
    order: list[tuple[str, int]] = [("F", m) for m in range(warmup)]
    for j in range(M - warmup):
        order += [("F", warmup + j), ("B", j)]
    order += [("B", j) for j in range(M - warmup, M)]
    if not split:
        return [Op("BW" if k == "B" else k, m, 0) for k, m in order]
    ops, next_w = [], 0
    for kind, m in order:
        ops.append(Op(kind, m, 0))
        if kind == "B" and m - rank >= 0:  # W of micro-batch m - rank, p micro-batches late
            ops.append(Op("W", next_w, 0))
            next_w += 1
    ops += [Op("W", m, 0) for m in range(next_w, M)]
    return ops


def gpipe_ops(P: int, M: int, rank: int) -> list[Op]:
    return [Op("F", m, 0) for m in range(M)] + [Op("BW", m, 0) for m in range(M)]


def interleaved_ops(P: int, M: int, rank: int, V: int) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al., 2021). The k-th forward (backward) of a rank runs
    chunk (k mod PV) // P (reversed going backward) on micro-batch (k // PV) * P + k mod P.
    Warm-up: 2(P-p-1) + (V-1)P forwards (all V*M when M == P), then one forward and one
    backward in turn, then the remaining backwards."""
    total = M * V

    def op(kind: str, k: int) -> Op:
        chunk = (k % (P * V)) // P
        return Op(kind, (k // (P * V)) * P + k % P, chunk if kind == "F" else V - 1 - chunk)

    warmup = total if M == P else min((P - rank - 1) * 2 + (V - 1) * P, total)
    ops = [op("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [op("F", warmup + i), op("BW", i)]
    return ops + [op("BW", k) for k in range(total - warmup, total)]


@lru_cache(maxsize=64)
def zbv_ops(P: int, M: int) -> tuple[tuple[Op, ...], ...]:
    """The ZB-V order of every rank: a greedy list schedule over unit-time F, B and W.

    Rank p holds global chunk p (first leg) and 2P-1-p (second leg). Whenever a rank is free
    it runs, in this priority: a ready B (chunk 0 first: it ends the micro-batch's backward
    sooner, freeing memory and W work); a pending W if 2P-2 chunk W's are pending (the bound
    on stored W inputs); a ready F if fewer than 2P chunk activations are in flight
    (second-leg chunk first, it reaches the loss sooner); a pending W; else it idles until
    something becomes ready. Deterministic, so every rank computes the same orders. The bound
    2P-2 was chosen by simulation: smaller bounds (1..P) leave 2-3x the bubble at some M
    (P = 4, M = 12: 0.065-0.089 against 0.040)."""
    S = 2 * P  # global chunks
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro, global chunk) -> end time
    next_micro = {(k, g): 0 for k in "FBW" for g in range(S)}
    ops: list[list[Op]] = [[] for _ in range(P)]
    free_at = [0] * P
    in_flight = [0] * P
    pending_w = [0] * P
    remaining = 3 * M * S
    t = 0
    while remaining:
        for rank in range(P):
            if free_at[rank] > t:
                continue
            chosen = _zbv_choice(rank, P, M, t, done, next_micro, in_flight[rank], pending_w[rank], max(1, 2 * P - 2))
            if chosen is None:
                continue
            kind, g = chosen
            m = next_micro[(kind, g)]
            next_micro[(kind, g)] += 1
            done[(kind, m, g)] = t + 1
            free_at[rank] = t + 1
            in_flight[rank] += {"F": 1, "B": -1, "W": 0}[kind]
            pending_w[rank] += {"F": 0, "B": 1, "W": -1}[kind]
            ops[rank].append(Op(kind, m, 0 if g == rank else 1))
            remaining -= 1
        t += 1
        if t > 10 * (3 * M * S + S):
            raise RuntimeError(f"zbv_ops(P={P}, M={M}) did not finish: a bug in the greedy schedule")
    return tuple(tuple(o) for o in ops)


def _zbv_choice(rank, P, M, t, done, next_micro, in_flight, pending_w, w_cap):
    S = 2 * P
    chunks = (rank, S - 1 - rank)

    def ready(kind, g):
        m = next_micro[(kind, g)]
        if m >= M:
            return False
        if kind == "F":
            return g == 0 or done.get(("F", m, g - 1), t + 1) <= t
        if kind == "B":
            if done.get(("F", m, g), t + 1) > t:
                return False
            return g == S - 1 or done.get(("B", m, g + 1), t + 1) <= t
        return done.get(("B", m, g), t + 1) <= t

    for g in (chunks[0], chunks[1]):
        if ready("B", g):
            return "B", g
    if pending_w >= w_cap:
        for g in chunks:
            if ready("W", g):
                return "W", g
    if in_flight < S:
        for g in (chunks[1], chunks[0]):
            if ready("F", g):
                return "F", g
    for g in chunks:
        if ready("W", g):
            return "W", g
    return None


# -- the orders under one signature (the table's ``order`` field) -------------------------------
def gpipe_order(P: int, M: int, rank: int, V: int = 1) -> list[Op]:
    return gpipe_ops(P, M, rank)


def one_f_one_b_order(P: int, M: int, rank: int, V: int = 1) -> list[Op]:
    return one_f_one_b_ops(P, M, rank)


def zb_h1_order(P: int, M: int, rank: int, V: int = 1) -> list[Op]:
    return one_f_one_b_ops(P, M, rank, split=True)


def interleaved_order(P: int, M: int, rank: int, V: int = 1) -> list[Op]:
    return interleaved_ops(P, M, rank, V)


def zbv_order(P: int, M: int, rank: int, V: int = 2) -> list[Op]:
    return list(zbv_ops(P, M)[rank])


def forward_only_order(P: int, M: int, rank: int, V: int = 1) -> list[Op]:
    """Evaluation: micro-batch by micro-batch, the rank's chunks in local order (which is model
    order under every placement: interleaved c*P + p, the V's p < 2P-1-p)."""
    return [Op("F", m, c) for m in range(M) for c in range(V)]
