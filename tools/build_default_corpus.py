"""Build the default JSONL training corpus from the Python standard library sources.

    python tools/build_default_corpus.py --output data_cache/stdlib.jsonl --max-bytes 3000000

No download is needed and the output is byte-identical on every run with the
same Python version (see megalite/data/corpus.py for the format).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from megalite.data.corpus import build_default_corpus  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="path of the .jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=3_000_000,
                        help="stop before the corpus exceeds this many bytes (default 3000000)")
    args = parser.parse_args(argv)
    stats = build_default_corpus(args.output, max_bytes=args.max_bytes)
    note = " (stopped at --max-bytes)" if stats["truncated"] else ""
    print(f"wrote {stats['path']}: {stats['documents']:,} documents, {stats['bytes']:,} "
          f"bytes from {stats['files']:,} modules{note}")


if __name__ == "__main__":
    main()
