"""Pipeline schedules as per-rank lists of operations, and their simulation.

A schedule is, for every pipeline rank, the order in which it runs its operations on
(micro-batch m, local model chunk c):

- ``F``: forward of the chunk;
- ``B``: backward to the chunk's *input* only (what the previous chunk waits for);
- ``W``: the chunk's *weight* gradients (nobody waits for them), deferred from B.

The classical schedules run B and W together (``BW``). The zero-bubble schedules (Qi et
al., "Zero Bubble Pipeline Parallelism", 2024) place the W's in the slots 1F1B leaves idle:

- ``zb-h1``: 1F1B's order of F and B; stage p runs W of micro-batch j - p right after B of
  micro-batch j, and the rest after its last B. F-done-B-pending micro-batches stay 1F1B's
  P - p; at most p more micro-batches wait for their W, holding only the W inputs (the
  inputs of the linears and the gradients of their outputs). With equal F, B, W times
  t, the bubble per rank is (P-1)(F+B-W) = (P-1) t, a third of 1F1B's (P-1)(F+B+W).
- ``zbv``: two chunks per rank in a V: rank p holds global chunk p (first leg, activations
  go to rank p+1) and global chunk 2P-1-p (second leg, activations go to rank p-1); rank
  P-1 turns the V around locally, and rank 0 holds both the embedding and the loss. The
  order comes from a greedy list schedule (:func:`zbv_ops`): B first (it is on the
  critical path), then F while fewer than 2P chunk activations (P stages' worth, 1F1B's
  peak on stage 0) are in flight, then W to fill what is left.

:func:`simulate` runs any schedule with given F/B/W times (all ranks advancing in
parallel, dependencies between ranks honoured) and reports each operation's start and end:
the theory for the bubble and the in-flight counts, and the order in which the pipeline's
messages are produced, which :mod:`megalite.pipeline.executor` posts in (the same order on
both ends of every link, so the exchange cannot deadlock, see there).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megalite.pipeline.schedule_kinds import ZERO_BUBBLE, schedule as describe  # noqa: F401 (ZERO_BUBBLE: re-exported)


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W" or "BW" (B and W fused, the classical backward)
    micro: int
    chunk: int  # local chunk index on its rank


def num_chunks(schedule: str, virtual: int = 1) -> int:
    """Model chunks per rank: 2 for zbv, ``virtual`` for the interleaved schedule, else 1."""
    return describe(schedule).chunks_per_rank(virtual)


def global_chunk(schedule: str, P: int, rank: int, chunk: int) -> int:
    """Position in the model (0 = embedding ... P*V-1 = loss) of a rank's local chunk."""
    return describe(schedule).global_chunk(P, rank, chunk)


def owner(schedule: str, P: int, V: int, g: int) -> tuple[int, int]:
    """(rank, local chunk) holding global chunk ``g``."""
    return describe(schedule).owner(P, g)


# -- the orders ---------------------------------------------------------------------------------
def one_f_one_b_ops(P: int, M: int, rank: int, split: bool = False) -> list[Op]:
    """1F1B: min(P-rank-1, M) warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards. ``split``: the zb-h1 order (module docstring)."""
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


@lru_cache(maxsize=64)
def zbv_ops(P: int, M: int) -> tuple[tuple[Op, ...], ...]:
    """The ZB-V order of every rank: a greedy list schedule over unit-time F, B and W.

    Whenever a rank is free it runs, in this priority: a ready B (chunk 0 first: it ends
    the micro-batch's backward sooner, freeing memory and W work); a pending W if 2P-2
    chunk W's are pending (the bound on stored W inputs); a ready F if fewer than 2P chunk
    activations are in flight (second-leg chunk first, it reaches the loss sooner); a
    pending W; else it idles until something becomes ready. Deterministic, so every rank
    computes the same orders. The bound 2P-2 was chosen by simulation: smaller bounds
    (1..P) leave 2-3x the bubble at some M (P = 4, M = 12: 0.065-0.089 against 0.040)."""
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


def rank_ops(schedule: str, P: int, M: int, rank: int, virtual: int = 1) -> list[Op]:
    """This rank's operations, in order, for a schedule the generic executor runs."""
    if schedule == "zb-h1":
        return one_f_one_b_ops(P, M, rank, split=True)
    if schedule == "zbv":
        return list(zbv_ops(P, M)[rank])
    if schedule == "1f1b" and virtual == 1:
        return one_f_one_b_ops(P, M, rank)
    if schedule == "gpipe":
        return gpipe_ops(P, M, rank)
    raise ValueError(f"no operation list for schedule {schedule!r} with {virtual} chunks per rank")


