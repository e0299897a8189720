"""tools/generate.py prints the prompt followed by its continuation, as one text.

It used to print the new text alone, which starts wherever the prompt stopped (a newline after
"def main():"), with no prompt to read it against; SentencePiece also drops a word's leading space
when the new ids are decoded alone. The continuation is now what the new ids add to the prompt's
decoding, printed after the prompt as given; --json still gives the new ids and their text.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import generate as generate_tool  # noqa: E402

from megalite.checkpoint import save_weights_checkpoint  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.data.corpus import build_default_corpus  # noqa: E402
from megalite.data.tokenizer import build_tokenizer  # noqa: E402
from megalite.data.tokenizer_training import train_sentencepiece  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402

PROMPT = "def main():"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small SentencePiece tokenizer and a random 2-layer model of its vocabulary, saved."""
    root = tmp_path_factory.mktemp("echo")
    build_default_corpus(str(root / "corpus.jsonl"), max_bytes=40_000)
    model_file = train_sentencepiece(str(root / "corpus.jsonl"), str(root / "tok"), vocab_size=384)
    model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=384,
                                 seq_length=64, hidden_dropout=0.0, attention_dropout=0.0))
    model.init_weights(3)
    save_weights_checkpoint(str(root / "ckpt"), model)
    return str(root / "ckpt"), model_file


def _generate(capsys, load, model_file, *extra):
    argv = ["--load", load, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model_file,
            "--prompt", PROMPT, "--max-new-tokens", "12", *extra]
    assert generate_tool.main(argv) == 0
    return capsys.readouterr().out


def test_generate_prints_the_prompt_then_its_continuation(checkpoint, capsys):
    """The printed text is the prompt as given followed by what the new ids add to its decoding
    (the same greedy ids --json reports), so it starts with the prompt, never with a newline."""
    load, model_file = checkpoint
    new = json.loads(_generate(capsys, load, model_file, "--json"))["ids"]
    assert len(new) > 0
    out = _generate(capsys, load, model_file)
    tokenizer = build_tokenizer("SentencePieceTokenizer", model_file)
    ids = tokenizer.tokenize(PROMPT)
    before, whole = tokenizer.detokenize(ids), tokenizer.detokenize(list(ids) + new)
    assert whole.startswith(before)
    assert out == PROMPT + whole[len(before):] + "\n", (out, tokenizer.detokenize(new))


def test_generate_with_prompt_ids_and_no_tokenizer_echoes_the_ids(checkpoint, capsys):
    """Without a tokenizer the prompt's ids are printed, then `` | ``, then the new ids."""
    load, _ = checkpoint
    assert generate_tool.main(["--load", load, "--prompt-ids", "5,17,42", "--max-new-tokens", "3", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)["ids"]
    assert generate_tool.main(["--load", load, "--prompt-ids", "5,17,42", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == "5,17,42 | " + ",".join(map(str, new)) + "\n"
