"""--tokenizer-type HuggingFaceTokenizer: a local tokenizer.json read with the `tokenizers`
package (a small BPE trained here; nothing is downloaded), its BOS/EOS from the config files,
preprocessing with it, and training on the result."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from megalite.data.corpus import build_default_corpus  # noqa: E402
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megalite.train.pretrain import main, pretrain  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "def f(x):\n\treturn x  # ünïcödé → 🙂\n\n  spaces   and\ttabs"


def train_bpe(corpus: str, vocab_size: int):
    """A byte-level BPE (GPT-2 style) with special tokens <s> (id 0) and </s> (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok.train_from_iterator(texts, trainer)
    return tok


def save(folder, tok, tokenizer_config=None, **json_files):
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    files = dict(json_files)
    if tokenizer_config is not None:
        files["tokenizer_config"] = tokenizer_config
    for name, content in files.items():
        with open(os.path.join(folder, name + ".json"), "w") as f:
            json.dump(content, f)
    return str(folder)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    corpus = str(root / "corpus.jsonl")
    build_default_corpus(corpus, max_bytes=40_000)
    tok = train_bpe(corpus, 400)
    folder = save(root / "tok", tok, {"bos_token": "<s>", "add_bos_token": True,
                                      "eos_token": {"content": "</s>", "special": True}})
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return {"root": root, "corpus": corpus, "tok": tok, "folder": folder, "docs": docs}


def test_round_trip_ids_and_special_tokens(hf):
    assert "HuggingFaceTokenizer" in TOKENIZER_TYPES
    tok = build_tokenizer("HuggingFaceTokenizer", hf["folder"])
    raw = hf["tok"]
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 400
    assert (tok.bos, tok.eod, tok.eos_ids, tok.add_bos) == (0, 1, [1], True)
    ids = tok.tokenize(TEXT)
    assert ids == [0] + raw.encode(TEXT, add_special_tokens=False).ids  # BOS once, no EOS
    assert tok.tokenize(TEXT, add_bos=False) == ids[1:]
    assert tok.detokenize(ids[1:]) == TEXT
    assert tok.detokenize(ids).startswith("<s>")
    for doc in hf["docs"][:20]:
        assert tok.detokenize(tok.tokenize(doc, add_bos=False)) == doc
    # the path of tokenizer.json itself works the same; config rebuilds the same tokenizer
    direct = build_tokenizer("HuggingFaceTokenizer", os.path.join(hf["folder"], "tokenizer.json"))
    assert (direct.tokenize(TEXT), direct.eod, direct.bos) == (ids, 1, 0)
    again = build_tokenizer(**tok.config)
    assert again.tokenize(TEXT) == ids and again.add_bos
    no_bos = build_tokenizer("HuggingFaceTokenizer", hf["folder"], add_bos=False)
    assert no_bos.tokenize(TEXT) == ids[1:] and build_tokenizer(**no_bos.config).add_bos is False


def test_special_tokens_from_the_config_files(hf, tmp_path):
    from tokenizers import processors
    tok = hf["tok"]
    # generation_config.json with a list of EOS ids (instruct models): eod is the
    # tokenizer_config's eos_token, every id stops generation
    t = build_tokenizer("HuggingFaceTokenizer", save(
        tmp_path / "a", tok, {"eos_token": "</s>", "add_bos_token": False, "bos_token": "<s>"},
        generation_config={"bos_token_id": 0, "eos_token_id": [5, 1, 7]}))
    assert (t.bos, t.eod, t.eos_ids, t.add_bos) == (0, 1, [1, 5, 7], False)
    assert t.tokenize(TEXT)[0] != 0
    # no tokenizer_config.json: ids from config.json, the first EOS of a list is eod
    t = build_tokenizer("HuggingFaceTokenizer", save(
        tmp_path / "b", tok, config={"bos_token_id": 0, "eos_token_id": [1, 9]}))
    assert (t.bos, t.eod, t.eos_ids, t.add_bos) == (0, 1, [1, 9], False)
    # Llama 3 style: no add_bos_token, the post-processor puts BOS first
    tok_bos = tokenizers.Tokenizer.from_str(tok.to_str())
    tok_bos.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    t = build_tokenizer("HuggingFaceTokenizer", save(
        tmp_path / "c", tok_bos, {"bos_token": "<s>", "eos_token": "</s>"}))
    assert t.add_bos and t.tokenize(TEXT) == [0] + tok.encode(TEXT).ids  # BOS exactly once
    # nothing said: no BOS, no EOS; --append-eod is then refused clearly
    t = build_tokenizer("HuggingFaceTokenizer", save(tmp_path / "d", tok))
    assert (t.bos, t.eod, t.eos_ids, t.add_bos) == (None, None, [], False)
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="no end-of-document"):
        preprocess(str(tmp_path / "c.jsonl"), str(tmp_path / "x"), t, append_eod=True)


