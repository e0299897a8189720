"""Blended datasets (``--data-path 0.7 A 0.3 B``): proportions, order under any DP, resume,
the cached blend index, pretrain end to end, and bad input."""
import multiprocessing
import os

import numpy as np
import pytest
import torch

from megalite.data.blended import BlendedDataset, blend_index, describe_data, parse_data_path
from megalite.data.builder import build_data_iterators, build_datasets
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.train.pretrain import main, pretrain
from megalite.testing import WorldError, run_world

SEQ = 16
A_IDS, B_IDS = (0, 100), (100, 200)  # disjoint id ranges: a sample's tokens name its dataset


def write(prefix, num_docs, ids, seed, lengths=(5, 60)):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for _ in range(num_docs):
            builder.add_document(rng.integers(*ids, size=int(rng.integers(*lengths))))
        builder.finalize()
    return str(prefix)


@pytest.fixture
def two(tmp_path):
    return write(tmp_path / "a", 200, A_IDS, 1), write(tmp_path / "b", 100, B_IDS, 2)


def source(sample) -> int:
    """0 if every token of the sample is one of A's ids, 1 if one of B's (else fail)."""
    sample = np.asarray(sample)
    if sample.max() < A_IDS[1]:
        return 0
    assert sample.min() >= B_IDS[0], "a sample mixes the two datasets"
    return 1


def datasets(data_path, train=10_000, valid=0, test=0, split="90,10,0", seed=3):
    return build_datasets(data_prefix=data_path, mock=False, split=split, vocab_size=256,
                          seq_length=SEQ, seed=seed, num_samples=[train, valid, test])


def global_samples(data_path, dp_size, micro, n, consumed=0):
    """Token content of the global samples consumed .. n, reassembled from all DP ranks."""
    iters = [build_data_iterators(data_prefix=data_path, mock=False, split="90,10,0",
                                  vocab_size=256, seq_length=SEQ, seed=3, micro_batch_size=micro,
                                  dp_rank=r, dp_size=dp_size, train_samples=n, valid_samples=0,
                                  test_samples=0, consumed_train_samples=consumed)[0]
             for r in range(dp_size)]
    rows = []
    for batches in zip(*iters):
        for batch in batches:  # rank r holds block r of each micro-batch step
            rows.append(torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1))
    return torch.cat(rows).numpy()


def test_proportions_follow_the_weights(two):
    a, b = two
    train, _, _ = datasets(["0.7", a, "0.3", b])
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    origin = np.array([source(train[i]) for i in range(len(train))])
    assert np.array_equal(origin, train.index[:, 0])  # the index agrees with the content
    fraction_a = float((origin == 0).mean())
    assert abs(fraction_a - 0.7) < 0.01, fraction_a
    assert abs(fraction_a - 0.7) <= 1 / 10_000 + 1e-12  # greedy: within one sample
    # every prefix of the blend is within one sample of its share
    taken_a = np.cumsum(origin == 0)
    n = np.arange(1, len(origin) + 1)
    assert np.abs(taken_a - 0.7 * n).max() <= 1.0
    # each dataset's samples are used once each, in order
    for d in (0, 1):
        assert np.array_equal(train.index[origin == d, 1], np.arange((origin == d).sum()))
        assert len(train.datasets[d]) >= (origin == d).sum()


def test_three_way_blend_and_weights_are_normalized(two, tmp_path):
    a, b = two
    c = write(tmp_path / "c", 50, A_IDS, 3)
    first = datasets(["0.7", a, "0.3", b], train=2000)[0]
    scaled = datasets(["7", a, "3", b], train=2000)[0]
    assert scaled.weights == pytest.approx([0.7, 0.3])
    assert np.array_equal(first.index, scaled.index)
    assert first.cache_path == scaled.cache_path and scaled.cache_status == "loaded"
    three = datasets(["2", a, "1", b, "1", c], train=4000)[0]
    assert np.bincount(three.index[:, 0]).tolist() == [2000, 1000, 1000]
    assert parse_data_path(["1", "x", "3", "y"]) == (["x", "y"], [0.25, 0.75])
    assert parse_data_path("x") == parse_data_path(["x"]) == (["x"], [1.0])


def test_greedy_order_matches_the_rule():
    """The first samples by hand: pick the largest w_d * max(n, 1) - taken_d (lowest d on ties)."""
    assert blend_index([0.7, 0.3], 6)[:, 0].tolist() == [0, 1, 0, 0, 1, 0]
    assert blend_index([0.5, 0.5], 4)[:, 0].tolist() == [0, 1, 0, 1]


