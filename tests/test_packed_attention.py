"""Packed documents in attention: a token sees only the earlier tokens of its own document.

- ``attention()`` with documents equals each document run alone (output and dq/dk/dv, fp32),
  torch backend (SDPA with the document mask) and the Triton kernels under the interpreter.
- Every context-parallel type (p2p ring, a2a, allgather, a2a+p2p) at C = 2 and 4 with documents
  equals full attention with documents (the reference), torch blocks and one Triton case each.
- The load balance with documents: the visible (query, key) pairs each rank's blocks hold,
  printed (4 documents of s/4 at C = 2, and documents that straddle the chunks).
- Backends that cannot take documents say so: flash (attention and ring blocks).
"""
import pytest
import torch

from megalite.config import ParallelConfig
from megalite.context_parallel.attention import CP_COMM_TYPES, ContextParallelGroups, context_parallel_attention
from megalite.context_parallel.data import context_parallel_slice
from megalite.context_parallel.ring_attention import block_ops, local_chunk_ids
from megalite.kernels.attention_reference import attention_reference
from megalite.layers.attention import BackendUnavailable, attention
from megalite.layers.documents import Documents, documents_from_lengths, visible_mask
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 2e-6
LENGTHS = [[5, 11, 1, 7], [24]]  # two rows of 24 tokens: four documents (one of a single token), one


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def triton_cannot_run() -> str | None:
    """Why the Triton kernels cannot run on CPU tensors here (a GPU run with them compiled,
    TRITON_INTERPRET=0), in the words of megalite's backend check; None under the interpreter.
    That is the only reason a Triton case here may skip: a kernel that takes no documents fails."""
    from megalite.layers.backends import triton_missing
    return triton_missing("cpu")


def _inputs(heads, groups, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, d, generator=g)
    k, v = (torch.randn(2, groups, s, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, heads, s, d, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_attention_with_documents_equals_each_document_alone(backend, heads, groups):
    if backend == "triton" and triton_cannot_run():
        pytest.skip(triton_cannot_run())
    q, k, v, dout = _inputs(heads, groups, 24, 16)
    docs = documents_from_lengths(LENGTHS)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, causal=True, backend=backend, documents=docs)
    out.backward(dout)
    want = [torch.zeros_like(t) for t in (q, q, k, v)]  # out, dq, dk, dv assembled from the documents alone
    for row, lengths in enumerate(LENGTHS):
        lo = 0
        for n in lengths:
            alone = [t[row: row + 1, :, lo: lo + n].clone().requires_grad_() for t in (q, k, v)]
            ref = attention(*alone, causal=True, backend="torch")
            ref.backward(dout[row: row + 1, :, lo: lo + n])
            for full, part in zip(want, [ref.detach()] + [t.grad for t in alone]):
                full[row: row + 1, :, lo: lo + n] = part
            lo += n
    errs = {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], want)}
    print(f"{backend}, {heads} heads / {groups} groups, each document alone vs packed:", errs)
    assert max(errs.values()) < TOL, errs


def test_the_document_mask_is_the_references():
    docs = documents_from_lengths(LENGTHS)
    from megalite.kernels.attention_reference import causal_visible
    assert torch.equal(visible_mask(docs, 24, 24), causal_visible(24, 24, 0, 0, docs.start.device, docs.start))
    assert torch.equal(visible_mask(docs, 8, 16, 16, 8),
                       causal_visible(8, 16, 16, 8, docs.start.device, docs.start[:, 16:24]))


def test_flash_refuses_documents_with_the_fix():
    q, k, v, _ = _inputs(4, 4, 8, 16)
    docs = documents_from_lengths([[3, 5], [8]])
    with pytest.raises(BackendUnavailable, match="packed documents.*triton"):
        attention(q, k, v, backend="flash", documents=docs)
    with pytest.raises(BackendUnavailable, match="packed documents.*triton"):
        block_ops("flash", q, documents=True)  # the ring's and allgather's blocks


# -- context parallelism ------------------------------------------------------------------------
def _groups(rank, world, inner_size):
    """A world that is one CP group; a2a+p2p split into inner (consecutive) x outer (strided)."""
    import torch.distributed as dist
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    inner = outer = None
    for lo in range(0, world, inner_size):
        g = dist.new_group(list(range(lo, lo + inner_size))) if inner_size > 1 else None
        inner = g if lo <= rank < lo + inner_size else inner
    for i in range(inner_size):
        ranks = list(range(i, world, inner_size))
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        outer = g if rank in ranks else outer
    return ContextParallelGroups(grid.cp_group, inner, outer)


