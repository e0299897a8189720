#!/bin/bash
# Llama-3 70B pretraining on H100 80GB nodes of 8 GPUs.
# Model: 80 layers, hidden 8192, 64 heads in 8 KV groups, SwiGLU FFN 28672, RMSNorm, RoPE base
# 500000, untied output, no biases, vocabulary 128256 (Llama-3's tokenizer), sequence 8192.
# Batch: 1024 sequences of 8192 = 8.4M tokens per step, micro-batch 1.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=64   TP 8 (SP) x PP 2 (interleaved 1f1b, V 2) x DP 4, ZeRO-1, recompute none
#   GPUS=512  TP 4 (SP) x PP 2 (interleaved 1f1b, V 20) x DP 64, ZeRO-2, recompute none
#   8 GPUs cannot hold it: its weights, gradients and Adam state alone are 1,183 GiB (18 bytes per
#   parameter), 576 GiB is what 8 GPUs have after the planner's headroom; no layout fits there.
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/llama3-70b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/llama3-70b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=512 bash examples/recipes/llama3-70b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag given
# again wins).
#SBATCH --job-name=llama3-70b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/llama3}
CKPT_DIR=${CKPT_DIR:-ckpt/llama3-70b}
VOCAB_SIZE=128256

MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8
            --ffn-hidden-size 28672 --swiglu --normalization RMSNorm --norm-epsilon 1e-5
            --position-embedding-type rope --rotary-base 500000 --seq-length 8192
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0)
case "$GPUS" in
    64)  LAYOUT_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 20 --zero-stage 1 --sequence-parallel --overlap-grad-reduce) ;;
    512) LAYOUT_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --zero-stage 2 --num-layers-per-virtual-pipeline-stage 2 --sequence-parallel --overlap-grad-reduce) ;;
    *)   no_layout llama3-70b "64 or 512" "8 GPUs cannot hold the model state" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --bf16
            --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --lr-decay-iters 250000 --train-iters 250000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/llama3-70b.jsonl")

launch "$@"
