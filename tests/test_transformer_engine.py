"""``--transformer-impl transformer_engine`` and FP8 (megalite/layers/transformer_engine.py, fp8.py).

transformer-engine installs only where CUDA and cuDNN are, so on a CPU the adapter is tested
against ``tests/te_standin.py``, a stand-in with TE 2.x's interface and documented semantics
(its own TP/SP communication over real gloo groups, full sizes divided by TP, deferred init on
meta, FP8 delayed-scaling state). What these tests prove is megalite's side: the sharding
marks, the parameter names, the block wiring, the amax group and the FP8 checkpoint state.
The ``gpu`` tests at the end run the real library wherever it is installed; their ``cpu`` cases
run the same bodies on the stand-in.
"""
import dataclasses

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.testing import run_world
from tests import te_standin
from tests.device_twins import CUDA, DEVICES, cpu
from tests.test_tensor_parallel import PRETRAIN

TE = ["--transformer-impl", "transformer_engine"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
VARIANTS = {
    "gpt2": dict(),
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", num_query_groups=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
}


@pytest.fixture
def standin(monkeypatch):
    return te_standin.install(monkeypatch)


def _loss_and_grads(cfg):
    model = GPTModel(cfg)
    model.init_weights(7)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
    loss = model(x[:, :-1], labels=x[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_names_same_numbers_as_the_local_layers(standin, variant):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, **VARIANTS[variant])
    local_loss, local_grads, _ = _loss_and_grads(cfg)
    te_loss, te_grads, model = _loss_and_grads(dataclasses.replace(cfg, transformer_impl="transformer_engine"))
    assert type(model.layers["0"].attn.qkv).__name__ == "LayerNormLinear"  # the norm runs inside
    assert type(model.layers["0"].mlp.fc2).__name__ == "Linear"
    assert type(model.layers["0"].attn.te_core.attention).__name__ == "DotProductAttention"
    assert list(te_grads) == list(local_grads)  # layers.0.attn_norm.weight etc., in the same order
    assert abs(te_loss - local_loss) <= 1e-6 * local_loss
    for name, grad in local_grads.items():
        assert torch.allclose(te_grads[name], grad, rtol=1e-5, atol=1e-7), name


def test_moe_layers_keep_megalite_experts_between_te_layers(standin):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=48)
    local_loss, local_grads, _ = _loss_and_grads(cfg)
    te_loss, te_grads, _ = _loss_and_grads(dataclasses.replace(cfg, transformer_impl="transformer_engine"))
    assert list(te_grads) == list(local_grads) and abs(te_loss - local_loss) <= 1e-6 * local_loss
    for name, grad in local_grads.items():
        assert torch.allclose(te_grads[name], grad, rtol=1e-5, atol=1e-7), name


def _pretrain_worker(rank, world, extra):
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + extra)]


def _worst(log, ref):
    return max(abs(a - b) / b for pair, r in zip(log, ref) for a, b in zip(pair, r))


LAYOUTS = {
    "TP2 SP x DP2 ZeRO-1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]),
    "TP2 x PP2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "CP2 (ring attention between TE linears)": (2, ["--context-parallel-size", "2"]),
    "DP2 ZeRO-3 (TE weights gathered layer by layer)": (2, ["--zero-stage", "3"]),
}


@pytest.mark.slow
def test_te_layouts_train_as_the_serial_local_model(standin):
    from megalite.train.pretrain import pretrain
    serial = [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN)]
    worst = {}
    for name, (world, extra) in LAYOUTS.items():
        for log in run_world(_pretrain_worker, world, TE + extra, timeout=300):
            worst[name] = max(worst.get(name, 0.0), _worst(log, serial))
    print("largest relative loss / grad-norm difference, TE layouts vs serial local, 20 iterations:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst


def _fp8_states(path):
    from megalite.checkpoint.format import PieceReader
    reader = PieceReader(str(path / "iter_0000020"))
    return {n: reader.full_tensor(n, "fp8") for n in reader.names("fp8")}


def _state_error(a, b):
    assert a.keys() == b.keys() and a
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in a)


