#!/bin/bash
# GPT-3 1.3B ("GPT-3 XL") pretraining on H100 80GB nodes of 8 GPUs.
# Model: 24 layers, hidden 2048, 16 heads, GeLU FFN 8192, LayerNorm, learned positions,
# embeddings tied to the output, biases, dropout 0.1, GPT-2's BPE (50257 ids), sequence 2048.
# Batch: 512 sequences of 2048 = 1M tokens per step (the GPT-3 paper's batch for this size),
# micro-batch 4.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=8    DP 8, ZeRO-0, recompute none
#   GPUS=64   DP 64, ZeRO-1, recompute none
#   GPUS=512  TP 4 (SP) x DP 128, ZeRO-3, recompute none
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/gpt3-1.3b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/gpt3-1.3b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=64 bash examples/recipes/gpt3-1.3b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with GPT-2's tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag
# given again wins).
#SBATCH --job-name=gpt3-1.3b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/gpt2}
CKPT_DIR=${CKPT_DIR:-ckpt/gpt3-1.3b}
VOCAB_SIZE=50257

MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
            --max-position-embeddings 2048 --hidden-dropout 0.1 --attention-dropout 0.1)
case "$GPUS" in
    8)   LAYOUT_ARGS=(--overlap-grad-reduce) ;;
    64)  LAYOUT_ARGS=(--zero-stage 1 --overlap-grad-reduce) ;;
    512) LAYOUT_ARGS=(--tensor-model-parallel-size 4 --zero-stage 3 --sequence-parallel --overlap-grad-reduce) ;;
    *)   no_layout gpt3-1.3b "8, 64 or 512" ;;
esac
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 512 --bf16
            --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 375
            --lr-decay-iters 250000 --train-iters 286000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 2000 --keep-last 3
           --eval-interval 2000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/gpt3-1.3b.jsonl")

launch "$@"
