"""No host sync in the train step; one per log line. The fused AdamW step equals the unfused one.

Host reads of tensor values are counted by megalite.observe.host_syncs (``torch.Tensor`` patches and a
dispatch mode for the synchronizing operators; test_host_sync_counter.py shows it sees each
kind): on a GPU each would wait for the kernels queued before it. The step decides the inf/NaN skip,
the clip coefficient and the fp16 loss scale on the device, so a dense step reads nothing; an
MoE layer with expert parallelism reads its all-to-all split sizes once per forward (they
must be host ints), and none without it on the grouped GEMM (whose kernels, in ``kernels/``,
are megalite's code to the counter). The training loop then reads
every pending step's values with one ``tolist()``.
"""
import math
import types

import pytest
import torch

from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.data_parallel.adamw import FlatAdamW, segments
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.observe.host_syncs import count_host_syncs
from megalite.parallel.grid import build_grid
from megalite.pipeline.partition import build_model_chunks
from megalite.observe.step_values import LossScaler, resolve_steps
from megalite.testing import run_world
from megalite.testing.reference_step import train_step

from tests.device_twins import DEVICES, FakeSyncDebugMode
from tests.test_zero import global_batch


def make_config(tp=1, pp=1, cp=1, ep=1, layers=2, experts=0, fp16=False, grouped=False):
    moe = dict(num_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=1e-2,
               moe_grouped_gemm=grouped) if experts else {}
    model = ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, **moe)
    t = TrainConfig(micro_batch_size=2, global_batch_size=8, lr=3e-3, weight_decay=0.1, clip_grad=0.5,
                    train_iters=3, fp16=fp16)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp, expert_model_parallel_size=ep)
    return Config(model, parallel, t, DataConfig(mock_data=True))


def _sync_worker(rank, world, case):
    """Syncs per step (``steps``, 3 by default) of one layout, and of reading the results at once;
    ``micro`` keeps the first micro-batches of each rank's share only."""
    config = make_config(**case.get("layout", {}))
    grid = build_grid(config.parallel, world, rank, experts=bool(config.model.num_experts))
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(7)
    fp16 = config.train.fp16
    opt = DistributedOptimizer(chunks, config.train, grid, stage=case.get("stage", 0), bucket_size=1500,
                               param_dtype=torch.float16 if fp16 else torch.float32, grad_dtype=torch.float32)
    scaler = LossScaler(fp16, initial_scale=2.0**8)
    dp, r = grid.layout.dp, grid.dp_rank
    per_step, results = [], []
    for s in range(case.get("steps", 3)):
        mine = [b for i, b in enumerate(global_batch(config.model, s)) if i % dp == r][:case.get("micro")]
        with count_host_syncs() as calls:
            results.append(train_step(chunks, opt, mine, config.train, s, scaler, grid))
        per_step.append(list(calls))
    with count_host_syncs() as read:
        resolve_steps(results)
    losses = [x.loss for x in results]
    return per_step, list(read), losses, len(mine)


DENSE = {"single process": (1, {}), "DP2 ZeRO-1": (2, {"stage": 1}), "TP2 PP2 (1F1B)": (4, {"layout": {"tp": 2, "pp": 2}}),
         "DP2 ZeRO-3": (2, {"stage": 3}), "CP2 (ring)": (2, {"layout": {"cp": 2}}), "fp16 dynamic loss scale": (1, {"layout": {"fp16": True}})}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_step_reads_nothing_and_the_log_reads_once(name):
    world, case = DENSE[name]
    run = (lambda f, *a: [f(0, 1, *a)]) if world == 1 else (lambda f, *a: run_world(f, world, *a))
    for per_step, read, losses, _ in run(_sync_worker, case):
        assert per_step == [[], [], []], per_step
        assert read == ["tolist"], read  # all three steps' values in one transfer
        assert all(math.isfinite(x) for x in losses)


