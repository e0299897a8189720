#!/usr/bin/env python
"""Measure this machine and write a hardware profile the planner reads (``plan_parallel.py --hardware FILE``).

Six measurements, each timed after a warm-up (CUDA events on a GPU, ``perf_counter`` on a CPU):

1. **Matmul rate** at the GEMM shapes one transformer layer of the given model produces on a rank of
   tensor-parallel size t (b micro-batch, s sequence, h hidden, a heads, d = h/a; FLOPs = 2 m k n):
   QKV ``(b s) x h x 3h/t``, the projection ``(b s) x h/t x h``, FC1 ``(b s) x h x 4h/t``, FC2
   ``(b s) x 4h/t x h``, the scores ``(b a/t) x [s x d x s]`` and the context ``(b a/t) x [s x s x d]``;
   plus one square GEMM. bf16 on a GPU, fp32 on a CPU (one thread: what one rank process gets).
   ``peak_tflops`` = the best rate seen. ``achieved_tflops``: the rate a **training step** achieves,
   a ``--training-layers``-layer megalite GPT of that shape through forward and backward on one
   rank (no optimizer step), its model FLOPs (:func:`megalite.model.counting.flops_per_token`: what
   the planner's compute term counts) over the time: the norms, softmax, loss, autograd and Python
   around the GEMMs included (on a CPU a whole step runs at about 0.7x the bare GEMMs' rate).
   ``--training-layers 0``: the layer's GEMM FLOPs over their time instead.
2. **Collectives** per group size n (2, 4, 8 up to the world): all-reduce, all-gather,
   reduce-scatter, all-to-all and send/recv (a ring: each rank sends to the next, receives from the
   previous), over message sizes S (the whole tensor), gloo on CPU in forked processes
   (:func:`megalite.testing.run_world`), NCCL on GPUs under ``torchrun``. A point's time is the slowest
   rank's mean over the repeats, the best of the trials. Each is fitted by least squares in relative
   error, ``time = latency + wire / bandwidth``, with the planner's wire bytes per rank
   (:data:`megalite.planner.WIRE_MEASURE`): ``2 (n-1)/n S`` for an all-reduce, ``(n-1)/n S`` for an
   all-gather, reduce-scatter or all-to-all, ``S`` for a send. So the bandwidth is the one the planner
   divides its wire bytes by (nccl-tests calls it bus bandwidth).
3. **Memory copy** bandwidth: ``dst.copy_(src)`` of a large tensor, bytes read + written per second.
4. **CP blocks**: a context-parallel rank's attention blocks (CP 2, causal, load-balanced: the
   ring's and allgather's block functions on this device, Triton's on a GPU, torch's reference on
   a CPU) forward and backward at the layer's shape, the ranks' mean: ``cp_block_tflops`` = the
   planner's attention FLOPs of a rank (3 x 4 b heads d s^2 / CP, as ``step_time.attention_seconds``
   counts them) over that time; the fused attention (SDPA) over the whole sequence is timed beside.
5. **A call after compute** per group size (:func:`measure_call_after_compute`): a 4 KiB all-gather
   issued after untimed GEMMs, as a step issues its calls (the transport's threads asleep, caches
   cold), not back to back as the table above times them: on this project's CPU 1.2-3.5 ms a call
   against 0.2-1.3 ms back to back, under load (a loaded machine wakes the threads late: calibrate
   an idle one). The rank arriving last waits for nobody, so its time is the call's own; the median
   over rounds, less the wire time, is the profile's latency with ``--latency after-compute``
   (default ``fit``: the fits' intercept, as before; the measurement is kept under ``measured``).
6. **Overlap cost** per group size (:func:`measure_overlap`): square GEMMs for about twice an
   all-reduce of the largest message, timed alone (C), the all-reduce alone (A), and the GEMMs with
   the all-reduce started before them and waited after (T); ``overlap_cost = (T - C) / A`` in
   [0, 1], what a collective hidden behind compute still costs per second of its own time (the
   planner's "overlap" term): near 0 where the two share nothing, near 1 where the collective's
   work runs on the compute's own cores (gloo's threads on a CPU), between on a GPU (NCCL's SMs).

The profile's link figures: ``nvlink_gbps`` / ``nvlink_latency_us`` the median fit of all-reduce,
all-gather and reduce-scatter at the largest group (``--link-ranks``: another); one machine has no
second level, so ``ib_*`` repeat them (``sources`` says so); ``overlap_cost`` that group's measurement.
Every fit and point is kept under ``measured`` (:func:`megalite.planner.hardware.measured_collective`
reads one) for a model that wants more.

The measurements live in ``tools/calibrate_compute.py`` (1, 3, 4) and ``tools/calibrate_links.py``
(2, 5, 6); this tool runs them and turns them into a profile.

    python tools/calibrate_hardware.py --output docs/profiles/cpu-2core.json [--quick] [--max-ranks 8]
    torchrun --nproc-per-node 8 tools/calibrate_hardware.py --output h100-node.json   # NCCL, one node
"""
import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megalite.planner.hardware import write_profile  # noqa: E402
from megalite.planner.types import GiB, Hardware  # noqa: E402
from megalite.testing import run_world  # noqa: E402
from tools.calibrate_compute import (copy_bandwidth, layer_gemms, measure_cp_blocks, measure_matmuls,  # noqa: E402
                                     measure_training)
