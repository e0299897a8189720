"""Packed documents in the Triton attention kernels (interpreter) against the torch reference
with a document mask: forward and backward for documents of length 1, exactly a tile, across
tile edges and one filling the sequence; as ring-attention blocks at offsets; the count of
tiles computed, which is the documents' causal tiles and not the sequence's."""
import pytest
import torch

from megalite.kernels._utils import INTERPRET_TILES
from megalite.kernels.attention_reference import (attention_block_backward, attention_block_forward,
                                                  attention_reference)
from megalite.kernels.flash_attention import flash_attention, flash_attention_forward, forward_tiles
from megalite.kernels.flash_attention_bwd import flash_attention_backward

TILE = INTERPRET_TILES[0]  # the interpreter's one config: 32 x 32 tiles
assert INTERPRET_TILES[1] == TILE


def documents(lengths_per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_start, doc_end) (b, s) int32 from each row's document lengths."""
    rows = [[], []]
    for lengths in lengths_per_row:
        start, starts, ends = 0, [], []
        for n in lengths:
            starts += [start] * n
            ends += [start + n] * n
            start += n
        rows[0].append(starts)
        rows[1].append(ends)
    return torch.tensor(rows[0], dtype=torch.int32), torch.tensor(rows[1], dtype=torch.int32)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


CASES = {  # name: (document lengths per batch row, heads, groups, d)
    "length-1 documents and a tile-sized one": ([[1, 1, TILE, 1, 37], [72]], 4, 2, 16),
    "documents across tile edges": ([[20, 30, 22], [5, 60, 7]], 2, 1, 32),
    "exactly tiles": ([[TILE, TILE, TILE], [2 * TILE, TILE]], 2, 2, 16),
    "one document filling the sequence": ([[77], [77]], 4, 4, 8),
}


@pytest.mark.parametrize("name", CASES)
def test_kernels_equal_the_document_masked_reference(name):
    lengths, heads, groups, d = CASES[name]
    doc_start, doc_end = documents(lengths)
    b, s = doc_start.shape
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(b, heads, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, heads, s, d, generator=g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, doc_start=doc_start)
    ref.backward(dout.double())
    out, lse = flash_attention(q, k, v, doc_start=doc_start, doc_end=doc_end, return_lse=True)
    out.backward(dout)
    errs = {"out": rel(out, ref), "lse": rel(lse, ref_lse), "dq": rel(q.grad, q64.grad),
            "dk": rel(k.grad, k64.grad), "dv": rel(v.grad, v64.grad)}
    print(name, errs)
    assert max(errs.values()) < 2e-6, errs
    # Each document alone gives the same rows: the mask is the document's own causal mask.
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            alone, _ = attention_reference(q64[row:row + 1, :, start:start + n], k64[row:row + 1, :, start:start + n],
                                           v64[row:row + 1, :, start:start + n])
            assert rel(out[row:row + 1, :, start:start + n], alone) < 2e-6
            start += n
    if len(lengths[0]) == 1:  # one document: exactly the plain causal kernel
        plain = flash_attention(q.detach(), k.detach(), v.detach())
        assert torch.equal(out.detach(), plain)


