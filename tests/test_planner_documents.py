"""The planner and the dry run with packed documents (megalite.planner.documents): the FLOPs both
ways against 6 N + 12 L h length, the step's batch bytes against what pretrain holds (real
batches of megalite.data.builder), the printed flags through pretrain's parser, the dry run's line."""
from __future__ import annotations

import re
import shlex
from types import SimpleNamespace

import pytest

from megalite.arguments import build_parser as pretrain_parser
from megalite.arguments import config_from_args
from megalite.config import ModelConfig, validate
from megalite.context_parallel.data import WHOLE_SEQUENCE_KEYS
from megalite.data.builder import build_data_iterators
from megalite.layers.documents import documents_from_lengths
from megalite.model.gpt import count_active_parameters
from megalite.observe.monitor import attended_length
from megalite.planner import Layout, stage_memory
from megalite.planner.documents import (
    batch_bytes,
    document_flops,
    format_flops,
    token_bytes,
)
from megalite.planner.flags import pretrain_flags
from megalite.train.step import context_parallel_batches
from tests.test_planner import BF16, gpt7b
from tools import dry_run, plan_parallel

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--vocab-size", "500", "--global-batch-size", "8", "--micro-batch-size", "1", "--gpu-memory-gb", "1",
        "--gpus-per-node", "2", "--nodes", "1"]
DOCS = ["--reset-position-ids", "--reset-attention-mask"]


def test_flops_with_equal_documents_against_the_formula():
    """7B, s = 4096, documents of 1024: 6 N + 12 L h N per token against 6 N + 12 L h s; the
    saving 12 L h (s - N) is 1 - N/s = 75% of the attention FLOPs. Equal documents of N have a
    mean attended length of exactly N (monitor.attended_length of such a batch)."""
    m = gpt7b()
    L, h, s, n = 32, 4096, 4096, 1024
    f = document_flops(m, n)
    params = 6.0 * count_active_parameters(m)
    assert f.whole == params + 12 * L * h * s and f.documents == params + 12 * L * h * n
    assert f.saved == 12 * L * h * (s - n) and f.saved_fraction == pytest.approx(0.75)
    assert f.saved_of_total == pytest.approx(12 * L * h * (s - n) / (params + 12 * L * h * s))
    docs = documents_from_lengths([[n] * (s // n)] * 2)
    assert attended_length([{"doc_start": docs.start, "doc_end": docs.end}]) == n


def test_plan_parallel_reports_the_flops_and_without_the_flags_nothing_changes(capsys):
    assert plan_parallel.main(TINY) == 0
    plain = capsys.readouterr().out
    assert "Packed documents" not in plain and "--reset-" not in plain
    assert plan_parallel.main(TINY + DOCS + ["--document-length", "32"]) == 0
    text = capsys.readouterr().out
    m = plan_parallel.model_from_args(plan_parallel.build_parser().parse_args(TINY))
    f = document_flops(m, 32)
    tokens = 8 * 128
    assert "taken as equal documents of 32: 12 L h N = 12 x 2 x 64 x 32 per token" in text
    line = next(x for x in text.splitlines() if "model FLOPs per token" in x)
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    numbers = [float(x) * scale[u] for x, u in re.findall(r"([\d.]+) ([kMG])FLOP", line)]
    expected = [f.whole, f.documents, f.whole * tokens, f.documents * tokens]
    assert numbers == pytest.approx(expected, rel=5e-3)
    assert f"per step of {tokens:,} tokens" in line
    saved = next(x for x in text.splitlines() if "attention FLOPs saved" in x)
    assert "75.0% of the attention FLOPs (1 - N/s)" in saved
    assert f"{100 * f.saved_of_total:.1f}% of the model FLOPs" in saved
    # The default document length is the whole sequence: nothing saved.
    assert plan_parallel.main(TINY + ["--reset-attention-mask"]) == 0
    assert "0.0% of the attention FLOPs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_parallel.main(TINY + ["--document-length", "32"])  # without --reset-attention-mask


def _batches(reset_attention_mask: bool, micro: int = 2, seq: int = 64, num_micro: int = 3) -> list[dict]:
    it, _, _ = build_data_iterators(data_prefix=None, mock=True, split="969,30,1", vocab_size=500, seq_length=seq,
                                    seed=1234, micro_batch_size=micro, dp_rank=0, dp_size=1,
                                    train_samples=micro * num_micro, valid_samples=0, test_samples=0, eod_token=499,
                                    reset_position_ids=True, reset_attention_mask=reset_attention_mask,
                                    eod_mask_loss=True)
    return [next(it) for _ in range(num_micro)]


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_data_entry_is_the_bytes_pretrain_holds(documents, cp):
    """The step's micro-batches as pretrain moves them to the device (every key of every
    micro-batch), plus, under CP, the new storages context_parallel_batches makes for the rank
    (the sliced keys and the loss denominator; the documents' arrays stay the same tensors)."""
    micro, seq, num_micro = 2, 64, 3
    batches = _batches(documents, micro, seq, num_micro)
    held = sum(t.nbytes for b in batches for t in b.values())
    assert held == num_micro * micro * seq * token_bytes(documents) == batch_bytes(seq, micro, num_micro, 1, documents)
    assert token_bytes(documents) == (36 if documents else 28)
    grid = SimpleNamespace(layout=SimpleNamespace(cp=cp), cp_rank=cp - 1)
    whole = {t.untyped_storage().data_ptr() for b in batches for t in b.values()}
    sliced = context_parallel_batches(batches, grid)
    new = sum(t.nbytes for b in sliced for t in b.values() if t.untyped_storage().data_ptr() not in whole)
    assert all(b[k] is o[k] for b, o in zip(sliced, batches) for k in WHOLE_SEQUENCE_KEYS if k in o)
    assert held + new == batch_bytes(seq, micro, num_micro, cp, documents)
    # and the planner's total carries it
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=seq, vocab_size=500)
    mem = stage_memory(m, Layout(cp=cp, dp=1), 0, micro, num_micro, BF16, flash_attention=True, documents=documents)[1]
    assert mem["data"] == held + new
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))


