#!/usr/bin/env python
"""Compile every megalite Triton kernel for a CUDA architecture, on a machine without a GPU.

Triton lowers to PTX and runs its bundled ptxas without touching a device, so this catches
what the CPU interpreter cannot: type errors of the compiled language, unsupported dot
shapes, and tiles that need more shared memory than a GPU has (printed per kernel; an H100
block may use 227 KB, an A100 block 163 KB). It uses the configurations the launchers pick on
a GPU. Uncached, each compilation takes seconds: ``--quick`` compiles one dtype (bf16).

    python tools/compile_kernels.py [--arch 80 90] [--quick]
"""
import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megalite.kernels import cross_entropy as ce, flash_attention as fa  # noqa: E402
from megalite.kernels import flash_attention_bwd as fb, grouped_gemm as gg, norms  # noqa: E402

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def compile_one(fn, types: dict, consts: dict, arch: int, warps: int, stages: int) -> int:
    """Compile fn with argument types ``types`` and constexprs ``consts``; shared bytes."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n].removesuffix(":16") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    # a type ending in ":16": divisible by 16, as the launcher specializes such arguments
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and types[n].endswith(":16")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return kernel.metadata.shared


def jobs(dtype: str):
    """(name, kernel, argument types, constexprs, warps, stages) as the launchers pick them."""
    import torch

    p, tdtype = "*" + dtype, getattr(torch, TORCH_DTYPES[dtype])
    prec = "ieee" if dtype == "fp32" else "tf32"
    for d in (64, 128):
        bm, bn, warps, stages = fa._fwd_config(d, tdtype)
        types = dict(Q=p, K=p, V=p, O=p, LSE="*fp32", s_q="i32", s_k="i32", delta="i32",
                     qk_scale="fp32", heads="i32", groups="i32")
        yield (f"attention fwd d{d}", fa._fwd_kernel, types,
               dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, CAUSAL=True, MASK_N=True,
                    UPCAST=False, PREC=prec), warps, stages)
        cfg = fb._bwd_config(d, tdtype)
        types = dict(Q=p, K=p, V=p, DO=p, LSE="*fp32", DELTA="*fp32", DK=p, DV=p, DQ=p, s_q="i32",
                     s_k="i32", delta_pos="i32", qk_scale="fp32", scale="fp32", heads="i32",
                     groups="i32")
        for name, fn, key in (("dk/dv", fb._dkdv_kernel, "kv"), ("dq", fb._dq_kernel, "q")):
            bm, bn, warps, stages = cfg[key]
            yield (f"attention {name} d{d}", fn, types,
                   dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, CAUSAL=True, UPCAST=False,
                        PREC=prec), warps, stages)
    for n in (1000, 8192):
        block, block_r, warps = norms._tiles(n)
        types = dict(X=p, W=p, B=p, Y=p, DY=p, DX=p, MEAN="*fp32", RSTD="*fp32", DW_PART="*fp32",
                     DB_PART="*fp32", n_rows="i32", n_cols="i32", eps="fp32", n_tiles="i32")
        consts = dict(RMS=False, HAS_BIAS=True, BLOCK_R=block_r, BLOCK=block)
        yield f"layernorm fwd n{n}", norms._norm_fwd_kernel, types, consts, warps, 1
        yield f"layernorm bwd n{n}", norms._norm_bwd_kernel, types, consts, warps, 1
    block_r, block_v, warps = ce._tiles(50304)
    types = dict(Z=p, TARGET="*i64", MAX="*fp32", SUMEXP="*fp32", TLOGIT="*fp32", LSE="*fp32",
                 GRAD="*fp32", DZ=p, n_rows="i32", n_cols="i32", stride_row="i32",
                 vocab_start="i32", vocab_size="i32", ignore_index="i32")
    consts = dict(BLOCK_R=block_r, BLOCK_V=block_v)
    yield "cross-entropy stats", ce._ce_stats_kernel, types, consts, warps, 1
    yield "cross-entropy grad", ce._ce_grad_kernel, types, consts, warps, 1
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
                   dict(**kw, **extra, UPCAST=False, PREC=prec), c.num_warps, c.num_stages)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capability x10")
    p.add_argument("--quick", action="store_true", help="bf16 only")
    args = p.parse_args()
    for arch in args.arch:
        for dtype in ["bf16"] if args.quick else ["bf16", "fp16", "fp32"]:
            for name, fn, types, consts, warps, stages in jobs(dtype):
                shared = compile_one(fn, {k: types[k] for k in fn.arg_names if k in types}, consts,
                                     arch, warps, stages)
                print(f"sm_{arch} {dtype:<5} {name:<22} ok  shared {shared / 1024:6.1f} KB")


if __name__ == "__main__":
    main()
