#!/usr/bin/env bash
# Set up the environment, build the default corpus (from this Python's standard library:
# no download), train a sentencepiece tokenizer on it, preprocess it into an indexed
# dataset, then pretrain a small GPT on CPU through torchrun (2 data-parallel ranks).
# Usage: ./scripts/demo.sh [extra pretrain_gpt.py flags, e.g. --train-iters 50]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
PY=.venv/bin/python
OUT=runs/demo
NPROC="${NPROC:-2}"
mkdir -p "$OUT"
[ -f "$OUT/corpus.jsonl" ] || $PY tools/build_default_corpus.py --output "$OUT/corpus.jsonl"
[ -f "$OUT/tok.model" ] || $PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" \
    --model-prefix "$OUT/tok" --vocab-size 4096
[ -f "$OUT/corpus.idx" ] || $PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" \
    --output-prefix "$OUT/corpus" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/tok.model" --append-eod --workers 2
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --data-path "$OUT/corpus" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tok.model" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
    --lr 2e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
    --hidden-dropout 0.0 --attention-dropout 0.0 --weight-decay 0.1 --clip-grad 1.0 \
    --log-interval 10 --eval-interval 50 --eval-iters 4 --seed 1234 \
    --log-json "$OUT/log.jsonl" --save "$OUT/model" "$@"
