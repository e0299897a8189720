"""The four context-parallel communication types (p2p ring, a2a Ulysses, allgather, a2a+p2p)
against full attention on one process: outputs and dQ/dK/dV, C = 2 and 4, causal and not, MHA
and GQA (with key/value heads that do and do not divide by the all-to-all size), head dims 64
and 128, the Triton kernels under the interpreter once per type; and the bytes each type hands
to its collectives, forward and backward, against the formulas of context_parallel.traffic."""
import pytest
import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.context_parallel.attention import CP_COMM_TYPES, ContextParallelGroups, context_parallel_attention
from megalite.context_parallel.data import context_parallel_slice
from megalite.context_parallel.traffic import cp_attention_traffic
from megalite.kernels.attention_reference import attention_reference
from megalite.parallel import comm
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 2e-6


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _groups(rank, world, inner_size):
    """The CP groups of a world that is one CP group, a2a+p2p split A = inner_size inner ranks
    (consecutive) by B = world / A outer ranks (strided). Every rank creates every group."""
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    inner = outer = None
    for lo in range(0, world, inner_size):
        g = dist.new_group(list(range(lo, lo + inner_size))) if inner_size > 1 else None
        inner = g if lo <= rank < lo + inner_size else inner
    for i in range(inner_size):
        ranks = list(range(i, world, inner_size))
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        outer = g if rank in ranks else outer
    return grid.cp_group, ContextParallelGroups(grid.cp_group, inner, outer)


def _case(rank, world, groups, comm_type, causal, heads, kv_groups, seq, d, backend):
    g = torch.Generator().manual_seed(seq * 7 + d + heads)
    q = torch.randn(2, heads, seq, d, generator=g)
    k, v = (torch.randn(2, kv_groups, seq, d, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, seq, d, generator=g)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=causal)
    ref.backward(dout.double())

    def mine(t):  # this rank's load-balanced slice of the sequence (dim 2)
        return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world, causal)["x"].view(
            t.shape[0], t.shape[1], -1, t.shape[3])

    ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
    with comm.count_collectives() as fwd:
        out = context_parallel_attention(ql, kl, vl, groups, comm_type, causal=causal, backend=backend)
    with comm.count_collectives() as bwd:
        out.backward(mine(dout))
    errs = {"out": rel(out, mine(ref.detach())), "dq": rel(ql.grad, mine(q64.grad)),
            "dk": rel(kl.grad, mine(k64.grad)), "dv": rel(vl.grad, mine(v64.grad))}
    counted = {"forward": {k: v["bytes"] for k, v in fwd.items()}, "backward": {k: v["bytes"] for k, v in bwd.items()}}
    return errs, counted


def _worker(rank, world, inner_size, cases):
    _, hier = _groups(rank, world, inner_size)
    plain = ContextParallelGroups(hier.group)
    return [_case(rank, world, hier if case[0] == "a2a+p2p" else plain, *case) for case in cases]


