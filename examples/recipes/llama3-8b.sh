#!/bin/bash
# Llama-3 8B pretraining on H100 80GB nodes of 8 GPUs.
# Model: 32 layers, hidden 4096, 32 heads in 8 KV groups, SwiGLU FFN 14336, RMSNorm, RoPE base
# 500000, untied output, no biases, vocabulary 128256 (Llama-3's tokenizer), sequence 8192.
# Batch: 512 sequences of 8192 = 4.2M tokens per step, micro-batch 1.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=8    DP 8, ZeRO-3, recompute none
#   GPUS=64   TP 2 (SP) x DP 32, ZeRO-1, recompute none
#   GPUS=512  DP 512, ZeRO-3, recompute none
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/llama3-8b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/llama3-8b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=64 bash examples/recipes/llama3-8b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py.
#SBATCH --job-name=llama3-8b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/llama3}
CKPT_DIR=${CKPT_DIR:-ckpt/llama3-8b}
VOCAB_SIZE=128256

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
            --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --norm-epsilon 1e-5
            --position-embedding-type rope --rotary-base 500000 --seq-length 8192
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0)
case "$GPUS" in
    8)   LAYOUT_ARGS=(--zero-stage 3 --overlap-grad-reduce) ;;
    64)  LAYOUT_ARGS=(--tensor-model-parallel-size 2 --zero-stage 1 --sequence-parallel --overlap-grad-reduce) ;;
    512) LAYOUT_ARGS=(--zero-stage 3 --overlap-grad-reduce) ;;
    *)   no_layout llama3-8b "8, 64 or 512" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 512 --bf16
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --lr-decay-iters 250000 --train-iters 250000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/llama3-8b.jsonl")

launch "$@"
