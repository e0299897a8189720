"""Packed documents on the data side: position ids that restart after EOD, document bounds
(doc_start/doc_end) for attention that stops at documents, --eod-mask-loss, mock documents,
and the errors when there is no EOD token to find documents with.

The bounds are checked against values written by hand and, on mock documents, against
:func:`documents_of` (a plain loop over the EOD positions, apart from data.packing); pretrain
with the three flags against the same weights run document by document."""
import numpy as np
import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, validate
from megalite.data.builder import build_data_iterators, collate
from megalite.data.gpt_dataset import GPTDataset, MockGPTDataset
from megalite.data.indexed_dataset import DatasetError, IndexedDataset, IndexedDatasetBuilder
from megalite.data.packing import Packing, document_bounds

E = 9  # the EOD id of the hand-made rows
ALL = Packing(True, True, True, E)


def documents_of(row, eod) -> list[tuple[int, int]]:
    """(start, end) of each document of a window, by the EOD rule: an EOD closes the document
    it ends (it belongs to it); what follows it starts the next one."""
    spans, start = [], 0
    for i, token in enumerate(row):
        if token == eod:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(row):
        spans.append((start, len(row)))
    return spans


def bounds_by_documents(row, eod) -> tuple[list[int], list[int]]:
    """doc_start and doc_end of every position of a window, from :func:`documents_of`."""
    starts, ends = [], []
    for start, end in documents_of(row, eod):
        starts += [start] * (end - start)
        ends += [end] * (end - start)
    return starts, ends

# (row, doc_start, doc_end): EOD at the start, at the end, twice in a row, nowhere, and a
# window that starts inside a document (its first partial document starts at 0)
CASES = [
    ([E, 1, 2, E, 3, 4], [0, 1, 1, 1, 4, 4], [1, 4, 4, 4, 6, 6]),
    ([1, 2, 3, E], [0, 0, 0, 0], [4, 4, 4, 4]),
    ([1, E, E, 2], [0, 0, 2, 3], [2, 2, 3, 4]),
    ([1, 2, 3, 4], [0, 0, 0, 0], [4, 4, 4, 4]),
    ([5, 6, E, 7, 8, E, E], [0, 0, 0, 3, 3, 3, 6], [3, 3, 3, 6, 6, 6, 7]),
]


@pytest.mark.parametrize("row,start,end", CASES)
def test_document_bounds_and_positions_on_hand_made_rows(row, start, end):
    doc_start, doc_end = document_bounds(np.array([row]), E)
    assert doc_start[0].tolist() == start and doc_end[0].tolist() == end
    # a sample is the row plus one more token (the last label)
    batch = collate([np.array(row + [3])], ALL)
    assert batch["doc_start"].dtype == torch.int32 and batch["doc_end"].dtype == torch.int32
    assert batch["doc_start"][0].tolist() == start and batch["doc_end"][0].tolist() == end
    assert batch["position_ids"].dtype == torch.int64
    assert batch["position_ids"][0].tolist() == [i - s for i, s in enumerate(start)]
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"][0].tolist() == [0.0 if t == E else 1.0 for t in row]
    assert batch["labels"][0].tolist() == row[1:] + [3]


def test_each_flag_alone_and_none():
    sample = np.array([1, E, 2, 3, E, 4, 5])
    plain = collate([sample])
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert plain["position_ids"][0].tolist() == list(range(6))
    assert plain["loss_mask"].sum().item() == 6
    positions = collate([sample], Packing(reset_position_ids=True, eod_token=E))
    assert set(positions) == set(plain)  # no document bounds without --reset-attention-mask
    assert positions["position_ids"][0].tolist() == [0, 1, 0, 1, 2, 0]
    assert positions["loss_mask"].sum().item() == 6
    masks = collate([sample], Packing(reset_attention_mask=True, eod_token=E))
    assert masks["position_ids"][0].tolist() == list(range(6))
    assert masks["doc_start"][0].tolist() == [0, 0, 2, 2, 2, 5]
    assert masks["doc_end"][0].tolist() == [2, 2, 5, 5, 5, 6]
    loss = collate([sample], Packing(eod_mask_loss=True, eod_token=E))
    assert set(loss) == set(plain)
    assert loss["loss_mask"][0].tolist() == [1, 0, 1, 1, 0, 1]  # 0 exactly where the input is EOD


