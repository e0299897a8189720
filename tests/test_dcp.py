"""--ckpt-format torch_dcp: checkpoints through torch.distributed.checkpoint.

A rank's pieces (flat ranges of its TP shard) are boxes of the global tensors; DCP's own
tools read the result as full tensors under megalite's names; any layout loads any other,
with the values megalite's own format gives, bit for bit.
"""
import json
import math
import os
import random
import shutil

import pytest
import torch

from megalite.checkpoint import CheckpointError, PieceReader, is_dcp_checkpoint, load_serial_model
from megalite.checkpoint.dcp_boxes import global_shape, piece_boxes
from megalite.checkpoint.names import global_pieces
from megalite.parallel.sharding import TPSplit, shard_tensor
from megalite.testing import WorldError, run_world

BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "100",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
DCP = ["--ckpt-format", "torch_dcp"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DP2_ZERO1 = ["--use-distributed-optimizer"]
KINDS = ("weight", "exp_avg", "exp_avg_sq")
# megalite.checkpoint.dcp* silence these process-wide at import; pytest restores filters per test.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*deprecating ShardedTensor:FutureWarning")]


def _pretrain(rank, world, *runs):
    from megalite.train.pretrain import pretrain
    return [[r["loss"] for r in pretrain(argv)] for argv in runs]


def _full_state(directory) -> dict:
    """DCP's own conversion: one torch.save file of full tensors (loaded back here)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(str(directory) + "_full.pt")
    dcp_to_torch_save(str(directory), out)
    return torch.load(out, weights_only=True)


def _logits(path):
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_serial_model(str(path))(tokens)


def _assert_same_state(full: dict, reader: PieceReader) -> int:
    """DCP's full tensors equal megalite's assembled ones, bit for bit, and nothing else is there."""
    names = reader.names("weight")
    for kind in KINDS:
        for name in names:
            assert torch.equal(full[f"{kind}/{name}"], reader.full_tensor(name, kind, 300)), (kind, name)
    params = {k for k in full if not k.startswith("rng/")}
    assert params == {f"{kind}/{name}" for kind in KINDS for name in names}
    return len(params)


def test_flat_ranges_map_to_global_boxes_exactly_once():
    """Random shapes, splits (sections: fused QKV), TP sizes and cuts: every box's view equals
    the global tensor's values there, and the boxes of all ranks cover it exactly once
    (vocabulary padding rows excluded)."""
    rng = random.Random(0)
    for trial in range(300):
        tp, sections, nd = rng.choice([1, 2, 4]), rng.choice([1, 3]), rng.randint(1, 3)
        dim = rng.randrange(nd)
        shape = [rng.randint(1, 4) for _ in range(nd)]
        shape[dim] = sections * tp * rng.randint(1, 3)
        name, split, vocab = "x", [dim, sections], 0
        if trial % 3 == 0:  # a vocabulary parameter: padded rows, split on rows
            name, split = "word_embeddings.weight", [0, 1]
            shape[0] = tp * rng.randint(1, 3)
            vocab = rng.randint(1, shape[0])
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        cover = torch.zeros(shape)
        for r in range(tp):
            local = shard_tensor(full, TPSplit(*split), r, tp)
            n = local.numel()
            cuts = sorted({0, n} | {rng.randint(0, n) for _ in range(3)})  # ZeRO-like flat ranges
            for a, z in zip(cuts, cuts[1:]):
                for g, view in piece_boxes(name, list(local.shape), split, r, tp, a, z, vocab,
                                           local.reshape(-1)[a:z].clone()):
                    box = tuple(slice(o, o + s) for o, s in zip(g, view.shape))
                    assert torch.equal(full[box], view), trial
                    cover[box] += 1
        expected = global_shape(name, list(local.shape), split, tp, vocab)
        rows = vocab if vocab else shape[0]
        assert expected == [rows] + shape[1:]
        assert (cover[:rows] == 1).all() and (cover[rows:] == 0).all(), trial


def test_single_process_save_equals_megalite_format_and_resumes_alike(tmp_path):
    """One process (no process group): the same run saved in both formats gives the same
    tensors (DCP's dcp_to_torch_save vs megalite's pieces; --async-save too), the same serial
    logits, and a resume from either continues with the same losses; metadata.json marks the
    format; a damaged DCP checkpoint is one CheckpointError."""
    from megalite.train.pretrain import pretrain
    base = BASE + ["--hidden-dropout", "0.1"]  # dropout: the RNG streams are restored too
    pretrain(base + ["--train-iters", "2", "--save", str(tmp_path / "meg")])
    pretrain(base + DCP + ["--train-iters", "2", "--save", str(tmp_path / "dcp")])
    pretrain(base + DCP + ["--train-iters", "2", "--save", str(tmp_path / "async"), "--async-save"])
    directory = tmp_path / "dcp" / "iter_0000002"
    assert (tmp_path / "dcp" / "latest").read_text() == "2" and is_dcp_checkpoint(str(directory))
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", "metadata.json"]
    meta = json.loads((directory / "metadata.json").read_text())
    assert meta["ckpt_format"] == "torch_dcp" and meta["optimizer_step"] == 2 and meta["consumed_samples"] == 16
    full = _full_state(directory)
    assert _assert_same_state(full, PieceReader(str(tmp_path / "meg" / "iter_0000002"))) == 84  # 3 x 28 tensors
    background = _full_state(tmp_path / "async" / "iter_0000002")  # dcp.async_save: the same tensors
    assert background.keys() == full.keys() and all(torch.equal(background[k], full[k]) for k in full)
    assert torch.equal(_logits(tmp_path / "dcp"), _logits(tmp_path / "meg"))
    from megalite.checkpoint.convert import export_hf  # Hugging Face export reads either format
    from safetensors.torch import load_file
    hf = [load_file(os.path.join(export_hf(str(tmp_path / d), str(tmp_path / f"hf_{d}"), progress=False),
                                 "model.safetensors")) for d in ("meg", "dcp")]
    assert hf[0].keys() == hf[1].keys() and all(torch.equal(hf[0][k], hf[1][k]) for k in hf[0])
    resumed = [[r["loss"] for r in pretrain(base + ["--train-iters", "4", "--load", str(tmp_path / d)])]
               for d in ("meg", "dcp")]
    assert resumed[0] == resumed[1] and len(resumed[0]) == 2  # iteration 4 follows a step from the loaded moments
    # A missing data file or a corrupt index: one CheckpointError, no DCP internals.
    for damage in ("__0_0.distcp", ".metadata"):
        broken = tmp_path / f"broken{damage}"
        shutil.copytree(tmp_path / "dcp", broken)
        target = broken / "iter_0000002" / damage
        target.write_bytes(target.read_bytes()[:50]) if damage == ".metadata" else target.unlink()
        with pytest.raises(CheckpointError, match="incomplete or corrupt"):
            load_serial_model(str(broken))


def test_dp2_resume_trains_on_exactly_as_the_uninterrupted_run(tmp_path):
    """DP2 without ZeRO (rank 1 owns nothing: it writes no box and must still read every one):
    resumed from iteration 2 of a torch_dcp run, three more iterations give every rank the
    uninterrupted run's losses bit for bit. Iterations 4 and 5 come after optimizer steps taken
    from the loaded state, so they see the Adam moments (a swapped exp_avg / exp_avg_sq) and
    rank 1's weights (a load that fills only the boxes a rank owns) as well as the RNG streams
    (dropout) and the data position."""
    argv = BASE + DCP + ["--hidden-dropout", "0.1", "--train-iters", "5"]
    runs = run_world(_pretrain, 2, argv + ["--save", str(tmp_path / "full"), "--save-interval", "2"],
                     argv + ["--load", str(tmp_path / "full"), "--ckpt-step", "2"])
    for rank, (full, resumed) in enumerate(runs):
        assert len(full) == 5 and resumed == full[2:], rank


@pytest.mark.slow
def test_zero1_dp2_save_equals_megalite_format_and_loads_serially(tmp_path):
    """DP2 with ZeRO-1: each rank's flat ranges become boxes; the same run saved in both
    formats gives the same tensors (DCP's dcp_to_torch_save vs megalite's pieces) and the
    same serial logits; metadata.json marks the format and 'latest' is written."""
    argv = BASE + DP2_ZERO1 + ["--train-iters", "2"]
    run_world(_pretrain, 2, argv + ["--save", str(tmp_path / "meg")], argv + DCP + ["--save", str(tmp_path / "dcp")])
    directory = tmp_path / "dcp" / "iter_0000002"
    assert (tmp_path / "dcp" / "latest").read_text() == "2" and is_dcp_checkpoint(str(directory))
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    meta = json.loads((directory / "metadata.json").read_text())
    assert meta["ckpt_format"] == "torch_dcp" and meta["optimizer_step"] == 2 and meta["zero_stage"] == 1
    full = _full_state(directory)
    assert _assert_same_state(full, PieceReader(str(tmp_path / "meg" / "iter_0000002"))) == 84  # 3 x 28 tensors
    assert {k.split("/")[1] for k in full if k.startswith("rng/")} == {"rank00000", "rank00001"}  # each its own
    assert torch.equal(_logits(tmp_path / "dcp"), _logits(tmp_path / "meg"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--expert-model-parallel-size", "4"],
                                    ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel"]])
def test_experts_ep4_zero1_are_stored_per_global_expert_and_load_at_ep1(tmp_path, layout):
    """MoE at EP4 (and TP2 x EP2, where TP rank 1 writes the experts it holds) with ZeRO-1:
    each expert is its own global tensor (weight/layers.0.mlp.experts.2.fc1.weight), equal to
    megalite's format; loaded at DP2 without expert parallelism, training continues exactly as
    from megalite's format."""
    argv = BASE + ["--num-experts", "4", "--use-distributed-optimizer", "--train-iters", "2"] + layout
    run_world(_pretrain, 4, argv + ["--save", str(tmp_path / "meg")], argv + DCP + ["--save", str(tmp_path / "dcp")])
    full = _full_state(tmp_path / "dcp" / "iter_0000002")
    assert "weight/layers.0.mlp.experts.2.fc1.weight" in full
    assert _assert_same_state(full, PieceReader(str(tmp_path / "meg" / "iter_0000002"))) == 114
    argv = BASE + ["--num-experts", "4", "--train-iters", "3"]
    losses = [run_world(_pretrain, 2, argv + ["--load", str(tmp_path / d)])[0][0] for d in ("meg", "dcp")]
    assert losses[0] == losses[1] and len(losses[0]) == 1


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """A TP2 x PP2 run saved in both formats (same seeds, so the same state)."""
    root = tmp_path_factory.mktemp("tp2pp2")
    argv = BASE + TP2PP2 + ["--train-iters", "3"]
    run_world(_pretrain, 4, argv + DCP + ["--save", str(root / "dcp")], argv + ["--save", str(root / "meg")])
    return root


@pytest.mark.slow
def test_tp2pp2_dcp_loads_at_dp2_and_serially_with_the_same_logits(tp2pp2, tmp_path):
    """Saved at TP2 x PP2 in torch_dcp, loaded at DP2 (ZeRO-1: other boxes, flat ranges) and
    serially: the logits equal those of the megalite-format save of the same state, and training
    at DP2 continues exactly as from the megalite-format checkpoint."""
    dcp_root, meg_root = tp2pp2 / "dcp", tp2pp2 / "meg"
    ref = _logits(meg_root)
    assert torch.equal(_logits(dcp_root), ref)  # serially (DCP reads full tensors)
    argv = BASE + DP2_ZERO1 + ["--train-iters", "5"]
    losses = {}
    for name, root in (("dcp", dcp_root), ("meg", meg_root)):  # resharded on load, both
        losses[name] = run_world(_pretrain, 2, argv + ["--load", str(root), "--save", str(tmp_path / name)])[0][0]
    assert losses["dcp"] == losses["meg"] and len(losses["dcp"]) == 2  # iterations 4 and 5, bit for bit
    a, b = (PieceReader(str(tmp_path / n / "iter_0000005")) for n in ("dcp", "meg"))
    assert all(torch.equal(a.full_tensor(n, k, 300), b.full_tensor(n, k, 300)) for k in KINDS for n in a.names())
    assert torch.equal(_logits(tmp_path / "dcp"), _logits(tmp_path / "meg"))


@pytest.mark.slow
def test_dcp_to_torch_save_equals_the_serial_export(tp2pp2):
    """DCP's own tool gives full tensors under megalite's names equal to the serial model's
    parameters (vocabulary rows unpadded) and to megalite's assembled optimizer state."""
    full = _full_state(tp2pp2 / "dcp" / "iter_0000003")
    model = load_serial_model(str(tp2pp2 / "meg"))
    count = 0
    for name, p in model.named_parameters():
        for global_name, start, numel, shape in global_pieces(name, p):
            stored = full[f"weight/{global_name}"]
            expected = p.detach()[:300] if name in ("word_embeddings.weight", "output_layer.weight") \
                else p.detach().reshape(-1)[start: start + numel].view(shape)
            assert torch.equal(stored, expected), name
            count += 1
    assert count == len(PieceReader(str(tp2pp2 / "meg" / "iter_0000003")).names("weight"))
    _assert_same_state(full, PieceReader(str(tp2pp2 / "meg" / "iter_0000003")))


@pytest.mark.slow
def test_async_dcp_save_equals_sync_and_a_kill_during_the_write_keeps_the_previous(tmp_path):
    """--async-save --ckpt-format torch_dcp writes the tensors the synchronous save writes;
    a rank killed during the background write leaves 'latest' on the previous checkpoint,
    the partial one uncommitted, and training resumes from the previous one with the
    uninterrupted run's losses."""
    argv = BASE + DCP + ["--train-iters", "4", "--save-interval", "2"]
    uninterrupted = run_world(_pretrain, 2, argv + ["--save", str(tmp_path / "sync")],
                              argv + ["--async-save", "--save", str(tmp_path / "async")])[0][0]
    for it in ("iter_0000002", "iter_0000004"):
        a, b = _full_state(tmp_path / "sync" / it), _full_state(tmp_path / "async" / it)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), it
        ma, mb = (json.loads((tmp_path / d / it / "metadata.json").read_text()) for d in ("sync", "async"))
        assert {k: v for k, v in ma.items() if k != "config"} == {k: v for k, v in mb.items() if k != "config"}
    killed = tmp_path / "killed"
    with pytest.raises(WorldError, match="died"):
        run_world(_pretrain, 2, argv + ["--async-save", "--save", str(killed), "--inject-fault", "kill-during-save@4"])
    assert (killed / "latest").read_text() == "2"
    assert (killed / "iter_0000004.tmp").exists() and not (killed / "iter_0000004").exists()
    resumed = run_world(_pretrain, 2, argv + ["--load", str(killed)])[0][0]
    assert len(uninterrupted) == 4 and resumed == uninterrupted[2:]  # iteration 4 follows a step from the load


