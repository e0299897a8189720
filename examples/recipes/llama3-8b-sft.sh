#!/bin/bash
# Llama-3 8B supervised fine-tuning from a Hugging Face checkpoint, on H100 80GB nodes of 8 GPUs.
# Model: Llama-3 8B as imported (32 layers, hidden 4096, 32 heads in 8 KV groups, SwiGLU FFN 14336,
# RMSNorm, RoPE base 500000, untied output, vocabulary 128256); the flags below restate it (a flag
# that contradicted the checkpoint would be refused). Sequence 8192, documents packed with
# positions and attention reset at each document (--reset-position-ids --reset-attention-mask),
# loss on response tokens only (the SFT loss mask of tools/preprocess_data.py --json-format sft)
# and not on the EOD input (--eod-mask-loss).
# Batch: 64 sequences of 8192 = 0.5M tokens per step, micro-batch 1; lr 1e-5, no dropout.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=8    DP 8, ZeRO-3, recompute none
#   GPUS=64   DP 64, ZeRO-3, recompute none
#   (512 GPUs would hold one sequence each only with a batch of 512 or more: not an SFT batch.)
# Once, before training (any machine with the checkout; no GPU):
#   ACTION=prepare bash examples/recipes/llama3-8b-sft.sh
#   imports HF_MODEL (a folder with config.json, model*.safetensors and the tokenizer) into
#   IMPORTED, and tokenizes SFT_JSONL (lines {"prompt": ..., "response": ...} or {"messages":
#   [...]}, rendered with the model's chat template when it has one) into SFT_DATA.
# Submit from the checkout:   sbatch --nodes 1 examples/recipes/llama3-8b-sft.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=1 bash examples/recipes/llama3-8b-sft.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=8 bash examples/recipes/llama3-8b-sft.sh
# The first run starts from IMPORTED (--finetune: weights only); once CKPT_DIR holds a checkpoint,
# running the script again resumes from it. Extra arguments go to pretrain_gpt.py (a flag given
# again wins).
#SBATCH --job-name=llama3-8b-sft
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=12:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

HF_MODEL=${HF_MODEL:-hf/Meta-Llama-3-8B-Instruct}
IMPORTED=${IMPORTED:-ckpt/llama3-8b-imported}
SFT_JSONL=${SFT_JSONL:-data/sft.jsonl}
SFT_DATA=${SFT_DATA:-data/sft}
CKPT_DIR=${CKPT_DIR:-ckpt/llama3-8b-sft}
VOCAB_SIZE=128256

if [ "$ACTION" = prepare ]; then
    if [ -n "${MEGALITE_VENV=.venv}" ]; then source "$MEGALITE_VENV/bin/activate"; fi
    python "$MEGALITE_HOME/tools/convert_hf.py" --direction import --hf-dir "$HF_MODEL" --save "$IMPORTED"
    python "$MEGALITE_HOME/tools/preprocess_data.py" --input "$SFT_JSONL" --json-format sft \
        --output-prefix "$SFT_DATA" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL"
    exit 0
fi

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
            --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --norm-epsilon 1e-5
            --position-embedding-type rope --rotary-base 500000 --seq-length 8192
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0)
case "$GPUS" in
    8)  LAYOUT_ARGS=(--zero-stage 3 --overlap-grad-reduce) ;;
    64) LAYOUT_ARGS=(--zero-stage 3 --overlap-grad-reduce) ;;
    *)  no_layout llama3-8b-sft "8 or 64" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 64 --bf16
            --reset-position-ids --reset-attention-mask --eod-mask-loss
            --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50
            --lr-decay-iters 2000 --train-iters 2000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$SFT_DATA" --split 98,2,0
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL")
if [ -e "$CKPT_DIR/latest" ]; then
    START=(--load "$CKPT_DIR")                  # resume the fine-tuning run
else
    START=(--finetune --load "$IMPORTED")       # weights only, iteration 0
fi
CKPT_ARGS=("${START[@]}" --save "$CKPT_DIR" --save-interval 200 --keep-last 2
           --eval-interval 200 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/llama3-8b-sft.jsonl")
# A restart by torchrun would repeat the same command line, --finetune included: run the script
# again instead (it resumes from CKPT_DIR).
MAX_RESTARTS=${MAX_RESTARTS:-0}

launch "$@"