def test_sft_samples_carry_the_mask_of_their_labels():
    """A sample with a token mask (SFT) trains on the labels whose mask is 1; in a blend with
    plain data a sample without one trains on every label."""
    sft = {"tokens": np.array([1, 2, 3, 4, E, 5]), "token_mask": np.array([0, 0, 1, 1, 1, 0], np.uint8)}
    batch = collate([sft, np.array([1, 2, E, 3, 4, 5])], Packing(eod_mask_loss=True, eod_token=E))
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]]


def _indexed(tmp_path, docs, name="docs"):
    prefix = str(tmp_path / name)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in docs:
            builder.add_document(np.array(doc))
        builder.finalize()
    return IndexedDataset(prefix)


def test_windows_of_a_dataset_cut_documents(tmp_path):
    """Window 1 starts inside document 1 (at its 5): that partial document starts at 0."""
    docs = [[1, 2, 3, E], [4, 5, 6, 7, 8, E], [1, E]]
    ds = GPTDataset(_indexed(tmp_path, docs), range(3), seq_length=5, num_samples=2, seed=0,
                    shuffle=False)
    batch = collate([ds[0], ds[1]], ALL)
    assert batch["tokens"].tolist() == [[1, 2, 3, E, 4], [5, 6, 7, 8, E]]
    assert batch["labels"].tolist() == [[2, 3, E, 4, 5], [6, 7, 8, E, 1]]
    assert batch["doc_start"].tolist() == [[0, 0, 0, 0, 4], [0, 0, 0, 0, 0]]
    assert batch["doc_end"].tolist() == [[4, 4, 4, 4, 5], [5, 5, 5, 5, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 0]]


def test_mock_documents_and_iterators():
    # without a flag the mock data is what it always was
    plain = MockGPTDataset(50, 16, 4, seed=3)
    assert np.array_equal(plain[1], np.random.default_rng([3, 1]).integers(0, 50, 17))
    mock = MockGPTDataset(50, 16, 64, seed=3, eod_token=49)
    samples = np.stack([mock[i] for i in range(64)])
    eods = (samples == 49).sum(axis=1)
    assert eods.min() >= 1 and 3 < eods.mean() < 8  # documents of 1..8 tokens
    assert np.array_equal(samples[5], mock[5])  # a function of (seed, i)
    assert ((samples[:, 1:] == 49) & (samples[:, :-1] == 49)).any()  # consecutive EODs occur
    train, valid, _ = build_data_iterators(
        data_prefix=None, mock=True, split="1", vocab_size=50, seq_length=16, seed=1,
        micro_batch_size=2, dp_rank=0, dp_size=1, train_samples=4, valid_samples=2, test_samples=0,
        eod_token=49, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    for batch in (next(train), next(valid)):
        tokens = batch["tokens"].numpy()
        assert (tokens == 49).any()
        for i, row in enumerate(tokens.tolist()):
            start, end = bounds_by_documents(row, 49)
            assert batch["doc_start"][i].tolist() == start and batch["doc_end"][i].tolist() == end, row
            assert batch["position_ids"][i].tolist() == [j - a for j, a in enumerate(start)], row
            assert batch["loss_mask"][i].tolist() == [float(t != 49) for t in row], row


def test_no_eod_token_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"--reset-attention-mask needs an end-of-document \(EOD\) "
                                         r"token .* but the tokenizer has none. Fix: .* or drop "
                                         r"--reset-attention-mask"):
        build_data_iterators(data_prefix=None, mock=True, split="1", vocab_size=50, seq_length=8,
                             seed=1, micro_batch_size=1, dp_rank=0, dp_size=1, train_samples=1,
                             valid_samples=0, test_samples=0, reset_attention_mask=True)
    # the config refuses it before anything is built
    config = Config(data=DataConfig(mock_data=True, reset_position_ids=True, eod_mask_loss=True,
                                    tokenizer_type="HuggingFaceTokenizer", tokenizer_model="tok"))
    with pytest.raises(ConfigError, match=r"--reset-position-ids --eod-mask-loss needs an "
                                          r"end-of-document \(EOD\) token .*\(HuggingFaceTokenizer "
                                          r"tok\) has none.*drop --reset-position-ids --eod-mask-loss"):
        validate(config)
    config.data.eod_token = 3
    validate(config)
    # data preprocessed without --append-eod holds no document boundary
    _indexed(tmp_path, [[1, 2, 3], [4, 5, 6, 7]] * 4)
    with pytest.raises(DatasetError, match=r"--eod-mask-loss: dataset .*docs holds no "
                                           r"end-of-document token \(id 9\).*--append-eod"):
        build_data_iterators(data_prefix=str(tmp_path / "docs"), mock=False, split="1",
                             vocab_size=16, seq_length=4, seed=1, micro_batch_size=1, dp_rank=0,
                             dp_size=1, train_samples=2, valid_samples=0, test_samples=0,
                             eod_token=E, eod_mask_loss=True)


