#!/usr/bin/env python
"""Each Triton kernel against its alternatives, side by side: time, throughput, max error.

- attention: megalite Triton flash attention vs torch SDPA (default choice; on a GPU also
  forced to its flash backend, FlashAttention-2) vs flash-attn (when installed).
  Causal and full, head dims 64 and 128, and q/k 192 with v 128 (DeepSeek-V3's MLA; not
  flash-attn, which takes one head size), sequence 1k to 16k (16k tokens per case) on a GPU.
  TFLOP/s: forward 2*B*H*N^2*(D + D_v) (= 4*B*H*N^2*D when they are equal), backward 2.5x
  that, half of each when causal.
- layernorm / rmsnorm: Triton vs torch (and torch.compile of it on a GPU), hidden up to 16k.
  GB/s: forward reads x and writes y, backward reads x and dy and writes dx.
- cross-entropy: Triton (stats + gradient, no probabilities stored) vs torch F.cross_entropy
  (and torch.compile of it on a GPU), vocabulary up to 256k.
  GB/s: forward reads the logits, backward reads them and writes their gradient.
- grouped GEMM (mixture-of-experts expert layers, rows sorted by expert): Triton
  grouped_linear (one launch per product) vs the loop of one F.linear per expert vs
  torch._grouped_mm (when this torch has it and it runs here). TFLOP/s: forward 2*N*K*Nout,
  backward (dx and dw) twice that; the forward + backward total is printed below the table.
  GPU: Mixtral-like shapes (8 experts, 8192 tokens x top-2 routed rows, h 4096, F 14336:
  the fc1 product h -> 2F and the fc2 product F -> h), unevenly routed.

Max error: against a float64 torch reference (attention on a GPU: the last 64 queries of the
first batch element, which see every key; backward errors only up to N = 2048). Grouped GEMM:
max |a - ref| / max(1, max |ref|), the reference the loop in float64 (GPU: float32, TF32 off).

On a CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set here) at one small
size: those times say nothing about speed; only the errors mean something.

--plot PATH also draws the chart (needs matplotlib; PNG, SVG or PDF by the extension):
attention forward and backward TFLOP/s against sequence length, one line per implementation
(and head dim, dtype), and the row-wise kernels' GB/s per implementation.

    python tools/bench_kernels.py [--quick] [--json PATH] [--plot PATH]
"""
import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import torch.nn.functional as F  # noqa: E402

