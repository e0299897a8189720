"""A pipeline schedule resolved once: :func:`resolve_schedule` turns the --pipeline-schedule
name, the pipeline size P and the chunks per rank into a :class:`PipelineSchedule`, and every
module asks that object instead of the name.

The resolution is the one place a schedule name is looked at: the table row
(:mod:`megalite.pipeline.schedule_kinds`) of the schedule that runs (1f1b or gpipe with V > 1
chunks per rank run the interleaved order), and, for evaluation, the same chunk placement with the
forward-only order. What the object owns:

- chunks per rank, whether the backward is split into B and W, the chunk placement
  (``global_chunk``, ``owner``);
- its operation list per rank (:meth:`PipelineSchedule.ops`, from the row's order function);
- its simulation (:meth:`PipelineSchedule.simulate`): every operation started when its rank is
  free and its inputs exist, with F/B/W times (default 1, BW = B + W); from it the theory
  bubble and the global message order the executor posts in;
- its theory bubble: (P-1)/(V*M+P-1) for the classical schedules with F = B = W (a classical
  backward of 2 units, ideal stages), else the simulation's idle fraction;
- the order in which its operations complete a rank's gradients
  (:meth:`PipelineSchedule.op_positions`), which ZeRO's overlapped reduction follows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megalite.pipeline.orders import Op, forward_only_order
from megalite.pipeline.schedule_kinds import Schedule, schedule as table_row


@dataclass(frozen=True)
class PipelineSchedule:
    """One schedule on P ranks with ``V`` chunks per rank (module docstring)."""
    kind: Schedule  # the table row of the schedule that runs
    P: int
    V: int  # chunks per rank
    forward_only: bool = False  # evaluation: forward operations only, same placement

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def display(self) -> str:
        return self.kind.display

    @property
    def split_backward(self) -> bool:
        """B and W run apart (the layers keep their weight gradients until W runs)."""
        return self.kind.split_backward and not self.forward_only

    @property
    def chunks(self) -> int:
        """Model chunks of the whole pipeline."""
        return self.P * self.V

    def global_chunk(self, rank: int, chunk: int) -> int:
        return self.kind.global_chunk(self.P, rank, chunk)

    def owner(self, g: int) -> tuple[int, int]:
        return self.kind.owner(self.P, g)

    def evaluation(self) -> PipelineSchedule:
        """The same placement, forward only."""
        return replace(self, forward_only=True)

    def runs(self, M: int) -> bool:
        """Whether the schedule runs a step of M micro-batches (interleaving needs M % P == 0)."""
        return not self.kind.micro_groups or M % self.P == 0

    def ops(self, M: int, rank: int) -> tuple[Op, ...]:
        """The rank's operations for one step of M micro-batches, in order."""
        return _ops(self, M, rank)

    def simulate(self, M: int, times: dict | None = None) -> Simulation:
        return simulate_ops(self, M, times)

    def messages(self, M: int, rank: int) -> tuple[tuple, ...]:
        """The rank's p2p messages of one step in the global order (:meth:`Simulation.messages`)."""
        return _messages(self, M, rank)

    def theory_bubble(self, M: int, times: dict | None = None) -> float:
        """Idle fraction of a step with F = B = W (or ``times``): the closed form (P-1)/(V*M+P-1)
        where the row has one, else the simulation's."""
        if self.kind.closed_bubble and times is None:
            return (self.P - 1) / (self.V * M + self.P - 1)
        return self.simulate(M, times).bubble()

    def op_positions(self, M: int, rank: int) -> dict[tuple[str, int, int], int]:
        """(kind, micro, chunk) -> position in the rank's list; a ``BW`` counts as both its B
        and its W. A parameter's gradient of micro-batch j is complete after the W (or the B,
        when the layer does not defer its weight gradient) of j on its chunk."""
        position = {}
        for k, op in enumerate(self.ops(M, rank)):
            for kind in ("B", "W") if op.kind == "BW" else (op.kind,):
                position[(kind, op.micro, op.chunk)] = k
        return position


