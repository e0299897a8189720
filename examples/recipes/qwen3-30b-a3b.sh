#!/bin/bash
# Qwen3-30B-A3B-shaped pretraining on H100 80GB nodes of 8 GPUs.
# Model (Qwen3-30B-A3B's config.json): 48 layers, hidden 2048, 32 query heads of 128 (--kv-channels:
# the attention is 4096 wide, twice the hidden size) in 4 KV groups, RMSNorm on each head's query and
# key (--qk-layernorm), every MLP a mixture of 128 SwiGLU experts of FFN 768 with top-8 softmax routing
# (weights renormalised over the 8, as norm_topk_prob), no shared expert, load-balancing loss 0.001,
# RMSNorm eps 1e-6, RoPE base 1000000, untied output, no biases, vocabulary 151936 (Qwen's tokenizer),
# sequence 4096. 30.5B parameters, about 3.3B active per token.
# Batch: 1024 sequences of 4096 = 4.2M tokens per step, micro-batch 1.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=64    PP 2 (zbv) x DP 32, EP 8, ZeRO-1, recompute none
#   GPUS=256   PP 2 (zbv) x DP 128, EP 8, ZeRO-1, recompute none
#   GPUS=1024  PP 4 (interleaved 1f1b, V 12) x DP 256, EP 8, ZeRO-1, recompute none
# Submit from the checkout:   sbatch --nodes 8 examples/recipes/qwen3-30b-a3b.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=8 MASTER_ADDR=node0 bash examples/recipes/qwen3-30b-a3b.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=64 bash examples/recipes/qwen3-30b-a3b.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag given
# again wins).
#SBATCH --job-name=qwen3-30b-a3b
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/qwen3}
CKPT_DIR=${CKPT_DIR:-ckpt/qwen3-30b-a3b}
VOCAB_SIZE=151936

MODEL_ARGS=(--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 4
            --kv-channels 128 --qk-layernorm --ffn-hidden-size 6144 --swiglu
            --normalization RMSNorm --norm-epsilon 1e-6
            --position-embedding-type rope --rotary-base 1000000 --seq-length 4096
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0
            --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-aux-loss-coeff 0.001)
case "$GPUS" in
    64)   LAYOUT_ARGS=(--pipeline-model-parallel-size 2 --zero-stage 1 --expert-model-parallel-size 8 --pipeline-schedule zbv --overlap-grad-reduce) ;;
    256)  LAYOUT_ARGS=(--pipeline-model-parallel-size 2 --zero-stage 1 --expert-model-parallel-size 8 --pipeline-schedule zbv --overlap-grad-reduce) ;;
    1024) LAYOUT_ARGS=(--pipeline-model-parallel-size 4 --zero-stage 1 --expert-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 1 --overlap-grad-reduce) ;;
    *)    no_layout qwen3-30b-a3b "64, 256 or 1024" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --bf16
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --lr-decay-iters 250000 --train-iters 250000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/qwen3-30b-a3b.jsonl")

launch "$@"
