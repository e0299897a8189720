"""Tokenize a corpus into a megalite indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input data_cache/stdlib.jsonl --json-keys text \\
        --output-prefix data_cache/stdlib --tokenizer-type GPTSentencePieceTokenizer \\
        --tokenizer-model data_cache/tok.model --append-eod --workers 2

With a local Hugging Face tokenizer (a folder holding tokenizer.json; needs the
`tokenizers` package): --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR.
Each document then starts with BOS when the tokenizer adds one (Llama 2/3), as in
Megatron.

The input is JSONL (one object per line, text under --json-keys) or plain text
(documents separated by blank lines).  Train with --data-path PREFIX.

Supervised fine-tuning data: --json-format sft reads JSONL lines {"prompt", "response"}
or {"messages": [{"role", "content"}, ...]} (chosen per line; messages are rendered with
the Hugging Face folder's chat template) and also writes PREFIX_loss_mask.bin/.idx, 1 on
the response tokens: only those are trained on (see megalite/data/sft.py).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from megalite.data.preprocess import format_summary, preprocess  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from tools.tool_errors import one_line_errors, positive  # noqa: E402


def make_output_folder(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Create the folder of ``--output-prefix`` (and its parents), as pretrain_gpt.py creates
    its --save folder; a path that cannot be a folder is refused in one line before any work."""
    folder = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        parser.error(f"--output-prefix {prefix}: cannot create the folder {folder}: {e.strerror} "
                     f"(give another path)")


def main(argv=None) -> None:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--input", required=True, help=".jsonl/.json or plain-text corpus")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL field holding the document (one key)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin and PREFIX.idx (creating their folder, as --save does)")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                        default="GPTSentencePieceTokenizer")
    parser.add_argument("--tokenizer-model", help="SentencePiece .model file, or for HuggingFaceTokenizer "
                                                   "a folder holding tokenizer.json")
    parser.add_argument("--vocab-size", type=int, help="only for NullTokenizer")
    parser.add_argument("--append-eod", action="store_true",
                        help="append the end-of-document id after every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--json-format", choices=["text", "sft"], default="text",
                        help="text: one document under --json-keys per line; sft: prompt/response "
                             "or messages per line, with a loss mask (EOD always appended)")
    args = parser.parse_args(argv)
    if len(args.json_keys) != 1:
        parser.error(f"--json-keys got {args.json_keys}; megalite writes one dataset per "
                     f"run, so pass one key and run once per key.")
    positive(parser, "--workers", args.workers)
    make_output_folder(parser, args.output_prefix)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        print(f"tokenizing {args.input} with {tokenizer}, {args.workers} worker(s)")
        summary = preprocess(args.input, args.output_prefix, tokenizer,
                             json_key=args.json_keys[0], append_eod=args.append_eod,
                             workers=args.workers, progress_stream=sys.stderr,
                             json_format=args.json_format)
    except ValueError as e:  # bad input (a line, the template, the tokenizer): one message
        print(f"preprocess_data.py: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # one line naming the file, no traceback
        print(f"preprocess_data.py: cannot read {e.filename}: {e.strerror}" if e.filename
              else f"preprocess_data.py: {e}", file=sys.stderr)
        sys.exit(2)
    print(format_summary(summary))


if __name__ == "__main__":
    main()
