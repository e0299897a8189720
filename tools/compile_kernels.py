#!/usr/bin/env python
"""Compile every megalite Triton kernel for a CUDA architecture, on a machine without a GPU.

Triton lowers to PTX and runs its bundled ptxas without touching a device, so this catches what
the CPU interpreter cannot: type errors of the compiled language, unsupported dot shapes, and
tiles that need more shared memory than a GPU has (printed per kernel; an H100 block may use 227
KB, an A100 block 163 KB, sm_86/sm_89 99 KB). It compiles the configurations the launchers use
on a GPU: for the autotuned kernels (flash attention forward, dk/dv, dq and delta for head dims
64, 96, 128 and 256, and q/k 192 with v 128 as DeepSeek-V3's MLA; grouped GEMM) every autotune
config, with pointers, strides and sizes 16-divisible as in a model, so the pipelined loops are
what compiles. For those it also prints the launcher's shared-memory estimate (the one that
prunes configs on a GPU) and fails if the estimate is below the compiled figure; and, with the
bundled cuobjdump, registers per thread and the stack frame (``stack`` > 0: register spills).
The norms (LayerNorm and RMSNorm, whole-row and chunked) and the cross-entropy (both vocabulary
block widths) compile in the one tile setting their launchers use. Uncached, each compilation
takes seconds (the last line prints the count and seconds per variant; point TRITON_CACHE_DIR at
an empty folder to time it): ``--quick`` compiles one dtype (bf16), ``--only`` a subset.

    python tools/compile_kernels.py [--arch 80 90] [--quick] [--only attention] [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megalite.kernels import cross_entropy as ce, flash_attention as fa  # noqa: E402
from megalite.kernels import flash_attention_bwd as fb, grouped_gemm as gg, norms  # noqa: E402

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def compile_one(fn, types: dict, consts: dict, arch: int, warps: int, stages: int) -> dict:
    """Compile fn with argument types ``types`` and constexprs ``consts``: its shared bytes, and
    registers per thread and stack bytes when cuobjdump is at hand."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n].removesuffix(":16") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    # a type ending in ":16": divisible by 16, as the launcher specializes such arguments
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and types[n].endswith(":16")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return dict(shared=kernel.metadata.shared, **resources(kernel.asm["cubin"]))