def test_te_moe_at_ep2_trains_as_the_serial_local_moe(standin):
    from megalite.train.pretrain import pretrain
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--train-iters", "8"]
    serial = [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + moe)]
    ep2 = run_world(_pretrain_worker, 2, TE + moe + ["--expert-model-parallel-size", "2"])[0]
    assert _worst(ep2, serial) < 1e-5


@pytest.mark.slow
def test_fp8_amax_reduced_over_the_stage_so_tp_sp_matches_serial_fp8(standin, monkeypatch, tmp_path):
    """The stand-in's FP8 rounds by each tensor's scale: TP ranks agree with the serial run only
    if their scales come from amaxes reduced over the whole stage (TP x DP). Scales move after
    every forward (each micro-batch's autocast exit, as in TE), so the DP ranks take micro-
    batches of 1: together they see the serial run's micro-batch of 2 in each forward."""
    from megalite.train.pretrain import pretrain
    serial = [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + TE + FP8 + ["--save", str(tmp_path / "1")])]
    local = [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN)]
    assert _worst(serial, local) > 1e-6  # the rounding is there, and shows in the loss
    extra = TE + FP8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1",
                        "--micro-batch-size", "1"]
    worst = max(_worst(log, serial) for log in
                run_world(_pretrain_worker, 4, extra + ["--save", str(tmp_path / "4")], timeout=300))
    # Not bitwise: a value a rounding away from a grid point can land on the other side.
    assert worst < 2e-4, worst
    # The scales and amax histories themselves (of TP/DP rank 0) follow the serial run's.
    reduced = _state_error(_fp8_states(tmp_path / "4"), _fp8_states(tmp_path / "1"))
    import megalite.layers.fp8 as fp8  # mutation: each rank on its own amaxes
    recipe = fp8.fp8_recipe
    monkeypatch.setattr(fp8, "fp8_recipe", lambda cfg, reduce_amax=True: recipe(cfg, reduce_amax=False))
    run_world(_pretrain_worker, 4, extra + ["--save", str(tmp_path / "own")], timeout=300)
    unreduced = _state_error(_fp8_states(tmp_path / "own"), _fp8_states(tmp_path / "1"))
    print(f"TP2 SP x DP2 FP8 (stand-in) vs serial: loss/grad norm {worst:.1e}; scaling state {reduced:.1e} "
          f"with the stage's amax reduction, {unreduced:.1e} without")
    assert reduced < 1e-3 and unreduced > 100 * reduced


def _from_iteration_5(path):
    (path / "latest").write_text("5")  # the run also saved 10: resume from 5
    return str(path)


def _resume_worker(rank, world, extra, save, load, iters):
    from megalite.train.pretrain import pretrain
    args = PRETRAIN + extra + ["--train-iters", str(iters), "--save-interval", "5"]
    args += ["--save", save] if save else []
    args += ["--load", load] if load else []
    return [(r["iteration"], r["loss"]) for r in pretrain(args)]