from tools.calibrate_links import (DEFAULT_SIZES, LINK_COLLECTIVES, QUICK_SIZES, fit_latency_bandwidth,  # noqa: E402
                                   measure_collectives, wire_bytes)
from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402


def fits_of(raw: dict) -> dict:
    """The fit of every (collective, group size), with its points: ``[tensor, wire, measured, fitted]`` s."""
    fits = {}
    for kind, by_n in raw.items():
        for n, points in by_n.items():
            wire = [wire_bytes(kind, s, int(n)) for s, _ in points]
            seconds = [t for _, t in points]
            latency, bandwidth = fit_latency_bandwidth(wire, seconds)
            fits.setdefault(kind, {})[str(n)] = {
                "latency_us": latency * 1e6, "gbps": bandwidth / 1e9,
                "points": [[s, w, t, latency + w / bandwidth] for (s, t), w in zip(points, wire)]}
    return fits


def profile_figures(fits: dict, matmuls: list[dict], copy_gbps: float, ranks: int, memory_gib: float,
                    what: str, link_ranks: int | None = None, training: dict | None = None,
                    overlap: dict | None = None, cp_blocks: dict | None = None,
                    after_compute: dict | None = None) -> tuple[dict, dict]:
    """The Hardware fields of a calibration and where each comes from (links and the overlap cost:
    the fits, :func:`measure_overlap` and ``after_compute`` (:func:`measure_call_after_compute`: the
    latency, less its wire time; without it the fits' intercept) among ``link_ranks``, default the
    largest group measured; the achieved rate: ``training``'s, a :func:`measure_training` result,
    else the layer's GEMMs')."""
    layer = [r for r in matmuls if r["name"] != "square"]
    achieved = (training["tflops"] if training else
                sum(r["flops"] for r in layer) / sum(r["seconds"] for r in layer) / 1e12)
    peak = max(r["tflops"] for r in matmuls)
    hw = {"gpu_memory_gb": round(memory_gib, 2), "gpus_per_node": link_ranks or ranks, "peak_tflops": peak,
          "achieved_tflops": achieved, "hbm_gbps": copy_gbps}
    src = {"gpu_memory_gb": f"{what}: memory per rank",
           "gpus_per_node": "the ranks measured on this machine" if not link_ranks else
                            f"--link-ranks: the group the link figures are of ({ranks} ranks measured)",
           "peak_tflops": f"measured: the best matmul rate of {len(matmuls)} shapes",
           "achieved_tflops": (f"measured: a {training['layers']}-layer GPT's forward + backward on one rank, model "
                               f"FLOPs / time" if training else "measured: one layer's forward GEMMs, total FLOPs / total time"),
           "hbm_gbps": "measured: dst.copy_(src), bytes read + written per second"}
    if cp_blocks:
        hw["cp_block_tflops"] = cp_blocks["tflops"]
        src["cp_block_tflops"] = (f"measured: a CP {cp_blocks['cp']} rank's {cp_blocks['backend']} attention blocks, "
                                  f"forward + backward, the planner's attention FLOPs / time")
    largest = str(link_ranks or max((int(n) for n in fits.get("all_reduce", {})), default=0))
    if largest != "0":
        gbps = statistics.median(fits[k][largest]["gbps"] for k in LINK_COLLECTIVES)
        latency = statistics.median(fits[k][largest]["latency_us"] for k in LINK_COLLECTIVES)
        hw.update(nvlink_gbps=gbps, nvlink_latency_us=max(latency, 0.1), ib_gbps=gbps, ib_latency_us=max(latency, 0.1))
        if overlap and largest in overlap:
            o = overlap[largest]
            hw["overlap_cost"] = o["overlap_cost"]
            src["overlap_cost"] = (f"measured among {largest} ranks: GEMMs with an all-reduce of {o['tensor_bytes']} "
                                   f"bytes in flight against each alone, (together - GEMMs) / all-reduce")
        fitted = (f"measured: the median fit (time = latency + wire bytes / bandwidth) of all-reduce, all-gather "
                  f"and reduce-scatter among {largest} ranks")
        after = (after_compute or {}).get(largest)
        if after:
            wire = wire_bytes("all_gather", after["tensor_bytes"], int(largest)) / (gbps * 1e9)
            latency = max((after["seconds"] - wire) * 1e6, 0.1)
            hw.update(nvlink_latency_us=latency, ib_latency_us=latency)
        src.update(nvlink_gbps=fitted, nvlink_latency_us=fitted if not after else (
                       f"measured: a {after['tensor_bytes']}-byte all-gather issued after compute among {largest} "
                       f"ranks, as a step issues its calls (the last-arriving rank's mean, the median of "
                       f"{len(after['rounds'])} rounds), less its wire time; the fits' intercept "
                       f"({statistics.median(fits[k][largest]['latency_us'] for k in LINK_COLLECTIVES):.0f} us) "
                       f"is the back-to-back figure"),
                   ib_gbps="one machine: no second level measured, the same as nvlink_gbps",
                   ib_latency_us="one machine: no second level measured, the same as nvlink_latency_us")
    else:
        default = "not measured (one rank: no collective); Hardware's default"
        hw.update(nvlink_gbps=Hardware.nvlink_gbps, nvlink_latency_us=Hardware.nvlink_latency_us,
                  ib_gbps=Hardware.ib_gbps, ib_latency_us=Hardware.ib_latency_us)
        src.update({k: default for k in ("nvlink_gbps", "nvlink_latency_us", "ib_gbps", "ib_latency_us")})
    return hw, src


