"""CUDA launch limits and int32 offsets of every kernel launcher, checked on the CPU.

A CUDA grid may have 2^31 - 1 programs on axis 0 but only 65,535 on axes 1 and 2; a launch past
them fails on the GPU ('invalid argument'), which the interpreter never shows. Here every
launcher (attention forward, delta, dk/dv, dq; grouped GEMM y/dx and dw; norms; cross-entropy)
is called on meta tensors of sizes no CPU could hold (b * heads = 70,000 and 10^6, 2^22 tokens,
70,000 experts, 10^9 rows), with its kernel launch intercepted: the grid it would launch is
evaluated for every GPU config of that kernel and must be within CUDA's limits. Then small
interpreter runs show the remapped program ids compute what the torch reference does (the
attention grids' (batch, head) pairs spilling onto axis 2, with axis 1 capped at 4 for the
test; the grouped GEMM's dw on one axis), and views whose tile offsets would pass int32 reach
the kernels as copies.
"""
from __future__ import annotations

import pytest
import torch

from megalite.kernels import _utils
from megalite.kernels import cross_entropy as ce
from megalite.kernels import flash_attention as fa
from megalite.kernels import flash_attention_bwd as fb
from megalite.kernels import grouped_gemm as gg
from megalite.kernels import norms
from megalite.kernels.attention_reference import attention_reference

AXIS0, AXIS12 = 2**31 - 1, 65535
META = torch.device("meta")


def attention_metas() -> list[dict]:
    """The tile sizes of every GPU attention config (and the interpreter's), as grid meta dicts."""
    metas = [dict(BLOCK_M=_utils.INTERPRET_TILES[0], BLOCK_N=_utils.INTERPRET_TILES[1])]
    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            for configs in (fa.fwd_configs, fb.dkdv_configs, fb.dq_configs, fb.delta_configs):
                metas += [{"BLOCK_N": 16, **c.kwargs} for c in configs(d, dtype, interpret=False)]
    return metas


def gemm_metas() -> list[dict]:
    return [c.kwargs for dt in (torch.bfloat16, torch.float32) for c in gg.mm_configs(dt) + gg.dw_configs(dt)] + \
        [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)]


class Launches:
    """Intercepts every kernel launch of the kernel modules (nothing runs): records the grid,
    evaluated for each meta dict of the kernel family, and the tensors passed."""

    def __init__(self, monkeypatch):
        self.grids, self.tensors = [], []
        test = self

        def attention(kernel, tuned, config, grid, *args, **consts):
            while hasattr(kernel, "fn"):  # heuristics -> jit function -> python function
                kernel = kernel.fn
            test.add(kernel.__name__, grid, attention_metas(), args)

        class Kernel:
            def __init__(self, name, metas):
                self.name, self.metas = name, metas

            def __getitem__(self, grid):
                return lambda *args, **kwargs: test.add(self.name, grid, self.metas, args)

        monkeypatch.setattr(fa, "launch_tiles", attention)
        monkeypatch.setattr(fb, "launch_tiles", attention)
        monkeypatch.setattr(gg, "_tuned", lambda kind, dtype: Kernel(f"grouped {kind}", gemm_metas()))
        for module, name in ((norms, "_norm_fwd_kernel"), (norms, "_norm_bwd_kernel"),
                             (norms, "_norm_fwd_chunked_kernel"), (norms, "_norm_bwd_chunked_kernel"),
                             (ce, "_ce_stats_kernel"), (ce, "_ce_grad_kernel")):
            monkeypatch.setattr(module, name, Kernel(name, [{}]))
        # the GPU's tiles and program counts, not the interpreter's (nothing runs)
        monkeypatch.setattr(norms, "INTERPRET", False)
        monkeypatch.setattr(ce, "INTERPRET", False)
        monkeypatch.setattr(norms, "_sm_count", lambda device: 132)

    def add(self, name, grid, metas, args):
        grids = [grid(m) for m in metas] if callable(grid) else [grid]
        self.grids += [(name, g) for g in grids]
        self.tensors.append((name, [a for a in args if isinstance(a, torch.Tensor)]))

    def check(self):
        assert self.grids
        for name, grid in self.grids:
            assert 1 <= len(grid) <= 3, (name, grid)
            assert 1 <= grid[0] <= AXIS0, (name, grid)
            assert all(1 <= n <= AXIS12 for n in grid[1:]), (name, grid, "axes 1 and 2 take at most 65,535")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device=META, dtype=dtype)


