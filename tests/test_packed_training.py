"""Packed documents train like documents alone, and every layout trains like one process.

- The GPT (GPT-2, and Llama-style with RoPE and GQA) on one packed sample of several documents,
  with documents (``--reset-attention-mask``) and positions restarting per document
  (``--reset-position-ids``), gives each token the loss it has with its document run alone, and
  the gradient of the summed losses is the sum of the documents' gradients (fp32).
- ``pretrain`` with ``--reset-position-ids --reset-attention-mask --eod-mask-loss`` on mock data
  with EOD tokens, at TP2 x SP, PP2, DP2 with ZeRO-1 and CP2 under each --cp-comm-type,
  reproduces the single-process losses and gradient norms (one 2-rank world runs them all).
  Under CP the ranks hold different numbers of trained tokens (EODs are masked), which the
  loss's denominator (the whole micro-batch's count) handles.
- The meta dry run (one rank of a 16-rank layout, fake process group) passes with the flags.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.layers.documents import documents_from_lengths, reset_positions
from megalite.model.gpt import GPTModel
from megalite.testing import run_world

TOL = 1e-5
LENGTHS = [[6, 1, 9, 8], [13, 11]]  # two packed rows of 24 tokens
GPT2 = {}
LLAMA = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm", "swiglu": True,
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def _model(extra: dict) -> GPTModel:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=24,
                      max_position_embeddings=24, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    model = GPTModel(cfg)
    model.init_weights(3)
    return model


@pytest.mark.parametrize("name,extra", [("gpt2", GPT2), ("llama", LLAMA),
                                        ("llama, full recompute", {**LLAMA, "recompute_granularity": "full"}),
                                        ("gpt2, selective recompute", {"recompute_granularity": "selective"}),
                                        ("llama, transformer-engine stand-in",
                                         {**LLAMA, "transformer_impl": "transformer_engine"})])
def test_packed_sample_equals_each_document_alone(monkeypatch, name, extra):
    if "transformer_impl" in extra:  # TE's core gets no document mask: megalite's attention runs the core
        from tests import te_standin
        te_standin.install(monkeypatch)
    model = _model(extra)
    x = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(1))
    tokens, labels = x[:, :-1], x[:, 1:]
    docs = documents_from_lengths(LENGTHS)
    packed = model(tokens, reset_positions(docs), labels=labels, documents=docs)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.zeros_like(packed)
    for row, lengths in enumerate(LENGTHS):
        lo = 0
        for n in lengths:
            losses = model(tokens[row: row + 1, lo: lo + n], labels=labels[row: row + 1, lo: lo + n])
            losses.sum().backward()  # positions 0 .. n-1 and plain causal attention: the document alone
            alone[row, lo: lo + n] = losses.detach()[0]
            lo += n
    errs = {"losses": ((packed.detach() - alone).abs().max() / alone.abs().max()).item()}
    gmax = max(p.grad.abs().max().item() for p in model.parameters())
    for n, p in model.named_parameters():
        errs[n] = ((packed_grads[n] - p.grad).abs().max() / max(p.grad.abs().max().item(), 1e-3 * gmax)).item()
    worst = max(errs.values())
    print(f"{name}: packed vs each document alone, largest relative difference (losses, every gradient): "
          f"{worst:.2e}")
    assert worst < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}


# -- pretrain: every layout against one process --------------------------------------------------
ITERS = "3"
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "100", "--train-iters", ITERS, *PACKED]
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--num-query-groups", "2", "--normalization", "RMSNorm",
               "--swiglu", "--disable-bias-linear"]


def cp_flags(comm_type: str, sizes=None) -> list[str]:
    flags = ["--context-parallel-size", "2", "--cp-comm-type", comm_type]
    return flags + (["--hierarchical-context-parallel-sizes", *map(str, sizes)] if sizes else [])


# name: (model flags of the serial reference, parallel flags); every one runs on 2 ranks.
RUNS = {
    "TP2 x SP": ((), ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "PP2": ((), ["--pipeline-model-parallel-size", "2"]),
    "DP2, ZeRO-1": ((), ["--zero-stage", "1"]),
    "CP2 p2p": (tuple(LLAMA_FLAGS), cp_flags("p2p")),
    "CP2 a2a": (tuple(LLAMA_FLAGS), cp_flags("a2a")),
    "CP2 allgather": (tuple(LLAMA_FLAGS), cp_flags("allgather")),
    "CP2 a2a+p2p 1x2": (tuple(LLAMA_FLAGS), cp_flags("a2a+p2p", (1, 2))),
}


def _log(argv) -> list:
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(argv)]


@functools.lru_cache
def serial_log(model_flags: tuple) -> list:
    return _log(BASE + list(model_flags))


def _world_worker(rank, world, runs):
    return {name: _log(argv) for name, argv in runs}


@pytest.fixture(scope="module")
def two_rank_world():
    runs = [(name, BASE + list(model) + flags) for name, (model, flags) in RUNS.items()]
    return run_world(_world_worker, 2, runs, timeout=400)


@pytest.mark.parametrize("name", RUNS)
def test_pretrain_with_packed_documents_matches_single_process(two_rank_world, name):
    serial = serial_log(RUNS[name][0])
    assert len(serial) == int(ITERS)
    worst = 0.0
    for out in two_rank_world:
        assert len(out[name]) == len(serial)
        worst = max([worst] + [abs(a - b) / abs(b) for got, want in zip(out[name], serial) for a, b in zip(got, want)])
    print(f"packed documents, {name}: largest relative loss / grad-norm difference vs 1 process: {worst:.2e}")
    assert worst < TOL, (name, worst)


def test_cp_ranks_hold_different_numbers_of_trained_tokens():
    """The case the CP loss denominator is for: with --eod-mask-loss the mock data's EODs fall
    unevenly on the two CP ranks' chunks (else the old per-rank mean would have matched too)."""
    from megalite.context_parallel.data import context_parallel_slice
    from megalite.data.builder import build_data_iterators
    train, _, _ = build_data_iterators(data_prefix=None, mock=True, split="969,30,1", vocab_size=300, seq_length=32,
                                       seed=1234, micro_batch_size=2, dp_rank=0, dp_size=1, train_samples=12,
                                       valid_samples=0, test_samples=0, eod_token=299, reset_position_ids=True,
                                       reset_attention_mask=True, eod_mask_loss=True)
    batch = next(train)
    counts = [context_parallel_slice(batch, r, 2)["loss_mask"].sum().item() for r in range(2)]
    assert "doc_start" in batch and counts[0] != counts[1], counts


# -- the meta dry run ----------------------------------------------------------------------------
@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_meta_dry_run_with_packed_documents(monkeypatch, comm_type):
    from megalite.train.pretrain import pretrain
    flags = ["--mock-data", "--vocab-size", "500", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "1", "--log-interval", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", comm_type,
             "--attention-dropout", "0", *LLAMA_FLAGS, *PACKED]
    from megalite.model import attention as gpt  # SelfAttention calls context_parallel_attention there
    seen = []

    def recording(q, k, v, *args, documents=None, **kwargs):  # the documents reach every layer, on meta
        seen.append(documents is not None and documents.start.device.type == "meta"
                    and documents.start.shape == (2, 64))
        return cp_attention(q, k, v, *args, documents=documents, **kwargs)

    cp_attention = gpt.context_parallel_attention
    monkeypatch.setattr(gpt, "context_parallel_attention", recording)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in (0, 3, 15):  # first stage TP/CP positions, last stage
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 8))
        try:
            log = pretrain(["--fake-process-group", "--device", "meta", *flags])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        assert [r["iteration"] for r in log] == [1], (comm_type, rank)
    assert seen and all(seen), seen