def test_unknown_format_is_one_clear_message(capsys):
    from megalite.train.pretrain import main
    assert main(BASE + ["--train-iters", "1", "--ckpt-format", "zarr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ckpt-format: invalid choice: 'zarr'" in err[0] and "torch_dcp" in err[0], err


def _tiny_run():
    """(config, grid, optimizer, scaler) of a one-process run, no training."""
    from megalite.parallel.random import model_parallel_seed
    from megalite.pipeline.partition import build_model_chunks
    from megalite.train.pretrain import setup
    from megalite.train.step import LossScaler, build_data_parallel_optimizer
    _, config, _, grid, device = setup(BASE + ["--train-iters", "1"])
    model_parallel_seed(config.train.seed, grid, device)
    chunks = build_model_chunks(config, grid, device)
    for chunk in chunks:
        chunk.init_weights(config.train.seed)
    return config, grid, build_data_parallel_optimizer(chunks, config.train, grid), LossScaler(False, 0, None)


def test_async_saver_reports_each_commit_once_and_reraises_a_writer_error(tmp_path, monkeypatch):
    """poll() reports a committed directory once; save() waits for the write in flight (whose
    directory the next poll reports); an error in the writer thread is raised on the caller's
    thread at the next wait, and that save stays uncommitted."""
    import megalite.checkpoint.dcp_async as dcp_async
    from megalite.checkpoint import AsyncDcpSaver
    config, grid, optimizer, scaler = _tiny_run()
    saver = AsyncDcpSaver(grid)
    first = saver.save(str(tmp_path), 1, optimizer, scaler, config, grid, 8, extra_meta={"data_batches": 1})
    second = saver.save(str(tmp_path), 2, optimizer, scaler, config, grid, 16, keep_last=1)
    assert saver.wait() == [first, second] and not saver.in_flight and saver.poll() == []
    assert (tmp_path / "latest").read_text() == "2" and not os.path.exists(first)  # keep_last 1 pruned it
    assert json.loads((tmp_path / "iter_0000002" / "metadata.json").read_text())["consumed_samples"] == 16

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(dcp_async, "commit", disk_full)
    saver.save(str(tmp_path), 3, optimizer, scaler, config, grid, 24)
    with pytest.raises(OSError, match="No space left"):
        saver.wait()
    assert (tmp_path / "latest").read_text() == "2" and (tmp_path / "iter_0000003.tmp").is_dir()
    saver.close()
