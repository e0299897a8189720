"""Data parallel (the simple all-reduce reference) against serial, and the RNG streams."""
import torch

from megalite.config import ParallelConfig, TrainConfig
from megalite.parallel.grid import build_grid
from megalite.parallel.random import get_rng_tracker, model_parallel_seed
from megalite.testing import run_world
from megalite.train.step import LossScaler
from megalite.testing.reference_step import build_optimizer, train_step
from tests.test_model import batch, build, split, tiny

STEPS, GLOBAL, MICRO = 3, 8, 2


def _global_batches(cfg):
    return [batch(cfg, GLOBAL, seed=100 + s) for s in range(STEPS)]


def _micro_batches_for(global_batch, dp_rank, dp_size):
    """Megatron's order: step k of MICRO*DP samples, rank r takes its MICRO of them."""
    chunks = split(global_batch, GLOBAL // MICRO)
    return [c for i, c in enumerate(chunks) if i % dp_size == dp_rank]


def _train(cfg, dp_rank=0, dp_size=1, grid=None):
    model = build(cfg, seed=5)
    t = TrainConfig(lr=1e-3, train_iters=STEPS)
    opt = build_optimizer(model, t)
    losses, grads = [], []
    for s, gb in enumerate(_global_batches(cfg)):
        r = train_step(model, opt, _micro_batches_for(gb, dp_rank, dp_size), t, s, LossScaler(False), grid)
        losses.append((r.loss, r.grad_norm))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    return losses, grads


def _dp_worker(rank, world_size):
    grid = build_grid(ParallelConfig(), world_size, rank)
    return _train(tiny(), grid.dp_rank, grid.layout.dp, grid)


def test_data_parallel_2_and_4_match_serial():
    """Loss, grad norm and every gradient of every step (after optimizer steps in between).
    Gradients are compared with an absolute floor: some are zero in exact arithmetic (the
    key bias, to which softmax is invariant) and are float noise in both runs."""
    ref_losses, ref_grads = _train(tiny())
    for world in (2, 4):
        for losses, grads in run_world(_dp_worker, world):
            for (l, n), (rl, rn) in zip(losses, ref_losses):
                assert abs(l - rl) / rl < 1e-5 and abs(n - rn) / rn < 1e-5
            for step, (g, rg) in enumerate(zip(grads, ref_grads)):
                for k in rg:
                    assert torch.allclose(g[k], rg[k], rtol=1e-5, atol=1e-7), (world, step, k)


def _rng_worker(rank, world_size):
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=2), world_size, rank)
    tracker = model_parallel_seed(1234, grid)
    x = torch.ones(64)
    default_mask = torch.nn.functional.dropout(x, 0.5)
    with tracker.fork():
        tp_mask = torch.nn.functional.dropout(x, 0.5)
    after_fork = torch.nn.functional.dropout(x, 0.5)
    # The fork must not consume the default stream: reseed and redraw without the fork.
    model_parallel_seed(1234, grid)
    d1, d2 = torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(d1, default_mask) and torch.equal(d2, after_fork)
    return grid.coord.__dict__, default_mask, tp_mask


def test_dropout_streams_agree_and_differ_where_they_should():
    results = run_world(_rng_worker, 4)  # TP=2 x DP=2
    by = {(c["tp"], c["dp"]): (d, t) for c, d, t in results}
    for dp in (0, 1):  # replicated tensors: same mask on both TP ranks
        assert torch.equal(by[(0, dp)][0], by[(1, dp)][0])
        assert not torch.equal(by[(0, dp)][1], by[(1, dp)][1])  # split tensors: differ over TP
    for tp in (0, 1):  # different data-parallel replicas: different masks
        assert not torch.equal(by[(tp, 0)][0], by[(tp, 1)][0])
        assert not torch.equal(by[(tp, 0)][1], by[(tp, 1)][1])


def test_rng_tracker_state_round_trip():
    tracker = model_parallel_seed(5)
    state = tracker.state_dict()
    assert set(state) == {"default.cpu", "tensor-parallel.cpu"}  # no CUDA state on a CPU run
    with tracker.fork():
        a = torch.rand(4)
    b = torch.rand(4)
    tracker.load_state_dict(state)
    with tracker.fork():
        assert torch.equal(torch.rand(4), a)
    assert torch.equal(torch.rand(4), b)
    _ = get_rng_tracker()