def loss_document_by_document(chunk, batch, eod) -> float:
    """One micro-batch's loss computed without packing: each document of each window runs alone
    through ``chunk`` (positions from 0, plain causal attention, no document bounds), its tokens'
    losses are masked where the input is EOD, and the sum is divided by the trained tokens."""
    total, trained = 0.0, 0
    for tokens, labels in zip(batch["tokens"], batch["labels"]):
        for start, end in documents_of(tokens.tolist(), eod):
            doc = tokens[start:end].unsqueeze(0)
            losses = chunk(doc, torch.arange(end - start).unsqueeze(0), labels=labels[start:end].unsqueeze(0))
            mask = (doc != eod).float()
            total += (losses.float() * mask).sum().item()
            trained += int(mask.sum().item())
    return total / trained


def test_pretrain_with_the_three_flags_trains_each_document_as_if_alone(monkeypatch):
    """pretrain with --reset-position-ids --reset-attention-mask --eod-mask-loss on mock
    documents: each step's loss (the mean of its micro-batches') equals the loss of the same
    weights run document by document (:func:`loss_document_by_document`), fp32 to 1e-5: the
    bounds, the positions and the mask all reach the model as one document alone would see them."""
    from megalite.train import loop as train_loop
    from megalite.data.tokenizer import build_tokenizer
    from megalite.train.pretrain import pretrain

    eod = build_tokenizer("NullTokenizer", vocab_size=64).eod
    real, seen = train_loop.train_step, []

    def step_beside_its_reference(model, optimizer, micro_batches, *args, **kwargs):
        (chunk,) = model
        with torch.no_grad():
            reference = sum(loss_document_by_document(chunk, b, eod) for b in micro_batches) / len(micro_batches)
        assert any((b["tokens"] == eod).any() for b in micro_batches)  # there are documents to keep apart
        result = real(model, optimizer, micro_batches, *args, **kwargs)
        seen.append((float(result.loss), reference))
        return result

    monkeypatch.setattr(train_loop, "train_step", step_beside_its_reference)
    base = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "2", "--log-interval", "100", "--eval-interval", "1000",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    log = pretrain(base + ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"])
    assert [r["loss"] for r in log] == [loss for loss, _ in seen] and len(seen) == 2
    for loss, reference in seen:
        assert abs(loss - reference) <= 1e-5 * reference, (loss, reference)