def test_moe_step_on_the_grouped_gemm_reads_nothing():
    """A whole train step (router, Triton grouped GEMM forward and backward in the interpreter,
    the optimizer) with one MoE layer, EP1: no read, from megalite/ or from kernels/. One step
    of two micro-batches keeps it in the fast tier."""
    [(per_step, read, losses, _)] = [_sync_worker(0, 1, {"layout": {"experts": 4, "grouped": True, "layers": 1},
                                                         "steps": 1, "micro": 2})]
    assert per_step == [[]] and read == ["tolist"], (per_step, read)
    assert math.isfinite(losses[0])


@pytest.mark.slow
def test_moe_step_reads_split_sizes_once_per_layer_with_expert_parallelism():
    """EP1 on the grouped GEMM: nothing. EP2: one read per MoE layer forward (2 layers x the
    rank's micro-batches), none in backward."""
    [(per_step, read, _, _)] = [_sync_worker(0, 1, {"layout": {"experts": 4, "grouped": True}})]
    assert per_step == [[], [], []] and read == ["tolist"], (per_step, read)
    for per_step, read, _, micro in run_world(_sync_worker, 2, {"layout": {"experts": 4, "ep": 2}}):
        assert [len(calls) for calls in per_step] == [2 * micro] * 3, per_step
        assert read == ["tolist"]


