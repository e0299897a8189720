"""What tools/calibrate_hardware.py measures of a machine's links (its module docstring, items 2, 5
and 6): each collective's time per group size and message size with its latency + bandwidth fit in
the planner's wire bytes, a small call issued after compute, and what a collective in flight costs
the compute beside it (the overlap cost)."""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from tools.calibrate_compute import seconds_per_call

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
LINK_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # the ring collectives the planner's links carry
DEFAULT_SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
QUICK_SIZES = [2**10, 2**14, 2**18]


def wire_bytes(kind: str, tensor_bytes: int, n: int) -> float:
    """What one rank sends for one call on a tensor of ``tensor_bytes`` among ``n`` ranks (ring algorithms)."""
    if kind == "send_recv":
        return float(tensor_bytes)
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * tensor_bytes


def fit_latency_bandwidth(wire: list[float], seconds: list[float]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``t = latency + wire / bandwidth`` by weighted least squares,
    ``min sum (fit - t)^2 / t``: between plain least squares (the largest message decides everything,
    the latency comes out anywhere) and relative error (1/t^2: every size counts alike, so the
    largest messages, a gradient bucket's, end up fitted worst); on this machine's table (docs/BENCHMARKS.md)
    1/t put the largest size's median error at 5% against 14% with 1/t^2 (plain: 2%), the median
    over all sizes at 13% against 14% (plain: 20%). A negative latency is clamped to 0 and the slope
    refitted through the origin; a time that falls with the size is all latency (the weighted mean)."""
    w = [1.0 / t for t in seconds]
    sw, sx, sxx = sum(w), sum(wi * x for wi, x in zip(w, wire)), sum(wi * x * x for wi, x in zip(w, wire))
    sy, sxy = sum(wi * t for wi, t in zip(w, seconds)), sum(wi * x * t for wi, x, t in zip(w, wire, seconds))
    det = sw * sxx - sx * sx
    latency, slope = ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (0.0, 0.0)
    if latency < 0 or det <= 0:
        latency, slope = 0.0, sxy / sxx
    if slope <= 0:  # a time that does not grow with the bytes: all latency, bandwidth beyond measure
        latency, slope = sy / sw, 1e-18
    return latency, 1.0 / slope


def _collective_call(kind: str, tensor_bytes: int, n: int, rank: int, group, device, dtype):
    """A closure running one ``kind`` call among ranks 0..n-1 on a tensor of ``tensor_bytes``."""
    numel = max(n, tensor_bytes // torch.tensor([], dtype=dtype).element_size() // n * n)
    x = torch.ones(numel, device=device, dtype=dtype)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        part = torch.ones(numel // n, device=device, dtype=dtype)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # newer torch's name
        return lambda: gather(x, part, group=group)
    if kind == "reduce_scatter":
        part = torch.empty(numel // n, device=device, dtype=dtype)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: scatter(part, x, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    out = torch.empty_like(x)  # send/recv: a ring, each rank to the next (a pipeline's sends)

    def ring():
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % n, group), dist.P2POp(dist.irecv, out, (rank - 1) % n, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return ring


def measure_collectives(rank: int, world: int, group_sizes: list[int], sizes: list[int], repeats: int,
                        trials: int, device_type: str = "cpu") -> dict:
    """Every collective at every group size and message size, on this rank; rank 0's dict holds the
    slowest rank's times: ``{kind: {n: [[tensor_bytes, seconds], ...]}}``."""
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0)) if device_type == "cuda" else None)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    out: dict = {k: {} for k in COLLECTIVES + ("overlap", "after_compute")}
    for n in group_sizes:
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank < n:
            for kind in COLLECTIVES:
                points = []
                for size in sizes:
                    call = _collective_call(kind, size, n, rank, group, device, dtype)
                    for _ in range(2):  # warm-up: connections, buffers
                        call()
                    best = float("inf")
                    for _ in range(trials):
                        dist.barrier(group=group)
                        slowest = torch.tensor([seconds_per_call(call, device, repeats)], dtype=torch.float64, device=device)
                        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                        best = min(best, slowest.item())
                    points.append([size, best])
                out[kind][n] = points
            out["overlap"][n] = measure_overlap(group, max(sizes), trials, device, dtype)
            out["after_compute"][n] = measure_call_after_compute(rank, n, group, repeats, trials, device, dtype)
        dist.barrier()
    return out


