"""A checkpoint carries its tokenizer: pretrain copies the sentencepiece model it trained with into
the iteration directory (``tokenizer/``) with its SHA-256 in metadata.json, and tools/generate.py
then needs only --load and --prompt; an altered or missing copy is one message; explicit
tokenizer flags still override; mock data records a NullTokenizer without files."""
import hashlib
import json
import os
import sys

import pytest

from megalite.data.corpus import build_default_corpus
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import build_tokenizer
from megalite.data.tokenizer_training import train_sentencepiece
from megalite.train.pretrain import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import generate as generate_tool  # noqa: E402

DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "2e-3",
        "--log-interval", "100"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A demo-shaped model trained 2 iterations on a sentencepiece tokenizer, saved."""
    tmp = tmp_path_factory.mktemp("tokckpt")
    corpus = tmp / "corpus.jsonl"
    build_default_corpus(str(corpus), max_bytes=60_000)
    model = train_sentencepiece(str(corpus), str(tmp / "tok"), vocab_size=512)
    preprocess(str(corpus), str(tmp / "data"), build_tokenizer("SentencePieceTokenizer", model))
    assert main(DEMO + ["--data-path", str(tmp / "data"), "--tokenizer-type", "SentencePieceTokenizer",
                        "--tokenizer-model", model, "--save", str(tmp / "ckpt")]) == 0
    return tmp, model


def _generate(capsys, *argv):
    code = generate_tool.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_checkpoint_records_and_copies_its_tokenizer(trained):
    tmp, model = trained
    directory = tmp / "ckpt" / "iter_0000002"
    record = json.loads((directory / "metadata.json").read_text())["tokenizer"]
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    copy = directory / "tokenizer" / "tok.model"
    assert record == {"type": "SentencePieceTokenizer", "vocab_size": 512, "eod": tokenizer.eod,
                      "bos": tokenizer.bos, "add_bos": False, "model": "tokenizer/tok.model",
                      "files": {"tokenizer/tok.model": hashlib.sha256(copy.read_bytes()).hexdigest()}}
    assert copy.read_bytes() == open(model, "rb").read()
    assert not any(p.name.endswith(".tmp") for p in (tmp / "ckpt").iterdir())  # written before the rename


def test_generate_needs_only_load_and_prompt(trained, capsys):
    tmp, model = trained
    code, out, err = _generate(capsys, "--load", str(tmp / "ckpt"), "--prompt", "def main(", "--max-new-tokens",
                               "6", "--json")
    assert code == 0, err
    result = json.loads(out)
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    assert 0 < len(result["ids"]) <= 6 and result["text"] == tokenizer.detokenize(result["ids"])
    # explicit flags override the recorded tokenizer: the same file by another path gives the same ids
    code, out2, err = _generate(capsys, "--load", str(tmp / "ckpt"), "--prompt", "def main(", "--max-new-tokens",
                                "6", "--json", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model)
    assert code == 0 and json.loads(out2) == result, err


def test_an_altered_or_missing_tokenizer_copy_is_one_message(trained, capsys, tmp_path):
    import shutil

    tmp, _ = trained
    load = tmp_path / "iter_0000002"
    shutil.copytree(tmp / "ckpt" / "iter_0000002", load)
    copy = load / "tokenizer" / "tok.model"
    copy.write_bytes(copy.read_bytes()[:-10] + b"0123456789")
    code, out, err = _generate(capsys, "--load", str(load), "--prompt", "def main(")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"generate: {copy}: checksum mismatch (expected ") and "altered or is corrupt" in err
    copy.unlink()
    code, out, err = _generate(capsys, "--load", str(load), "--prompt", "def main(")
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"generate: {copy} is missing"), err
    code, out, err = _generate(capsys, "--load", str(load), "--prompt-ids", "5,6", "--max-new-tokens", "2")
    assert code == 0, err  # ids need no tokenizer


def test_mock_data_records_that_there_is_no_tokenizer(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert main(["--mock-data", "--vocab-size", "200", "--num-layers", "2", "--hidden-size", "32",
                 "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--train-iters", "1", "--save", str(save)]) == 0
    record = json.loads((save / "iter_0000001" / "metadata.json").read_text())["tokenizer"]
    assert record == {"type": "NullTokenizer", "vocab_size": 200, "eod": 199, "bos": None, "add_bos": False,
                      "model": None, "files": {}}
    assert not (save / "iter_0000001" / "tokenizer").exists()
    capsys.readouterr()
    code, out, err = _generate(capsys, "--load", str(save), "--prompt", "hello")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "trained with NullTokenizer" in err and "--prompt-ids" in err


def test_a_hugging_face_tokenizer_folder_is_recorded_with_its_files(tmp_path):
    """The folder's tokenizer files are copied and rebuilt as trained (BOS choice included)."""
    tokenizers = pytest.importorskip("tokenizers")
    from megalite.checkpoint.format import write_tokenizer

    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    raw.train_from_iterator(["def f(x): return x + 1", "print('hello world')"] * 20, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder = tmp_path / "hf"
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}))
    (folder / "unrelated.bin").write_bytes(b"not a tokenizer file")
    for add_bos in (None, False):
        trained = build_tokenizer("HuggingFaceTokenizer", str(folder), add_bos=add_bos)
        directory = tmp_path / f"iter_{add_bos}"
        directory.mkdir()
        record = write_tokenizer(str(directory), trained)
        assert record["model"] == "tokenizer" and sorted(record["files"]) == [
            "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
        assert record["add_bos"] is trained.add_bos is (add_bos is None)
        rebuilt, why = generate_tool.recorded_tokenizer(str(directory), {"tokenizer": record})
        assert why is None and rebuilt.tokenize("def f(x):") == trained.tokenize("def f(x):")


def test_a_resharded_checkpoint_still_carries_its_tokenizer(trained, capsys, tmp_path):
    """reshard_checkpoint copies the tokenizer folder its metadata names, so generation from the
    resharded checkpoint needs no tokenizer flags either."""
    import reshard_checkpoint
    tmp, _ = trained
    out = tmp_path / "tp2"
    assert reshard_checkpoint.main(["--load", str(tmp / "ckpt"), "--save", str(out),
                                    "--target-tensor-model-parallel-size", "2"]) in (0, None)
    assert (out / "iter_0000002" / "tokenizer" / "tok.model").is_file()
    capsys.readouterr()  # the reshard tool's report
    code, result, err = _generate(capsys, "--load", str(out), "--prompt", "def main(", "--max-new-tokens", "4",
                                  "--json")
    assert code == 0, err
    code, original, err = _generate(capsys, "--load", str(tmp / "ckpt"), "--prompt", "def main(",
                                    "--max-new-tokens", "4", "--json")
    assert json.loads(result) == json.loads(original)