@pytest.mark.slow
def test_checkpoint_moves_between_te_and_local_and_fp8_state_resumes(standin, tmp_path, monkeypatch):
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    # TE with FP8 at TP2 SP, saved at iteration 5, then 10 uninterrupted iterations.
    full = run_world(_resume_worker, 2, TE + FP8 + tp2, str(tmp_path / "fp8"), None, 10)[0]
    meta = open(tmp_path / "fp8" / "iter_0000005" / "rank00000.json").read()
    assert '"kind": "fp8"' in meta and "layers.1.mlp.fc1.fp8.scaling_fwd.amax_history" in meta
    # Resumed from iteration 5: the same losses, bit for bit at TP2, to rounding serially.
    after = [loss for i, loss in full if i > 5]
    _from_iteration_5(tmp_path / "fp8")
    for world, extra, tol in ((2, TE + FP8 + tp2, 0.0), (1, TE + FP8, 1e-5)):
        resumed = run_world(_resume_worker, world, extra, None, str(tmp_path / "fp8"), 10)[0]
        assert [i for i, _ in resumed] == list(range(6, 11))
        assert max(abs(a - b) / b for (_, a), b in zip(resumed, after)) <= tol, (resumed, full)
    # Without the FP8 state the resumed run quantizes with fresh scales, and differs.
    monkeypatch.setattr("megalite.checkpoint.core.load_fp8_state", lambda *a: 0)
    lost = run_world(_resume_worker, 1, TE + FP8, None, str(tmp_path / "fp8"), 10)[0]
    assert max(abs(a - b) / b for (_, a), b in zip(lost, after)) > 1e-4  # 10x the tolerance above
    # A TE checkpoint (no FP8) resumes with megalite's own layers, and the other way round.
    te_run = run_world(_resume_worker, 2, TE + tp2, str(tmp_path / "te"), None, 10)[0]
    _from_iteration_5(tmp_path / "te")
    local = run_world(_resume_worker, 1, [], None, str(tmp_path / "te"), 10)[0]
    assert max(abs(a - b) / b for (_, a), (_, b) in zip(local, te_run[5:])) < 1e-5
    local_run = run_world(_resume_worker, 1, [], str(tmp_path / "local"), None, 10)[0]
    _from_iteration_5(tmp_path / "local")
    te_resumed = run_world(_resume_worker, 2, TE + tp2, None, str(tmp_path / "local"), 10)[0]
    assert max(abs(a - b) / b for (_, a), (_, b) in zip(te_resumed, local_run[5:])) < 1e-5


@pytest.mark.slow
def test_reshard_and_serial_tools_read_te_checkpoints_without_te(standin, tmp_path):
    """Offline tools build megalite's own layers from a TE checkpoint; FP8 state survives a reshard."""
    import subprocess
    import sys

    from megalite.checkpoint.format import PieceReader
    from megalite.checkpoint.serial import load_serial_model
    from megalite.train.pretrain import pretrain
    pretrain(PRETRAIN + TE + FP8 + ["--train-iters", "2", "--save", str(tmp_path / "ck")])
    model = load_serial_model(str(tmp_path / "ck"))
    assert model.cfg.transformer_impl == "local"
    subprocess.run([sys.executable, "tools/reshard_checkpoint.py", "--load", str(tmp_path / "ck"), "--save",
                    str(tmp_path / "tp2"), "--target-tensor-model-parallel-size", "2"], check=True)
    src, dst = PieceReader(str(tmp_path / "ck" / "iter_0000002")), PieceReader(str(tmp_path / "tp2" / "iter_0000002"))
    assert dst.names("fp8") == src.names("fp8") and len(src.names("fp8")) == 4 * 2 * 4  # 4 linears x 2 layers
    for name in src.names("fp8"):
        assert torch.equal(dst.full_tensor(name, "fp8"), src.full_tensor(name, "fp8"))


def test_fp8_autocast_signature_of_te_before_2_9(monkeypatch):
    """TE 2.0-2.8 has only fp8_autocast(fp8_recipe=, fp8_group=); 2.9+ autocast(recipe=, amax_reduction_group=).
    The stand-in runs both through one implementation, so this shows only that both paths train
    alike; the names and keywords are checked against the real 2.8.0 and newest wheels in
    tests/test_te_real_signatures.py."""
    from megalite.train.pretrain import pretrain
    te_standin.install(monkeypatch, version="2.8")
    old = [r["loss"] for r in pretrain(PRETRAIN + TE + FP8 + ["--train-iters", "4"])]
    te_standin.install(monkeypatch, version="2.9")
    new = [r["loss"] for r in pretrain(PRETRAIN + TE + FP8 + ["--train-iters", "4"])]
    assert old == new


