#!/bin/bash
# Mixtral 8x7B pretraining on H100 80GB nodes of 8 GPUs.
# Model: 32 layers, hidden 4096, 32 heads in 8 KV groups, every MLP a mixture of 8 SwiGLU experts
# of FFN 14336 with top-2 routing (46.7B parameters, about 13B active per token), RMSNorm, RoPE
# base 1000000, untied output, no biases, vocabulary 32000 (Mixtral's tokenizer), sequence 4096
# (Mixtral's own context is 32k; this recipe trains at 4096).
# Batch: 512 sequences of 4096 = 2.1M tokens per step, micro-batch 1; load-balancing loss 0.02.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=64   TP 2 (SP) x PP 2 (zbv) x DP 16, EP 8, ZeRO-1, recompute none
#   GPUS=512  TP 2 (SP) x PP 4 (zbv) x DP 64, EP 8, ZeRO-1, recompute none
#   8 GPUs cannot hold it: its weights, gradients and Adam state alone are 783 GiB (18 bytes per
#   parameter), 576 GiB is what 8 GPUs have after the planner's headroom; no layout fits there.
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/mixtral-8x7b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/mixtral-8x7b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=64 bash examples/recipes/mixtral-8x7b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag given
# again wins).
#SBATCH --job-name=mixtral-8x7b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/mixtral}
CKPT_DIR=${CKPT_DIR:-ckpt/mixtral-8x7b}
VOCAB_SIZE=32000

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
            --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --norm-epsilon 1e-5
            --position-embedding-type rope --rotary-base 1000000 --seq-length 4096
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0
            --num-experts 8 --moe-ffn-hidden-size 14336 --moe-router-topk 2 --moe-aux-loss-coeff 0.02)
case "$GPUS" in
    64)  LAYOUT_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1 --expert-model-parallel-size 8 --pipeline-schedule zbv --sequence-parallel --overlap-grad-reduce) ;;
    512) LAYOUT_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --zero-stage 1 --expert-model-parallel-size 8 --pipeline-schedule zbv --sequence-parallel --overlap-grad-reduce) ;;
    *)   no_layout mixtral-8x7b "64 or 512" "8 GPUs cannot hold the model state" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 512 --bf16
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --lr-decay-iters 250000 --train-iters 250000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/mixtral-8x7b.jsonl")

launch "$@"