def test_same_global_samples_under_any_dp_and_on_resume(two):
    a, b = two
    blend = ["0.7", a, "0.3", b]
    dp1 = global_samples(blend, 1, 4, 400)
    dp2 = global_samples(blend, 2, 2, 400)
    dp4 = global_samples(blend, 4, 1, 400)
    assert dp1.shape == (400, SEQ + 1)
    assert np.array_equal(dp1, dp2) and np.array_equal(dp1, dp4)
    train = datasets(blend, train=400)[0]
    assert np.array_equal(dp1, np.stack([train[i] for i in range(400)]))
    resumed = global_samples(blend, 2, 2, 400, consumed=120)
    assert np.array_equal(resumed, dp1[120:])
    assert abs(np.mean([source(s) == 0 for s in dp1]) - 0.7) < 0.01


def test_per_dataset_split_and_sample_counts(two):
    a, b = two
    train, valid, test = datasets(["0.7", a, "0.3", b], train=1000, valid=200, split="80,20,0")
    assert test is None
    for blend, docs in ((train, [range(0, 160), range(0, 80)]),
                        (valid, [range(160, 200), range(80, 100)])):
        assert [ds.doc_range for ds in blend.datasets] == docs
        for w, ds in zip(blend.weights, blend.datasets):  # ceil(w * n * 1.005)
            assert len(ds) == int(np.ceil(w * len(blend) * 1.005))
    assert {source(valid[i]) for i in range(len(valid))} == {0, 1}
    # a valid split without documents in one dataset blends the other one alone
    small = write(os.path.join(os.path.dirname(a), "small"), 4, B_IDS, 5, lengths=(40, 50))
    train, valid, _ = datasets(["0.5", a, "0.5", small], train=100, valid=20, split="80,20,0")
    assert valid.names == [a, small] and valid.weights == [0.5, 0.5]
    _, valid, _ = datasets(["0.5", a, "0.5", small], train=100, valid=20, split="90,10,0")
    assert valid.names == [a] and valid.weights == [1.0]
    with pytest.raises(ValueError, match=r"small has no training documents with --split 1,9 "
                                         r"\(4 documents in all\)"):
        datasets(["0.5", a, "0.5", small], train=100, split="1,9")


def test_blend_index_cache_reused_and_rebuilt(two):
    a, b = two
    first = datasets(["0.7", a, "0.3", b], train=3000)[0]
    path = first.cache_path
    assert first.cache_status == "built" and os.path.isfile(path)
    assert os.path.basename(path).startswith("a.blend-") and path.endswith(".npy")
    assert os.path.dirname(path) == os.path.dirname(a)
    loaded = np.load(path, allow_pickle=False)
    assert loaded.shape == (3000, 2) and np.array_equal(loaded, first.index)
    os.utime(path, ns=(1, 1))  # a rebuild would give the file a new mtime
    again = datasets(["0.7", a, "0.3", b], train=3000)[0]
    assert again.cache_status == "loaded" and again.cache_path == path
    assert os.stat(path).st_mtime_ns == 1
    assert np.array_equal(again.index, first.index)
    # a different weight, sample count, seq length or seed: another file
    other = datasets(["0.6", a, "0.4", b], train=3000)[0]
    assert other.cache_status == "built" and other.cache_path != path
    assert abs(np.mean(other.index[:, 0] == 0) - 0.6) < 0.01
    assert datasets(["0.7", a, "0.3", b], train=3001)[0].cache_path != path
    assert datasets(["0.7", a, "0.3", b], train=3000, seed=4)[0].cache_path != path
    # a rewritten dataset (new .idx size/mtime): another file
    write(b, 101, B_IDS, 2)
    assert datasets(["0.7", a, "0.3", b], train=3000)[0].cache_status == "built"
    # a damaged cache file is rebuilt in place
    current = datasets(["0.7", a, "0.3", b], train=3000)[0]
    with open(current.cache_path, "wb") as f:
        f.write(b"garbage")
    fixed = datasets(["0.7", a, "0.3", b], train=3000)[0]
    assert fixed.cache_status == "built" and fixed.cache_path == current.cache_path
    assert np.array_equal(np.load(fixed.cache_path, allow_pickle=False),
                          blend_index([0.7, 0.3], 3000))
    assert not [f for f in os.listdir(os.path.dirname(a)) if ".tmp" in f]


def test_unwritable_cache_folder_keeps_the_index_in_memory(two, monkeypatch):
    a, b = two

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", dst)
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.warns(UserWarning, match="could not cache the blend index.*Make the folder writable"):
        train = datasets(["0.7", a, "0.3", b], train=500)[0]
    assert train.cache_status == "memory" and np.array_equal(train.index, blend_index([0.7, 0.3], 500))
    assert not [f for f in os.listdir(os.path.dirname(a)) if ".blend-" in f]


