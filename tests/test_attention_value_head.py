"""Attention whose value head size d_v differs from the query/key head size d (DeepSeek-V3's
MLA: 192 and 128), forward and backward, against a float64 oracle written here from the
definition (not from megalite's code):

    s_ij = q_i . k_j / sqrt(d)   over the keys j query i sees (causal: j <= i; documents: same doc)
    p_ij = exp(s_ij) / sum_j' exp(s_ij'),   o_i = sum_j p_ij v_j   (size d_v),
    lse_i = log sum_j exp(s_ij)

and its autograd gradients (dq, dk of size d, dv of size d_v). Covered: the Triton kernels under
the interpreter (fp32 and fp16; causal and not; GQA; packed documents; sizes that are not powers
of two; 192/128), the torch reference, the attention() backends (torch, triton, meta; flash
refused with one message), the shared-memory estimates, and the four context-parallel comm
types (C = 2, run_world) on the torch blocks and once on the Triton ones."""
import math

import pytest
import torch

from megalite.config import ParallelConfig
from megalite.context_parallel.attention import CP_COMM_TYPES, ContextParallelGroups, context_parallel_attention
from megalite.context_parallel.data import context_parallel_slice
from megalite.context_parallel.flash_blocks import flash_block_forward
from megalite.context_parallel.traffic import cp_attention_traffic
from megalite.kernels import _utils
from megalite.kernels import flash_attention as fa
from megalite.kernels import flash_attention_bwd as fb
from megalite.kernels.attention_reference import attention_block_backward, attention_block_forward, attention_reference
from megalite.kernels.flash_attention import flash_attention
from megalite.layers.attention import BackendUnavailable, attention, resolve_backend
from megalite.layers.documents import Documents
from megalite.parallel import comm
from megalite.parallel.grid import build_grid
from megalite.testing import run_world