def resolve_schedule(name: str, P: int, virtual: int = 1, evaluation: bool = False) -> PipelineSchedule:
    """The schedule ``name`` (a --pipeline-schedule value, or ``interleaved``) on P ranks with
    ``virtual`` interleaved chunks per rank (the V of --num-layers-per-virtual-pipeline-stage;
    the V-shaped schedule sets its own 2). The only place a name picks behaviour. 1f1b and gpipe
    with V > 1 run the interleaved order (as the classical runner always did)."""
    kind = table_row(table_row(name).run_name(virtual))
    if kind.chunks_per_rank(virtual) > 1 and not (kind.v_shape or kind.any_chunks):
        raise ValueError(f"pipeline schedule {name} runs one chunk per rank, not {virtual} "
                         f"(megalite.pipeline.checks refuses the configuration)")
    resolved = PipelineSchedule(kind, P, kind.chunks_per_rank(virtual))
    return resolved.evaluation() if evaluation else resolved


@lru_cache(maxsize=256)
def _ops(s: PipelineSchedule, M: int, rank: int) -> tuple[Op, ...]:
    order = forward_only_order if s.forward_only else s.kind.order
    return tuple(order(s.P, M, rank, s.V))


@lru_cache(maxsize=32)
def _messages(s: PipelineSchedule, M: int, rank: int) -> tuple[tuple, ...]:
    """Once per shape: the simulation takes ~1 s for P = 16, M = 512."""
    return tuple(m for m in s.simulate(M).messages() if rank in (m[1], m[2]))


# -- simulation ---------------------------------------------------------------------------------
@dataclass
class Simulation:
    """Start and end of every operation, per rank, in the order the rank runs them."""
    schedule: str
    P: int
    M: int
    V: int
    timed: list[list[tuple[Op, float, float]]]
    placement: PipelineSchedule | None = None

    @property
    def span(self) -> float:
        return max(e for ops in self.timed for _, _, e in ops)

    def bubble(self) -> float:
        """Idle fraction of the step, averaged over ranks (as the measured bubble)."""
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
        out, s = [], self.placement
        for rank, ops in enumerate(self.timed):
            for op, _, end in ops:
                if op.kind not in ("F", "B", "BW"):
                    continue
                g = s.global_chunk(rank, op.chunk)
                if op.kind == "F" and g < s.chunks - 1:
                    dst, _ = s.owner(g + 1)
                    if dst != rank:
                        out.append((end, rank, dst, "act", op.micro, g + 1))
                elif op.kind != "F" and g > 0:
                    dst, _ = s.owner(g - 1)
                    if dst != rank:
                        out.append((end, rank, dst, "grad", op.micro, g - 1))
        return sorted(out)


def simulate_ops(s: PipelineSchedule, M: int, times: dict | None = None) -> Simulation:
    """Run every rank's order with operation times ``times`` (default F = B = W = 1, BW =
    B + W), each operation starting when its rank is free and its inputs exist. Raises if
    an order waits for something that never comes (a schedule bug)."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, **(times or {})}
    times.setdefault("BW", times["B"] + times["W"])
    P, S = s.P, s.chunks
    orders = [s.ops(M, r) for r in range(P)]
    end: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * P, [0.0] * P
    timed: list[list] = [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                g = s.global_chunk(r, op.chunk)
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
        raise RuntimeError(f"schedule {s.name} P={P} M={M}: rank {r} waits forever at {orders[r][pos[r]]}")
    return Simulation(s.name, P, M, s.V, timed, s)


def _needs(op: Op, g: int, S: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", op.micro, g - 1)] if g > 0 else []
    if op.kind == "W":
        return [("B", op.micro, g)]
    needs = [("F", op.micro, g)]
    return needs + ([("B", op.micro, g + 1)] if g < S - 1 else [])
