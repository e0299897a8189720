# Sourced by the recipes in this folder (not run on its own). A recipe sources it first, which
# sets GPUS_PER_NODE, NNODES, GPUS and ACTION; then it fills the arrays MODEL_ARGS (the
# architecture), LAYOUT_ARGS (the parallel layout for $GPUS), TRAIN_ARGS (batch, optimizer,
# schedule, precision, packing), DATA_ARGS (data and tokenizer) and CKPT_ARGS (checkpoints and
# logs), sets VOCAB_SIZE (the tokenizer's vocabulary, for the dry run only: training reads it
# from the tokenizer) and ends with `launch "$@"`.
#
# What `launch` does depends on ACTION:
#   train (default)  torchrun on this node, one rank per GPU, c10d rendezvous on MASTER_ADDR:
#                    under SLURM (sbatch, one task per node) through srun, with the first node of
#                    the allocation as MASTER_ADDR; by hand, run the script on every node with
#                    NNODES and MASTER_ADDR set the same everywhere.
#   dry-run          tools/dry_run.py on this machine's CPU: one rank per pipeline stage of the
#                    $GPUS-GPU layout runs one iteration on meta tensors, its peak memory is
#                    measured and compared with the planner's (GPU_MEMORY_GB, default 80).
#   print            the pretrain_gpt.py flags of the training run, on one line, shell-quoted.
#   print-dry-run    the tools/dry_run.py arguments of the dry run, on one line, shell-quoted.
# Extra arguments to the recipe go to pretrain_gpt.py (train, print) or to the dry run.

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${SLURM_NNODES:-${NNODES:-1}}
GPUS=${GPUS:-$((NNODES * GPUS_PER_NODE))}
ACTION=${ACTION:-train}
LOG_DIR=${LOG_DIR:-logs}
# The checkout holding pretrain_gpt.py and tools/: the one this file is in. (sbatch runs a copy
# of the recipe from its spool directory; the recipe finds this file through the submit
# directory, so submit from the checkout, or set MEGALITE_HOME.)
MEGALITE_HOME=${MEGALITE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}

# A recipe's layouts are for the GPU counts it names; another count is refused.
no_layout() {  # no_layout RECIPE "8, 64 or 512" [why]
    echo "$1: no layout for GPUS=$GPUS; this recipe has layouts for $2 GPUs${3:+ ($3)}." \
         "tools/plan_parallel.py plans other counts (docs/recipes.md)." >&2
    exit 2
}

launch() {
    case "$ACTION" in
    print)
        printf '%q ' "${MODEL_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" \
            "${CKPT_ARGS[@]}" "$@"
        echo
        ;;
    print-dry-run|dry-run)
        local dry=(--world-size "$GPUS" --gpus-per-node "$GPUS_PER_NODE" --gpu-memory-gb "${GPU_MEMORY_GB:-80}"
                   "${MODEL_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" --vocab-size "$VOCAB_SIZE" "$@")
        if [ "$ACTION" = print-dry-run ]; then
            printf '%q ' "${dry[@]}"
            echo
        else
            "${PYTHON:-python}" "$MEGALITE_HOME/tools/dry_run.py" "${dry[@]}"
        fi
        ;;
    train)
        if [ "$GPUS" -ne $((NNODES * GPUS_PER_NODE)) ]; then
            echo "GPUS=$GPUS but this run has NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE GPUs:" \
                 "set NNODES (sbatch --nodes $((GPUS / GPUS_PER_NODE)))." >&2
            exit 2
        fi
        # The Python environment with megalite installed (torchrun included): the virtualenv at
        # $MEGALITE_VENV (default .venv); MEGALITE_VENV= (empty) when it is already active.
        if [ -n "${MEGALITE_VENV=.venv}" ]; then source "$MEGALITE_VENV/bin/activate"; fi
        local launcher=()
        if [ -n "${SLURM_JOB_ID:-}" ]; then
            # The first host of the allocation (no "| head": under pipefail it can end the job).
            local hosts
            hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
            MASTER_ADDR=${hosts%%$'\n'*}
            MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
            RUN_ID=${RUN_ID:-$SLURM_JOB_ID}
            # srun does not inherit --cpus-per-task from sbatch (SLURM 22.05 and later).
            launcher=(srun --cpus-per-task="${SLURM_CPUS_PER_TASK:-64}")
        fi
        local cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / GPUS_PER_NODE > 0 ? cpus / GPUS_PER_NODE : 1))}
        mkdir -p "$LOG_DIR"
        "${launcher[@]}" torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --max-restarts "${MAX_RESTARTS:-3}" \
            --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \
            --rdzv-id "${RUN_ID:-megalite}" \
            "$MEGALITE_HOME/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" \
            "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
        ;;
    *)
        echo "ACTION=$ACTION: one of train, dry-run, print, print-dry-run (and prepare for the SFT recipe)." >&2
        exit 2
        ;;
    esac
}