# (b, heads, groups, s, d): b * heads and b * groups past 65,535, long sequences
ATTENTION_SIZES = [(2, 35_000, 35_000, 1024, 128), (70_000, 1, 1, 64, 64), (1000, 1000, 125, 64, 64),
                   (1, 64, 8, 2**22, 128), (4096, 32, 32, 4096, 128)]


@pytest.mark.parametrize("size", ATTENTION_SIZES, ids=lambda s: "x".join(map(str, s)))
def test_attention_grids_stay_within_cuda_limits(monkeypatch, size):
    b, heads, groups, s, d = size
    launches = Launches(monkeypatch)
    q, k, v = meta(b, heads, s, d), meta(b, groups, s, d), meta(b, groups, s, d)
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    fb.flash_attention_backward(q, k, v, out, meta(b, heads, s, d), meta(b, heads, s, dtype=torch.float32))
    assert [n for n, _ in launches.tensors] == ["_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel"]
    launches.check()


@pytest.mark.parametrize("experts,rows,n_out,k", [(70_000, 70_000, 64, 64), (128, 2**24, 28672, 8192)])
def test_grouped_gemm_grids_stay_within_cuda_limits(monkeypatch, experts, rows, n_out, k):
    launches = Launches(monkeypatch)
    counts = [rows // experts] * experts
    counts[0] += rows - sum(counts)
    x, w, dy = meta(rows, k), meta(experts, n_out, k), meta(rows, n_out)
    offsets, host = gg.group_offsets(counts, experts, rows, META)
    gg.grouped_matmul(x, w, offsets, host)
    gg.grouped_matmul(x, w, offsets, None)          # device counts: the bound on row tiles
    gg.grouped_weight_grad(dy, x, offsets)
    assert {n for n, _ in launches.grids} == {"grouped mm", "grouped dw"}
    launches.check()


@pytest.mark.parametrize("rows,n", [(10**9, 1024), (10**8, 8192), (2**31 - 1, 16384)])
def test_norm_grids_stay_within_cuda_limits(monkeypatch, rows, n):
    launches = Launches(monkeypatch)
    x, w = meta(rows, n), meta(n)
    y, mean, rstd = norms.norm_forward(x, w, w, 1e-5, False)
    norms.norm_backward(x, x, w, True, mean, rstd, False)
    launches.check()


@pytest.mark.parametrize("rows,vocab", [(10**8, 50304), (2**31 - 1, 128256), (16, 2**26)])
def test_cross_entropy_grids_stay_within_cuda_limits(monkeypatch, rows, vocab):
    launches = Launches(monkeypatch)
    z, t = meta(rows, vocab), torch.empty(rows, device=META, dtype=torch.long)
    ce.cross_entropy_stats(z, t)
    ce.cross_entropy_grad(z, t, meta(rows, dtype=torch.float32), meta(rows, dtype=torch.float32))
    launches.check()


def test_a_grid_past_the_limits_is_a_clear_error():
    assert _utils.check_grid("k", (AXIS0, AXIS12, AXIS12)) == (AXIS0, AXIS12, AXIS12)
    with pytest.raises(ValueError, match="65536 programs on axis 1, above CUDA's 65535"):
        _utils.check_grid("k", (1, 65536))
    with pytest.raises(ValueError, match="axis 0"):
        _utils.check_grid("k", (2**31,))


# -- int32 tile offsets ----------------------------------------------------------------------------

def test_views_whose_tile_offsets_pass_int32_are_copied(monkeypatch):
    """The kernels keep a tile's offsets ``i * stride_s + j`` in int32 (registers): a view with a
    sequence stride of millions of elements (a slice of a huge fused tensor) reaches them as a
    contiguous copy; an ordinary view is read in place."""
    launches = Launches(monkeypatch)
    big = 2**25  # 127 * 2^25 > 2^31
    q = meta(1, 2, 64, 128)
    k = torch.empty_strided((1, 2, 64, 128), (0, 128, big, 1), device=META, dtype=torch.bfloat16)
    small = torch.empty_strided((1, 2, 64, 128), (0, 128, 2**16, 1), device=META, dtype=torch.bfloat16)
    out, lse = fa.flash_attention_forward(q, k, small, causal=True)
    fb.flash_attention_backward(k, k, small, out, k, meta(1, 2, 64, dtype=torch.float32))
    for name, tensors in launches.tensors:
        for t in tensors:
            if t.dim() == 4 and name != "_delta_kernel":  # delta's offsets are int64 throughout
                assert (_utils.MAX_TILE - 1) * t.stride(2) + t.shape[3] <= _utils.INT32_MAX, (name, t.stride())
    fwd_args = launches.tensors[0][1]
    assert fwd_args[2].stride() == small.stride(), "a view within int32 is read in place"
    assert _utils.seq_strided(small) is small and _utils.seq_strided(k).stride(2) == 128
    tiles = [c.kwargs[n] for d in (64, 128, 256) for dt in (torch.bfloat16, torch.float32)
             for configs in (fa.fwd_configs, fb.dkdv_configs, fb.dq_configs)
             for c in configs(d, dt, interpret=False) for n in ("BLOCK_M", "BLOCK_N")]
    assert max(tiles) <= _utils.MAX_TILE, "MAX_TILE must bound every attention tile"


# -- the remapped program ids compute the same ----------------------------------------------------

def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grid_y", [_utils.MAX_GRID_Y, 4])
@pytest.mark.slow
def test_split_attention_grids_match_the_reference(monkeypatch, grid_y):
    """3 batches x 4 heads on 2 groups, 70 queries (3 row tiles of 32) and 45 keys, forward and
    backward. With axis 1 capped at 4 (as CUDA caps it at 65,535) the 12 (batch, head) pairs
    take grid (tiles, 4, 3), the 6 (batch, group) pairs (tiles, 4, 2), 2 of whose programs
    return at once: every pair still lands where it should."""
    monkeypatch.setattr(_utils, "MAX_GRID_Y", grid_y)
    grids = []
    monkeypatch.setattr(fa, "split_grid", lambda *a: grids.append(_utils.split_grid(*a)) or grids[-1])
    monkeypatch.setattr(fb, "split_grid", lambda *a: grids.append(_utils.split_grid(*a)) or grids[-1])
    q, dout = randn(3, 4, 70, 24, seed=1), randn(3, 4, 70, 24, seed=2)
    k, v = randn(3, 2, 45, 24, seed=3), randn(3, 2, 45, 24, seed=4)
    for causal, q_off in ((True, 5), (False, 0)):
        out, lse = fa.flash_attention_forward(q, k, v, causal, q_off, 0)
        grads = fb.flash_attention_backward(q, k, v, out, dout, lse, causal, q_off, 0)
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = attention_reference(*leaves, causal, q_off, 0)
        ref_out.backward(dout.double())
        assert (out.double() - ref_out).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5
        for g, leaf in zip(grads, leaves):
            assert (g.double() - leaf.grad).abs().max() < 1e-5
    # (y, z) of the (batch, head) grids (forward, delta, dq) and the (batch, group) one (dk/dv)
    assert {g[1:] for g in grids} == ({(12, 1), (6, 1)} if grid_y > 12 else {(4, 3), (4, 2)})


def test_one_axis_weight_gradient_programs_match_the_loop():
    """dw over 5 groups (one empty) with 2 x 3 output tiles each: group pid // tiles is right."""
    counts, n_out, k = [7, 0, 40, 3, 33], 50, 70
    x, dy = randn(sum(counts), k, seed=5), randn(sum(counts), n_out, seed=6)
    offsets, _ = gg.group_offsets(counts, len(counts), sum(counts), "cpu")
    dw = gg.grouped_weight_grad(dy, x, offsets)
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert (dw[e].double() - dy[a:b].double().T @ x[a:b].double()).abs().max() < 1e-4, e