AFTER_COMPUTE_BYTES = 4096  # the all-gather whose call after compute gives the profile's latency


def measure_call_after_compute(rank: int, n: int, group, repeats: int, trials: int, device, dtype) -> dict:
    """Seconds of one all-gather of :data:`AFTER_COMPUTE_BYTES` issued after three untimed square
    GEMMs, each rank's mean over ``4 x repeats`` calls; per round the least over the ranks (the rank
    arriving last: its time is the call's, not a wait for a peer), over ``max(trials, 5)`` rounds
    (module docstring, 5). ``seconds``: the rounds' median."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    call = _collective_call("all_gather", AFTER_COMPUTE_BYTES, n, rank, group, device, dtype)
    side = 4096 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device, dtype=dtype)
    call(), torch.mm(a, a)  # warm-up
    rounds = []
    for _ in range(max(trials, 5)):
        dist.barrier(group=group)
        seconds = 0.0
        for _ in range(4 * repeats):
            for _ in range(3):
                torch.mm(a, a)
            seconds += seconds_per_call(call, device, 1)
        mine = torch.tensor([seconds / (4 * repeats)], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
        rounds.append(mine.item())
    return {"tensor_bytes": AFTER_COMPUTE_BYTES, "rounds": rounds, "seconds": statistics.median(rounds)}


def overlap_cost_of(compute_s: float, collective_s: float, together_s: float) -> float:
    """``(T - C) / A`` clipped to [0, 1] (module docstring, 4): the share of a collective's own
    time A that the compute C, with the collective in flight behind it, still took longer (T)."""
    return min(1.0, max(0.0, (together_s - compute_s) / collective_s))


def measure_overlap(group, tensor_bytes: int, trials: int, device, dtype) -> dict:
    """Seconds of square GEMMs alone (C), an all-reduce of ``tensor_bytes`` alone (A) and the two
    together (T: the all-reduce started before the GEMMs, waited after), the slowest rank's each;
    the three are timed back to back in each of ``max(trials, 5)`` rounds, and the overlap cost is
    the median of the rounds' :func:`overlap_cost_of` (a shared machine's load changes between
    rounds, less within one). The GEMMs: enough for about twice the all-reduce."""
    if device.type == "cpu":
        torch.set_num_threads(1)  # a rank's one core (this process is a forked rank or torchrun's)
    numel = max(1, tensor_bytes // torch.tensor([], dtype=dtype).element_size())
    x = torch.ones(numel, device=device, dtype=dtype)
    side = 4096 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device, dtype=dtype)

    def slowest(fn, repeats=1):
        dist.barrier(group=group)
        seconds = torch.tensor([seconds_per_call(fn, device, repeats)], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
        return seconds.item()

    reduce = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    reduce(), torch.mm(a, a)  # warm-up
    count = max(1, round(2 * min(slowest(reduce) for _ in range(3)) / slowest(lambda: torch.mm(a, a), 10)))
    compute = lambda: [torch.mm(a, a) for _ in range(count)]  # noqa: E731

    def together():
        work = dist.all_reduce(x, group=group, async_op=True)
        compute()
        work.wait()
    rounds = [(slowest(compute), slowest(reduce), slowest(together)) for _ in range(max(trials, 5))]
    return {"tensor_bytes": tensor_bytes, "gemms": count, "rounds": rounds,
            "overlap_cost": statistics.median(overlap_cost_of(*r) for r in rounds)}
