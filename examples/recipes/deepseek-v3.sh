#!/bin/bash
# DeepSeek-V3 (671B)-shaped pretraining on H100 80GB nodes of 8 GPUs.
# Model (DeepSeek-V3's config.json): 61 layers, hidden 7168, 128 heads of Multi-head Latent
# Attention (query latent 1536, key/value latent 512; per head 128 without RoPE + 64 with the
# shared RoPE key, value 128), YaRN RoPE (factor 40 over an original 4096, mscale = mscale_all_dim
# = 1, base 10000); the first 3 layers dense (SwiGLU FFN 18432), the other 58 a mixture of 256
# routed SwiGLU experts of FFN 2048, top-8, plus 1 shared expert of 2048: sigmoid scores,
# group-limited routing (8 groups, the best 4 per token), top-8 weights renormalised and scaled by
# 2.5, aux-loss-free balancing by the expert bias (update rate 1e-3); RMSNorm eps 1e-6, untied
# output, no biases, vocabulary 129280, sequence 4096; one multi-token-prediction depth (an MoE
# layer on the last stage predicting token t+2, loss weight 0.1). 671B parameters without the MTP
# depth, 682.6B with it (DeepSeek's 685B also counts the depth's copies of the embedding and output
# head, which megalite shares), about 37B active per token.
# Batch: 4096 sequences of 4096 = 16.8M tokens per step (DeepSeek-V3 ramped to 15360), micro-batch 1.
# Layouts (tools/plan_parallel.py's recommendation; planned and measured memory in docs/recipes.md):
#   GPUS=256   TP 2 (SP) x DP 128, EP 256, ZeRO-2, recompute full
#   GPUS=1024  TP 8 (SP) x DP 128, EP 256, ZeRO-1, recompute none
#   64 GPUs cannot hold it: its weights, gradients and Adam state alone are 11,249 GiB (18 bytes
#   per parameter), 4,608 GiB is what 64 GPUs have after the planner's headroom; no layout fits there.
# Submit from the checkout:   sbatch --nodes 32 examples/recipes/deepseek-v3.sh   (GPUS = nodes x 8)
# By hand, on every node:     NNODES=32 MASTER_ADDR=node0 bash examples/recipes/deepseek-v3.sh
# Measure first (CPU, meta):  ACTION=dry-run GPUS=256 bash examples/recipes/deepseek-v3.sh
# Paths: DATA_PATH (preprocessed, tools/preprocess_data.py), TOKENIZER (a Hugging Face folder
# with tokenizer.json), CKPT_DIR, LOG_DIR. Extra arguments go to pretrain_gpt.py (a flag given
# again wins).
#SBATCH --job-name=deepseek-v3
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
set -euo pipefail
source "${MEGALITE_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/recipes/launch.sh"

DATA_PATH=${DATA_PATH:-data/corpus_text_document}
TOKENIZER=${TOKENIZER:-tokenizers/deepseek-v3}
CKPT_DIR=${CKPT_DIR:-ckpt/deepseek-v3}
VOCAB_SIZE=129280

MODEL_ARGS=(--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432 --swiglu
            --normalization RMSNorm --norm-epsilon 1e-6 --seq-length 4096
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0
            --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512
            --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
            --position-embedding-type rope --rotary-base 10000
            --rope-type yarn --rotary-scaling-factor 40 --yarn-original-max-position-embeddings 4096
            --mscale 1.0 --mscale-all-dim 1.0
            --num-experts 256 --moe-ffn-hidden-size 2048 --moe-router-topk 8
            --moe-shared-expert-intermediate-size 2048 --moe-layer-freq '([0]*3+[1]*58)'
            --moe-router-score-function sigmoid --moe-router-num-groups 8 --moe-router-group-topk 4
            --moe-router-topk-scaling-factor 2.5
            --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
            --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
case "$GPUS" in
    256)  LAYOUT_ARGS=(--tensor-model-parallel-size 2 --zero-stage 2 --expert-model-parallel-size 256 --sequence-parallel --recompute-granularity full --overlap-grad-reduce) ;;
    1024) LAYOUT_ARGS=(--tensor-model-parallel-size 8 --zero-stage 1 --expert-model-parallel-size 256 --sequence-parallel --overlap-grad-reduce) ;;
    *)    no_layout deepseek-v3 "256 or 1024" "64 GPUs cannot hold the model state" ;;
esac
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 4096 --bf16
            --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --lr-decay-iters 100000 --train-iters 100000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
DATA_ARGS=(--data-path "$DATA_PATH" --split 990,9,1
           --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 --keep-last 3
           --eval-interval 1000 --eval-iters 10 --log-interval 10 --log-json "$LOG_DIR/deepseek-v3.jsonl")

launch "$@"
