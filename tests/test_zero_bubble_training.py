"""The zero-bubble schedules inside training: pretrain's losses and gradient norms against one
process (fp32, 1e-5 relative).

Fast tier:
- PP2 x DP2 under zb-h1 with ZeRO-1 (overlapped reduction) and under zbv with DDP. Every
  zero-bubble run with the data-parallel optimizer passes its gradient hook the undefined
  gradient a B leaves for its W: this is the case that sees the hook trip over it.
- fp16 with a loss scale so large that the first steps overflow (PP2, zb-h1 and zbv): the same
  steps are skipped as in one process, the scale halves as there, and the losses and norms
  after the skips equal one process's (the skip path under zero-bubble, deferred W included).

Slow tier (one world per size runs every case in sequence; pretrain leaves the process group
up): ZeRO-2 with overlapped reduction, context parallelism and full recomputation, mixture of
experts with expert parallelism, tensor + sequence parallelism, fp16 overflow under DP2 (against
1F1B, which runs the same arithmetic), a checkpoint saved under zbv resumed under 1F1B, 8 ranks,
and the meta dry run.
"""
import functools

import pytest
import torch

from megalite.testing import run_world


TOL = 1e-5
ITERS = "3"
BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
PP2 = ["--pipeline-model-parallel-size", "2"]
MOE_MODEL = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01")
MOE = list(MOE_MODEL) + ["--expert-model-parallel-size", "2"]


def _pretrain(argv) -> list:
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) + ((r["valid_loss"],) if "valid_loss" in r else ())
            for r in pretrain(argv)]


@functools.lru_cache
def serial_log(extra: tuple = ()) -> list:
    return [r[1:] for r in _pretrain(BASE + list(extra) + ["--train-iters", ITERS])]


def worst_rel(log, ref) -> float:
    assert len(log) == len(ref)
    return max(abs(a - b) / abs(b) for got, want in zip(log, ref) for a, b in zip(got, want))


def _world_worker(rank, world, runs, overlap_cases=()):
    out = {name: _pretrain(argv) for name, argv in runs}
    out["overlap"] = [_overlap_check(rank, world, *case) for case in overlap_cases]
    return out


def _overlap_check(rank, world, schedule, stage):
    """PP2 x DP2 with the distributed optimizer: the reductions still start from the gradient
    hooks (which W now fires) while other gradients are still to come, and under DDP / ZeRO-1
    never before the last micro-batch's gradients; the step reads no value to the host."""
    from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
    from megalite.data_parallel.zero import DistributedOptimizer
    from megalite.parallel.grid import build_grid
    from megalite.pipeline.partition import build_model_chunks
    from megalite.train.step import LossScaler
    from megalite.testing.reference_step import train_step

    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0)
    config = Config(model, ParallelConfig(pipeline_model_parallel_size=2),
                    TrainConfig(micro_batch_size=2, global_batch_size=16, pipeline_schedule=schedule),
                    DataConfig(mock_data=True))
    validate(config, world)
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, grid, stage=stage, overlap=True, bucket_size=1500)
    g = torch.Generator().manual_seed(1)
    mine = []
    for _ in range(4):
        x = torch.randint(0, 97, (2, 17), generator=g)
        mine.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(2, 16),
                     "position_ids": torch.arange(16).expand(2, -1)})
    from megalite.observe.host_syncs import count_host_syncs
    with count_host_syncs() as syncs:  # no host read in the step (each would stall a GPU)
        train_step(chunks, opt, mine, config.train, 0, LossScaler(False), grid)
    assert list(syncs) == [], list(syncs)
    log, n_params = opt.sync.launch_log, sum(len(b.params) for b in opt.sync.buckets)
    total = n_params * len(mine)
    overlapped = any(hook and seen < total for _, _, hook, seen in log)
    not_early = stage >= 2 or all(seen > n_params * (len(mine) - 1) for *_, seen in log)
    return overlapped, not_early, len(log)


# -- fast tier ----------------------------------------------------------------------------------
FAST_DP_RUNS = {
    "pp2 dp2 zb-h1 zero-1 overlap": PP2 + ["--pipeline-schedule", "zb-h1", "--zero-stage", "1",
                                           "--overlap-grad-reduce"],
    "pp2 dp2 zbv ddp": PP2 + ["--pipeline-schedule", "zbv"],
}