from megalite.kernels.attention_reference import attention_reference  # noqa: E402
from megalite.kernels.cross_entropy import cross_entropy  # noqa: E402
from megalite.kernels.flash_attention import flash_attention  # noqa: E402
from megalite.kernels.grouped_gemm import grouped_linear, grouped_linear_reference  # noqa: E402
from megalite.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference  # noqa: E402
from megalite.layers.backends import flash_missing  # noqa: E402
from tools.tool_errors import one_line_errors, writable  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() (triton's do_bench on a GPU)."""
    if GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def max_err(a, ref) -> float:
    return (a.double() - ref.double()).abs().max().item()


def fwd_bwd(make_fwd, inputs, grad, reps):
    """(fwd ms, bwd ms, out, input grads); bwd ms = (fwd + bwd) - fwd."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = make_fwd(*leaves)
    out.backward(grad)
    grads = [x.grad for x in leaves]
    with torch.no_grad():
        t_fwd = timed(lambda: make_fwd(*inputs), reps)

    def step():
        for x in leaves:
            x.grad = None
        make_fwd(*leaves).backward(grad)
    return t_fwd, max(timed(step, reps) - t_fwd, 0.0), out.detach(), grads


# -- attention -------------------------------------------------------------------------------------

def attention_impls(causal: bool = True):
    impls = {"triton": lambda q, k, v: flash_attention(q, k, v, causal=causal),
             "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    if GPU:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        impls["sdpa-flash"] = sdpa_flash
    if flash_missing() is None:
        from flash_attn import flash_attn_func

        impls["flash-attn"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2)
    return impls


def bench_attention(cases, dtype, reps, causal: bool = True):
    """Cases (b, heads, n, d) or (b, heads, n, d, d_v): a value head size of its own (MLA's
    192/128), labelled D{d}/{d_v}; FLOPs 2 b h n^2 (d + d_v) (halved when causal); flash-attn 2
    takes one head size and is left out of those."""
    rows = []
    kind = "causal" if causal else "full"
    for b, h, n, d, *rest in cases:
        d_v = rest[0] if rest else d
        label = f"B{b} H{h} N{n} D{d}" + (f"/{d_v}" if d_v != d else "")
        gen = torch.Generator(DEVICE).manual_seed(0)
        q, k, v, dout = (torch.randn(b, h, n, size, device=DEVICE, dtype=dtype, generator=gen)
                         for size in (d, d, d_v, d_v))
        tail = min(n, 64)  # reference rows: the last queries, which see every key
        ref_out, _ = attention_reference(q[:1, :, -tail:].double(), k[:1].double(), v[:1].double(),
                                         causal, n - tail, 0)
        ref_grads = None
        if n <= 2048:
            leaves = [x[:1].detach().double().requires_grad_() for x in (q, k, v)]
            attention_reference(*leaves, causal)[0].backward(dout[:1].double())
            ref_grads = [x.grad for x in leaves]
        flops = 2 * b * h * n * n * (d + d_v) / (2 if causal else 1)
        for name, fn in attention_impls(causal).items():
            if name == "sdpa-flash" and dtype == torch.float32 or name == "flash-attn" and d_v != d:
                continue
            try:
                t_f, t_b, out, grads = fwd_bwd(fn, (q, k, v), dout, reps)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # e.g. math SDPA at 16k
                rows.append(dict(kernel="attention", case=f"{label} {kind}", impl=name,
                                 error=str(e).splitlines()[0][:80]))
                continue
            bwd_err = (max(max_err(g[:1], r) for g, r in zip(grads, ref_grads))
                       if ref_grads is not None else None)
            rows.append(dict(kernel="attention", case=f"{label} {kind}",
                             dtype=str(dtype).split(".")[-1], impl=name, fwd_ms=t_f, bwd_ms=t_b,
                             fwd_rate=flops / t_f / 1e9, bwd_rate=2.5 * flops / t_b / 1e9 if t_b else None,
                             unit="TFLOP/s", fwd_err=max_err(out[:1, :, -tail:], ref_out),
                             bwd_err=bwd_err))
    return rows


# -- norms and cross-entropy -----------------------------------------------------------------------

def bench_rowwise(kernel, cases, dtype, reps):
    rows = []
    for r, n in cases:
        gen = torch.Generator(DEVICE).manual_seed(0)
        if kernel == "cross-entropy":
            x = torch.randn(r, n, device=DEVICE, dtype=dtype, generator=gen) * 3
            target = torch.randint(0, n, (r,), device=DEVICE, generator=gen)
            grad = torch.randn(r, device=DEVICE, generator=gen)
            impls = {"triton": lambda z: cross_entropy(z, target),
                     "torch": lambda z: F.cross_entropy(z.float(), target, reduction="none")}
            ref = lambda z: F.cross_entropy(z, target, reduction="none")  # noqa: E731
            inputs, io_fwd, io_bwd = (x,), r * n * x.element_size(), 2 * r * n * x.element_size()
        else:
            x = torch.randn(r, n, device=DEVICE, dtype=dtype, generator=gen)
            w = 1 + 0.1 * torch.randn(n, device=DEVICE, dtype=dtype, generator=gen)
            bias = torch.randn(n, device=DEVICE, dtype=dtype, generator=gen)
            grad = torch.randn(r, n, device=DEVICE, dtype=dtype, generator=gen)
            if kernel == "layernorm":
                impls = {"triton": lambda z, w, b: layer_norm(z, w, b),
                         "torch": lambda z, w, b: F.layer_norm(z, (n,), w, b)}
                ref = lambda z, w, b: layer_norm_reference(z, w, b)  # noqa: E731
                inputs = (x, w, bias)
            else:
                impls = {"triton": lambda z, w: rms_norm(z, w),
                         "torch": lambda z, w: rms_norm_reference(z, w)}
                ref = lambda z, w: rms_norm_reference(z, w)  # noqa: E731
                inputs = (x, w)
            io_fwd, io_bwd = 2 * r * n * x.element_size(), 3 * r * n * x.element_size()
        if GPU:  # what a user gets from the compiler instead of a hand-written kernel
            impls["torch.compile"] = torch.compile(impls["torch"], dynamic=False)
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        ref_out = ref(*leaves)
        ref_out.backward(grad.double())
        for name, fn in impls.items():
            t_f, t_b, out, grads = fwd_bwd(fn, inputs, grad, reps)
            rows.append(dict(kernel=kernel, case=f"{r}x{n}", dtype=str(dtype).split(".")[-1],
                             impl=name, fwd_ms=t_f, bwd_ms=t_b, fwd_rate=io_fwd / t_f / 1e6,
                             bwd_rate=io_bwd / t_b / 1e6 if t_b else None, unit="GB/s",
                             fwd_err=max_err(out, ref_out),
                             bwd_err=max(max_err(g, l.grad) for g, l in zip(grads, leaves))))
    return rows


# -- grouped GEMM -----------------------------------------------------------------------------------

def routed_counts(rows: int, experts: int, gen) -> list[int]:
    """Rows per expert from a skewed router: each row picks an expert with probabilities
    softmax(0.5 z), z ~ N(0, 1) (a few experts get about twice the mean)."""
    probs = torch.softmax(0.5 * torch.randn(experts, generator=gen), 0)
    return torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen),
                          minlength=experts).tolist()


def rel_err(a, ref) -> float:
    return max_err(a, ref) / max(1.0, ref.double().abs().max().item())


def grouped_impls(counts):
    impls = {"triton": lambda x, w: grouped_linear(x, w, counts),
             "loop": lambda x, w: grouped_linear_reference(x, w, counts)}
    if hasattr(torch, "_grouped_mm"):
        ends = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
        impls["_grouped_mm"] = lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    return impls


def bench_grouped(cases, dtype, reps):
    rows = []
    for experts, counts, k, n_out in cases:  # counts: a list, or the number of rows to route
        gen = torch.Generator().manual_seed(0)
        if isinstance(counts, int):
            counts = routed_counts(counts, experts, gen)
        n = sum(counts)
        x = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
        w = (torch.randn(experts, n_out, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
        grad = torch.randn(n, n_out, generator=gen).to(DEVICE, dtype)
        ref_dtype = torch.float32 if GPU else torch.float64
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (x, w)]
        ref_out = grouped_linear_reference(*leaves, counts)
        ref_out.backward(grad.to(ref_dtype))
        ref_out = ref_out.detach()
        flops = 2 * n * k * n_out
        case = f"E{experts} N{n} K{k} O{n_out}"
        for name, fn in grouped_impls(counts).items():
            try:
                t_f, t_b, out, grads = fwd_bwd(fn, (x, w), grad, reps)
            except (RuntimeError, NotImplementedError, torch.cuda.OutOfMemoryError) as e:
                rows.append(dict(kernel="grouped GEMM", case=case, impl=name,
                                 error=str(e).splitlines()[0][:80]))
                continue
            rows.append(dict(kernel="grouped GEMM", case=case, dtype=str(dtype).split(".")[-1],
                             impl=name, fwd_ms=t_f, bwd_ms=t_b, fwd_rate=flops / t_f / 1e9,
                             bwd_rate=2 * flops / t_b / 1e9 if t_b else None, unit="TFLOP/s",
                             fwd_bwd_ms=t_f + t_b, fwd_bwd_rate=3 * flops / (t_f + t_b) / 1e9,
                             fwd_err=rel_err(out, ref_out),
                             bwd_err=max(rel_err(g, l.grad) for g, l in zip(grads, leaves))))
        del ref_out, leaves
    return rows


def print_table(rows):
    fmt = "{:<14} {:<26} {:<6} {:<11} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9}"
    print(fmt.format("kernel", "case", "dtype", "impl", "fwd ms", "bwd ms", "fwd rate", "bwd rate",
                     "unit", "fwd err", "bwd err"))
    num = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<14} {r['case']:<26} {'':<6} {r['impl']:<11} failed: {r['error']}")
            continue
        print(fmt.format(r["kernel"], r["case"], r["dtype"], r["impl"], num(r["fwd_ms"], ".3f"),
                         num(r["bwd_ms"], ".3f"), num(r["fwd_rate"], ".2f"), num(r["bwd_rate"], ".2f"),
                         r["unit"], num(r["fwd_err"], ".1e"), num(r["bwd_err"], ".1e")))
    grouped = [r for r in rows if "fwd_bwd_ms" in r]
    if grouped:
        print("grouped GEMM, forward + backward:")
        for r in grouped:
            print(f"  {r['case']:<26} {r['dtype']:<9} {r['impl']:<11} {r['fwd_bwd_ms']:9.3f} ms "
                  f"{r['fwd_bwd_rate']:9.2f} TFLOP/s")


def plot(rows, path, device: str) -> list[str]:
    """The table as a chart: causal attention TFLOP/s against sequence length (forward,
    backward; the full-attention rows stay in the table) and the row-wise kernels' GB/s;
    returns the paths written."""
    from megalite.observe.plotting import new_figure, save

    fig = new_figure(16, 5.2)
    grid = fig.add_gridspec(1, 3, width_ratios=[1, 1, 1.3])
    attention = [r for r in rows if r["kernel"] == "attention" and "error" not in r and r["case"].endswith("causal")]
    series = {}
    for r in attention:
        n, d = re.search(r"N(\d+) D(\d+(?:/\d+)?)", r["case"]).groups()
        series.setdefault(f"{r['impl']} D{d} {r['dtype']}", []).append((int(n), r))
    lengths = sorted({n for pts in series.values() for n, _ in pts})
    for col, (key, what) in enumerate((("fwd_rate", "forward"), ("bwd_rate", "backward"))):
        ax = fig.add_subplot(grid[0, col])
        for i, (name, pts) in enumerate(sorted(series.items())):
            pts = sorted((n, r[key]) for n, r in pts if r.get(key) is not None)
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=name,
                    color=f"C{i % 10}", linestyle="-" if "triton" in name else "--")
        if len(lengths) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel("TFLOP/s (causal attention FLOPs)")
        ax.set_title(f"Attention {what}")
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[0, 2])
    rowwise = [r for r in rows if r.get("unit") == "GB/s"]  # not the grouped GEMM (TFLOP/s)
    groups = list(dict.fromkeys(f"{r['kernel']}\n{r['case']}\n{r['dtype']}" for r in rowwise))
    bars = list(dict.fromkeys((r["impl"], key) for r in rowwise for key in ("fwd_rate", "bwd_rate")))
    width = 0.8 / max(1, len(bars))
    for j, (impl, key) in enumerate(bars):
        values = {f"{r['kernel']}\n{r['case']}\n{r['dtype']}": r.get(key) or 0.0 for r in rowwise
                  if r["impl"] == impl}
        ax.bar([g + (j - (len(bars) - 1) / 2) * width for g in range(len(groups))],
               [values.get(g, 0.0) for g in groups], width, color=f"C{j // 2}",
               alpha=1.0 if key == "fwd_rate" else 0.55,
               hatch=None if key == "fwd_rate" else "//",
               label=f"{impl} {'forward' if key == 'fwd_rate' else 'backward'}")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title("Norms and cross-entropy")
    ax.grid(True, axis="y", alpha=0.3)
    if bars:
        ax.legend(fontsize=8)
    failed = [f"{r['impl']} {r['case']}" for r in rows if "error" in r]
    title = f"Triton kernels against their alternatives, {device}"
    if not GPU:
        title += ("\nCPU: Triton ran in the interpreter at one small size; these speeds are NOT "
                  "meaningful (only the errors in the table are)")
    if failed:
        title += f"\nfailed (not drawn): {', '.join(failed)}"
    fig.suptitle(title, fontsize=12, color="black" if GPU else "#b00000")
    return save(fig, path)


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="GPU: only the smallest sizes")
    p.add_argument("--plot", metavar="PATH", help="also draw the chart (.png, .svg, .pdf)")
    args = p.parse_args()
    writable(p, "--json", args.json)
    writable(p, "--plot", args.plot)
    if args.plot:  # fail now, not after the benchmark
        from megalite.observe.plotting import require_matplotlib
        require_matplotlib()
    if GPU:
        seqs = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
        # 16k tokens per case, hidden 2048 either way: 16 heads of 128 or 32 heads of 64
        attn = [(max(1, 16384 // n), 16, n, 128) for n in seqs] + [(max(1, 16384 // n), 32, n, 64) for n in seqs]
        if not args.quick:  # DeepSeek-V3 MLA: q/k 192, v 128. Its own autotuning key (~66 more configs,
            # ~50 s) would overrun gpu_check's part (d) budget, which runs --quick: full runs only.
            attn += [(max(1, 16384 // n), 16, n, 192, 128) for n in seqs]
        dtypes, reps = [torch.bfloat16], None
        norm_cases = [(16384, 1024), (16384, 4096), (8192, 8192), (4096, 16384)]
        ce_cases = [(4096, 50304), (4096, 128256), (2048, 256000)]
        # (experts, rows routed unevenly, K, Nout): Mixtral fc1 (h -> 2F) and fc2 (F -> h)
        tokens = 8192 if args.quick else 16384  # routed rows: 4096 or 8192 tokens x top-2
        grouped_cases = [(8, tokens, 4096, 2 * 14336)] + ([] if args.quick else [(8, tokens, 14336, 4096)])
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        attn, dtypes, reps = [(1, 2, 96, 64), (1, 2, 40, 24, 16)], [torch.float32, torch.float16], 3
        norm_cases, ce_cases = [(64, 1000)], [(32, 1000)]
        grouped_cases = [(4, [0, 37, 5, 22], 48, 40)]
        print("NOTE: no GPU: the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), one "
              "small size. CPU times are NOT meaningful; only the errors are.")
    rows = []
    for dtype in dtypes:
        rows += bench_attention(attn, dtype, reps, causal=True)
        rows += bench_attention(attn, dtype, reps, causal=False)
        rows += bench_rowwise("layernorm", norm_cases, dtype, reps)
        rows += bench_rowwise("rmsnorm", norm_cases, dtype, reps)
        rows += bench_rowwise("cross-entropy", ce_cases, dtype, reps)
        rows += bench_grouped(grouped_cases, dtype, reps)
    print_table(rows)
    device = torch.cuda.get_device_name() if GPU else "cpu (interpreter)"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"chart: {', '.join(plot(rows, args.plot, device))}")


if __name__ == "__main__":
    main()
