#!/bin/bash
# GPT-3 13B pretraining on H100 80GB nodes of 8 GPUs.
# Model: 40 layers, hidden 5120, 40 heads, GeLU FFN 20480, LayerNorm, learned positions,
# embeddings tied to the output, biases, dropout 0.1, GPT-2's BPE (50257 ids), sequence 2048.
# Batch: 1024 sequences of 2048 = 2M tokens per step (the GPT-3 paper's batch for this size),
# micro-batch 1.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=8    DP 8, ZeRO-2, recompute none
#   GPUS=64   TP 2 (SP) x PP 2 (zbv) x DP 16, ZeRO-1, recompute none
#   GPUS=512  TP 4 (SP) x PP 4 (zb-h1) x DP 32, ZeRO-1, recompute none
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/gpt3-13b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/gpt3-13b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=64 bash examples/recipes/gpt3-13b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with GPT-2's tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag
# given again wins).
#SBATCH --job-name=gpt3-13b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/gpt2}
CKPT_DIR=${CKPT_DIR:-ckpt/gpt3-13b}
VOCAB_SIZE=50257

MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length 2048
            --max-position-embeddings 2048 --hidden-dropout 0.1 --attention-dropout 0.1)
case "$GPUS" in
    8)   LAYOUT_ARGS=(--zero-stage 2 --overlap-grad-reduce) ;;
    64)  LAYOUT_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1 --pipeline-schedule zbv --sequence-parallel --overlap-grad-reduce) ;;
    512) LAYOUT_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --zero-stage 1 --pipeline-schedule zb-h1 --sequence-parallel --overlap-grad-reduce) ;;
    *)   no_layout gpt3-13b "8, 64 or 512" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --bf16
            --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 180
            --lr-decay-iters 125000 --train-iters 143000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/gpt3-13b.jsonl")

launch "$@"
