#!/usr/bin/env bash
# GPU acceptance check for a machine with one CUDA GPU: one command from the repository root,
# under 10 minutes on an H200.
#
#     scripts/gpu_check.sh                 # results in ${OUT:-gpu_check_out}/
#
# Uses python3 from PATH (or $PYTHON) with torch, triton, pytest (and what tests/ imports)
# already installed; nothing is installed or downloaded: the repository goes on PYTHONPATH
# (megalite/__init__.py maps kernels/ to megalite.kernels in a plain checkout).
# Parts, each with a timeout and ONE summary line "gpu_check: (x) ...: PASS|FAIL ..."; a failed
# part does not stop the others, and the exit status is 1 if any failed:
#   (a) pytest -m gpu tests/: Triton kernels in bf16/fp16, CUDA RNG streams, fp32 CUDA = CPU
#   (b) --fake-process-group ranks on CUDA: first and last rank of four 8-rank layouts (one MoE)
#   (c) a GPT of ~1.3B parameters, bf16, 12 iterations, Triton and torch SDPA attention: tokens/s, MFU
#       (and with transformer-engine, bf16 and FP8, where it is installed)
#   (d) tools/bench_kernels.py (flags: GPU_CHECK_BENCH_ARGS, default --quick; "" for the full table)
# Without a GPU it says so and exits 0 without running anything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-gpu_check_out}"
logging=0
say() {
  echo "gpu_check: $*"
  if [ "$logging" = 1 ]; then echo "gpu_check: $*" >> "$OUT/summary.txt"; fi
}

# -- is there a GPU? --------------------------------------------------------------------------
smi_name=""
if command -v nvidia-smi > /dev/null 2>&1; then
  smi_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
fi
torch_name="$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")' 2> /dev/null)"
if [ -z "$torch_name" ]; then
  if [ -z "$smi_name" ]; then
    say "$(date '+%Y-%m-%d %H:%M:%S %Z'): no GPU on this machine (no nvidia-smi GPU, no CUDA device for $PY): nothing to run"
    exit 0
  fi
  say "nvidia-smi sees '$smi_name' but torch in '$PY' sees no CUDA device (a CPU-only torch?): FAIL"
  exit 1
fi

mkdir -p "$OUT" && : > "$OUT/summary.txt" && logging=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
say "$(date '+%Y-%m-%d %H:%M:%S %Z') on $(uname -n)"
say "GPU: ${smi_name:-$torch_name} (torch: $torch_name)"
say "$("$PY" -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]} | torch {torch.__version__} (CUDA {torch.version.cuda}) | triton {triton.__version__}")' 2>&1 | tail -n 1)"
failed=""
report() {  # part, description, exit status, details
  if [ "$3" -eq 0 ]; then say "($1) $2: PASS $4"; else say "($1) $2: FAIL (exit $3) $4"; failed="$failed $1"; fi
}

# -- (a) the tests marked gpu -----------------------------------------------------------------
timeout -k 30 420 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/ \
  --junitxml="$OUT/a_pytest_gpu.xml" > "$OUT/a_pytest_gpu.log" 2>&1
rc=$?
tally="$(tail -n 1 "$OUT/a_pytest_gpu.log")"
if [ "$rc" -eq 0 ] && [[ "$tally" == *skipped* ]]; then rc=1; fi  # on a GPU nothing may be skipped
report a "pytest -m gpu tests/" "$rc" "($tally; log $OUT/a_pytest_gpu.log)"

# -- (b) fake process group ranks on CUDA -----------------------------------------------------
FAKE=(--fake-process-group --device cuda --mock-data --vocab-size 1024 --num-layers 4 --hidden-size 256
      --num-attention-heads 8 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 2 --bf16
      --hidden-dropout 0 --attention-dropout 0)  # ring attention (CP) has no attention dropout
fake_ok=0 fake_total=0 fake_failed=""
fake_layout() {  # name, layout flags: ranks 0 and 7 of a world of 8
  local name="$1" rank
  shift
  for rank in 0 7; do
    fake_total=$((fake_total + 1))
    if WORLD_SIZE=8 RANK=$rank timeout -k 10 120 "$PY" pretrain_gpt.py "${FAKE[@]}" "$@" \
        > "$OUT/b_${name}_rank$rank.log" 2>&1 && grep -q "^done: 2 iterations" "$OUT/b_${name}_rank$rank.log"; then
      fake_ok=$((fake_ok + 1))
    else
      fake_failed="$fake_failed $name/rank$rank"
    fi
  done
}
fake_layout tp2pp2dp2_zero1 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1
fake_layout tp2cp2dp2 --tensor-model-parallel-size 2 --context-parallel-size 2
fake_layout tp4dp2_zero3 --tensor-model-parallel-size 4 --zero-stage 3
fake_layout tp2dp4_ep4_moe --tensor-model-parallel-size 2 --sequence-parallel --num-experts 8 --moe-router-topk 2 \
  --expert-model-parallel-size 4 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --zero-stage 1