def markdown(fits: dict, matmuls: list[dict], hw: dict) -> list[str]:
    """The measured tables as docs/BENCHMARKS.md shows them (collectives: measured (fitted) ms per size)."""
    lines = ["| GEMM | batch x m x k x n | ms | TFLOP/s |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {' x '.join(map(str, r['shape']))} | {r['seconds'] * 1e3:.3f} | {r['tflops']:.4f} |"
              for r in matmuls]
    sizes = sorted({p[0] for by_n in fits.values() for f in by_n.values() for p in f["points"]})
    if sizes:
        lines += ["", "| collective | ranks | latency us | GB/s (wire) | "
                  + " | ".join(f"{s / 1024:g} KiB" for s in sizes) + " |", "|---|---|---|---|" + "---|" * len(sizes)]
        for kind, by_n in fits.items():
            for n, f in by_n.items():
                gbps = f"{f['gbps']:.3f}" if f["gbps"] < 1e6 else "- (no growth with size)"
                lines.append(f"| {kind} | {n} | {f['latency_us']:.0f} | {gbps} | "
                             + " | ".join(f"{p[2] * 1e3:.3f} ({p[3] * 1e3:.3f})" for p in f["points"]) + " |")
    lines += ["", "profile: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in hw.items())]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="the profile JSON to write (plan_parallel.py --hardware FILE)")
    p.add_argument("--name", default=None, help="the profile's name (default: cpu-Ncore or the GPU's name)")
    p.add_argument("--quick", action="store_true", help="small sizes, 2 ranks, few repeats: seconds, not minutes")
    p.add_argument("--max-ranks", type=int, default=None,
                   help="CPU: the largest gloo world (group sizes 2, 4, 8 up to it; default 8, 2 with --quick); "
                        "under torchrun the world is torchrun's")
    p.add_argument("--link-ranks", type=int, default=None, metavar="N",
                   help="the group size whose fits fill the profile's link figures (default: the largest measured; "
                        "every size's fits are kept under 'measured')")
    p.add_argument("--sizes", type=int, nargs="+", default=None, metavar="BYTES",
                   help="message sizes (whole tensor) in bytes (default 4 KiB .. 16 MiB by 4x; --quick 1, 16, 256 KiB)")
    p.add_argument("--repeats", type=int, default=None, help="calls per timed trial (default 5, --quick 2)")
    p.add_argument("--trials", type=int, default=None,
                   help="timed trials per point, the best kept (default 3, --quick 2)")
    p.add_argument("--latency", choices=("fit", "after-compute"), default="fit",
                   help="the profile's latency per call: the back-to-back fits' intercept (fit, the default), or a "
                        "small all-gather issued after compute, as a step issues its calls (after-compute)")
    g = p.add_argument_group("the model whose GEMM shapes are timed (default: h 512, s 512, b 2, 8 heads on a CPU; "
                             "h 8192, s 4096, b 1, 64 heads on a GPU; --quick: h 64, s 64)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--training-layers", type=int, default=None, metavar="L",
                   help="layers of the GPT whose forward + backward gives the achieved rate (default 2, --quick 1; "
                        "0: the GEMMs' rate instead)")
    g.add_argument("--vocab-size", type=int, default=None, help="that GPT's vocabulary (default 4096, --quick 256)")
    return p


def settings(a, gpu: bool) -> dict:
    model = (64, 64, 1, 4) if a.quick else (8192, 4096, 1, 64) if gpu else (512, 512, 2, 8)
    h, s, b, heads = (given if given is not None else default for given, default in
                      zip((a.hidden_size, a.seq_length, a.micro_batch_size, a.num_attention_heads), model))
    return {"model": (h, s, b, heads), "sizes": a.sizes or (QUICK_SIZES if a.quick else DEFAULT_SIZES),
            "repeats": a.repeats or (2 if a.quick else 5), "trials": a.trials or (2 if a.quick else 3),
            "max_ranks": a.max_ranks or (2 if a.quick else 8), "matmul_seconds": 0.01 if a.quick else 0.3,
            "square": 256 if a.quick else 8192 if gpu else 1024, "copy_bytes": 2**23 if a.quick else 2**28}


def measure_compute(a, c: dict, device: torch.device, gpu: bool) -> tuple[list[dict], float, dict | None, dict]:
    """The matmul rows (one layer's GEMMs and a square one), the copy bandwidth in GB/s, the
    training step's rate (None with ``--training-layers 0``) and the CP blocks' (:func:`measure_cp_blocks`)."""
    h, s, b, heads = c["model"]
    square = c["square"]
    shapes = layer_gemms(h, s, b, heads, a.tensor_model_parallel_size) + [("square", 1, square, square, square)]
    matmuls = measure_matmuls(shapes, device, torch.bfloat16 if gpu else torch.float32, c["matmul_seconds"],
                              c["trials"])
    layers = 1 if a.quick and a.training_layers is None else 2 if a.training_layers is None else a.training_layers
    vocab = a.vocab_size or (256 if a.quick else 4096)
    training = (measure_training(c["model"], layers, vocab, device, gpu, c["repeats"], c["trials"]) if layers > 0
                else None)
    rank_shape = (h, s, b, heads // a.tensor_model_parallel_size)  # a TP rank's heads
    dtype = torch.bfloat16 if gpu else torch.float32
    cp_blocks = measure_cp_blocks(rank_shape, device, dtype, c["repeats"], c["trials"])
    return matmuls, copy_bandwidth(device, c["copy_bytes"], 3 if a.quick else 10) / 1e9, training, cp_blocks


def main(argv=None) -> int:
    parser = one_line_errors(build_parser())
    a = parser.parse_args(argv)
    writable(parser, "--output", a.output)
    positive(parser, "--sizes", *(a.sizes or [1]))
    for flag, value in (("--max-ranks", a.max_ranks), ("--repeats", a.repeats), ("--trials", a.trials)):
        positive(parser, flag, *([] if value is None else [value]))
    if a.training_layers is not None and a.training_layers < 0:
        parser.error(f"--training-layers takes 0 (the GEMMs' rate) or more layers, got {a.training_layers}")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    c = settings(a, gpu)
    ranks = launched if launched > 1 else 1 if gpu else c["max_ranks"]  # one process per rank
    groups = [n for n in (2, 4, 8, 16) if n <= ranks]
    if a.link_ranks is not None and a.link_ranks not in groups:
        parser.error(f"--link-ranks {a.link_ranks} is not a group size measured here ({groups or 'none'}): "
                     "give one of those, or raise --max-ranks")
    h, s, b, heads = c["model"]
    if h % heads or heads % a.tensor_model_parallel_size or (4 * h) % a.tensor_model_parallel_size:
        parser.error(f"--hidden-size {h}, --num-attention-heads {heads}, --tensor-model-parallel-size "
                     f"{a.tensor_model_parallel_size}: heads must divide the hidden size and TP the heads")
    started, load = time.perf_counter(), os.getloadavg()[0]
    if launched > 1:  # torchrun: one rank per GPU (NCCL) or per process (gloo)
        dist.init_process_group("nccl" if gpu else "gloo")
        rank = dist.get_rank()
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        raw = measure_collectives(rank, launched, groups, c["sizes"], c["repeats"], c["trials"],
                                  "cuda" if gpu else "cpu")
    else:  # the forked gloo worlds first, before this process runs multi-threaded torch ops (ENV_NOTES)
        rank = 0
        raw = (run_world(measure_collectives, ranks, groups, c["sizes"], c["repeats"], c["trials"], timeout=1800)[0]
               if groups else {})
    device = torch.device("cuda") if gpu else torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a CPU a rank is one single-threaded process
    try:
        matmuls, copy_gbps, training, cp_blocks = measure_compute(a, c, device, gpu)
    finally:
        torch.set_num_threads(threads)
    if gpu:
        memory, what = torch.cuda.get_device_properties(device).total_memory / GiB, torch.cuda.get_device_name(device)
    else:
        per_node = a.link_ranks or ranks  # the rank processes sharing the host memory
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB / per_node
        what = f"host memory {memory * per_node:.1f} GiB / {per_node} rank processes"
    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return 0
    overlap = {str(n): o for n, o in raw.pop("overlap", {}).items()}
    after_compute = {str(n): o for n, o in raw.pop("after_compute", {}).items()}
    fits = fits_of({k: v for k, v in raw.items() if v})
    hw, sources = profile_figures(fits, matmuls, copy_gbps, ranks, memory, what, a.link_ranks, training, overlap,
                                  cp_blocks, after_compute if a.latency == "after-compute" else None)
    name = a.name or (torch.cuda.get_device_name(device).lower().replace(" ", "-") if gpu
                      else f"cpu-{os.cpu_count()}core")
    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": what if gpu else f"CPU, {os.cpu_count()} cores, gloo", "dtype": "bf16" if gpu else "fp32",
                "model": dict(zip(("hidden_size", "seq_length", "micro_batch_size", "num_attention_heads"), c["model"]),
                              tensor_model_parallel_size=a.tensor_model_parallel_size),
                "load_average": load, "seconds": time.perf_counter() - started,
                "matmul": matmuls, "training": training, "copy_gbps": copy_gbps, "collectives": fits,
                "overlap": overlap, "cp_blocks": cp_blocks,
                "after_compute": after_compute}
    write_profile(a.output, name, hw, sources, measured)
    print("\n".join(markdown(fits, matmuls, hw)))
    print(f"profile {name!r} written to {a.output} ({measured['seconds']:.1f} s; load average before "
          f"{measured['load_average']:.2f})")
    if launched > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
