#!/usr/bin/env python
"""Packed documents: the attention work document masking saves, and a packed run on CPU.

1. Tiles: the key tiles the Triton forward (and dq) kernel computes for one (row, head) of a
   32k-token sequence of 4k-token documents, with and without the document mask, for every
   16-bit head-dim-128 GPU config (megalite.kernels.flash_attention.forward_tiles: the kernel's
   own loop bounds, equal to the tiles the kernel counts under the interpreter, as
   tests/test_packed_kernels.py checks), beside the math: sum_d L_d (L_d + 1) / 2 against
   s (s + 1) / 2 query-key pairs.
2. End to end on this CPU: pretrain_gpt.py's tokens/s on mock data with
   --reset-position-ids --reset-attention-mask (about four documents per sample) against the
   same run without them, alternated so that drift hits both alike.
Time per layer on a GPU: not measured here (no GPU); scripts/gpu_check.sh is where it goes.

    python tools/bench_packed.py [--seq 32768 --doc 4096] [--iters 8] [--skip-cpu]
"""
import argparse
import contextlib
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from megalite.kernels.flash_attention import forward_tiles, fwd_configs  # noqa: E402
from megalite.kernels.flash_attention_bwd import dq_configs  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402


def tiles(seq: int, doc: int) -> None:
    doc_start = (torch.arange(seq) // doc * doc).to(torch.int32)
    pairs_docs = (seq // doc) * doc * (doc + 1) // 2
    pairs_all = seq * (seq + 1) // 2
    print(f"1. attention work for one (row, head): {seq} tokens, documents of {doc} "
          f"(query-key pairs: {pairs_docs:,} with the mask against {pairs_all:,}, ratio {pairs_docs / pairs_all:.4f})")
    print(f"{'kernel':>7} {'tile':>8} {'tiles, documents':>17} {'tiles, whole':>13} {'ratio':>7}")
    for kind, configs in (("forward", fwd_configs), ("dq", dq_configs)):
        seen = set()
        for c in configs(128, torch.bfloat16, interpret=False):
            bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            if (bm, bn) in seen:
                continue
            seen.add((bm, bn))
            with_docs, whole = forward_tiles(doc_start, seq, bm, bn), forward_tiles(None, seq, bm, bn)
            print(f"{kind:>7} {bm:>3}x{bn:<4} {with_docs:>17,} {whole:>13,} {with_docs / whole:>7.4f}")


CPU_MODEL = ["--mock-data", "--vocab-size", "2048", "--num-layers", "2", "--hidden-size", "128",
             "--num-attention-heads", "4", "--seq-length", "512", "--micro-batch-size", "4",
             "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1000", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--eval-interval", "100000"]


def cpu_tokens_per_second(iters: int, rounds: int = 2) -> None:
    from megalite.train.pretrain import pretrain

    packed = ["--reset-position-ids", "--reset-attention-mask"]
    print(f"\n2. end to end on this CPU (2 layers, hidden 128, 512 tokens x 4 per step, {iters} iterations "
          f"per run, the first 2 not timed), tokens/s:")
    results = {"unmasked": [], "packed documents": []}
    for _ in range(rounds):
        for name, extra in (("unmasked", []), ("packed documents", packed)):
            with contextlib.redirect_stdout(io.StringIO()):  # only the figures below
                log = pretrain(CPU_MODEL + extra + ["--train-iters", str(iters)])
            rates = [r["tokens_per_sec"] for r in log[2:] if r.get("tokens_per_sec")]
            results[name].append(sum(rates) / len(rates))
    base = max(results["unmasked"])
    for name, rates in results.items():
        print(f"  {name:>17}: {max(rates):,.0f} tokens/s (best of {rounds} runs), {max(rates) / base:.2f}x")
    print("  (on a CPU attention runs as torch SDPA with the document mask: the same work as unmasked; the\n"
          "   tiles saved are the Triton kernels', on a GPU)")


def main():
    p = one_line_errors(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--doc", type=int, default=4096)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip-cpu", action="store_true")
    args = p.parse_args()
    positive(p, "--seq/--doc/--iters", args.seq, args.doc, args.iters)
    tiles(args.seq, args.doc)
    if not args.skip_cpu:
        cpu_tokens_per_second(args.iters)


if __name__ == "__main__":
    main()