def test_zero_bubble_with_ddp_and_zero_matches_single_process():
    """PP2 x DP2, zb-h1 with ZeRO-1 and overlapped reduction, zbv with DDP: three iterations'
    losses and gradient norms equal one process's. Under the B/W split autograd still visits a
    weight's AccumulateGrad in B, with an undefined gradient, and runs the data-parallel
    optimizer's hook: a hook that does not pass over it crashes every such run, and this is the
    fast tier's run that would."""
    serial = serial_log()  # first: the ranks fork with pretrain imported
    runs = [(name, BASE + flags + ["--train-iters", ITERS]) for name, flags in FAST_DP_RUNS.items()]
    results = run_world(_world_worker, 4, runs)
    for name in FAST_DP_RUNS:
        worst = 0.0
        for out in results:
            assert [r[0] for r in out[name]] == [1, 2, 3], name
            worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
        assert worst < TOL, (name, worst)


FP16_SCALE = 2.0**22  # above what this model's fp16 gradients hold: the first steps overflow
FP16 = ["--fp16", "--initial-loss-scale", str(FP16_SCALE)]
FP16_ITERS = ["--train-iters", "4"]


def _fp16_pretrain(argv) -> list:
    """Per iteration: (iteration, skipped, loss scale after the step, loss, grad norm), the norm
    None on a skipped step (inf or nan there, which compares to nothing)."""
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["skipped"], r["loss_scale"], r["loss"], None if r["skipped"] else r["grad_norm"])
            for r in pretrain(argv)]


def _fp16_worker(rank, world, runs):
    return {name: _fp16_pretrain(argv) for name, argv in runs}


def same_skips_worst_rel(log, ref) -> float:
    """Assert the same iterations, skips and loss scales; return the largest relative difference
    of the losses and of the norms of the steps applied."""
    assert [r[:3] for r in log] == [r[:3] for r in ref], (log, ref)
    return max(abs(a - b) / abs(b) for got, want in zip(log, ref) for a, b in zip(got[3:], want[3:])
               if b is not None)


def test_fp16_overflow_skips_the_same_steps_under_zero_bubble_as_one_process():
    """fp16 with a loss scale the gradients overflow: PP2 under zb-h1 and zbv skips the steps
    one process skips, halves the scale as it does, and after the skips applies the same
    updates (losses and norms to 1e-5). PP2 x DP1 keeps each rank's micro-batch count, and so
    the scaled gradients that overflow, the serial run's. A deferred weight gradient that
    escaped the skip, or a skipped step that still moved a weight, changes a later loss."""
    serial = _fp16_pretrain(BASE + FP16 + FP16_ITERS)  # first: the ranks fork with pretrain imported
    skipped = [r[1] for r in serial]
    # The premise: the first step overflows and halves the scale; the last two are applied (the
    # update of the first applied step shows in the next loss).
    assert skipped[0] and not any(skipped[-2:]) and serial[0][2] == FP16_SCALE / 2, serial
    runs = [(s, BASE + PP2 + FP16 + FP16_ITERS + ["--pipeline-schedule", s]) for s in ("zb-h1", "zbv")]
    for rank, out in enumerate(run_world(_fp16_worker, 2, runs)):
        for schedule, _ in runs:
            worst = same_skips_worst_rel(out[schedule], serial)
            assert worst < TOL, (rank, schedule, worst)