def _causal_tiles(n_rows: int, n_keys: int) -> int:
    """Key tiles a causal query-tile loop visits for a document of n tokens starting on a tile edge."""
    tiles = -(-n_rows // TILE)
    return sum(min(m + 1, -(-n_keys // TILE)) for m in range(tiles))


def test_tiles_computed_are_the_documents_causal_tiles():
    """Documents starting on tile edges: forward and dq compute sum_d T_d (T_d + 1) / 2 key tiles
    per (batch, head), dk/dv the same number of query tiles; the whole sequence would be
    T (T + 1) / 2. Documents off the edges cost at most one extra tile per query tile."""
    lengths = [[TILE, 2 * TILE, TILE], [4 * TILE]]
    doc_start, doc_end = documents(lengths)
    b, s, heads, groups, d = 2, 4 * TILE, 2, 1, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = (torch.randn(b, groups, s, d, generator=g) for _ in range(2))
    counts = {}
    for name, docs in (("documents", dict(doc_start=doc_start, doc_end=doc_end)), ("plain", {})):
        forward, backward = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        out, lse = flash_attention_forward(q, k, v, tile_count=forward, **docs)
        flash_attention_backward(q, k, v, out, torch.ones_like(out), lse, tile_count=backward, **docs)
        counts[name] = (forward.item(), backward.item())
    per_row = [sum(n // TILE * (n // TILE + 1) // 2 for n in row) for row in lengths]  # [1 + 3 + 1, 10]
    expected = heads * sum(per_row)
    print("tiles (forward, backward):", counts, "documents' causal tiles per head:", per_row)
    assert counts["documents"] == (expected, 2 * expected)  # backward: dq's key tiles + dk/dv's query tiles
    assert counts["plain"] == (heads * b * 10, 2 * heads * b * 10)
    # Off tile edges too, the kernel computes exactly the tiles forward_tiles predicts (which the
    # benchmark and the planner use for sequences too long for the interpreter).
    doc_start, doc_end = documents([[20, 50, 58], [1, 127]])
    forward = torch.zeros(1, dtype=torch.int32)
    flash_attention_forward(q, k, v, doc_start=doc_start, doc_end=doc_end, tile_count=forward)
    predicted = heads * sum(forward_tiles(doc_start[r], s, TILE, TILE) for r in range(b))
    assert forward.item() == predicted < counts["plain"][0]
    assert heads * forward_tiles(None, s, TILE, TILE) * b == counts["plain"][0]


def test_ring_style_blocks_at_offsets_match_the_reference():
    """A later query chunk against an earlier key chunk (absolute offsets, as ring attention
    calls it), documents spanning the two: block forward and backward from the global lse."""
    doc_start, doc_end = documents([[10, 40, 30, 16], [96]])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 96, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 1, 96, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = attention_reference(q, k, v, doc_start=doc_start)
    dout = torch.randn_like(out)
    qs, ks = slice(48, 96), slice(0, 48)  # query chunk [48, 96) against key chunk [0, 48)
    block = dict(q_offset=48, k_offset=0, doc_start=doc_start[:, qs], doc_end=doc_end[:, ks])
    q32, k32, v32 = (t.float() for t in (q[:, :, qs], k[:, :, ks], v[:, :, ks]))
    o_ref, l_ref = attention_block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], **block)
    o_tri, l_tri = flash_attention_forward(q32, k32, v32, **block)
    visible = torch.isfinite(l_ref)  # rows whose document starts in the key chunk
    assert visible.any() and not visible.all()
    assert rel(o_tri, o_ref) < 2e-6 and (l_tri[visible] - l_ref[visible]).abs().max() < 1e-5
    assert torch.isinf(l_tri[~visible]).all()
    grads_ref = attention_block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], dout[:, :, qs],
                                         lse[:, :, qs], **block)
    grads_tri = flash_attention_backward(q32, k32, v32, out[:, :, qs].float(), dout[:, :, qs].float(),
                                         lse[:, :, qs].float(), **block)
    for a, b in zip(grads_tri, grads_ref):
        assert rel(a, b) < 2e-6


def test_documents_need_causal_attention_and_matching_shapes():
    doc_start, doc_end = documents([[4, 4]])
    q = torch.randn(1, 2, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="packed documents .* need causal attention"):
        flash_attention_forward(q, k, v, causal=False, doc_start=doc_start)
    with pytest.raises(ValueError, match=r"doc_start must be \(b, s_q\) = \(1, 8\), got \(1, 4\)"):
        flash_attention_forward(q, k, v, doc_start=doc_start[:, :4])
    with pytest.raises(ValueError, match=r"doc_end must be \(b, s_k\)"):
        attention_reference(q, k, v, doc_start=doc_start, doc_end=doc_end[:, :3])
