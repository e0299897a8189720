"""Pipeline parallelism against the serial computation: GPipe, 1F1B and interleaved 1F1B,
PP=2 and 4, M in {P, 2P, odd}, with TP and DP; memory bound; schedule rules."""
import pytest
import torch

from megalite.config import (Config, ConfigError, DataConfig, ModelConfig, ParallelConfig,
                             TrainConfig, validate)
from megalite.model.gpt import GPTModel
from megalite.parallel import comm
from megalite.parallel.grid import build_grid
from megalite.parallel.sharding import gather_full
from megalite.pipeline.partition import build_model_chunks, chunk_layers
from megalite.testing import run_world
from megalite.train.step import forward_backward
from megalite.testing.reference_step import reduce_gradients

TOL = 1e-5
MICRO = 2


def make_config(layers, tp=1, pp=1, vp_layers=None, sp=False, schedule="1f1b", variant="gpt2"):
    extra = {} if variant == "gpt2" else dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=2)
    model = ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=97,
                        seq_length=16, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers_per_virtual_pipeline_stage=vp_layers, sequence_parallel=sp)
    return Config(model, parallel, TrainConfig(micro_batch_size=MICRO, pipeline_schedule=schedule),
                  DataConfig(mock_data=True))


def micro_batches(cfg, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        x = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length + 1), generator=g)
        out.append({"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(MICRO, cfg.seq_length),
                    "position_ids": torch.arange(cfg.seq_length).expand(MICRO, -1)})
    return out


def serial_reference(config, batches):
    model = GPTModel(config.model)
    model.init_weights(3)
    loss = forward_backward(model, batches, config.train)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline_worker(rank, world, cases):
    results = []
    for case in cases:
        config = make_config(**case["config"])
        config.train.global_batch_size = MICRO * case["m"]
        validate(config, world)
        grid = build_grid(config.parallel, world, rank)
        batches = micro_batches(config.model, case["m"])
        ref_loss, ref_grads = serial_reference(config, batches)
        chunks = build_model_chunks(config, grid)
        for c in chunks:
            c.init_weights(3)
        # Each DP replica takes every DP-th micro-batch, as the sampler would.
        mine = batches[grid.dp_rank::grid.layout.dp]
        loss = forward_backward(chunks, mine, config.train, grid=grid)
        loss = comm.all_reduce(loss, grid.dp_cp_group) / grid.layout.dp  # the replicas' mean
        params = [p for c in chunks for p in c.parameters()]
        reduce_gradients(params, grid)
        errs = {"loss": abs(loss.item() - ref_loss) / ref_loss}
        gmax = max(g.abs().max().item() for g in ref_grads.values())
        names = set()
        for c in chunks:
            for name, p in c.named_parameters():
                full = gather_full(p.grad, getattr(p, "tp_split", None), grid.tp_group)
                ref = ref_grads[name]
                full = full[: ref.shape[0]]  # padded vocabulary rows
                errs[name] = ((full - ref).abs().max() / ref.abs().max().clamp_min(1e-3 * gmax)).item()
                names.add(name)
        results.append((case, errs, sorted(names)))
    return results


def _check(results_per_rank, num_params):
    for case_idx in range(len(results_per_rank[0])):
        all_names = set()
        for rank_results in results_per_rank:
            case, errs, names = rank_results[case_idx]
            bad = {k: v for k, v in errs.items() if v > TOL}
            assert not bad, (case, bad)
            all_names |= set(names)
        assert len(all_names) == num_params, case  # every parameter checked on some rank


def cases(pp, configs):
    return [{"config": dict(layers=layers, pp=pp, **cfg), "m": m} for layers, cfg, m in configs]


def _num_params(layers, variant="gpt2"):
    return len(list(GPTModel(make_config(layers, variant=variant).model).parameters()))


def test_pp2_schedules_match_serial():
    todo = cases(2, [(4, {}, 2), (4, {}, 4), (4, {}, 3),
                     (4, {"schedule": "gpipe"}, 2), (4, {"schedule": "gpipe"}, 3),
                     (4, {"vp_layers": 1}, 2), (4, {"vp_layers": 1}, 4), (4, {"vp_layers": 1}, 6)])
    _check(run_world(_pipeline_worker, 2, todo), _num_params(4))


@pytest.mark.slow
def test_pp4_schedules_match_serial():
    todo = cases(4, [(8, {}, 4), (8, {}, 8), (8, {}, 5), (8, {"schedule": "gpipe"}, 5),
                     (8, {"vp_layers": 1}, 4), (8, {"vp_layers": 1}, 8)])
    _check(run_world(_pipeline_worker, 4, todo), _num_params(8))


