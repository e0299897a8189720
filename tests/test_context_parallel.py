"""Context parallelism: the math block functions, ring attention against full attention (torch
and Triton blocks), load balance, overlap (the GPT and pretrain_gpt.py against one process:
tests/test_context_parallel_training.py)."""
import math

import pytest
import torch

from megalite.config import ParallelConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.kernels.attention_reference import (attention_block_backward, attention_block_delta,
                                                  attention_block_forward, attention_reference)
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def naive_attention(q, k, v, causal, q_offset=0, k_offset=0):
    """softmax(q k^T / sqrt(d) + mask) v written out, GQA by repeating k and v; (out, lse)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        i = torch.arange(q.shape[2]).unsqueeze(1) + q_offset
        j = torch.arange(k.shape[2]).unsqueeze(0) + k_offset
        s = s.masked_fill(j > i, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


BLOCK_CASES = [(True, 4, 4, 13, 13, 8), (False, 4, 2, 13, 7, 8), (True, 6, 2, 9, 9, 12),
               (False, 3, 1, 5, 11, 4)]  # (causal, heads, groups, s_q, s_k, d)


@pytest.mark.parametrize("causal,heads,groups,s_q,s_k,d", BLOCK_CASES)
def test_math_block_forward_backward_match_autograd(causal, heads, groups, s_q, s_k, d):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, groups, s_k, d, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64)
    ref, ref_lse = naive_attention(q, k, v, causal)
    out, lse = attention_block_forward(q, k, v, causal=causal)
    assert not out.requires_grad and lse.dtype == torch.float64
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    # Autograd of the torch reference is the oracle of the hand-written backward.
    ref_out, _ = attention_reference(q, k, v, causal=causal)
    ref_out.backward(dout)
    grads = attention_block_backward(q, k, v, out, dout, lse, causal=causal)
    for got, t in zip(grads, (q, k, v)):
        assert got.shape == t.shape and got.dtype == t.dtype
        assert (got - t.grad).abs().max() < 1e-12


def test_math_block_backward_from_global_lse_sums_over_key_blocks():
    """Key blocks at offsets, rows of the first block that see no key, the global lse given by
    the caller (as ring attention does): the blocks' gradients add up to the full ones."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 4, 12, 8, generator=g, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True)
    out.backward(dout)
    delta = attention_block_delta(out.detach(), dout)
    dq = torch.zeros_like(q)
    for lo, hi in ((0, 5), (5, 12)):
        dq_b, dk_b, dv_b = attention_block_backward(q, k[:, :, lo:hi], v[:, :, lo:hi], None, dout,
                                                    lse.detach(), causal=True, k_offset=lo, delta=delta)
        assert torch.isfinite(dq_b).all()
        dq += dq_b
        assert (dk_b - k.grad[:, :, lo:hi]).abs().max() < 1e-12
        assert (dv_b - v.grad[:, :, lo:hi]).abs().max() < 1e-12
    assert (dq - q.grad).abs().max() < 1e-12
    # A query block before every key of the block: lse of such rows is -inf, gradients 0.
    none = torch.full((1, 4, 3), float("-inf"), dtype=torch.float64)
    grads = attention_block_backward(q[:, :, :3], k[:, :, 5:], v[:, :, 5:], out[:, :, :3].detach(),
                                     dout[:, :, :3], none, causal=True, k_offset=5)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in grads)


def test_math_block_16_bit_inputs_compute_in_float32():
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, 16, 8, generator=g).to(torch.bfloat16) for _ in range(4))
    out, lse = attention_block_forward(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    _, ref_lse = attention_reference(*(t.double() for t in (q, k, v)))
    assert (lse.double() - ref_lse).abs().max() < 1e-5  # fp32 lse, not bf16's 1e-2
    grads = attention_block_backward(q, k, v, out, dout, lse)
    assert all(t.dtype == torch.bfloat16 for t in grads)


def test_math_block_runs_on_meta_tensors():
    """Every tensor is made on the inputs' device: meta in, meta out (the dry-run mode)."""
    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)
    q, k, v = meta(2, 4, 6, 8), meta(2, 2, 6, 8), meta(2, 2, 6, 8)
    for causal in (True, False):
        out, lse = attention_block_forward(q, k, v, causal=causal)
        assert out.device.type == lse.device.type == "meta" and lse.shape == (2, 4, 6)
        delta = attention_block_delta(out, meta(2, 4, 6, 8))
        grads = attention_block_backward(q, k, v, out, meta(2, 4, 6, 8), lse, causal=causal, delta=delta)
        assert [t.device.type for t in grads] == ["meta"] * 3
        assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]