# -- simulation ---------------------------------------------------------------------------------
@dataclass
class Simulation:
    """Start and end of every operation, per rank, in the order the rank runs them."""
    schedule: str
    P: int
    M: int
    V: int
    timed: list[list[tuple[Op, float, float]]]

    @property
    def span(self) -> float:
        return max(e for ops in self.timed for _, _, e in ops)

    def bubble(self) -> float:
        """Idle fraction of the step, averaged over ranks (as :func:`measured_bubble`)."""
        busy = [sum(e - s for _, s, e in ops) for ops in self.timed]
        return sum(1 - b / self.span for b in busy) / self.P

    def peak_counts(self, rank: int) -> tuple[int, int]:
        """(most chunk activations whose B is pending, most chunk-W's pending at that moment)
        on a rank: the schedule's activation memory, in units of one chunk's activations and
        one chunk's W inputs, counted right after each F."""
        fb = w = 0
        best = (0, 0)
        for op, _, _ in self.timed[rank]:
            if op.kind == "F":
                fb += 1
                best = max(best, (fb, w))
            elif op.kind == "B":
                fb, w = fb - 1, w + 1
            elif op.kind == "W":
                w -= 1
            else:
                fb -= 1
        return best

    def peak_memory(self, rank: int, activation: float = 1.0, w_inputs: float = 1.0) -> float:
        """The most a rank holds at any operation boundary: chunk activations whose B is
        pending times ``activation`` plus chunk W's pending times ``w_inputs`` (per chunk and
        micro-batch). Exact for the schedule, unlike :meth:`peak_counts`, which looks only
        right after each F: in ZBV's cool-down B's turn activations into W inputs."""
        fb = w = 0
        best = 0.0
        for op, _, _ in self.timed[rank]:
            fb += {"F": 1, "B": -1, "BW": -1}.get(op.kind, 0)
            w += {"B": 1, "W": -1}.get(op.kind, 0)
            best = max(best, fb * activation + w * w_inputs)
        return best

    def messages(self) -> list[tuple]:
        """Every p2p message of the step in one global order: (produced at, src, dst, kind,
        micro, receiving global chunk), kind "act" or "grad". Sorted by when the simulation
        produces it, ties broken by the rest of the tuple: every rank derives the same order."""
        out = []
        for rank, ops in enumerate(self.timed):
            for op, _, end in ops:
                if op.kind not in ("F", "B", "BW"):
                    continue
                g = global_chunk(self.schedule, self.P, rank, op.chunk)
                if op.kind == "F" and g < self.P * self.V - 1:
                    dst, _ = owner(self.schedule, self.P, self.V, g + 1)
                    if dst != rank:
                        out.append((end, rank, dst, "act", op.micro, g + 1))
                elif op.kind != "F" and g > 0:
                    dst, _ = owner(self.schedule, self.P, self.V, g - 1)
                    if dst != rank:
                        out.append((end, rank, dst, "grad", op.micro, g - 1))
        return sorted(out)


def simulate(schedule: str, P: int, M: int, times: dict | None = None, virtual: int = 1) -> Simulation:
    """Run every rank's order with operation times ``times`` (default F = B = W = 1, BW =
    B + W), each operation starting when its rank is free and its inputs exist. Raises if
    an order waits for something that never comes (a schedule bug)."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, **(times or {})}
    times.setdefault("BW", times["B"] + times["W"])
    V = num_chunks(schedule, virtual)
    S = P * V
    orders = [rank_ops(schedule, P, M, r, virtual) for r in range(P)]
    end: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * P, [0.0] * P
    timed: list[list] = [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                g = global_chunk(schedule, P, r, op.chunk)
                needs = _needs(op, g, S)
                if any(n not in end for n in needs):
                    break
                start = max([clock[r]] + [end[n] for n in needs])
                finish = start + times[op.kind]
                for kind in ("B", "W") if op.kind == "BW" else (op.kind,):
                    end[(kind, op.micro, g)] = finish
                timed[r].append((op, start, finish))
                clock[r], pos[r] = finish, pos[r] + 1
                progress = True
    stuck = [r for r in range(P) if pos[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise RuntimeError(f"schedule {schedule} P={P} M={M}: rank {r} waits forever at {orders[r][pos[r]]}")
    return Simulation(schedule, P, M, V, timed)


def _needs(op: Op, g: int, S: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", op.micro, g - 1)] if g > 0 else []
    if op.kind == "W":
        return [("B", op.micro, g)]
    needs = [("F", op.micro, g)]
    return needs + ([("B", op.micro, g + 1)] if g < S - 1 else [])


def theory_bubble(schedule: str, P: int, M: int, virtual: int = 1, times: dict | None = None) -> float:
    """The bubble of a schedule with F = B = W (or ``times``): the closed form where one is
    known, (P-1)/(V*M+P-1) for 1F1B and interleaved, else the simulation's."""
    if schedule in ("1f1b", "gpipe") and times is None:
        return (P - 1) / (virtual * M + P - 1)
    return simulate(schedule, P, M, times, virtual).bubble()
