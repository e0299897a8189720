"""MoE faults that only a GPU would show, caught on the CPU.

1. The fake process group moves no data: a collective's output buffer made with
   ``empty``/``empty_like`` keeps whatever memory held (on a GPU: garbage; on the CPU often
   zeros, which hides the fault). Here every ``empty`` is filled with garbage (negative ints,
   NaN floats) to play the GPU, and one rank of a fake EP group runs the layer on CPU tensors:
   the split sizes must be the balanced ones, and forward and backward must run, finite.
2. The router's logits are fp32 under autocast (CPU autocast casts ``linear`` too).
3. The (source rank, local expert) -> (local expert, source rank) permutation, vectorised,
   equals the old loop of aranges.
4. Host syncs per MoE layer forward/backward, counted by wrapping the Tensor methods that read
   a value to the host (only calls made from megalite's own code: the Triton interpreter
   copies to the host on its own, which a GPU launch does not):

   ===============================  ========  ========
   case                             forward   backward
   ===============================  ========  ========
   EP=1 dropless, grouped GEMM      0         0
   EP=1 dropless, torch loop        1         0
   EP=1 capacity (either experts)   1         0
   EP=2 (gloo), any of the above    1         0
   ===============================  ========  ========

   A sync inside a torch op (``nonzero``, ``repeat_interleave`` without ``output_size``) is not
   seen here; the GPU test at the end runs the layer under ``torch.cuda.set_sync_debug_mode``.

The two ``gpu`` tests at the end have ``cpu`` cases (tests/device_twins.py) that run the same
bodies here: the sync-debug test with a fake ``set_sync_debug_mode`` that counts megalite's host
reads instead (the interpreter's grouped GEMM), the fake-group test on CPU tensors in this process.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from megalite.moe import MoELayer
from megalite.moe.dispatch import expert_major_permutation
from megalite.moe.router import TopKRouter
from megalite.observe.host_syncs import count_host_syncs
from megalite.testing import run_world
from tests.device_twins import CUDA, DEVICES, FakeSyncDebugMode, cpu

H, FFN, E, K, T = 16, 12, 8, 2, 20
SEED, STD = 1234, 0.3


def _layer(ep_group=None, cf=None, token_group=None, grouped=False):
    layer = MoELayer(H, FFN, E, K, ep_group=ep_group, token_group=token_group, capacity_factor=cf,
                     aux_loss_coeff=0.1, z_loss_coeff=0.01, grouped_gemm=grouped)
    layer.init_weights(SEED, "layers.0.mlp.", std=STD)
    return layer


def _data(tokens, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)


# -- 1. the fake process group on a non-meta device ---------------------------------------------------

def _fill_garbage(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(float("nan") if t.dtype.is_floating_point else -1234567)


@contextlib.contextmanager
def garbage_empty():
    """``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return garbage, as
    uninitialised GPU memory may be."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    empty, empty_like, new_empty = saved
    torch.empty = lambda *a, **kw: _fill_garbage(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: _fill_garbage(empty_like(*a, **kw))
    torch.Tensor.new_empty = lambda self, *a, **kw: _fill_garbage(new_empty(self, *a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved


def _start_fake(rank, world):
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()  # the harness's gloo world of one
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _fake_cpu_worker(_rank, _world, ep, cf, token_group):
    """Rank 1 of a fake EP group of ``ep`` ranks, CPU tensors, garbage in every empty buffer."""
    _start_fake(1, ep)
    splits = []
    real = dist.all_to_all_single

    def observed(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        if output_split_sizes is not None:
            splits.append((list(output_split_sizes), list(input_split_sizes)))
        return real(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = observed
    try:
        with garbage_empty():
            layer = _layer(dist.group.WORLD, cf, dist.group.WORLD if token_group else None)
            x, g = _data(T)
            x.requires_grad_(True)
            out, loss = layer(x)
            ((out * g).sum() + loss).backward()
    finally:
        dist.all_to_all_single = real
    finite = bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all()
                  and torch.isfinite(layer.experts.w1.grad).all())
    return splits, finite, list(layer.local_experts)


@pytest.mark.parametrize("cf,token_group", [(None, False), (1.0, True)])
def test_fake_group_rank_on_cpu_routes_balanced(cf, token_group):
    """Balanced routing: T*K = 40 rows, 5 per expert, 10 per rank of 4 (2 experts each), out
    and back, forward and backward; with capacity, all T*K rows as on meta (dropped ones have
    weight 0) and the router's all-gathered ids ignored."""
    (splits, finite, local), = run_world(_fake_cpu_worker, 1, 4, cf, token_group, timeout=60)
    assert local == [2, 3]
    assert splits == [([10] * 4, [10] * 4)] * 4
    assert finite


def _pretrain_worker(_rank, _world, extra):
    from megalite.train.pretrain import pretrain

    dist.destroy_process_group()
    os.environ.update({"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"})
    flags = ["--fake-process-group", "--device", "cpu", "--mock-data", "--vocab-size", "256",
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "8",
             "--moe-router-topk", "2", "--expert-model-parallel-size", "4", *extra]
    with garbage_empty():
        log = pretrain(flags)
    if not dist.is_initialized():  # the harness ends with a barrier
        _start_fake(0, 1)
    return [r["iteration"] for r in log]


@pytest.mark.parametrize("extra", [[], ["--moe-expert-capacity-factor", "1.25"]])
def test_pretrain_fake_group_cpu_moe_ep(extra):
    """End to end: rank 0 of TP2 SP x EP4 (8 ranks), fake group, CPU tensors, garbage empties."""
    assert run_world(_pretrain_worker, 1, extra, timeout=120) == [[1, 2]]


# -- 2. the router in fp32 under autocast ---------------------------------------------------------------

def test_router_logits_fp32_under_autocast():
    router = TopKRouter(H, E, K)
    torch.nn.init.normal_(router.weight, std=STD, generator=torch.Generator().manual_seed(0))
    x = _data(T)[0]
    want = router(x)
    seen = []  # the dtype of the logits, as the z-loss's logsumexp receives them
    real_logsumexp = torch.logsumexp

    def logsumexp(t, *a, **kw):
        seen.append(t.dtype)
        return real_logsumexp(t, *a, **kw)

    torch.logsumexp = logsumexp
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = router(x)
    finally:
        torch.logsumexp = real_logsumexp
    assert seen == [torch.float32]  # the logits
    assert got.weights.dtype == got.aux_loss.dtype == got.z_loss.dtype == torch.float32
    assert torch.equal(got.expert_ids, want.expert_ids)
    for name in ("weights", "aux_loss", "z_loss"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# -- 3. the permutation to expert-major order -----------------------------------------------------------

def _old_loop(recv: list[int], P: int, E_local: int) -> torch.Tensor:
    """The loop it replaces: one arange per (local expert e, source rank q)."""
    starts, s = [], 0
    for n in recv:
        starts.append(s)
        s += n
    pieces = [torch.arange(starts[q * E_local + e], starts[q * E_local + e] + recv[q * E_local + e])
              for e in range(E_local) for q in range(P)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("P,E_local", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2), (4, 4)])
def test_expert_major_permutation_equals_the_loop(P, E_local):
    g = torch.Generator().manual_seed(P * 10 + E_local)
    matrices = [torch.zeros(P * E_local, dtype=torch.long)]
    for _ in range(20):
        c = torch.randint(0, 6, (P * E_local,), generator=g)
        c[torch.rand(P * E_local, generator=g) < 0.3] = 0  # zeros: empty (rank, expert) blocks
        matrices.append(c)
    for counts in matrices:
        n = int(counts.sum())
        perm, position = expert_major_permutation(counts, P, E_local, n)
        want = _old_loop(counts.tolist(), P, E_local)
        assert torch.equal(perm, want), counts.tolist()
        assert torch.equal(position[perm], torch.arange(n))  # the inverse


# -- 4. host syncs ---------------------------------------------------------------------------------

def _syncs(layer, x, g):
    x = x.clone().requires_grad_(True)
    with count_host_syncs() as forward:
        out, loss = layer(x)
    with count_host_syncs() as backward:
        ((out * g).sum() + loss).backward()
    return list(forward), list(backward)


@pytest.mark.parametrize("grouped,cf,want", [(True, None, 0), (False, None, 1), (True, 1.0, 1), (False, 1.0, 1)])
def test_host_syncs_ep1(grouped, cf, want):
    x, g = _data(T)
    forward, backward = _syncs(_layer(cf=cf, grouped=grouped), x, g)
    assert (len(forward), len(backward)) == (want, 0), (forward, backward)


def _ep_sync_worker(rank, world):
    x, g = _data(world * T)
    mine = slice(rank * T, (rank + 1) * T)
    group = dist.group.WORLD
    out = {}
    for grouped in (False, True):
        for cf, tokens in ((None, None), (1.0, group)):
            out[(grouped, cf)] = _syncs(_layer(group, cf, tokens, grouped), x[mine], g[mine])
    return out


def test_host_syncs_ep2():
    """One sync per layer forward (the all-to-all split sizes, with capacity's kept count in
    the same read), none in backward; on both ranks, loop or grouped GEMM, dropless or not."""
    for rank_result in run_world(_ep_sync_worker, 2, timeout=120):
        for case, (forward, backward) in rank_result.items():
            assert (len(forward), len(backward)) == (1, 0), (case, forward, backward)


# -- on a GPU ----------------------------------------------------------------------------------------

def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


# cpu: two passes of the interpreter's grouped GEMM, ~1.3 s: slow tier (the fast tier counts the
# same layer's host reads in test_host_syncs_ep1)
@pytest.mark.parametrize("device", [cpu(pytest.mark.slow), CUDA])
def test_no_device_sync_ep1_dropless_grouped_gemm_on_cuda(device, monkeypatch):
    """EP=1, dropless, Triton grouped GEMM: forward and backward without one device->host sync
    (torch raises on any synchronizing CUDA call under sync debug mode "error"). The CPU case:
    the interpreter's kernels, and a fake sync debug mode that raises on megalite's host reads."""
    dev = _device(device)
    if dev.type == "cpu":
        fake = FakeSyncDebugMode.install(monkeypatch)
    layer = _layer(grouped=True).to(dev)
    x, g = (t.to(dev) for t in _data(T))
    x.requires_grad_(True)
    out, loss = layer(x)  # warm-up: the Triton autotuner times its configs (syncs) on first calls
    ((out * g).sum() + loss).backward()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, loss = layer(x)
        ((out * g).sum() + loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all()
    if dev.type == "cpu":
        assert fake.modes == ["error", 0] and fake.reads == [] and fake.synchronized == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cf", [None, 1.0])
def test_fake_group_rank_on_cuda(cf, device):
    """One rank of a fake EP4 group on CUDA tensors (in this process: a forked worker cannot
    use CUDA once the parent has): forward and backward run and give finite numbers. The CPU
    case: the same on CPU tensors, in this process too."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dev = _device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        layer = _layer(dist.group.WORLD, cf, dist.group.WORLD if cf else None).to(dev)
        x, g = (t.to(dev) for t in _data(T))
        x.requires_grad_(True)
        out, loss = layer(x)
        ((out * g).sum() + loss).backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        assert out.device.type == dev.type
    finally:
        dist.destroy_process_group()