# -- the real transformer-engine, on a GPU ------------------------------------------------------
# transformer-engine cannot be installed without CUDA and cuDNN: the CPU cases run the same test
# bodies with the stand-in installed (so they check the tests' own logic, not the real library),
# on smaller models.
def _real_te(device="cuda", monkeypatch=None):
    from megalite.layers import backends
    if device == "cpu":
        te_standin.install(monkeypatch)
        monkeypatch.setattr(backends, "te_missing", lambda: None)
    why = backends.te_missing()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("device", DEVICES)
def test_real_te_matches_local_layers_on_gpu(device, monkeypatch):
    _real_te(device, monkeypatch)
    size = dict(hidden_size=256, seq_length=128, vocab_size=512) if device == "cuda" else \
        dict(hidden_size=64, seq_length=32, vocab_size=128)
    cfg = ModelConfig(num_layers=2, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, **size,
                      **VARIANTS["llama"])
    results = []
    for impl in ("local", "transformer_engine"):
        c = dataclasses.replace(cfg, transformer_impl=impl)
        with torch.device("meta"):
            model = GPTModel(c)
        from megalite.model.gpt import materialize
        model = materialize(model, torch.device(device))
        model.init_weights(7)
        model = model.to(torch.bfloat16)
        x = torch.randint(0, c.vocab_size, (4, c.seq_length + 1), device=device,
                          generator=torch.Generator(device).manual_seed(3))
        loss = model(x[:, :-1], labels=x[:, 1:]).float().mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert list(g0) == list(g1) and abs(l0 - l1) < 2e-2 * l0
    for name in g0:  # bf16: kernels differ in rounding only
        err = ((g0[name] - g1[name]).norm() / g0[name].norm().clamp_min(1e-12)).item()
        assert err < 5e-2, (name, err)


@pytest.mark.parametrize("device", [cpu(pytest.mark.slow), CUDA])  # cpu: two bf16 CPU runs, ~1.5 s
def test_real_te_fp8_trains_and_its_state_round_trips(tmp_path, device, monkeypatch):
    _real_te(device, monkeypatch)
    import transformer_engine.pytorch as te
    if hasattr(te, "is_fp8_available") and not te.is_fp8_available():
        pytest.skip("this GPU has no FP8")
    from megalite.train.pretrain import pretrain
    size = ["--hidden-size", "256", "--seq-length", "128"] if device == "cuda" else \
        ["--hidden-size", "128", "--seq-length", "16", "--device", "cpu"]
    args = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", *size,
            "--num-attention-heads", "4", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "6", "--lr", "1e-3", "--bf16", "--log-interval", "100"] + TE + FP8
    full = [r["loss"] for r in pretrain(args + ["--save", str(tmp_path), "--save-interval", "3"])]
    # from iteration 3: the run saved at 3 and at 6 too, and "latest" (6) would leave nothing to train
    resumed = [r["loss"] for r in pretrain(args + ["--load", str(tmp_path), "--ckpt-step", "3"])]
    assert all(torch.isfinite(torch.tensor(full))) and full[-1] < full[0]
    assert resumed == pytest.approx(full[3:], rel=1e-3)


# -- --tp-comm-overlap (TE userbuffers) ---------------------------------------------------------
def _overlap_worker(rank, world):
    from megalite.arguments import build_parser, config_from_args
    from megalite.layers.transformer_engine import tp_comm_overlap
    from megalite.parallel.grid import build_grid
    from megalite.pipeline.partition import build_model_chunks
    argv = PRETRAIN + TE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                            "--tp-comm-overlap", "--tp-comm-bootstrap-backend", "gloo"]
    config = config_from_args(build_parser().parse_args(argv), vocab_size=300)
    grid = build_grid(config.parallel, world, rank)
    release = tp_comm_overlap(config)
    layer = build_model_chunks(config, grid)[0].layers["0"]
    linears = {path.split(".")[1]: layer.get_submodule(path) for path in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    switches = {name: {k for k, on in linear.ub.items() if on} for name, linear in linears.items()}
    names = [linear.ub_name for linear in linears.values()]
    ub = dict(te_standin.UB["initialized"])
    release()
    return switches, names, ub, te_standin.UB["initialized"]


def test_tp_comm_overlap_sets_up_userbuffers_and_each_linear_overlap(standin):
    switches, names, ub, after = run_world(_overlap_worker, 2)[0]
    # buffers for one micro-batch of all TP ranks' tokens (s b / CP, h), before any layer is built
    assert ub == dict(shape=[16 * 2, 32], tp_size=2, use_fp8=False, dtype=torch.bfloat16, bootstrap_backend="gloo")
    column, row = {"ag_fprop", "bulk_dgrad", "bulk_wgrad"}, {"rs_fprop", "ag_dgrad"}
    assert switches == {"qkv": column, "proj": row, "fc1": column, "fc2": row}
    assert names == ["qkv", "proj", "fc1", "fc2"] and after is None  # freed again


def _overlap_train_worker(rank, world, extra):
    return _pretrain_worker(rank, world, extra), dict(te_standin.UB["used"])


OVERLAP_BASE = TE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", "--train-iters", "4",
                     "--tp-comm-bootstrap-backend", "gloo"]