# -- slow tier ----------------------------------------------------------------------------------
RUNS4 = {
    "pp2 dp2 zbv zero-2 overlap": PP2 + ["--pipeline-schedule", "zbv", "--zero-stage", "2", "--overlap-grad-reduce"],
    # the interleaved 1F1B's buckets reduce-scattered in the order its operation list completes them
    "pp2 dp2 interleaved zero-2 overlap": PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "2",
                                                 "--overlap-grad-reduce"],
    "pp2 cp2 zbv full recompute": PP2 + ["--pipeline-schedule", "zbv", "--context-parallel-size", "2",
                                         "--recompute-granularity", "full"],
    "pp2 dp2 zb-h1 full recompute": PP2 + ["--pipeline-schedule", "zb-h1", "--recompute-granularity", "full"],
    "pp2 cp2 zb-h1 a2a selective recompute": PP2 + ["--pipeline-schedule", "zb-h1", "--context-parallel-size", "2",
                                                    "--cp-comm-type", "a2a", "--recompute-granularity", "selective"],
    "pp2 tp2 sp zbv": PP2 + ["--pipeline-schedule", "zbv", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel"],
}
MOE_RUNS4 = {"pp2 dp2 ep2 zb-h1 moe": PP2 + MOE + ["--pipeline-schedule", "zb-h1"],
             "pp2 dp2 ep2 zbv moe zero-1": PP2 + MOE + ["--pipeline-schedule", "zbv", "--zero-stage", "1"]}
# DP2 doubles what each rank's scaled gradients hold: 2^21 overflows here as 2^22 does in one process.
FP16_DP2 = PP2 + ["--fp16", "--initial-loss-scale", str(FP16_SCALE / 2)]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("zb_resume"))
    iters = ["--train-iters", ITERS]
    runs = [(name, BASE + flags + iters) for name, flags in {**RUNS4, **MOE_RUNS4}.items()]
    runs += [(f"fp16 {s}", BASE + FP16_DP2 + ["--pipeline-schedule", s] + iters) for s in ("1f1b", "zb-h1", "zbv")]
    evaluation = ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2"]
    runs += [(f"eval {s}", BASE + PP2 + ["--pipeline-schedule", s] + evaluation) for s in ("1f1b", "zbv")]
    dropout = ["--hidden-dropout", "0.1"]  # the resume must restore the random streams too
    zbv = PP2 + ["--pipeline-schedule", "zbv"]
    runs += [("zbv saved", BASE + zbv + dropout + iters + ["--save", ckpt + "/a", "--save-interval", "2"]),
             ("zbv resumed", BASE + zbv + dropout + iters + ["--load", ckpt + "/a", "--ckpt-step", "2"]),
             ("zbv saved, no dropout", BASE + zbv + iters + ["--save", ckpt + "/b", "--save-interval", "2"]),
             ("1f1b resumed, no dropout", BASE + PP2 + iters + ["--load", ckpt + "/b", "--ckpt-step", "2"])]
    return run_world(_fp16_world_worker, 4, runs, [("zb-h1", 1), ("zbv", 2)], timeout=400)


def _fp16_world_worker(rank, world, runs, overlap_cases):
    """The fp16 runs log their skips and scales (:func:`_fp16_pretrain`); the others as before."""
    out = _world_worker(rank, world, [r for r in runs if not r[0].startswith("fp16")], overlap_cases)
    out.update(_fp16_worker(rank, world, [r for r in runs if r[0].startswith("fp16")]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS4) + list(MOE_RUNS4))
def test_zero_bubble_pretrain_matches_single_process(world4, name):
    serial = serial_log(MOE_MODEL) if name in MOE_RUNS4 else serial_log()
    worst = 0.0
    for out in world4:
        assert [r[0] for r in out[name]] == [1, 2, 3]
        worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
        assert worst < TOL, (name, worst)
    print(f"{name}: largest relative loss / grad-norm difference vs 1 process: {worst:.2e}")


@pytest.mark.slow
def test_fp16_overflow_under_zero_bubble_with_dp2_equals_1f1b(world4):
    """PP2 x DP2 (the DDP reduction of fp16 gradients that overflow): the zero-bubble runs skip
    the steps 1F1B skips, with its scales, losses and norms (same arithmetic in another order);
    the first step overflows and a later one is applied."""
    for out in world4:
        ref = out["fp16 1f1b"]
        assert ref[0][1] and not ref[-1][1], ref
        for schedule in ("zb-h1", "zbv"):
            assert same_skips_worst_rel(out[f"fp16 {schedule}"], ref) < TOL, schedule