def oracle(q, k, v, causal=True, doc_start=None):
    """(out, lse) in float64 from the definition; q (b, h, s_q, d), k (b, g, s_k, d), v (b, g, s_k, d_v)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    seen = (j <= i) if causal else torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    seen = seen.expand(q.shape[0], 1, -1, -1)
    if doc_start is not None:
        seen = seen & (j[None, None] >= doc_start[:, None, :, None])
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) against the output gradient dout."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def inputs(b, heads, groups, s, d, d_v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g)
    k = torch.randn(b, groups, s, d, generator=g)
    v = torch.randn(b, groups, s, d_v, generator=g)
    dout = torch.randn(b, heads, s, d_v, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def check_against_oracle(fn, q, k, v, dout, tol, causal=True, doc_start=None):
    out, dq, dk, dv = grads(fn, q, k, v, dout)
    ref = grads(lambda q_, k_, v_: oracle(q_, k_, v_, causal, doc_start)[0], q.double(), k.double(), v.double(), dout)
    assert out.shape == q.shape[:3] + v.shape[3:] and dq.shape == q.shape and dk.shape == k.shape \
        and dv.shape == v.shape
    errs = [rel(a, r) for a, r in zip((out, dq, dk, dv), ref)]
    assert max(errs) < tol, errs


# -- the Triton kernels (interpreter) and the torch reference --------------------------------------

KERNEL_CASES = [  # (d, d_v, causal, heads, groups, s, dtype, tol)
    (24, 16, True, 4, 2, 37, torch.float32, 1e-5),
    (16, 24, False, 2, 2, 21, torch.float32, 1e-5),
    (40, 24, True, 4, 1, 19, torch.float16, 5e-3),
    (192, 128, True, 2, 1, 18, torch.float32, 1e-5),
]


@pytest.mark.parametrize("d,d_v,causal,heads,groups,s,dtype,tol", KERNEL_CASES)
def test_triton_kernels_take_a_value_head_size_of_their_own(d, d_v, causal, heads, groups, s, dtype, tol):
    q, k, v, dout = inputs(2, heads, groups, s, d, d_v, dtype)
    check_against_oracle(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal), q, k, v, dout, tol, causal)
    _, lse = fa.flash_attention_forward(q, k, v, causal=causal)
    assert rel(lse, oracle(q, k, v, causal)[1]) < tol  # the LSE does not depend on d_v


def test_kernels_and_reference_with_packed_documents_and_offsets():
    q, k, v, dout = inputs(2, 2, 2, 23, 24, 16)
    doc_start = torch.tensor([[0] * 9 + [9] * 14, [0] * 4 + [4] * 12 + [16] * 7], dtype=torch.int32)
    for fn in (lambda q_, k_, v_: flash_attention(q_, k_, v_, doc_start=doc_start),
               lambda q_, k_, v_: attention_reference(q_, k_, v_, doc_start=doc_start)[0]):
        check_against_oracle(fn, q, k, v, dout, 1e-5, doc_start=doc_start)
    # a block of a longer attention: keys 0..9 against queries 10..22 (offsets), forward and backward
    qb, kb, vb = q[:, :, 10:], k[:, :, :10], v[:, :, :10]
    o_ref, lse_ref = attention_block_forward(qb.double(), kb.double(), vb.double(), q_offset=10)
    o, lse = fa.flash_attention_forward(qb, kb, vb, q_offset=10)
    assert o.shape == (2, 2, 13, 16) and rel(o, o_ref) < 1e-5 and rel(lse, lse_ref) < 1e-5
    mine = fb.flash_attention_backward(qb, kb, vb, o, dout[:, :, 10:], lse, q_offset=10)
    ref = attention_block_backward(qb.double(), kb.double(), vb.double(), o_ref, dout[:, :, 10:].double(), lse_ref,
                                   q_offset=10)
    assert [t.shape[-1] for t in mine] == [24, 24, 16]
    assert max(rel(a, r) for a, r in zip(mine, ref)) < 1e-5


def test_shapes_that_do_not_fit_are_refused_with_one_message():
    q, k, v, _ = inputs(1, 2, 2, 8, 24, 16)
    with pytest.raises(ValueError, match="v \\(b, groups, s_k, d_v\\)"):
        flash_attention(q, k, v[:, :, :7])
    with pytest.raises(ValueError, match="head dim 320 is above 256"):
        flash_attention(q, k, torch.zeros(1, 2, 8, 320))
    out, lse = fa.flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match="v's head size"):
        fb.flash_attention_backward(q, k, v, out, torch.zeros_like(q), lse)


def test_shared_memory_estimates_count_each_head_size():
    """Equal sizes: the estimates are the old ones; a narrower v tile costs less, by the v tiles
    the kernel stages; the 192/128 pair takes the 256-wide lists, and one config fits ~99 KB."""
    cfg = _utils.tile_config(64, 32, 8, 2)
    assert fa.fwd_shared_bytes(cfg, 128, 2) == (64 * 128 + 2 * 2 * 32 * 128 + 64 * 32) * 2
    assert fa.fwd_shared_bytes(cfg, 256, 2, 128) == (64 * 256 + 2 * 32 * (256 + 128) + 64 * 32) * 2
    assert fb.dkdv_shared_bytes(cfg, 256, 2, 128) == (32 * 384 + 2 * 64 * 384 + 2 * 64 * 32) * 2
    assert fb.dq_shared_bytes(cfg, 256, 2, 128) == (64 * 384 + 2 * 32 * 384 + 2 * 64 * 32) * 2
    for nbytes, configs in ((fa.fwd_shared_bytes, fa.fwd_configs), (fb.dkdv_shared_bytes, fb.dkdv_configs),
                            (fb.dq_shared_bytes, fb.dq_configs)):
        assert nbytes(cfg, 128, 2) == nbytes(cfg, 128, 2, 128) > nbytes(cfg, 128, 2, 64)
        listed = configs(max(192, 128), torch.float16, interpret=False)
        assert min(nbytes(c, 256, 2, 128) for c in listed) <= 99 * 1024


# -- the attention() backends ----------------------------------------------------------------------

def test_attention_backends_take_a_value_head_size_of_their_own():
    q, k, v, dout = inputs(2, 4, 2, 13, 24, 16)
    for backend in ("torch", "triton"):
        check_against_oracle(lambda q_, k_, v_: attention(q_, k_, v_, backend=backend), q, k, v, dout, 1e-5)
    doc_start = torch.tensor([[0] * 6 + [6] * 7] * 2, dtype=torch.int32)
    documents = Documents(start=doc_start, end=torch.tensor([[6] * 6 + [13] * 7] * 2, dtype=torch.int32))
    for backend in ("torch", "triton"):
        check_against_oracle(lambda q_, k_, v_: attention(q_, k_, v_, backend=backend, documents=documents),
                             q, k, v, dout, 1e-5, doc_start=doc_start)
    meta = attention(q.to("meta"), k.to("meta"), v.to("meta"))
    assert meta.shape == (2, 4, 13, 16)
    with pytest.raises(BackendUnavailable, match="query/key head size of 24 and a value head size of 16"):
        resolve_backend("flash", q, v_head_dim=16)
    with pytest.raises(BackendUnavailable, match="query/key head size of 24 and a value head size of 16"):
        flash_block_forward(q, k, v, causal=True, interface=object())


def _aten_ops_run(fn) -> set[str]:
    """The aten ops ``fn()`` dispatches (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    seen: set[str] = set()
    with Record():
        fn()
    return seen


@pytest.mark.parametrize("d,d_v", [(24, 16), (16, 24)])
def test_torch_backend_takes_the_cpu_fused_kernel_with_two_head_sizes(d, d_v):
    """On a CPU, SDPA's fused kernel needs one head size; with d_v != d the torch backend pads to
    one (zeros), passes the unpadded 1/sqrt(d) scale and slices the output: the same numbers as
    the definition, without SDPA's math path (which materialises the probabilities)."""
    q, k, v, dout = inputs(2, 4, 2, 13, d, d_v)
    doc_start = torch.tensor([[0] * 6 + [6] * 7] * 2, dtype=torch.int32)
    documents = Documents(start=doc_start, end=torch.tensor([[6] * 6 + [13] * 7] * 2, dtype=torch.int32))
    for docs, starts in ((None, None), (documents, doc_start)):
        check_against_oracle(lambda q_, k_, v_: attention(q_, k_, v_, backend="torch", documents=docs),
                             q, k, v, dout, 1e-5, doc_start=starts)
    ops = _aten_ops_run(lambda: grads(lambda q_, k_, v_: attention(q_, k_, v_, backend="torch"), q, k, v, dout))
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)


