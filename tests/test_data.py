"""Tests for the data pipeline: corpus, tokenizer, indexed dataset, samples, batches."""
import json
import os
import struct

import numpy as np
import pytest
import torch

from megalite.data.builder import build_data_iterators
from megalite.data.corpus import build_default_corpus
from megalite.data.gpt_dataset import GPTDataset, MockGPTDataset, parse_split, split_documents
from megalite.data.indexed_dataset import (DatasetError, IndexedDataset, IndexedDatasetBuilder,
                                           best_dtype)
from megalite.data.preprocess import preprocess
from megalite.data.sampler import PretrainingSampler
from megalite.data.tokenizer import build_tokenizer
from megalite.data.tokenizer_training import train_sentencepiece

CORPUS_BYTES = 120_000


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A small corpus, a tokenizer trained on it and its preprocessed dataset."""
    root = tmp_path_factory.mktemp("pipeline")
    corpus = str(root / "corpus.jsonl")
    build_default_corpus(corpus, max_bytes=CORPUS_BYTES)
    model = train_sentencepiece(corpus, str(root / "tok" / "tok"), vocab_size=512)
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    prefix = str(root / "ds")
    summary = preprocess(corpus, prefix, tokenizer, append_eod=True)
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return {"root": root, "corpus": corpus, "model": model, "tokenizer": tokenizer,
            "prefix": prefix, "summary": summary, "docs": docs}


def write_dataset(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()
    return IndexedDataset(str(prefix))


# ----------------------------------------------------------------------------- corpus

def test_corpus_is_deterministic_jsonl(tmp_path, pipeline):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    stats = build_default_corpus(str(first), max_bytes=CORPUS_BYTES)
    build_default_corpus(str(second), max_bytes=CORPUS_BYTES)
    data = first.read_bytes()
    assert data == second.read_bytes() == open(pipeline["corpus"], "rb").read()
    assert stats["bytes"] == len(data) <= CORPUS_BYTES and stats["truncated"]
    lines = data.decode("utf-8").splitlines()
    assert len(lines) == stats["documents"] > 10
    assert all(set(json.loads(line)) == {"text"} for line in lines)
    assert not list(tmp_path.glob("*.tmp*"))


def test_corpus_rejects_bad_max_bytes(tmp_path):
    with pytest.raises(ValueError, match="max_bytes=0"):
        build_default_corpus(str(tmp_path / "c.jsonl"), max_bytes=0)


# -------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip(pipeline):
    tok = pipeline["tokenizer"]
    assert tok.vocab_size <= 512 and tok.eod == 2
    for doc in pipeline["docs"][:20]:
        assert tok.detokenize(tok.tokenize(doc)) == doc
    text = "def f(x):\n\treturn x  # ünïcödé → 🙂\n\n"
    assert tok.detokenize(tok.tokenize(text)) == text
    gpt = build_tokenizer("GPTSentencePieceTokenizer", pipeline["model"])
    assert gpt.tokenize(text) == tok.tokenize(text) and gpt.eod == tok.eod


def test_tokenizer_training_is_deterministic(pipeline, tmp_path):
    again = build_tokenizer("SentencePieceTokenizer",
                            train_sentencepiece(pipeline["corpus"], str(tmp_path / "t"), 512))
    text = "\n".join(pipeline["docs"][:5])
    assert again.vocab_size == pipeline["tokenizer"].vocab_size
    assert again.tokenize(text) == pipeline["tokenizer"].tokenize(text)


def test_tokenizer_errors_and_null_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="Unknown tokenizer type 'BPE'"):
        build_tokenizer("BPE")
    with pytest.raises(ValueError, match="vocab_size=None"):
        build_tokenizer("NullTokenizer")
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert null.eod == 99 and null.tokenize("3 1\n4") == [3, 1, 4]
    assert null.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="outside"):
        null.tokenize("100")


# -------------------------------------------------------------- preprocess + indexed data

def test_preprocess_round_trip(pipeline):
    tok, ds = pipeline["tokenizer"], IndexedDataset(pipeline["prefix"])
    assert len(ds) == len(pipeline["docs"]) == pipeline["summary"]["documents"]
    expected = [tok.tokenize(doc) + [tok.eod] for doc in pipeline["docs"]]
    assert ds.sizes.tolist() == [len(ids) for ids in expected]
    assert ds.num_tokens == sum(map(len, expected)) == pipeline["summary"]["tokens"]
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert ds.dtype == np.uint16
    assert ds.get(3, offset=2, length=4).tolist() == expected[3][2:6]


def test_preprocess_with_workers_is_identical(pipeline, tmp_path):
    prefix = str(tmp_path / "w2")
    preprocess(pipeline["corpus"], prefix, pipeline["tokenizer"], workers=2)
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as a, open(pipeline["prefix"] + ext, "rb") as b:
            assert a.read() == b.read()


def test_preprocess_text_paragraphs(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("1 2 3\n4\n\n\n5 6\n   \n7\n", encoding="utf-8")
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    preprocess(str(path), str(tmp_path / "t"), null, append_eod=True)
    ds = IndexedDataset(str(tmp_path / "t"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 4, 9], [5, 6, 9], [7, 9]]


def test_preprocess_tool_creates_its_output_folder(tmp_path, capsys):
    """tools/preprocess_data.py creates the folder of --output-prefix, parents too, as
    pretrain_gpt.py creates --save, and writes there what the library writes; a path under a
    file is refused in one line naming the flag, before any work."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import preprocess_data

    path = tmp_path / "c.txt"
    path.write_text("1 2 3\n\n4 5\n", encoding="utf-8")
    flags = ["--input", str(path), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod"]
    prefix = tmp_path / "not" / "yet" / "there" / "c"
    preprocess_data.main(flags + ["--output-prefix", str(prefix)])
    ds = IndexedDataset(str(prefix))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 9], [4, 5, 9]]
    with pytest.raises(SystemExit) as exit_:
        preprocess_data.main(flags + ["--output-prefix", str(path / "under_a_file" / "c")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"--output-prefix {path / 'under_a_file' / 'c'}: cannot create the folder" in err


def test_builder_dtypes_and_ranges(tmp_path):
    assert best_dtype(65536) == np.uint16 and best_dtype(65537) == np.int32
    ds = write_dataset(tmp_path / "big", [[70000, 0], [], [5]], dtype=np.int32)
    assert [ds[i].tolist() for i in range(3)] == [[70000, 0], [], [5]]
    with IndexedDatasetBuilder(str(tmp_path / "bad"), np.uint16) as builder:
        with pytest.raises(ValueError, match="best_dtype"):
            builder.add_document([1, 70000])
    assert not list(tmp_path.glob("bad*"))  # temp files removed without finalize()


def _corrupt(prefix, case):
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if case == "missing bin":
        os.remove(bin_)
    elif case == "wrong magic":
        with open(idx, "r+b") as f:
            f.write(b"NOTMAGIC")
    elif case == "unknown version":
        with open(idx, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<Q", 99))
    elif case == "truncated header":
        os.truncate(idx, 20)
    elif case == "truncated idx":
        os.truncate(idx, os.path.getsize(idx) - 8)
    elif case == "bin size mismatch":
        os.truncate(bin_, os.path.getsize(bin_) - 2)


@pytest.mark.parametrize("case, words", [
    ("missing bin", ["does not exist", ".bin"]),
    ("wrong magic", ["magic", "NOTMAGIC"]),
    ("unknown version", ["version 1", "found 99"]),
    ("truncated header", ["40-byte header", "truncated"]),
    ("truncated idx", ["truncated", "expected"]),
    ("bin size mismatch", ["bytes", "expects"]),
])
def test_corrupt_files_raise_helpful_errors(tmp_path, case, words):
    prefix = str(tmp_path / "ds")
    write_dataset(prefix, [[1, 2, 3], [4, 5]])
    _corrupt(prefix, case)
    with pytest.raises(DatasetError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert prefix in message and "preprocess_data.py" in message
    for word in words:
        assert word in message
    if case == "missing bin":
        assert isinstance(info.value, FileNotFoundError)


# ------------------------------------------------------------------------ GPT samples

DOC_SIZES = [5, 1, 7, 3, 0, 9, 4, 2]


@pytest.fixture
def small_ds(tmp_path):
    docs = [[100 * d + t for t in range(n)] for d, n in enumerate(DOC_SIZES)]
    return write_dataset(tmp_path / "small", docs, dtype=np.int32), docs


def _naive_samples(docs, doc_order, sample_order, seq):
    stream = [token for d in doc_order for token in docs[d]]
    return [stream[j * seq: j * seq + seq + 1] for j in sample_order]


def test_gpt_dataset_unshuffled_matches_naive_stream(small_ds):
    ds, docs = small_ds
    doc_range, seq, n = range(1, 7), 4, 12
    gpt = GPTDataset(ds, doc_range, seq, n, seed=0, shuffle=False)
    order = list(doc_range) * gpt.num_epochs
    expected = _naive_samples(docs, order, range(n), seq)
    assert [gpt[i].tolist() for i in range(n)] == expected
    assert all(gpt[i].dtype == np.int64 and len(gpt[i]) == seq + 1 for i in range(n))


def test_gpt_dataset_shuffled_windows_and_determinism(small_ds):
    ds, docs = small_ds
    doc_range, seq, n = range(0, 8), 3, 30
    gpt = GPTDataset(ds, doc_range, seq, n, seed=7)
    per_epoch = np.split(gpt.doc_order, gpt.num_epochs)
    assert gpt.num_epochs > 1 and all(sorted(e) == list(doc_range) for e in per_epoch)
    assert sorted(gpt.sample_order) == list(range(n))
    expected = _naive_samples(docs, gpt.doc_order, gpt.sample_order, seq)
    samples = [gpt[i].tolist() for i in range(n)]
    assert samples == expected
    for j in range(n - 1):  # consecutive windows share one token
        assert gpt.window(j)[-1] == gpt.window(j + 1)[0]
    assert samples == [GPTDataset(ds, doc_range, seq, n, seed=7)[i].tolist() for i in range(n)]
    other = [GPTDataset(ds, doc_range, seq, n, seed=8)[i].tolist() for i in range(n)]
    assert other != samples


def test_gpt_dataset_errors(small_ds):
    ds, _ = small_ds
    with pytest.raises(ValueError, match="empty document range"):
        GPTDataset(ds, range(3, 3), 4, 1, seed=0)
    with pytest.raises(ValueError, match="fewer than one sample"):
        GPTDataset(ds, range(3, 5), 4, 1, seed=0)  # 3 + 0 tokens < 5
    with pytest.raises(ValueError, match="seed=-1"):
        GPTDataset(ds, range(0, 8), 4, 1, seed=-1)


def test_split_documents():
    assert [len(r) for r in split_documents(100, "969,30,1")] == [97, 3, 0]
    assert split_documents(10, "90,10") == [range(0, 9), range(9, 10), range(10, 10)]
    assert [len(r) for r in split_documents(10, "1/1/1")] == [3, 4, 3]
    for n in (0, 1, 7, 1000):
        ranges = split_documents(n, "5,3,2")
        assert ranges[0].start == 0 and ranges[2].stop == n
        assert ranges[0].stop == ranges[1].start and ranges[1].stop == ranges[2].start
    assert parse_split("3,1") == [0.75, 0.25, 0.0]
    for bad, msg in [("a,b", "not a list of numbers"), ("0,0,0", "sums to zero"),
                     ("1,2,3,4", "at most 3"), ("1,-1", "negative"), ("", "not a list")]:
        with pytest.raises(ValueError, match=msg):
            split_documents(10, bad)


# ------------------------------------------------------------------------ sampler

def _global_batches(global_batch, mbs, dp, total, consumed=0):
    """Sets of sample indices per global batch, gathered over all dp ranks."""
    accumulation = global_batch // (mbs * dp)
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    steps = len(per_rank[0])
    return [sorted(i for r in range(dp) for k in range(g, g + accumulation)
                   for i in per_rank[r][k]) for g in range(0, steps, accumulation)]


def test_sampler_global_batch_independent_of_dp():
    reference = _global_batches(8, 2, 1, total=64)
    assert reference[0] == list(range(8)) and len(reference) == 8
    for dp in (2, 4):
        assert _global_batches(8, 2, dp, total=64) == reference
    assert _global_batches(8, 2, 2, total=64, consumed=24) == reference[3:]


def test_sampler_resume_and_errors():
    full = list(PretrainingSampler(40, 0, 2, 1, 2))
    assert full[0] == [2, 3] and full[1] == [6, 7] and len(full) == 10
    assert list(PretrainingSampler(40, 12, 2, 1, 2)) == full[3:]
    with pytest.raises(ValueError, match="data_parallel_rank=2 must be < data_parallel_size=2"):
        PretrainingSampler(40, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples=40"):
        PretrainingSampler(40, 40, 2, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        PretrainingSampler(40, 0, 0, 0, 1)


# --------------------------------------------------------------- mock data + iterators

def test_mock_dataset_is_deterministic():
    a, b = MockGPTDataset(50, 16, 10, seed=3), MockGPTDataset(50, 16, 10, seed=3)
    assert np.array_equal(a[7], b[7]) and not np.array_equal(a[7], a[6])
    assert not np.array_equal(a[7], MockGPTDataset(50, 16, 10, seed=4)[7])
    assert a[2].dtype == np.int64 and a[2].shape == (17,)
    assert 0 <= min(a[i].min() for i in range(10)) and max(a[i].max() for i in range(10)) < 50


def _check_batch(batch, mbs, seq):
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key, dtype in [("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)]:
        assert batch[key].shape == (mbs, seq) and batch[key].dtype == dtype
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"], torch.arange(seq).expand(mbs, seq))
    assert bool((batch["loss_mask"] == 1).all())


def test_build_data_iterators_mock():
    kwargs = dict(data_prefix=None, mock=True, split="969,30,1", vocab_size=64, seq_length=8,
                  seed=1, micro_batch_size=2, dp_rank=0, dp_size=2, train_samples=20,
                  valid_samples=8, test_samples=0)
    train, valid, test = build_data_iterators(**kwargs)
    assert test is None
    batches = list(train)
    assert len(batches) == 5
    for batch in batches:
        _check_batch(batch, 2, 8)
    resumed, _, _ = build_data_iterators(**kwargs, consumed_train_samples=8)
    assert torch.equal(next(resumed)["tokens"], batches[2]["tokens"])
    first, second = next(valid), next(valid)  # valid cycles through its 2 micro-batches
    assert torch.equal(next(valid)["tokens"], first["tokens"])
    assert not torch.equal(first["tokens"], second["tokens"])
    assert not torch.equal(first["tokens"], batches[0]["tokens"])
    with pytest.raises(ValueError, match="valid_samples=3"):
        build_data_iterators(**{**kwargs, "valid_samples": 3})


def test_build_data_iterators_real_data(pipeline):
    kwargs = dict(data_prefix=pipeline["prefix"], mock=False, split="90,10,0",
                  vocab_size=pipeline["tokenizer"].vocab_size, seq_length=32, seed=5,
                  micro_batch_size=4, dp_rank=1, dp_size=2, train_samples=64,
                  valid_samples=16, test_samples=16, eod_token=pipeline["tokenizer"].eod)
    train, valid, test = build_data_iterators(**kwargs)
    assert test is None  # the test split has no documents
    _check_batch(next(train), 4, 32)
    _check_batch(next(valid), 4, 32)
    with pytest.raises(ValueError, match=r"token id \d+, but the vocabulary size is 100"):
        build_data_iterators(**{**kwargs, "vocab_size": 100, "eod_token": None})


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_data_path_with_an_extension_suggests_the_prefix(tmp_path, ext):
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document(np.arange(10))
        builder.finalize()
    with pytest.raises(DatasetError, match=f"without the extension. Fix: --data-path {prefix}$"):
        IndexedDataset(prefix + ext)
    with pytest.raises(DatasetError, match="Check --data-path, or create the dataset"):  # no extension: as before
        IndexedDataset(prefix + "-other")