def _lengths(s):
    """Documents that straddle chunk boundaries, a one-token document, and a whole-row one."""
    return [[3, s // 2 - 2, 1, s // 4, s - 3 - (s // 2 - 2) - 1 - s // 4], [s]]


def _cp_case(rank, world, groups, comm_type, heads, kv_groups, s, d, backend):
    q, k, v, dout = _inputs(heads, kv_groups, s, d, seed=s + heads)
    docs = documents_from_lengths(_lengths(s))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=True, doc_start=docs.start, doc_end=docs.end)
    ref.backward(dout.double())

    def mine(t):  # this rank's load-balanced slice of the sequence (dim 2)
        return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world)["x"].view(t.shape[0], t.shape[1], -1,
                                                                                     t.shape[3])

    whole = context_parallel_slice({"doc_start": docs.start, "doc_end": docs.end}, rank, world)
    assert torch.equal(whole["doc_start"], docs.start)  # the documents travel unsliced
    ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, groups, comm_type, causal=True, backend=backend,
                                     documents=Documents(whole["doc_start"], whole["doc_end"]))
    out.backward(mine(dout))
    return {"out": rel(out, mine(ref.detach())), "dq": rel(ql.grad, mine(q64.grad)),
            "dk": rel(kl.grad, mine(k64.grad)), "dv": rel(vl.grad, mine(v64.grad))}


def _cp_worker(rank, world, inner_size, cases):
    """Runs every case it is given, or raises: a case asked for never comes back empty."""
    hier = _groups(rank, world, inner_size)
    plain = ContextParallelGroups(hier.group)
    out = []
    for case in cases:
        if case[-1] == "triton" and triton_cannot_run():
            raise RuntimeError(f"rank {rank} was asked for the Triton case {case} and cannot run it: "
                               f"{triton_cannot_run()}")
        out.append(_cp_case(rank, world, hier if case[0] == "a2a+p2p" else plain, *case))
    return out


def _cp_cases(world, triton: bool, torch_blocks: bool = True):
    """(type, heads, kv groups, s, d, backend): MHA and GQA on torch blocks (unless
    ``torch_blocks`` is False), Triton once per type (left out when ``triton`` is False)."""
    cases = []
    for t in CP_COMM_TYPES:
        cases += [(t, 4, 4, 8 * world, 16, "torch"), (t, 4, 2, 4 * world, 8, "torch")] if torch_blocks else []
        cases += [(t, 4, 2, 4 * world, 16, "triton")] if triton else []
    return cases


# The fast tier runs the torch blocks at C=2; the Triton cases (about 5 s of the interpreter's
# launches) are slow: the packed kernels at ring offsets against the reference stay in the fast
# tier (tests/test_packed_kernels.py), as does the Triton ring with a value head of its own
# (tests/test_attention_value_head.py).
@pytest.mark.parametrize("world,inner,backends", [(2, 2, "torch"), pytest.param(2, 2, "triton", marks=pytest.mark.slow),
                                                  pytest.param(4, 2, "torch+triton", marks=pytest.mark.slow)])
def test_every_cp_type_with_documents_matches_full_attention(world, inner, backends):
    """Every case asked for comes back from every rank. The Triton cases are asked for unless the
    kernels cannot run on CPU tensors here (triton_cannot_run's reason, printed); under the
    interpreter (the suite's default) that is one per CP type."""
    why_not = triton_cannot_run() if "triton" in backends else "not asked for in this case"
    cases = _cp_cases(world, triton=why_not is None, torch_blocks="torch" in backends)
    results = run_world(_cp_worker, world, inner, cases, timeout=300)
    not_run = [(rank, case) for rank, rank_results in enumerate(results)
               for case, errs in zip(cases, rank_results) if errs is None]
    assert not not_run and all(len(r) == len(cases) for r in results), f"cases asked for and not run: {not_run}"
    worst = {case: max(max(r[i].values()) for r in results) for i, case in enumerate(cases)}
    print(f"C={world} (a2a+p2p as {inner} x {world // inner}) with documents, largest relative error:", worst,
          f"Triton cases left out: {why_not}" if why_not else "")
    assert all(v < TOL for v in worst.values()), {k: v for k, v in worst.items() if v >= TOL}
    triton_cases = {c[0] for c in cases if c[-1] == "triton"}
    assert triton_cases == (set() if why_not else set(CP_COMM_TYPES)), triton_cases


def rank_work(docs: Documents, cp: int) -> list[int]:
    """Per CP rank, the visible (query, key) pairs of its ring blocks: for each of its query chunks,
    against every key chunk at or before it, the entries of the document mask (the work the
    Triton kernels do, up to their tile granularity; the ring runs every such block)."""
    s = docs.start.shape[1]
    c = s // (2 * cp)
    work = []
    for rank in range(cp):
        total = 0
        for a in local_chunk_ids(rank, cp, True):
            for ka in range(a + 1):
                total += int(visible_mask(docs, c, c, a * c, ka * c).sum())
        work.append(total)
    return work


