"""Context parallelism: ring attention against full attention, load balance, overlap, GPT."""
import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.kernels.attention_reference import attention_reference
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _ring_worker(rank, world, causal, heads, groups, seq, d):
    from megalite.context_parallel import ring_attention as ra
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, d, generator=g)
    k = torch.randn(2, groups, seq, d, generator=g)
    v = torch.randn(2, groups, seq, d, generator=g)
    dout = torch.randn(2, heads, seq, d, generator=g)
    # Reference on the whole sequence, float64.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=causal)
    ref.backward(dout.double())

    def mine(t):  # this rank's slice along the sequence (dim 2)
        return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world, causal)["x"].view(
            t.shape[0], t.shape[1], -1, t.shape[3])

    ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
    ra.WORK_LOG.clear()
    exchange = ra.RingExchange(grid.cp_group)
    out = ra.ring_attention(ql, kl, vl, grid.cp_group, causal=causal, exchange=exchange)
    out.backward(mine(dout))
    errs = {"out": rel(out, mine(ref.detach())), "dq": rel(ql.grad, mine(q64.grad)),
            "dk": rel(kl.grad, mine(k64.grad)), "dv": rel(vl.grad, mine(v64.grad))}
    return errs, list(ra.WORK_LOG), exchange.events


CASES = [(2, True, 4, 4, 16, 16), (2, False, 4, 2, 16, 16), (4, True, 4, 2, 32, 16), (4, False, 2, 2, 32, 32),
         (2, True, 2, 1, 24, 32)]


@pytest.mark.parametrize("world,causal,heads,groups,seq,d", CASES)
def test_ring_attention_matches_full_attention(world, causal, heads, groups, seq, d):
    for errs, _, _ in run_world(_ring_worker, world, causal, heads, groups, seq, d):
        assert all(v < TOL for v in errs.values()), errs


def _flops(work, chunk):
    """Attention FLOPs of the logged kernel calls: a full chunk pair costs chunk^2, the causal
    diagonal about half (the kernel skips masked blocks)."""
    return sum(chunk * chunk * (0.5 if diag else 1.0) for _, _, diag in work)


def naive_contiguous_flops(seq, world):
    """Rank r holding positions [r*S/C, (r+1)*S/C) does its diagonal block plus r full blocks."""
    c = seq // world
    return [c * c * (r + 0.5) for r in range(world)]


def test_load_balanced_causal_split_is_equal_across_ranks():
    seq, world = 32, 4
    results = run_world(_ring_worker, world, True, 2, 2, seq, 16)
    flops = [_flops(work, seq // (2 * world)) for _, work, _ in results]
    assert max(flops) / min(flops) - 1 < 0.05, flops
    naive = naive_contiguous_flops(seq, world)
    assert sum(flops) == pytest.approx(sum(naive))  # the same total work...
    assert max(naive) / min(naive) > 5  # ...which the contiguous split spreads 7:1
    # Fully masked pairs do no work: of the 4C chunk pairs a rank meets, 2C + 1 are visible
    # (its two diagonals, then two per visiting block).
    assert all(len(work) == 2 * world + 1 for _, work, _ in results)
    print("causal attention work per rank (chunk-pair units): balanced", flops, "contiguous", naive)


def test_next_kv_transfer_is_in_flight_while_computing():
    results = run_world(_ring_worker, 2, True, 2, 2, 16, 16)
    for _, _, events in results:
        kinds = [e[0] for e in events]
        # forward: the transfer of the next block is posted before its compute starts,
        # and waited for only after the compute of the current block is done.
        first = kinds.index("posted")
        assert kinds[first: first + 4] == ["posted", "compute", "computed", "arrived"]
        t = {k: v for k, v in events[first: first + 4]}
        assert t["posted"] <= t["compute"] < t["computed"] <= t["arrived"]


def test_context_parallel_slice_keeps_true_positions():
    batch = {"position_ids": torch.arange(16).expand(2, -1)}
    assert context_parallel_slice(batch, 0, 2)["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel_slice(batch, 1, 2)["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert context_parallel_slice(batch, 1, 2, causal=False)["position_ids"][0].tolist() == list(range(8, 16))