def _build_in_process(paths, queue):
    train = build_datasets(data_prefix=paths, mock=False, split="90,10,0", vocab_size=256,
                           seq_length=SEQ, seed=3, num_samples=[200_000, 0, 0])[0]
    queue.put((train.cache_status, train.cache_path))


@pytest.mark.slow
def test_concurrent_builders_leave_one_whole_file(two):
    """Ranks building the same index at once (as under torchrun) each write a private tmp
    file and rename it into place: the result is one whole, correct file, no leftovers. The
    builders are forked (the parent's imports shared, as megalite.testing.run_world does): they
    start at once, a closer race than spawned ones, which spent seconds each importing torch."""
    a, b = two
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(["0.7", a, "0.3", b], queue))
             for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({path for _, path in results}) == 1
    path = results[0][1]
    assert np.array_equal(np.load(path, allow_pickle=False), blend_index([0.7, 0.3], 200_000))
    assert not [f for f in os.listdir(os.path.dirname(a)) if ".tmp" in f]
    assert datasets(["0.7", a, "0.3", b], train=200_000)[0].cache_status == "loaded"


def test_describe_data_lines(two):
    a, b = two
    train = datasets(["0.7", a, "0.3", b], train=1000)[0]
    lines = describe_data(train)
    assert lines[0].startswith("data: blend of 2 datasets, 1,000 training samples")
    assert a in lines[1] and "weight 0.7000" in lines[1] and "200 documents" in lines[1]
    assert b in lines[2] and "weight 0.3000" in lines[2] and "100 documents" in lines[2]
    ds = train.datasets[0]
    epochs = train.counts[0] * SEQ / ds.tokens_per_epoch
    assert f"{int(train.counts[0]):,} samples = {epochs:.3f} epochs" in lines[1]
    single = datasets(a, train=100)[0]
    assert describe_data(single)[0] == "data: 100 training samples"
    assert describe_data(None) == []


@pytest.mark.parametrize("values,fragments", [
    (["0.7", "A", "0.3"], ["3 values", "pairs of WEIGHT PREFIX", "give every prefix a weight"]),
    (["A", "B"], ["value 1 is 'A'", "needs a weight", "put a number before each prefix"]),
    (["0.7", "A", "0", "B"], ["weight '0' of 'B'", "positive", "weight > 0"]),
    (["0.7", "A", "-1", "B"], ["weight '-1' of 'B'", "positive"]),
    (["nan", "A", "1", "B"], ["weight 'nan' of 'A'", "positive"]),
    ([], ["--data-path got []"]),
])
def test_bad_data_path_values(values, fragments):
    with pytest.raises(ValueError) as info:
        parse_data_path(values)
    for fragment in fragments:
        assert fragment in str(info.value)


SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--log-interval", "100", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--split", "90,10,0", "--eval-interval", "1000",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("values,fragment", [
    (["0.7", "{a}", "0.3"], "3 values"),
    (["0.7", "{a}", "-0.3", "{b}"], "weight '-0.3'"),
    (["0.7", "{a}", "0.3", "{missing}"], "missing.idx"),
])
def test_pretrain_refuses_bad_blends(two, tmp_path, values, fragment, capsys):
    a, b = two
    values = [v.format(a=a, b=b, missing=tmp_path / "missing") for v in values]
    assert main(SMALL + ["--train-iters", "2", "--data-path", *values]) == 2
    err = capsys.readouterr().err
    assert fragment in err, err


def _pretrain_losses(rank, world, argv):
    return [r["loss"] for r in pretrain(argv)]


@pytest.mark.slow
def test_pretrain_on_a_blend_dp2_matches_dp1_and_resumes(two, tmp_path, capsys):
    a, b = two
    argv = SMALL + ["--data-path", "0.7", a, "0.3", b, "--train-iters", "6"]
    full = [r["loss"] for r in pretrain(argv)]
    out = capsys.readouterr().out
    assert "data: blend of 2 datasets, 48 training samples" in out and "weight 0.7000" in out
    assert all(np.isfinite(full))
    for name in os.listdir(tmp_path):  # both DP ranks build the index at once
        if ".blend-" in name:
            os.remove(tmp_path / name)
    dp2 = run_world(_pretrain_losses, 2, argv)[0]
    assert np.allclose(dp2, full, rtol=1e-5, atol=0)
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    with pytest.raises(WorldError, match="died"):
        run_world(_pretrain_losses, 1, argv + ckpt + ["--inject-fault", "kill@5"])
    resumed = pretrain(argv + ["--load", str(tmp_path / "ckpt")])
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert np.allclose([r["loss"] for r in resumed], full[3:], rtol=1e-6, atol=0)