def test_load_balance_with_documents_is_the_sum_of_document_overlaps():
    s, cp = 64, 2
    cases = {"no documents": documents_from_lengths([[s]]),
             "4 documents of s/4": documents_from_lengths([[s // 4] * 4]),
             "4 documents of s/4, shifted by s/8": documents_from_lengths([[s // 8, s // 4, s // 4, s // 4, s // 8]]),
             "16 documents of s/16": documents_from_lengths([[s // 16] * 16]),
             "2 documents of s/2": documents_from_lengths([[s // 2] * 2])}
    spread = {}
    for name, docs in cases.items():
        work = rank_work(docs, cp)
        spread[name] = max(work) / min(work)
        print(f"C={cp}, s={s}, {name}: visible (query, key) pairs per rank {work}, max/min {spread[name]:.3f}")
    assert spread["no documents"] == 1.0  # the 2C-chunk split balances the causal triangle
    assert spread["4 documents of s/4"] == 1.0  # each chunk is one document's triangle
    assert spread["16 documents of s/16"] == 1.0
    assert spread["2 documents of s/2"] == 1.0
    # Documents that straddle the chunks: the ranks differ by the overlaps their chunks happen to see.
    assert 1.0 < spread["4 documents of s/4, shifted by s/8"] < 1.5


def test_config_check_refuses_flash_with_documents():
    from megalite.config import ConfigError, ModelConfig
    from megalite.layers.documents import check_documents_attention
    check_documents_attention(ModelConfig(attention_backend="flash"), reset_attention_mask=False)
    check_documents_attention(ModelConfig(attention_backend="triton"), reset_attention_mask=True)
    with pytest.raises(ConfigError, match="--reset-attention-mask with --attention-backend flash.*Fix"):
        check_documents_attention(ModelConfig(attention_backend="flash"), reset_attention_mask=True)


def kernel_tiles(docs: Documents | None, cp: int, s: int, block: int) -> list[int]:
    """Per CP rank, the key tiles the Triton forward computes over its ring blocks (the kernel's
    own tile counter), with the block calls the ring makes (offsets and document slices)."""
    from megalite.kernels.flash_attention import flash_attention_forward

    from megalite.context_parallel.ring_attention import _pairs, block_kwargs
    c = s // (2 * cp)
    q, k, v, _ = _inputs(1, 1, s, 16)
    tiles = []
    for rank in range(cp):
        count = torch.zeros(1, dtype=torch.int32)
        for src in range(cp):
            for _, qa, _, ka, diag in _pairs(rank, src, cp, True):
                flash_attention_forward(q[:, :, qa * c: (qa + 1) * c], k[:, :, ka * c: (ka + 1) * c],
                                        v[:, :, ka * c: (ka + 1) * c], block_m=block, block_n=block,
                                        tile_count=count, **block_kwargs(docs, diag, qa, ka, c))
        tiles.append(int(count.sum()))
    return tiles


def test_kernel_tiles_per_rank_with_documents():
    """The work the Triton kernels do per ring rank (s = 128, C = 2, tiles of 16): without
    documents, and with 4 documents of s/4 (the ranks equal, and only the documents' tiles)."""
    if triton_cannot_run():
        pytest.skip(triton_cannot_run())
    s, cp = 128, 2
    plain = kernel_tiles(None, cp, s, 16)
    packed = kernel_tiles(documents_from_lengths([[s // 4] * 4] * 2), cp, s, 16)  # two rows alike
    shifted = kernel_tiles(documents_from_lengths([[s // 8, s // 4, s // 4, s // 4, s // 8]] * 2), cp, s, 16)
    print(f"Triton forward key tiles per rank, C={cp}, s={s}, tiles of 16: no documents {plain}, "
          f"4 documents of s/4 {packed}, shifted by s/8 {shifted}")
    assert plain[0] == plain[1] and packed[0] == packed[1]
    assert sum(packed) < sum(plain) / 2  # the pairs no document spans cost no tiles


def test_validate_refuses_flash_with_documents_before_any_work():
    """From the command line: validate() (before groups or a model) names the flag pair and the fix."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.config import ConfigError, validate
    argv = ["--mock-data", "--vocab-size", "300", "--attention-backend", "flash", "--reset-attention-mask"]
    config = config_from_args(build_parser().parse_args(argv), 300, eod_token=0)
    with pytest.raises(ConfigError, match="--reset-attention-mask with --attention-backend flash.*Fix: --attention-backend triton"):
        validate(config)