def test_errors_name_the_path_and_the_fix(hf, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist.*local folder"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer.json' does not exist"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs a tokenizer folder"):
        build_tokenizer("HuggingFaceTokenizer", None)
    bad = save(tmp_path / "bad", hf["tok"], {"bos_token": "<bos>"})
    with pytest.raises(ValueError, match=r"bos_token='<bos>' is not a token"):
        build_tokenizer("HuggingFaceTokenizer", bad)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer("HuggingFaceTokenizer", hf["folder"])


def test_preprocess_tool_and_training(hf, tmp_path, capsys):
    """tools/preprocess_data.py (2 worker processes, each rebuilding the tokenizer from its
    config) writes [BOS] + the tokenizer's ids + [EOS] per document; then pretrain on it."""
    prefix = str(tmp_path / "data")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", hf["corpus"],
         "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", hf["folder"], "--append-eod", "--workers", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = IndexedDataset(prefix)
    raw = tokenizers.Tokenizer.from_file(os.path.join(hf["folder"], "tokenizer.json"))
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    expected = [[bos] + raw.encode(doc, add_special_tokens=False).ids + [eos] for doc in hf["docs"]]
    assert len(ds) == len(expected)
    assert all(ds[i].tolist() == ids for i, ids in enumerate(expected))
    assert ds.dtype == np.uint16

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "3e-3", "--log-interval", "100", "--data-path", prefix,
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf["folder"],
            "--train-iters", "12", "--eval-interval", "1000", "--save", str(tmp_path / "out")]
    log = pretrain(argv)
    losses = [r["loss"] for r in log]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < losses[0] - 0.25, losses
    out = capsys.readouterr().out
    assert "vocab 400 (padded 512)" in out  # the model's vocabulary is padded, as for any tokenizer
    saved = json.load(open(tmp_path / "out" / "iter_0000012" / "metadata.json"))
    assert saved["config"]["model"]["vocab_size"] == 400
    assert saved["config"]["data"]["tokenizer_type"] == "HuggingFaceTokenizer"

    # data made with a bigger vocabulary than the model's tokenizer: refused, naming both
    small = save(tmp_path / "small", train_bpe(hf["corpus"], 300), {"eos_token": "</s>"})
    assert int(ds.tokens.max()) >= 300
    assert main(argv[:-2] + ["--tokenizer-model", small]) == 2
    err = capsys.readouterr().err
    assert f"contains token id {int(ds.tokens.max())}, but the vocabulary size is 300" in err
    # --tokenizer-model missing: the message says what HuggingFaceTokenizer needs
    assert main(["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer"]) == 2
    assert "a local folder holding tokenizer.json" in capsys.readouterr().err


def test_generate_from_a_text_prompt(hf, tmp_path, capsys):
    """tools/generate.py with this tokenizer: the prompt is encoded (BOS first, as the config
    says), the ids continue greedily, and the text is the detokenized ids; a model whose
    vocabulary is smaller than the tokenizer's is refused."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import generate as generate_tool

    from megalite.checkpoint import save_weights_checkpoint
    from megalite.config import ModelConfig
    from megalite.data.tokenizer import build_tokenizer
    from megalite.model.gpt import GPTModel

    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf["folder"])
    for vocab, code in ((512, 0), (300, 2)):
        model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab,
                                     seq_length=64, position_embedding_type="rope", normalization="RMSNorm",
                                     swiglu=True, hidden_dropout=0.0, attention_dropout=0.0))
        model.init_weights(1)
        save_weights_checkpoint(str(tmp_path / f"v{vocab}"), model)
        argv = ["--load", str(tmp_path / f"v{vocab}"), "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", hf["folder"], "--prompt", "def f(x):", "--max-new-tokens", "8", "--json"]
        assert generate_tool.main(argv) == code
        captured = capsys.readouterr()
        if code:
            assert "the tokenizer has 400 ids but the model only 300" in captured.err
            continue
        out = json.loads(captured.out)
        assert len(out["ids"]) <= 8 and out["text"] == tokenizer.detokenize(out["ids"])
        prompt = tokenizer.tokenize("def f(x):")
        assert prompt[0] == tokenizer.bos  # BOS first, as add_bos_token says
        from megalite.model.generation import generate
        model.eval()
        assert out["ids"] == generate(model, prompt, 8, eos_ids=tuple(tokenizer.eos_ids))