def test_tp2_pp2_and_dp2_pp2_match_serial():
    todo = [{"config": dict(layers=4, pp=2, tp=2), "m": 4},
            {"config": dict(layers=4, pp=2, tp=2, sp=True), "m": 3},
            {"config": dict(layers=4, pp=2, tp=2, vp_layers=1, sp=True), "m": 4},
            {"config": dict(layers=4, pp=2, tp=2, variant="llama"), "m": 2}]
    results = run_world(_pipeline_worker, 4, todo)
    _check([[r[i] for i in range(3)] for r in results], _num_params(4))
    _check([[r[3]] for r in results], _num_params(4, "llama"))
    # DP=2 x PP=2: 4 micro-batches, 2 per replica; gradients averaged once per step.
    _check(run_world(_pipeline_worker, 4, [{"config": dict(layers=4, pp=2), "m": 4}]), _num_params(4))


def test_partition_layers():
    assert [list(chunk_layers(8, 2, 1, p, 0)) for p in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # interleaved: chunk c of rank p holds global chunk c*P + p
    assert [list(chunk_layers(8, 2, 2, 0, c)) for c in range(2)] == [[0, 1], [4, 5]]
    assert [list(chunk_layers(8, 2, 2, 1, c)) for c in range(2)] == [[2, 3], [6, 7]]


def _memory_worker(rank, world, schedule, m):
    """Peak number of micro-batches in flight, and peak bytes of saved activations, on each
    stage (saved tensors: what autograd keeps for backward, parameters excluded)."""
    config = make_config(4, pp=world, schedule=schedule)
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(3)
    params = {id(p) for c in chunks for p in c.parameters()}
    live, peak = [0], [0]

    class Saved:
        def __init__(self, t):
            self.t, self.n = t, t.numel() * t.element_size()
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= self.n

    def pack(t):
        return t if id(t) in params else Saved(t)

    def unpack(x):
        return x.t if isinstance(x, Saved) else x

    from megalite.pipeline.executor import ScheduleExecutor
    from megalite.pipeline.plan import resolve_schedule
    from megalite.train.step import activation_shape, stage_forward, stage_loss
    batches = micro_batches(config.model, m)
    runner = ScheduleExecutor(resolve_schedule(schedule, grid.layout.pp, len(chunks)), chunks, batches, grid,
                              activation_shape(chunks[0], MICRO),
                              lambda c, x, b: stage_forward(c, x, b, config.train), stage_loss)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        runner.run()
    # Saved bytes of one micro-batch on this stage, for scale.
    live[0] = 0
    peak_total, peak[0] = peak[0], 0
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = stage_forward(chunks[0], None if grid.pp_rank == 0 else torch.zeros(activation_shape(chunks[0], MICRO), requires_grad=True),
                            batches[0], config.train)
        one = peak[0]
        del out
    return runner.max_in_flight, peak_total, one


@pytest.mark.parametrize("world", [2, 4])
def test_1f1b_keeps_at_most_p_micro_batches_in_flight(world):
    m = 3 * world
    one_f_one_b = run_world(_memory_worker, world, "1f1b", m)
    gpipe = run_world(_memory_worker, world, "gpipe", m)
    in_flight, peak_bytes, one = one_f_one_b[0]  # stage 0
    assert in_flight == world  # P in flight on the first stage, not M
    assert peak_bytes <= world * one * 1.01
    g_in_flight, g_peak, g_one = gpipe[0]
    assert g_in_flight == m and g_peak >= m * g_one * 0.99
    for stage, (flight, _, _) in enumerate(one_f_one_b):
        assert flight == world - stage  # stage p: P - p micro-batches at most


RULE_CASES = [
    (dict(layers=6, pp=4), 4, ["--num-layers (6)", "--pipeline-model-parallel-size (4)"]),
    (dict(layers=8, pp=2, vp_layers=3), 2, ["--num-layers (8)", "PP * layers-per-virtual-stage (6)"]),
    (dict(layers=4, pp=2, vp_layers=2), 2, ["gives 1 virtual stage", "interleaved"]),
    (dict(layers=4, pp=1, vp_layers=2), 1, ["interleaved schedule needs --pipeline-model-parallel-size >= 2"]),
]


@pytest.mark.parametrize("cfg,world,fragments", RULE_CASES)
def test_pipeline_validation_messages(cfg, world, fragments):
    with pytest.raises(ConfigError) as e:
        validate(make_config(**cfg), world)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_interleaved_micro_batch_count_rule():
    config = make_config(layers=8, pp=4, vp_layers=1)
    config.train.global_batch_size = MICRO * 6  # M = 6, not a multiple of P = 4
    with pytest.raises(ConfigError) as e:
        validate(config, 4)
    msg = str(e.value)
    assert "number of micro-batches (6 = global batch 12" in msg
    assert "multiple of --pipeline-model-parallel-size (4)" in msg and "multiple of 8" in msg


# -- pretrain_gpt.py end to end -----------------------------------------------------------------

PRETRAIN = ["--mock-data", "--vocab-size", "300", "--num-layers", "8", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "10", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100",
            "--eval-interval", "5", "--eval-iters", "1"]  # 10 iterations, two evaluations: every
# step, loss and grad norm compared (20 iterations before: the same code paths, twice the time)


def _pretrain_worker(rank, world, extra):
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"], r.get("valid_loss")) for r in pretrain(PRETRAIN + extra)]


@pytest.mark.slow
def test_pretrain_pipeline_layouts_match_pp1_per_iteration(tmp_path):
    from megalite.train.pretrain import pretrain
    serial = [(r["loss"], r["grad_norm"], r.get("valid_loss")) for r in pretrain(PRETRAIN)]
    layouts = {
        "PP=2 1F1B": (2, ["--pipeline-model-parallel-size", "2"]),
        "PP=4 1F1B": (4, ["--pipeline-model-parallel-size", "4"]),
        "PP=2 GPipe": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]),
        "PP=4 interleaved V=2": (4, ["--pipeline-model-parallel-size", "4",
                                     "--num-layers-per-virtual-pipeline-stage", "1"]),
        "TP=2 x PP=2": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    }
    assert len(serial) == 10 and sum(r[2] is not None for r in serial) == 2
    worst = {}
    for name, (world, extra) in layouts.items():
        if name == "PP=4 interleaved V=2":
            extra = extra + ["--pipeline-trace", str(tmp_path / "trace")]
        logs = run_world(_pretrain_worker, world, extra)
        assert len(logs) == world
        for rank_log in logs:
            assert len(rank_log) == len(serial), (name, len(rank_log))
            for got, ref in zip(rank_log, serial):
                assert len(got) == len(ref) and got[0] is not None, (name, got)
                for a, b in zip(got, ref):
                    if b is not None:
                        worst[name] = max(worst.get(name, 0.0), abs(a - b) / b)
    print("largest relative loss / grad-norm / valid-loss difference vs PP=1, 10 iterations:", worst)
    assert set(worst) == set(layouts), "a layout was not compared"
    assert all(v < 1e-5 for v in worst.values()), worst
    assert len(list((tmp_path / "trace").glob("trace_rank*.json"))) == 4