@pytest.mark.slow
def test_checkpoint_saved_under_zbv_resumes(world4):
    """A zbv run resumed from its iteration-2 checkpoint continues exactly, hidden dropout
    included (the random streams are restored). The V placement changes where layers live,
    not their names: a 1F1B run resumed from a zbv checkpoint continues the zbv run too
    (without dropout: the dropout streams are seeded per pipeline rank, so moving a layer to
    another rank changes its masks, as changing PP does)."""
    for out in world4:
        for saved, resumed in (("zbv saved", "zbv resumed"), ("zbv saved, no dropout", "1f1b resumed, no dropout")):
            assert [r[0] for r in out[resumed]] == [3]
            assert worst_rel([r[1:] for r in out[resumed]], [r[1:] for r in out[saved][2:]]) < TOL


@pytest.mark.slow
def test_evaluation_under_zbv_equals_1f1b(world4):
    """Evaluation runs forward only through the V (rank 0 embeds and computes the loss)."""
    for out in world4:
        assert out["eval zbv"][-1][3] == pytest.approx(out["eval 1f1b"][-1][3], rel=TOL)


@pytest.mark.slow
def test_gradient_reduction_stays_overlapped(world4):
    for out in world4:
        for overlapped, not_early, launches in out["overlap"]:  # zb-h1 ZeRO-1, zbv ZeRO-2
            assert launches > 1 and overlapped and not_early


RUNS8 = {
    "pp4 dp2 zb-h1 zero-1": ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--pipeline-schedule", "zb-h1",
                             "--zero-stage", "1", "--overlap-grad-reduce"],
    "pp4 dp2 zbv zero-1": ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--pipeline-schedule", "zbv",
                           "--zero-stage", "1", "--overlap-grad-reduce"],
    "tp2 pp4 sp zb-h1": ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--pipeline-schedule", "zb-h1",
                         "--tensor-model-parallel-size", "2", "--sequence-parallel"],
}


@pytest.mark.slow
@pytest.mark.parametrize("names", [["pp4 dp2 zb-h1 zero-1", "pp4 dp2 zbv zero-1"], ["tp2 pp4 sp zb-h1"]])
def test_zero_bubble_pretrain_on_8_ranks_matches_single_process(names):
    # One world per layout: a world that changes DP2 x PP4 for TP2 x PP4 hangs creating a group,
    # under 1F1B too (a limit of reusing one gloo world, not of the schedules).
    iters = ["--train-iters", ITERS]
    results = run_world(_world_worker, 8, [(n, BASE + RUNS8[n] + iters) for n in names], timeout=300)
    serial = serial_log(("--num-layers", "8"))
    for name in names:
        worst = max(worst_rel([r[1:] for r in out[name]], serial) for out in results)
        assert worst < TOL, (name, worst)


# -- the meta dry run (placement oracle) ---------------------------------------------------------
ZB_LAYOUTS = {
    "tp2-pp2-dp4-zb-h1-zero2-overlap": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                         "--pipeline-schedule", "zb-h1", "--zero-stage", "2",
                                         "--overlap-grad-reduce"], [0, 9, 15]),
    "llama-tp2-pp4-dp2-zbv-sp-bf16": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                                       "--pipeline-schedule", "zbv", "--sequence-parallel", "--bf16",
                                       "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                                       "--num-query-groups", "2", "--disable-bias-linear",
                                       "--num-layers", "8"], [0, 5, 15]),  # zbv: 2 x PP chunks
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(ZB_LAYOUTS))
def test_zero_bubble_meta_dry_run_every_role(monkeypatch, layout):
    """One rank of each role of a 16-rank layout on meta tensors and the fake process group:
    the schedules, the split and the reductions create nothing on the wrong device."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_dry_run import _cpu_tensors_meeting_meta, dry_run
    from megalite.train import step as training

    flags, ranks = ZB_LAYOUTS[layout]
    seen, Watch = _cpu_tensors_meeting_meta(flags)
    step = training.train_step

    def watched(*args, **kwargs):
        with Watch():
            return step(*args, **kwargs)

    monkeypatch.setattr("megalite.train.loop.train_step", watched)
    for rank in ranks:
        log = dry_run(monkeypatch, 16, rank, flags)
        assert [r["iteration"] for r in log] == [1, 2] and log[-1]["comm_bytes"], (layout, rank)
        assert "valid_loss" in log[-1]  # evaluation (forward only, V placement for zbv) ran too
    assert seen == [], sorted(set(seen))