class _PlacementExchange:
    """A ring of two without communication: "receives" uninitialized blocks like the sent
    ones. Numbers are meaningless; it lets the ring's own tensor creation run on meta."""
    size, rank = 2, 0

    def __init__(self):
        self.events, self.work = [], []

    def start(self, tensors):
        return [torch.empty_like(t) for t in tensors]

    def finish(self, pending):
        return pending


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_makes_its_tensors_on_the_inputs_device(causal):
    from megalite.context_parallel.ring_attention import ring_attention
    q = torch.empty(2, 4, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(2, 2, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = ring_attention(q, k, v, None, causal=causal, exchange=_PlacementExchange())
    out.backward(torch.empty_like(out))
    assert out.device.type == "meta" and out.dtype == torch.bfloat16
    assert [(t.grad.device.type, t.grad.dtype) for t in (q, k, v)] == [("meta", torch.bfloat16)] * 3


def test_math_block_backward_equals_the_triton_kernel():
    """The two block backends give the same numbers (Triton in the interpreter)."""
    from megalite.kernels.flash_attention_bwd import attention_delta, flash_attention_backward
    g = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(1, 4, 20, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(2))
    out, lse = attention_block_forward(q, k, v)
    assert torch.allclose(attention_block_delta(out, dout), attention_delta(out, dout), atol=1e-6)
    for ours, kernel in zip(attention_block_backward(q, k, v, out, dout, lse),
                            flash_attention_backward(q, k, v, out, dout, lse)):
        assert (ours - kernel).abs().max() < 1e-5


def _ring_case(rank, world, grid, causal, heads, groups, seq, d, backend):
    from megalite.context_parallel import ring_attention as ra
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
    exchange = ra.RingExchange(grid.cp_group)
    out = ra.ring_attention(ql, kl, vl, grid.cp_group, causal=causal, exchange=exchange, backend=backend)
    out.backward(mine(dout))
    errs = {"out": rel(out, mine(ref.detach())), "dq": rel(ql.grad, mine(q64.grad)),
            "dk": rel(kl.grad, mine(k64.grad)), "dv": rel(vl.grad, mine(v64.grad))}
    return errs, exchange.work, exchange.events


def _ring_worker(rank, world, cases):
    """Every case in one world (forking a world costs more than a small case)."""
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    return [_ring_case(rank, world, grid, *case) for case in cases]


# (causal, heads, groups, seq, d) per world size: causal and not, GQA and MQA, d not a power of 2.
RING_CASES = {2: [(True, 4, 4, 16, 16), (False, 4, 2, 16, 16), (True, 2, 1, 24, 32), (True, 3, 1, 12, 12)],
              4: [(True, 4, 2, 32, 16), (False, 2, 2, 32, 32), (False, 6, 3, 20, 8)]}
TRITON_CASES = {2: [(True, 4, 2, 16, 16), (False, 4, 2, 16, 16)], 4: [(True, 2, 1, 32, 16)]}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_ring_attention_matches_full_attention(world):
    """Torch math blocks (the CPU path) and, in the same world, the Triton kernels."""
    cases = ([case + ("torch",) for case in RING_CASES[world]]
             + [case + ("triton",) for case in TRITON_CASES[world]])
    worst = {}
    ranks = run_world(_ring_worker, world, cases)
    assert len(ranks) == world
    for results in ranks:
        assert len(results) == len(cases), (len(results), len(cases))
        for case, (errs, _, _) in zip(cases, results):
            assert set(errs) == {"out", "dq", "dk", "dv"}, errs
            worst[case] = max(worst.get(case, 0.0), *errs.values())
    print(f"ring attention C={world}, largest relative error per case:", worst)
    assert set(worst) == set(cases), "a case was not measured"
    assert all(v < TOL for v in worst.values()), worst


def test_ring_attention_backend_choice_and_errors():
    from megalite.context_parallel.ring_attention import block_ops, resolve_ring_backend
    from megalite.layers.attention import BackendUnavailable
    cpu, meta = torch.empty(1, 2, 4, 8), torch.empty(1, 2, 4, 8, device="meta")
    assert resolve_ring_backend("auto", cpu) == resolve_ring_backend("auto", meta) == "torch"
    assert block_ops("auto", cpu).forward is attention_block_forward
    assert block_ops("auto", meta).name == block_ops("triton", meta).name == "meta"  # no scores on meta
    assert resolve_ring_backend("triton", cpu) == "triton"  # the interpreter (conftest)
    with pytest.raises(BackendUnavailable, match=r"on flash-attn cannot run: flash-attn is not installed.*"
                                                 r"Fix: install it on a GPU machine"):
        resolve_ring_backend("flash", cpu)
    with pytest.raises(BackendUnavailable, match="'xformers' is unknown; use one of auto, triton, flash, torch"):
        resolve_ring_backend("xformers", cpu)


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
    results = [r[0] for r in run_world(_ring_worker, world, [(True, 2, 2, seq, 16, "torch")])]
    flops = [_flops(work, seq // (2 * world)) for _, work, _ in results]
    assert max(flops) / min(flops) - 1 < 0.05, flops
    naive = naive_contiguous_flops(seq, world)
    assert sum(flops) == pytest.approx(sum(naive))  # the same total work...
    assert max(naive) / min(naive) > 5  # ...which the contiguous split spreads 7:1
    # Fully masked pairs do no work: of the 4C chunk pairs a rank meets, 2C + 1 are visible
    # (its two diagonals, then two per visiting block).
    assert all(len(work) == 2 * world + 1 for _, work, _ in results)
    print("causal attention work per rank (chunk-pair units): balanced", flops, "contiguous", naive)


@pytest.mark.slow
def test_next_kv_transfer_is_in_flight_while_computing():
    results = run_world(_ring_worker, 2, [(True, 2, 2, 16, 16, "torch"), (True, 2, 2, 16, 16, "triton")])
    for _, _, events in (case for rank in results for case in rank):
        kinds = [e[0] for e in events]
        # forward: the transfer of the next block is posted before its compute starts,
        # and waited for only after the compute of the current block is done.
        first = kinds.index("posted")
        assert kinds[first: first + 4] == ["posted", "compute", "computed", "arrived"]
        t = {k: v for k, v in events[first: first + 4]}
        assert t["posted"] <= t["compute"] < t["computed"] <= t["arrived"]
        # backward: the dK/dV accumulator sent after step 0 is waited for only after step 1's
        # compute (double buffering), not at once.
        b = kinds.index("dkv posted")
        assert kinds[b: b + 7] == ["dkv posted", "posted", "arrived", "bwd compute", "bwd computed",
                                   "arrived", "dkv posted"], kinds[b:]


def test_context_parallel_slice_keeps_true_positions():
    batch = {"position_ids": torch.arange(16).expand(2, -1)}
    assert context_parallel_slice(batch, 0, 2)["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel_slice(batch, 1, 2)["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert context_parallel_slice(batch, 1, 2, causal=False)["position_ids"][0].tolist() == list(range(8, 16))


def _module_state_sizes():
    """Sizes of every module-level container of the context-parallel package and the attention
    layer: state that lives across calls (and would grow with steps)."""
    import sys
    sizes = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(("megalite.context_parallel", "megalite.layers.attention")) and module:
            for attr, value in vars(module).items():
                if isinstance(value, (list, dict, set)) and not attr.startswith("__"):
                    sizes[f"{name}.{attr}"] = len(value)
    return sizes


def _repeated_ring_worker(rank, world, steps):
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    from megalite.context_parallel import ring_attention as ra
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    sizes = []
    for _ in range(steps):
        ra.ring_attention(q, k, v, grid.cp_group, causal=True, backend="torch").sum().backward()
        sizes.append(_module_state_sizes())
    return sizes


def test_ring_attention_keeps_no_state_across_steps():
    """Nothing module-level grows per call (a list appended to on every block of every step
    leaks host memory over a long run): the logs live on the per-call RingExchange."""
    for sizes in run_world(_repeated_ring_worker, 2, 3):
        assert sizes[0] == sizes[1] == sizes[2], sizes


def test_math_blocks_compute_in_float32_under_autocast():
    """The model's forward runs under autocast, which casts float32 matmuls to 16 bits: the
    block functions (the torch ring backend) must give the same numbers inside it as outside."""
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 4, 24, 16, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, 24, 16, generator=g).bfloat16() for _ in range(2))
    out, lse = attention_block_forward(q, k, v)
    grads = attention_block_backward(q, k, v, out, dout, lse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac, lse_ac = attention_block_forward(q, k, v)
        grads_ac = attention_block_backward(q, k, v, out, dout, lse)
    assert torch.equal(out, out_ac) and torch.equal(lse, lse_ac)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ac))