def test_bubble_measure_and_timeline_picture(tmp_path):
    from megalite.pipeline.op_lists import theory_bubble
    from megalite.observe.timeline import draw_timeline, measured_bubble, schedule_name
    # Ideal GPipe-like trace, P=2, M=2, unit forward and backward: each rank idles 2 of 6 units.
    events = [[("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 4, 5), ("B", 1, 0, 5, 6)],
              [("F", 0, 0, 1, 2), ("F", 1, 0, 2, 3), ("B", 0, 0, 3, 4), ("B", 1, 0, 4, 5)]]
    assert measured_bubble(events) == pytest.approx(2 / 6)
    assert theory_bubble("1f1b", 2, 2) == pytest.approx(1 / 3) and theory_bubble("1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert schedule_name(events) == "GPipe" and schedule_name(events, 2) == "interleaved 1F1B"
    one_f_one_b = [events[0], [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 3), ("F", 1, 0, 3, 4), ("B", 1, 0, 4, 5)]]
    assert schedule_name(one_f_one_b) == "1F1B"

    matplotlib = pytest.importorskip("matplotlib")
    import xml.etree.ElementTree as ET

    import matplotlib.image
    import numpy as np
    paths = draw_timeline(events, str(tmp_path / "t.png"), labels=["stage 0 (rank 4)", "stage 1 (rank 5)"],
                          formats=["png", "svg"])
    assert paths == [str(tmp_path / "t.png"), str(tmp_path / "t.svg")]
    image = matplotlib.image.imread(paths[0])
    assert image.ndim == 3 and image.shape[0] > 150 and image.shape[1] > 600
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # not a blank picture
    texts = [e.text or "" for e in ET.parse(paths[1]).iter() if e.tag.endswith("text")]
    for wanted in ("stage 0 (rank 4)", "stage 1 (rank 5)", "GPipe schedule, P=2 stages, M=2 micro-batches",
                   "bubble: measured 0.333", "time since the step's first operation (ms)", "forward",
                   "backward", "idle 33%"):
        assert any(wanted in t for t in texts), (wanted, texts)
    assert draw_timeline(events, str(tmp_path / "x.svg")) == [str(tmp_path / "x.svg")]  # format from the name


def _tied_worker(rank, world):
    from megalite.train.step import LossScaler
    from megalite.testing.reference_step import build_optimizer, train_step
    config = make_config(4, pp=world)
    config.train.global_batch_size = MICRO * 4
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(3)
    opt = build_optimizer(chunks, config.train)
    start = chunks[0].word_embeddings.weight.detach().clone() if hasattr(chunks[0], "word_embeddings") else None
    for step in range(3):
        train_step(chunks, opt, micro_batches(config.model, 4, seed=step), config.train, step,
                   LossScaler(False), grid)
    if not hasattr(chunks[0], "word_embeddings"):
        return None
    return start, chunks[0].word_embeddings.weight.detach().clone()


@pytest.mark.parametrize("world", [2, 4])
def test_tied_embedding_copies_start_and_stay_equal(world):
    results = run_world(_tied_worker, world)
    (first_start, first_end), (last_start, last_end) = results[0], results[-1]
    assert all(r is None for r in results[1:-1])  # middle stages hold no embedding
    assert torch.equal(first_start, last_start)
    assert not torch.equal(first_start, first_end)  # it trained
    assert torch.equal(first_end, last_end)