def _cases(world):
    """(type, causal, heads, kv groups, seq, d, backend): every type causal and not, MHA and GQA,
    d = 64 and 128, kv groups that do not divide by the all-to-all size, Triton once per type."""
    out = []
    for t in CP_COMM_TYPES:
        out += [(t, True, 4, 4, 8 * world, 64, "torch"), (t, False, 4, 2, 4 * world, 128, "torch"),
                (t, True, 4, 1, 4 * world, 64, "torch"), (t, True, 8, 2, 4 * world, 128, "torch")]
        out.append((t, True, 4, 2, 4 * world, 16, "triton"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,inner", [(2, 2), (4, 2)])
def test_every_comm_type_matches_full_attention_and_its_traffic_formula(world, inner):
    cases = _cases(world)
    results = run_world(_worker, world, inner, cases, timeout=300)
    assert len(results) == world
    worst = {}
    for rank_results in results:
        assert len(rank_results) == len(cases)
        for case, (errs, counted) in zip(cases, rank_results):
            assert set(errs) == {"out", "dq", "dk", "dv"}
            worst[case] = max(worst.get(case, 0.0), *errs.values())
            comm_type, _, heads, kv_groups, seq, d, _ = case
            theory = cp_attention_traffic(comm_type, batch=2, seq=seq, heads=heads, groups=kv_groups, head_dim=d,
                                          cp=world, element_size=4, inner=inner)
            assert counted == theory.handed, (case, counted, theory.handed)
    print(f"C={world} (a2a+p2p as {inner} x {world // inner}), largest relative error per case:", worst)
    assert set(worst) == set(cases)
    assert all(v < TOL for v in worst.values()), {k: v for k, v in worst.items() if v >= TOL}


GQA_A2A_CASES = [("a2a", True, 4, 2, 8, 8, "torch"), ("a2a", False, 8, 2, 8, 8, "torch"),
                 ("a2a", True, 4, 1, 8, 8, "torch"), ("a2a+p2p", True, 4, 2, 8, 8, "torch")]


def test_a2a_under_gqa_sends_key_value_groups_not_every_head():
    """C = 2, GQA: the all-to-all hands its collective q and the output with H heads and K, V
    with their own G' = G groups (G' = lcm(G, 2) = 2 when G = 1), forward and backward:
    (2H + 2G') b L d e bytes each way, written out here and equal to context_parallel.traffic's
    formula; and the result still equals full attention. K/V expanded to every head first
    gives the same numbers with up to twice the bytes: only the count sees it."""
    results = run_world(_worker, 2, 2, GQA_A2A_CASES)
    for rank_results in results:
        for case, (errs, counted) in zip(GQA_A2A_CASES, rank_results):
            comm_type, _, heads, groups, seq, d, _ = case
            kv_groups = groups if groups % 2 == 0 else 2  # whole groups on each of the 2 ranks
            one_way = (2 * heads + 2 * kv_groups) * 2 * (seq // 2) * d * 4  # b = 2, L = s / 2, fp32
            assert counted == {"forward": {"all_to_all": one_way}, "backward": {"all_to_all": one_way}}, case
            theory = cp_attention_traffic(comm_type, batch=2, seq=seq, heads=heads, groups=groups, head_dim=d, cp=2,
                                          element_size=4, inner=2)
            assert counted == theory.handed, (case, theory.handed)
            assert max(errs.values()) < TOL, (case, errs)


def _overlap_worker(rank, world):
    from megalite.context_parallel import allgather as ag
    from megalite.context_parallel.ring_attention import BlockOps, block_ops

    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    log = []
    base = block_ops("torch", torch.zeros(1))

    def forward(q, k, v, causal, scale):
        log.append(("forward", causal))
        return base.forward(q, k, v, causal=causal, scale=scale)

    def backward(*args, causal, **kwargs):
        log.append(("backward", causal))
        return base.backward(*args, causal=causal, **kwargs)

    ops = BlockOps("logged", forward, backward, base.delta)
    wait = ag.GatheredKV.wait
    ag.GatheredKV.wait = lambda self: (log.append(("gathered", None)), wait(self))[1]
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 8, 8, generator=g, requires_grad=True) for _ in range(3))
        ag._AllGatherAttention.apply(q, k, v, grid.cp_group, True, None, ops).sum().backward()
    finally:
        ag.GatheredKV.wait = wait
    return log


def test_allgather_computes_the_diagonal_blocks_while_the_gather_is_in_flight():
    """Forward and backward each start the all-gather, run the two diagonal blocks (local K/V
    only) and only then wait for the gathered K/V for the blocks below the diagonal."""
    for rank, log in enumerate(run_world(_overlap_worker, 2)):
        prefix_blocks = 1 if rank == 0 else 2  # chunks 0, 3 (chunk 0 has no earlier keys); 1, 2
        for phase in ("forward", "backward"):
            start = log.index(("gathered", None)) if phase == "forward" else len(log) - log[::-1].index(
                ("gathered", None)) - 1
            done = [e for e in log[:start] if e[0] == phase]
            after = [e for e in log[start + 1:] if e[0] == phase]
            assert done == [(phase, True), (phase, True)], (rank, log)
            assert after == [(phase, False)] * prefix_blocks, (rank, log)


def _bf16_worker(rank, world):
    _, hier = _groups(rank, world, 2)
    errs = {}
    for comm_type in CP_COMM_TYPES:
        groups = hier if comm_type == "a2a+p2p" else ContextParallelGroups(hier.group)
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 4, 8 * world, 32, generator=g)
        k, v = (torch.randn(2, 2, 8 * world, 32, generator=g) for _ in range(2))
        dout = torch.randn(2, 4, 8 * world, 32, generator=g)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref, _ = attention_reference(q64, k64, v64, causal=True)
        ref.backward(dout.double())

        def mine(t):
            return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world, True)["x"].view(
                t.shape[0], t.shape[1], -1, t.shape[3])

        ql, kl, vl = (mine(t).bfloat16().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, groups, comm_type, causal=True, backend="torch")
        out.backward(mine(dout).bfloat16())
        assert out.dtype == ql.grad.dtype == kl.grad.dtype == torch.bfloat16
        errs[comm_type] = max(rel(out, mine(ref.detach())), rel(ql.grad, mine(q64.grad)),
                              rel(kl.grad, mine(k64.grad)), rel(vl.grad, mine(v64.grad)))
    return errs


def test_every_comm_type_in_bfloat16_stays_within_bfloat16_rounding():
    """bf16 q, k, v at C=4 (a2a+p2p as 2 x 2): outputs and gradients in bf16, within a few bf16
    roundings (2^-8 = 3.9e-3 relative each) of the float64 result, for every type."""
    worst = {}
    for errs in run_world(_bf16_worker, 4):
        for t, e in errs.items():
            worst[t] = max(worst.get(t, 0.0), e)
    print("bf16, largest relative error per type:", worst)
    assert set(worst) == set(CP_COMM_TYPES)
    assert all(e < 1.6e-2 for e in worst.values()), worst
