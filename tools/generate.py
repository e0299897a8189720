#!/usr/bin/env python
"""Generate text from any megalite checkpoint (whatever layout saved it), with a KV cache.

    python tools/generate.py --load CKPT --prompt "def fibonacci(n):" --max-new-tokens 64 \\
        [--greedy | --temperature 0.8 --top-p 0.9 --seed 1]
    python tools/generate.py --load CKPT --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --prompt "..."
    python tools/generate.py --load CKPT --prompt-ids 5,17,42 --greedy --json

``--prompt`` uses the tokenizer the checkpoint records (pretrain copies the files of the one it
trained with into the checkpoint's ``tokenizer/`` folder, with their SHA-256, checked here; a
Hugging Face import's carried ``huggingface/tokenizer.json`` otherwise);
``--tokenizer-type/--tokenizer-model`` give another one instead.

Greedy by default; ``--temperature/--top-k/--top-p`` sample (``--seed`` reproduces). Stops at
an end-of-sequence id (the tokenizer's, else the checkpoint's Hugging Face config's) or
after ``--max-new-tokens``. It prints the prompt followed by its continuation, as one text (the
prompt as given, then what the new ids add to it; with ``--prompt-ids`` and no tokenizer, the
prompt's ids, `` | ``, then the new ids). ``--json`` prints the new ids and their text alone:
``{"ids": [...], "text": "..."}``.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpoint import CheckpointError, PieceReader, load_serial_model  # noqa: E402
from megalite.checkpoint.format import checkpoint_tokenizer  # noqa: E402
from megalite.checkpoint.serial import _checkpoint_dir  # noqa: E402
from megalite.checkpoint.settings import CARRIED  # noqa: E402
from megalite.model.generation import Sampling, generate  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megalite checkpoint directory (--save root or an iter_* dir)")
    p.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer"],
                   help="default: the tokenizer the checkpoint records")
    p.add_argument("--tokenizer-model", default=None, help="sentencepiece .model, or a folder with tokenizer.json")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (tokenized by the checkpoint's tokenizer, or the one given)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 5,17,42")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless sampling flags are set)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", action="store_true", help='print {"ids": [...], "text": "..."}')
    return p


def recorded_tokenizer(directory: str, meta: dict):
    """The tokenizer a checkpoint carries, its files checked against their SHA-256, or None
    with the reason. Raises CheckpointError for a missing or altered file."""
    from megalite.data.tokenizer import build_tokenizer

    record = checkpoint_tokenizer(directory, meta)
    if record is None:
        carried = os.path.join(directory, CARRIED)
        if os.path.isfile(os.path.join(carried, "tokenizer.json")):  # a Hugging Face import's tokenizer
            return build_tokenizer("HuggingFaceTokenizer", carried), None
        return None, "the checkpoint records no tokenizer"
    if record["path"] is None:
        return None, (f"the checkpoint was trained with {record['type']} (token ids, not text: mock data) and "
                      f"carries no tokenizer")
    try:
        tokenizer = build_tokenizer(record["type"], record["path"],
                                    add_bos=record.get("add_bos") if record["type"] == "HuggingFaceTokenizer" else None)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        raise CheckpointError(f"the checkpoint's tokenizer {record['path']} cannot be loaded ({e}).") from None
    if tokenizer.vocab_size != record.get("vocab_size") or tokenizer.eod != record.get("eod"):
        raise CheckpointError(f"the checkpoint's tokenizer {record['path']} has {tokenizer.vocab_size} ids and "
                              f"end-of-document id {tokenizer.eod}, but the checkpoint recorded "
                              f"{record.get('vocab_size')} and {record.get('eod')}: it is not the one it trained with.")
    return tokenizer, None


def continuation(tokenizer, prompt_ids: list[int], new: list[int]) -> str:
    """The text the new ids add after the prompt: the decoding of prompt and new ids together
    past the prompt's own decoding (a tokenizer that drops a word's leading space when it decodes
    the new ids alone keeps it here), else the new ids decoded alone."""
    before = tokenizer.detokenize(prompt_ids)
    whole = tokenizer.detokenize(list(prompt_ids) + list(new))
    return whole[len(before):] if whole.startswith(before) else tokenizer.detokenize(new)


def echo(prompt: str | None, tokenizer, prompt_ids: list[int], new: list[int]) -> str:
    """The prompt followed by its continuation (module docstring)."""
    if tokenizer is None:
        return ",".join(map(str, prompt_ids)) + " | " + ",".join(map(str, new))
    shown = prompt if prompt is not None else tokenizer.detokenize(prompt_ids)
    return shown + continuation(tokenizer, prompt_ids, new)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    tokenizer = None
    if a.tokenizer_type or a.tokenizer_model:
        from megalite.data.tokenizer import build_tokenizer

        if not (a.tokenizer_type and a.tokenizer_model):
            print("generate: --tokenizer-type and --tokenizer-model go together", file=sys.stderr)
            return 2
        try:
            tokenizer = build_tokenizer(a.tokenizer_type, a.tokenizer_model)
        except OSError as e:  # one line naming the file, no traceback
            print(f"generate: cannot read {e.filename}: {e.strerror}" if e.filename else f"generate: {e}",
                  file=sys.stderr)
            return 2
    try:
        directory = _checkpoint_dir(a.load)
        meta = PieceReader(directory).metadata
        why = None
        if a.prompt is not None and tokenizer is None:
            tokenizer, why = recorded_tokenizer(directory, meta)
        model = load_serial_model(a.load, getattr(torch, a.dtype)).to(a.device)
    except CheckpointError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    if a.prompt is not None:
        if tokenizer is None:
            print(f"generate: --prompt needs a tokenizer, but {why}. Fix: give --tokenizer-type and "
                  f"--tokenizer-model, or --prompt-ids", file=sys.stderr)
            return 2
        ids = list(tokenizer.tokenize(a.prompt))
        bos = getattr(tokenizer, "bos", None)
        if getattr(tokenizer, "add_bos", False) and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
    else:
        ids = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
    vocab = model.cfg.vocab_size
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        print(f"generate: the tokenizer has {tokenizer.vocab_size} ids but the model only {vocab}: they do not "
              f"belong together. Fix: the tokenizer the checkpoint was trained with.", file=sys.stderr)
        return 2
    if any(not 0 <= i < vocab for i in ids):
        print(f"generate: prompt ids must lie in [0, {vocab}) (the model's vocabulary)", file=sys.stderr)
        return 2
    eos = tuple(getattr(tokenizer, "eos_ids", None) or ([tokenizer.eod] if tokenizer is not None else []))
    if not eos:
        source_eos = (meta.get("source") or {}).get("eos_token_id")
        eos = tuple(source_eos if isinstance(source_eos, list) else [source_eos] if source_eos is not None else [])
    sampling = Sampling(greedy=a.greedy or a.temperature is None and a.top_k == 0 and a.top_p == 1.0,
                        temperature=a.temperature or 1.0, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    try:
        new = generate(model, ids, a.max_new_tokens, sampling, eos)
    except ValueError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    text = tokenizer.detokenize(new) if tokenizer is not None else None
    if a.json:
        print(json.dumps({"ids": new, "text": text}))
    else:
        print(echo(a.prompt, tokenizer, ids, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