# -- context parallelism, every comm type ----------------------------------------------------------

def _cp_worker(rank, world, cases):
    import torch.distributed as dist

    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    inner = dist.new_group(list(range(world)))
    results = []
    for comm_type, causal, backend in cases:
        groups = ContextParallelGroups(grid.cp_group, inner, None) if comm_type == "a2a+p2p" \
            else ContextParallelGroups(grid.cp_group)
        q, k, v, dout = inputs(2, 4, 2, 8 * world, 24, 16, seed=3)

        def mine(t):  # this rank's load-balanced slice of the sequence (dim 2)
            return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world, causal)["x"].view(
                t.shape[0], t.shape[1], -1, t.shape[3])

        ref = grads(lambda q_, k_, v_: oracle(q_, k_, v_, causal)[0], q.double(), k.double(), v.double(), dout)
        with comm.count_collectives() as counted:
            local = grads(lambda q_, k_, v_: context_parallel_attention(q_, k_, v_, groups, comm_type,
                                                                        causal=causal, backend=backend),
                          mine(q), mine(k), mine(v), mine(dout))
        handed = {kind: entry["bytes"] for kind, entry in counted.items()}
        results.append(([rel(a, mine(r)) for a, r in zip(local, ref)], tuple(t.shape[-1] for t in local), handed))
    return results


def test_every_cp_comm_type_takes_a_value_head_size_of_its_own():
    """C = 2: p2p, a2a, allgather and a2a+p2p (2 x 1) with d = 24, d_v = 16, GQA, causal and not,
    on the torch blocks, and the ring and allgather once on the Triton kernels: output, dQ, dK,
    dV equal single-process attention (fp32, 1e-5); the bytes handed to the collectives,
    forward and backward together, are context_parallel.traffic's with v_head_dim=16."""
    cases = [(t, causal, "torch") for t in CP_COMM_TYPES for causal in (True, False)]
    cases += [("p2p", True, "triton"), ("allgather", True, "triton")]
    for rank_results in run_world(_cp_worker, 2, cases, timeout=300):
        for case, (errs, sizes, handed) in zip(cases, rank_results):
            assert sizes == (16, 24, 24, 16), (case, sizes)
            assert max(errs) < 1e-5, (case, errs)
            theory = cp_attention_traffic(case[0], batch=2, seq=16, heads=4, groups=2, head_dim=24, cp=2,
                                          element_size=4, inner=2, v_head_dim=16)
            totals = {}
            for kinds in theory.handed.values():
                for kind, nbytes in kinds.items():
                    totals[kind] = totals.get(kind, 0) + nbytes
            assert handed == totals, (case, handed, totals)
