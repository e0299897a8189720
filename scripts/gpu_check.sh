#!/usr/bin/env bash
# GPU acceptance check for a machine with one CUDA GPU: one command from the repository root, at
# most 480 s on an H200 from a cold Triton cache (15 minutes of device time hold a failed start
# and one rerun).
#
#     scripts/gpu_check.sh --plan      # the parts, their budgets and the total; runs nothing, no GPU needed
#     scripts/gpu_check.sh             # results in ${OUT:-gpu_check_out}/
#
# Uses python3 from PATH (or $PYTHON) with torch, triton, pytest (and what tests/ imports)
# installed; nothing is installed or downloaded; the repository goes on PYTHONPATH. The work is
# done by tools/gpu_check.py (standard library only: it reports even if `import torch` breaks):
# tools/gpu_check_runner.py runs the parts, tools/gpu_check_results.py reads their results.
#
# Each part runs under its own hard budget: SIGINT to its process groups up to 5 s before it
# (pytest still writes its junit XML), SIGKILL to the groups at it. A failing or overrunning part
# does not stop the others. After every part, OUT/summary.json is rewritten atomically (per part:
# status pass/fail/timeout/skipped, figures, seconds, log tail) and a line is added to
# OUT/summary.txt, so a run cut short still brings back what it did. The whole check stops itself
# 5 s before 480 s: a part is given at most what is left, or skipped with a note. Exit status 1
# if any part failed, overran or was skipped for lack of time.
#   (a) pytest -m gpu tests/ in 5 shards side by side (tools/gpu_check_shard.py): Triton kernels in
#       bf16/fp16 vs float64 references, CUDA RNG streams, fp32 CUDA = CPU losses, GPU resume,
#       MoE on CUDA. Skips because flash-attn or transformer-engine is not installed are reported
#       ("skipped: N, flash-attn not installed (n), ..."), read from the junit XMLs; any other skip
#       of a gpu test is a failure.
#   (b) --fake-process-group ranks 0 and 7 of four 8-rank layouts on CUDA (TP2xPP2xDP2 ZeRO-1,
#       TP2xCP2xDP2, TP4xDP2 ZeRO-3, MoE TP2xDP4 EP4): all 8 processes at once, beside (a).
#   (c) a GPT of ~1.3B parameters, bf16, 12 iterations, Triton attention, then torch SDPA (and,
#       only where transformer-engine is installed and time is spare, TE bf16 and FP8):
#       tokens/s, TFLOP/s, MFU over iterations 7-12.
#   (d) tools/bench_kernels.py ${GPU_CHECK_BENCH_ARGS---quick} (through tools/gpu_check_bench.py,
#       which keeps each finished section's rows in d_bench_rows.jsonl).
# (a), (b), (c) run with MEGALITE_KERNEL_TUNING=fixed (one tile config per kernel); full
# autotuning runs once, in (d). (a) and (b) only check numbers, so they share the machine;
# (c) and (d) measure speed and run alone.
# Output in OUT: summary.json, summary.txt, a_pytest_gpu_<shard>.{log,xml}, b_<layout>_rank<r>.log,
# c_gpt1p3b_<run>.{log,jsonl}, d_bench_kernels.{txt,json}, d_bench_rows.jsonl.
#
# The budgets' arithmetic. Assumptions, to be checked on the first run: S = 10 s per python
# process that imports torch and initializes CUDA on the H200 host; C = 0.6 s per Triton kernel
# variant compiled cold (ENV_NOTES: tools/compile_kernels.py --arch 90 --quick compiled 86 bf16
# configurations with Triton 3.6 in 52 s, one process on a 2-core machine); T = 0.13 s to time
# one autotune config (Triton's do_bench: 25 ms warm-up + 100 ms of repetitions).
#   probe   20 s  one process: S (import torch + CUDA init), GPU name and versions; nvidia-smi.
#   (a)    120 s  variants with fixed tiles, from the gpu tests' shapes: attention 7 shapes x bf16/fp16
#                 x 4 kernels (fwd, delta, dk/dv, dq) = 56, test_attention_configs 5 x 4 + 1 = 21,
#                 norms 4 shapes x 2 kinds x 2 dtypes x fwd/bwd = 32, cross-entropy 3 x 2 dtypes x
#                 (stats, grad) x (whole vocabulary, TP slice) + 4 = 28, grouped GEMM 2 x 3 x 3 + 3
#                 = 21, the fp32 training runs ~10: ~170 x C = ~100 s. (Autotuned, the attention
#                 tests alone compiled 14 keys x 18 configs = 252.) Processes: 5 shards x (S + ~5 s
#                 of collection) and 6 pretrain_gpt.py runs started by tests (a CPU reference and 2
#                 fp32 CUDA runs; 3 runs in a row for the resume test) x S = 60 s. In one process:
#                 ~15 + 100 + 60 + ~10 s of test work = ~185 s. In 5 shards (~235 CPU-s on 16 cores)
#                 the longest shard holds the resume test's 3 runs (~40 s) and a fifth of the
#                 kernels: ~75 s expected.
#   (b)     90 s  8 processes at once, beside (a): S + ~12 variants x C (attention and ring blocks,
#                 norms, cross-entropy, grouped GEMM: ~7 s) + 2 iterations of a 4-layer h256 model:
#                 ~25 s each, side by side (one after another: ~8 x 25 = 200 s). Each rank holds
#                 < 1 GiB of the 139 GiB. Its budget sits inside (a)'s 120 s.
#   (c)  2x45 s   each run: S + drawing 1.3B weights on the CPU (init is layout-independent, one
#                 parameter at a time: 50M normals take 0.32 s here, so ~9 s) + ~8 new variants x C
#                 (~5 s) + 12 iterations x 8192 tokens x 9.1 GFLOP/token (6N + 12 L h s) = 0.9 PFLOP
#                 at >= 260 TFLOP/s (a third of the ~790 TFLOP/s bf16 peak): ~3.5 s, + ~3 s of
#                 first-iteration set-up: ~31 s. 12 iterations stay: they cost seconds, and the
#                 window (7-12) leaves compilation and allocator growth out of the figures.
#   (d)    245 s  full autotuning of 8 attention keys (causal/full x head dim 64/128 x seq 1k/4k)
#                 x 15 configs (fwd, dk/dv, dq: 5 each) + 4 delta keys x 3 = 132 x (C + T) = ~96 s;
#                 norms and cross-entropy 22 variants x C = ~13 s; grouped GEMM 14 configs = ~10 s;
#                 torch.compile baselines: 11 cases x 3 inductor graphs, ~15 s start + 33 x ~1.5 s
#                 = ~65 s; ~120 do_bench timings x T = ~16 s; S + references ~15 s: ~215 s.
#                 (d) may also use the time the parts before it leave unused (~110 s expected).
#   total  20 + 120 + 2 x 45 + 245 = 475 s, + 5 s reserve = 480 s. Expected: ~10 + ~75 + ~62 +
#          ~215 = ~360 s.
# Without a GPU it says so and exits 0 without running anything or creating OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
