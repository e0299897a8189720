"""Train a byte-fallback SentencePiece tokenizer on a corpus.

    python tools/train_tokenizer.py --input data_cache/stdlib.jsonl \\
        --model-prefix data_cache/tok --vocab-size 4096

Writes PREFIX.model (pass it as --tokenizer-model) and PREFIX.vocab.  Training
is deterministic; see megalite/data/tokenizer_training.py for the settings.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from megalite.data.tokenizer import build_tokenizer  # noqa: E402
from megalite.data.tokenizer_training import MODEL_TYPES, train_sentencepiece  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402


def main(argv=None) -> None:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--input", required=True, help=".jsonl (or blank-line separated .txt)")
    parser.add_argument("--model-prefix", required=True, help="output path without .model")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--json-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's log")
    args = parser.parse_args(argv)
    try:
        model_path = train_sentencepiece(args.input, args.model_prefix, args.vocab_size,
                                         model_type=args.model_type, json_key=args.json_key,
                                         verbose=args.verbose)
    except OSError as e:  # one line naming the file, no traceback
        print(f"train_tokenizer.py: cannot read {e.filename}: {e.strerror}" if e.filename
              else f"train_tokenizer.py: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:  # a corpus line that is not JSON, a --vocab-size too small: the message says which
        print(f"train_tokenizer.py: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:  # SentencePiece refused the corpus (the message names it); anything else is a bug
        if not str(e).startswith("SentencePiece training"):
            raise
        print(f"train_tokenizer.py: {e}", file=sys.stderr)
        sys.exit(2)
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", model_path)
    print(f"wrote {model_path} (vocab_size={tokenizer.vocab_size}, eod={tokenizer.eod})")


if __name__ == "__main__":
    main()