def resources(cubin: bytes) -> dict:
    """{"regs", "stack"} of a cubin from Triton's bundled cuobjdump (empty if it is missing)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return dict(regs=int(found.group(1)), stack=int(found.group(2))) if found else {}


ATTENTION_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))  # (q/k head dim, v head dim)


def attention_jobs(dtype: str):
    """Every autotune config of the attention kernels, per head dim, with its shared-memory
    estimate: (name, kernel, types, constexprs, warps, stages, estimated bytes)."""
    import torch

    tdtype = getattr(torch, TORCH_DTYPES[dtype])
    p, prec, size = f"*{dtype}:16", "ieee" if dtype == "fp32" else "tf32", tdtype.itemsize
    a = "i32:16"  # strides of (b, heads, s, d) tensors with d a multiple of 16, and the length keys
    strides = {f"stride_{t}{x}": a for t in "qkvo" for x in "bhs"}
    strides.update({f"stride_{t}{x}": a for t in "le" for x in "bh"})
    strides.update(stride_db=a, stride_dh=a, stride_ds=a)  # delta kernel: dout
    sizes = dict(s_q="i32", s_k="i32", delta="i32", delta_pos="i32", qk_scale="fp32", scale="fp32",
                 heads="i32", groups="i32", n_bh="i32", n_bg="i32", SQ_KEY=a, SK_KEY=a)
    tensors = {name: p for name in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    documents = dict(DS="*i32:16", DE="*i32:16", TILES="*i32:16")  # packed documents; tile counter
    types = dict(**tensors, LSE="*fp32:16", RM="*fp32:16", DELTA="*fp32:16", **documents, **strides, **sizes)
    for d, d_v in ATTENTION_HEAD_DIMS:
        width, v_width = fa.block_d(d), fa.block_d(d_v)
        label = f"d{d}" if d == d_v else f"d{d}/{d_v}"
        tile = dict(HEAD_DIM=d, V_DIM=d_v, BLOCK_D=width, BLOCK_DV=v_width, CAUSAL=True, COUNT=False, UPCAST=False,
                    PREC=prec, GRID_Y=fa._utils.MAX_GRID_Y)
        kinds = (("fwd", fa._fwd_kernel, fa.fwd_configs, fa.fwd_shared_bytes, dict(MASK_N=True, ROW_MAX=False)),
                 ("dk/dv", fb._dkdv_kernel, fb.dkdv_configs, fb.dkdv_shared_bytes, {}),
                 ("dq", fb._dq_kernel, fb.dq_configs, fb.dq_shared_bytes, {}))
        for kind, fn, configs, nbytes, extra in kinds:
            for i, c in enumerate(configs(max(d, d_v), tdtype, interpret=False)):
                kw = c.kwargs
                name = f"attention {kind} {label} {kw['BLOCK_M']}x{kw['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                # Every config as the plain causal kernel; the first also with packed documents
                # (two more loads and a compare per tile: the same tiles must still fit).
                for docs in (False, True) if i == 0 else (False,):
                    yield (name + (" documents" if docs else ""), fn, types, dict(**tile, **kw, **extra, DOCS=docs),
                           c.num_warps, c.num_stages, nbytes(c, width, size, v_width))
        if d != d_v:  # the delta kernel reads out and dout only: the v head dim's, listed already
            continue
        for c in fb.delta_configs(d, tdtype, interpret=False):
            yield (f"attention delta d{d} {c.kwargs['BLOCK_M']} rows w{c.num_warps}", fb._delta_kernel, types,
                   dict(HEAD_DIM=d, BLOCK_D=width, GRID_Y=fa._utils.MAX_GRID_Y, **c.kwargs), c.num_warps, c.num_stages,
                   fb.delta_shared_bytes(c, width, size))


def jobs(dtype: str):
    """(name, kernel, argument types, constexprs, warps, stages, estimated shared bytes or None)
    as the launchers pick them."""
    import torch

    p, tdtype = "*" + dtype, getattr(torch, TORCH_DTYPES[dtype])
    prec = "ieee" if dtype == "fp32" else "tf32"
    yield from attention_jobs(dtype)
    types = dict(X=p, W=p, B=p, Y=p, DY=p, DX=p, MEAN="*fp32", RSTD="*fp32", DW_PART="*fp32",
                 DB_PART="*fp32", n_rows="i32", n_cols="i32", eps="fp32", n_tiles="i32")
    for rms, kind in ((False, "layernorm"), (True, "rmsnorm")):
        norm = dict(RMS=rms, HAS_BIAS=not rms)
        for n in (1000, 8192):  # whole rows
            block, block_r, warps = norms._tiles(n)
            consts = dict(**norm, BLOCK_R=block_r, BLOCK=block)
            yield f"{kind} fwd n{n}", norms._norm_fwd_kernel, types, consts, warps, 1, None
            yield f"{kind} bwd n{n}", norms._norm_bwd_kernel, types, consts, warps, 1, None
        consts = dict(**norm, CHUNK=norms.CHUNK)  # rows above WHOLE_ROW_MAX, in column chunks (8 warps)
        yield f"{kind} fwd chunked", norms._norm_fwd_chunked_kernel, types, consts, 8, 1, None
        yield f"{kind} bwd chunked", norms._norm_bwd_chunked_kernel, types, consts, 8, 1, None
    types = dict(Z=p, TARGET="*i64", MAX="*fp32", SUMEXP="*fp32", TLOGIT="*fp32", LSE="*fp32",
                 GRAD="*fp32", DZ=p, n_rows="i32", n_cols="i32", stride_row="i32",
                 vocab_start="i32", vocab_size="i32", ignore_index="i32")
    for vocab in (50304, 1000):  # BLOCK_V 4096, and 1024 below 4096 columns
        block_r, block_v, warps = ce._tiles(vocab)
        consts = dict(BLOCK_R=block_r, BLOCK_V=block_v)
        yield f"cross-entropy stats V{block_v}", ce._ce_stats_kernel, types, consts, warps, 1, None
        yield f"cross-entropy grad V{block_v}", ce._ce_grad_kernel, types, consts, warps, 1, None
    # grouped GEMM: every autotune config (the autotuner picks among them on the GPU), with
    # pointers and sizes 16-divisible as in a model (h, F multiples of 16), so the pipelined
    # loop is what compiles: its shared memory is num_stages (sm_90) or num_stages - 1
    # (sm_80) buffers of the two tiles; the weight read as y needs it (stride_wk = 1).
    a, p16 = "i32:16", p + ":16"
    types = dict(X=p16, W=p16, Y=p16, DY=p16, DW=p16, OFFSETS="*i32:16", n_groups="i32", N_OUT=a, K=a,
                 stride_we=a, stride_wn=a, stride_wk="i32", M_HINT="i32")
    for name, fn, configs, extra in (("mm", gg._gmm_kernel, gg.mm_configs(tdtype),
                                      dict(BLOCK_E=16, stride_wk=1)),
                                     ("dw", gg._gmm_dw_kernel, gg.dw_configs(tdtype), {})):
        for c in configs:
            kw = c.kwargs
            yield (f"grouped {name} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}", fn, types,
                   dict(**kw, **extra, UPCAST=False, PREC=prec), c.num_warps, c.num_stages,
                   gg.shared_bytes(c, tdtype.itemsize))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capability x10")
    p.add_argument("--quick", action="store_true", help="bf16 only")
    p.add_argument("--dtype", nargs="+", choices=list(TORCH_DTYPES), help="these dtypes (default: all)")
    p.add_argument("--only", help="only the kernels whose name contains this (e.g. 'attention')")
    p.add_argument("--json", help="also write every figure to this JSON file")
    args = p.parse_args()
    dtypes = args.dtype or (["bf16"] if args.quick else ["bf16", "fp16", "fp32"])
    records, low, start = [], [], time.time()
    for arch in args.arch:
        for dtype in dtypes:
            for name, fn, types, consts, warps, stages, estimate in jobs(dtype):
                if args.only and args.only not in name:
                    continue
                got = compile_one(fn, {k: types[k] for k in fn.arg_names if k in types}, consts, arch, warps,
                                  stages)
                line = f"sm_{arch} {dtype:<5} {name:<46} ok  shared {got['shared'] / 1024:6.1f} KB"
                if estimate is not None:
                    line += f" (est {estimate / 1024:6.1f})"
                    if estimate < got["shared"]:
                        low.append(f"sm_{arch} {dtype} {name}")
                        line += " ESTIMATE BELOW COMPILED"
                if "regs" in got:
                    line += f"  regs {got['regs']:3d}  stack {got['stack']}"
                print(line, flush=True)
                records.append(dict(arch=arch, dtype=dtype, kernel=name, warps=warps, stages=stages,
                                    estimate=estimate, **got))
    took = time.time() - start
    print(f"Triton {triton.__version__}: {len(records)} kernel variants compiled in {took:.0f} s "
          f"({took / max(1, len(records)):.2f} s per variant)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if low:
        sys.exit("shared-memory estimate below the compiled figure (the pruning would keep a config that "
                 "does not fit): " + "; ".join(low))


if __name__ == "__main__":
    main()