def test_tp_comm_overlap_trains_as_without_it_and_its_userbuffers_fit(standin):
    """The stand-in keeps the plain collectives (the numbers cannot change), so what is tested is
    that every tensor the switched-on userbuffers carry, forward and backward, fits the buffers
    ``initialize_ub`` was given (TE's names, shape (s b / CP, h), dtype); and the losses."""
    plain = run_world(_pretrain_worker, 2, OVERLAP_BASE)[0]
    for log, used in run_world(_overlap_train_worker, 2, OVERLAP_BASE + ["--tp-comm-overlap"]):
        assert log == plain
        # column layers: input all-gather (fprop), bulk dgrad and wgrad; row layers: output
        # reduce-scatter (fprop) and output-gradient all-gather (dgrad); as often each (every
        # layer of every micro-batch, forward and backward)
        names = {f"{n}_{p}" for n in ("qkv", "fc1") for p in ("fprop", "dgrad", "wgrad")}
        names |= {f"{n}_{p}" for n in ("proj", "fc2") for p in ("fprop", "dgrad")}
        assert set(used) == names and len(set(used.values())) == 1 and min(used.values()) > 0, used


def _wrong_ub_worker(rank, world, extra, rows):
    """The fault: userbuffers of ``rows(s b / CP)`` rows instead of what tp_comm_overlap asked for."""
    import sys
    base = sys.modules["transformer_engine.pytorch"].module.base
    right = base.initialize_ub
    base.initialize_ub = lambda shape, **kw: right([rows(shape[0]), shape[1]], **kw)
    return _pretrain_worker(rank, world, extra)


def test_tp_comm_overlap_userbuffer_check_catches_a_wrong_buffer_size(standin):
    """Mutation: buffers for one micro-batch of one TP rank's tokens (s b / TP) fail the check."""
    with pytest.raises(Exception, match=r"userbuffer qkv_fprop: a \[32, 32\] tensor in a buffer of \[16, 32"):
        run_world(_wrong_ub_worker, 2, OVERLAP_BASE + ["--tp-comm-overlap"], lambda n: n // 2)


@pytest.mark.parametrize("flags,message", [
    ([], "Fix: add --sequence-parallel"),
    (["--sequence-parallel", "--bf16", "--tensor-model-parallel-size", "1"], "at --tensor-model-parallel-size 1"),
    (["--sequence-parallel"], "Fix: add --bf16"),
    (["--sequence-parallel", "--bf16", "--num-experts", "4"], "MoE layers' experts are megalite's own"),
])
def test_tp_comm_overlap_refused_where_it_cannot_run(standin, flags, message):
    from megalite.arguments import build_parser, config_from_args
    from megalite.config import ConfigError, validate
    argv = PRETRAIN + TE + ["--tensor-model-parallel-size", "2", "--tp-comm-overlap"] + flags
    with pytest.raises(ConfigError) as e:
        validate(config_from_args(build_parser().parse_args(argv), vocab_size=300), 2)
    assert message in str(e.value) and str(e.value).count("Fix:") == 1