report b "fake process group, ranks 0 and 7 of TP2xPP2xDP2 ZeRO-1, TP2xCP2xDP2, TP4xDP2 ZeRO-3, MoE TP2xDP4 EP4" \
  "$([ -z "$fake_failed" ] && echo 0 || echo 1)" \
  "($fake_ok/$fake_total ran${fake_failed:+; failed:$fake_failed}; logs $OUT/b_*.log)"

# -- (c) a ~1.3B GPT, bf16, throughput and MFU, Triton attention and torch SDPA ----------------
gpt_mfu() {  # name, flags: 12 iterations of 24 x 2048, seq 2048, micro 4 (GPT-2 XL width, ~1.3B parameters)
  local backend="$1" rc summary
  shift
  rm -f "$OUT/c_gpt1p3b_$backend.jsonl"
  timeout -k 30 240 "$PY" pretrain_gpt.py --device cuda --bf16 --mock-data --vocab-size 50257 --num-layers 24 \
    --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 --train-iters 12 \
    --log-interval 4 --log-json "$OUT/c_gpt1p3b_$backend.jsonl" "$@" --hidden-dropout 0 \
    --attention-dropout 0 > "$OUT/c_gpt1p3b_$backend.log" 2>&1
  rc=$?
  summary="$("$PY" - "$OUT/c_gpt1p3b_$backend.jsonl" "$OUT/c_gpt1p3b_$backend.log" 2>&1 <<'EOF'
import json, math, re, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
model = re.search(r"model: ([\d.]+M) parameters", open(sys.argv[2]).read())
assert len(recs) == 12 and all(math.isfinite(r["loss"]) for r in recs), f"{len(recs)} records, losses {[r['loss'] for r in recs]}"
tail = recs[-6:]  # skip the warm-up (autotuning, compilation, allocator growth)
secs = [r["elapsed_ms"] / 1e3 for r in tail]
def avg(key):  # time-weighted: total work over total time
    return sum(r[key] * s for r, s in zip(tail, secs)) / sum(secs)
mfu = f"MFU {100 * avg('mfu'):.1f}%" if all("mfu" in r for r in tail) else "MFU n/a (GPU not in the peak table)"
print(f"{model.group(1) if model else '?'} params: {avg('tokens_per_sec'):,.0f} tokens/s, "
      f"{avg('tflops_per_gpu'):.1f} TFLOP/s/GPU, {mfu} (iterations 7-12); loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}")
EOF
)" || rc=$((rc == 0 ? 1 : rc))
  report c "GPT ~1.3B bf16 (24 x 2048, seq 2048, micro 4), 12 iterations, $*" "$rc" \
    "(${summary##*$'\n'}; log $OUT/c_gpt1p3b_$backend.log)"
}
gpt_mfu triton --attention-backend triton
gpt_mfu torch --attention-backend torch
if "$PY" -c 'import transformer_engine.pytorch' > /dev/null 2>&1; then
  gpt_mfu te_bf16 --transformer-impl transformer_engine
  gpt_mfu te_fp8 --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 \
    --fp8-amax-compute-algo max
else
  say "(c) GPT ~1.3B with --transformer-impl transformer_engine (bf16, FP8): not run, transformer-engine is not installed"
fi

# -- (d) kernel microbenchmarks ---------------------------------------------------------------
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of flags
timeout -k 30 360 "$PY" tools/bench_kernels.py ${GPU_CHECK_BENCH_ARGS---quick} --json "$OUT/d_bench_kernels.json" \
  > "$OUT/d_bench_kernels.txt" 2>&1
rc=$?
summary="$("$PY" - "$OUT/d_bench_kernels.json" 2>&1 <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = [f"{r['kernel']} {r['case']} {r['impl']}" for r in rows if "error" in r and r["impl"] == "triton"]
def best(impl, key):
    vals = [r[key] for r in rows if r["kernel"] == "attention" and r["impl"] == impl and r.get(key)]
    return f"{max(vals):.0f}" if vals else "-"
print(f"{len(rows)} rows; attention TFLOP/s fwd/bwd best: triton {best('triton', 'fwd_rate')}/{best('triton', 'bwd_rate')}, "
      f"sdpa-flash {best('sdpa-flash', 'fwd_rate')}/{best('sdpa-flash', 'bwd_rate')}"
      + (f"; triton failed: {', '.join(bad)}" if bad else ""))
sys.exit(1 if bad else 0)
EOF
)" || rc=$((rc == 0 ? 1 : rc))
report d "tools/bench_kernels.py" "$rc" "(${summary##*$'\n'}; table $OUT/d_bench_kernels.txt)"

if [ -z "$failed" ]; then say "all parts PASS; results in $OUT/"; exit 0; fi
say "FAILED parts:$failed; results in $OUT/"
exit 1