def test_printed_flags_parse_with_pretrains_parser(capsys):
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=500)
    flags = pretrain_flags(m, Layout(dp=2), 8, 1, reset_position_ids=True, reset_attention_mask=True)
    assert flags[-2:] == DOCS
    args = pretrain_parser().parse_args(flags + ["--mock-data"])
    assert args.reset_position_ids and args.reset_attention_mask and not args.eod_mask_loss
    config = config_from_args(args, 500, eod_token=dry_run.mock_eod(500))
    validate(config, 2, 2)
    assert config.data.reset_position_ids and config.data.reset_attention_mask
    assert not [f for f in pretrain_flags(m, Layout(dp=2), 8, 1) if f.startswith("--reset")]
    # plan_parallel prints them in the recommendation and in the dry-run command
    assert plan_parallel.main(TINY + DOCS) == 0
    text = capsys.readouterr().out
    rec = text.split("The recommendation as pretrain_gpt.py flags", 1)[1].splitlines()[1].split()
    assert rec[-2:] == DOCS and pretrain_parser().parse_args(rec + ["--mock-data"]).reset_attention_mask
    command = next(x for x in text.splitlines() if x.startswith("Measure it first: "))
    assert shlex.split(command)[-2:] == DOCS


def test_dry_run_states_the_attention_work_of_its_batch(capsys):
    """The line from the dry run's own batch (mock data: about four documents per sample), the
    same figures as monitor.attended_length and the FLOPs formula; none without the flag."""
    base = ["--world-size", "1", "--gpus-per-node", "1", "--num-layers", "1", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "500", "--micro-batch-size", "2",
            "--global-batch-size", "4"]
    assert dry_run.main(base) == 0
    assert "packed documents" not in capsys.readouterr().out
    assert dry_run.main(base + ["--reset-attention-mask"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("packed documents"))
    args = pretrain_parser().parse_args(base[4:] + ["--mock-data", "--reset-attention-mask"])
    config = config_from_args(args, 500, eod_token=499)
    batches = dry_run.host_batches(config, SimpleNamespace(dp=1))
    assert len(batches) == 2 and batches[0]["doc_start"].shape == (2, 64)
    attended = attended_length(batches)
    assert f"mean attended length {attended:.1f} of s = 64 tokens" in line
    per_sample = float(re.search(r"\(([\d.]+) documents per sample\)", line).group(1))
    assert 2.5 < per_sample < 6  # lengths uniform in [1, s/2]: about four
    f = document_flops(config.model, attended)
    assert f"{f.saved_fraction:.1%} less" in line and f"{format_flops(f.documents)} with documents" in line