def _unfused_adamw(master, m, v, grad, decay_ranges, step, lr, wd, betas, eps, coeff):
    """The textbook AdamW as separate torch ops (the update this step replaced)."""
    b1, b2 = betas
    for a, z in decay_ranges:
        master[a:z].mul_(1 - lr * wd)
    g = grad.float() * coeff
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
    master.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_equals_the_unfused_step(grad_dtype, monkeypatch):
    """Three shards with decayed and undecayed ranges, clipping, a skipped step (found_inf)
    that changes nothing and does not count; 16-bit gradients cast in bounded slices.

    ``STEP_CHUNK`` is made 7 where it is read: by the step at run time, and as the default
    ``max_len`` of ``segments`` (bound when the function was defined, so patching the module
    constant alone never reached it). The 37-element decayed range is then cut in slices, and
    every fused call's fp32 casts of 16-bit gradients stay under two chunks."""
    import megalite.data_parallel.adamw as adamw
    chunk = 7
    monkeypatch.setattr(adamw, "STEP_CHUNK", chunk)
    monkeypatch.setattr(adamw.segments, "__defaults__", (chunk,))  # several slices per shard
    applied = []
    real_apply = adamw.FlatAdamW._apply

    def apply(self, i, grad, batch, *a):
        applied.append((grad.dtype, [z - a for a, z, _ in batch]))
        return real_apply(self, i, grad, batch, *a)

    monkeypatch.setattr(adamw.FlatAdamW, "_apply", apply)
    g = torch.Generator().manual_seed(0)
    sizes, ranges = [23, 5, 40], [[(0, 10), (14, 20)], [], [(3, 40)]]
    fused = [torch.randn(n, generator=g) for n in sizes]
    ref = [w.clone() for w in fused]
    m_f, v_f = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    m_r, v_r = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    opt = FlatAdamW(fused, m_f, v_f, ranges, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step = 0
    for it, (coeff, skip) in enumerate([(1.0, False), (0.3, False), (0.5, True), (0.7, False)]):
        grads = [torch.randn(n, generator=g).to(grad_dtype) for n in sizes]
        opt.step([x.clone() for x in grads], lr=1e-2 * (it + 1), grad_scale=torch.tensor(1 / coeff),
                 found_inf=torch.tensor(float(skip)))
        if not skip:
            step += 1
            for i in range(3):
                _unfused_adamw(ref[i], m_r[i], v_r[i], grads[i], ranges[i], step, 1e-2 * (it + 1), 0.1,
                               (0.9, 0.95), 1e-8, coeff)
        assert opt.step_count == step
        for a, b in zip(fused + m_f + v_f, ref + m_r + v_r):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    assert max(z - a for shard in opt.segments for a, z, _ in shard) == chunk  # (3, 40) cut in slices
    assert max(n for _, slices in applied for n in slices) == chunk
    if grad_dtype != torch.float32:  # a cast batch is flushed once it reaches a chunk
        assert max(sum(slices) for _, slices in applied) < 2 * chunk, applied


def test_segments_cover_the_shard_once():
    segs = segments([(2, 9), (12, 13)], 20, max_len=4)
    assert [(a, z) for a, z, _ in segs] == [(0, 2), (2, 6), (6, 9), (9, 12), (12, 13), (13, 17), (17, 20)]
    assert [d for *_, d in segs] == [False, True, True, False, True, False, False]


def test_resolve_reads_values_once_and_keeps_them():
    from megalite.observe.step_values import StepResult
    results = [StepResult(torch.tensor(float(i)), torch.tensor(2.0 * i), 0.1, 1.0, torch.tensor(i == 1))
               for i in range(4)]
    with count_host_syncs() as calls:
        resolve_steps(results)
        values = [(r.loss, r.grad_norm, r.skipped, r.loss_scale) for r in results]
    assert calls == ["tolist"]
    assert values == [(0.0, 0.0, False, 1.0), (1.0, 2.0, True, 1.0), (2.0, 4.0, False, 1.0), (3.0, 6.0, False, 1.0)]


def test_dynamic_loss_scale_on_the_device():
    scaler = LossScaler(True, initial_scale=8.0, growth_interval=2, min_scale=2.0)
    history = []
    for inf in (False, True, False, False, True, True, True):
        scaler.update(torch.tensor(inf))
        history.append(float(scaler.scale))
    assert history == [8.0, 4.0, 4.0, 8.0, 4.0, 2.0, 2.0]
    assert scaler.state_dict() == {"scale": 2.0, "clean_steps": 0}


def test_pipeline_trace_takes_the_device_clock(monkeypatch):
    """On a GPU the trace's marks are CUDA events (host timestamps time only the launches)."""
    from megalite.train.loop import step_trace

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    args, t = types.SimpleNamespace(pipeline_trace="out"), types.SimpleNamespace(train_iters=3)
    trace = step_trace(args, 2, t, torch.device("cuda", 0))
    assert trace.clock.cuda and isinstance(trace.clock.mark(), Event)
    assert step_trace(args, 1, t, torch.device("cuda", 0)) is None  # only the last iteration


@pytest.mark.parametrize("device", DEVICES)
def test_dense_step_makes_no_device_sync_on_cuda(device, monkeypatch):
    """On a GPU, torch's sync debug mode raises on any synchronizing CUDA call, those made
    inside torch's C++ code included (the CPU count sees those on its list): a bf16 step with the
    DP optimizer (clipping on, skip and clip decided on the device) makes none. The CPU case
    runs the same bf16 steps (torch's CPU ops) under a fake sync debug mode that raises on
    megalite's host reads (megalite.observe.host_syncs), the reads a GPU would sync on."""
    if device == "cpu":
        fake = FakeSyncDebugMode.install(monkeypatch)
    config = make_config()
    config.train.bf16 = True
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    chunks = build_model_chunks(config, build_grid(config.parallel, 1, 0), device)
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, None, stage=0, param_dtype=torch.bfloat16,
                               grad_dtype=torch.float32)
    batches = [[{k: v.to(device) for k, v in b.items()} for b in global_batch(config.model, s)] for s in range(3)]
    results = [train_step(chunks, opt, batches[0], config.train, 0, LossScaler(False))]  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results += [train_step(chunks, opt, batches[s], config.train, s, LossScaler(False)) for s in (1, 2)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    resolve_steps(results)
    assert all(math.isfinite(r.loss) and not r.skipped for r in results), [r.loss for r in results]
    if device.type == "cpu":
        assert fake.modes == ["error", 0] and fake.reads == [] and fake.synchronized == 1


def test_a_result_of_host_numbers_reads_nothing():
    from megalite.observe.step_values import StepResult
    result = StepResult(1.5, 2.0, 0.1, 1.0, False)
    with count_host_syncs() as calls:
        resolve_steps([result])
    assert calls == [] and (result.loss, result.grad_norm, result.skipped) == (1.5, 2.0, False)
