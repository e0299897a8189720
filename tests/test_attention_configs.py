"""Flash attention's GPU tile configurations, strided inputs and shared-memory pruning.

Under the CPU interpreter (TRITON_INTERPRET=1, conftest.py):
(a) every tile of every GPU autotune config (forward, dk/dv, dq for 16-bit and fp32, tile
    widths 64/128/256; delta's row counts), launched explicitly on a small ragged shape in
    fp32, causal (with an offset) and not, GQA: equals the float64 reference to ~1e-5. The
    interpreter ignores warps and stages, so configs are grouped by their (BLOCK_M, BLOCK_N)
    (each tile runs every kernel; the warps and stages of one of its configs are passed too).
(b) strided q, k, v, dout (permuted views of a fused qkv as the model makes them, chunks along
    the sequence as ring attention makes them) reach the kernels as the very tensors passed
    (no copy) and give bit-identical results to contiguous inputs; a non-unit last stride is
    copied and still right.
(c) head dims 96 and 256, forward and backward, against the reference.
Pruning by shared memory and the autotuned kernels against torch SDPA: tests/test_attention_autotune.py.
"""
from __future__ import annotations

import pytest
import torch

from megalite.kernels import _utils
from megalite.kernels import flash_attention as fa
from megalite.kernels import flash_attention_bwd as fb
from megalite.kernels.attention_reference import attention_reference

TOL = 1e-5
WIDTHS = (64, 128, 256)


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return (a - ref).abs().max().item() / max(0.1, ref.abs().max().item())  # the reference's scale, floor 0.1


def reference(q, k, v, dout, causal, q_off=0):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = attention_reference(*leaves, causal, q_off, 0)
    out.backward(dout.double())
    return out, lse, *(x.grad for x in leaves)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def gpu_configs():
    """{(BLOCK_M, BLOCK_N): [(kernel, width, dtype, config), ...]} over every GPU config list."""
    tiles = {}
    for width in WIDTHS:
        for dtype in (torch.bfloat16, torch.float32):
            for kind, configs in (("fwd", fa.fwd_configs), ("dkdv", fb.dkdv_configs), ("dq", fb.dq_configs)):
                for c in configs(width, dtype, interpret=False):
                    tile = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
                    tiles.setdefault(tile, []).append((kind, width, dtype, c))
    return tiles


TILES = gpu_configs()


# -- (a) every GPU config in the interpreter --------------------------------------------------------

@pytest.mark.parametrize("tile", [pytest.param(t, marks=() if t in (min(TILES), max(TILES)) else pytest.mark.slow)
                                  for t in sorted(TILES)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_gpu_tile_matches_the_reference(tile):
    """Forward and backward with this tile, causal (queries offset past some keys) and not,
    GQA (4 query heads on 2 key/value groups), s_q = 37, s_k = 45, head dim 20 (padded)."""
    c = TILES[tile][0][3]
    launch = dict(block_m=tile[0], block_n=tile[1], num_warps=c.num_warps, num_stages=c.num_stages)
    q, dout = randn(1, 4, 37, 20, seed=1), randn(1, 4, 37, 20, seed=2)
    k, v = randn(1, 2, 45, 20, seed=3), randn(1, 2, 45, 20, seed=4)
    for causal, q_off in ((True, 5), (False, 0)):
        out, lse = fa.flash_attention_forward(q, k, v, causal, q_off, 0, **launch)
        grads = fb.flash_attention_backward(q, k, v, out, dout, lse, causal, q_off, 0, **launch)
        ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, causal, q_off)
        assert err(out, ref_out) < TOL and err(lse, ref_lse) < TOL, (tile, causal)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert err(g, r) < TOL, (tile, causal, name, err(g, r))


def test_every_gpu_config_is_a_valid_tile():
    """Powers of two >= 16 (tl.dot), warps 4 or 8, 1-4 stages; each list has 3-5 configs."""
    for tile, uses in TILES.items():
        _utils.check_blocks(*tile)
        for kind, width, dtype, c in uses:
            assert c.num_warps in (4, 8) and 1 <= c.num_stages <= 4, (kind, width, dtype, c)
    for width in WIDTHS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for configs in (fa.fwd_configs, fb.dkdv_configs, fb.dq_configs, fb.delta_configs):
                assert 3 <= len(configs(width, dtype, interpret=False)) <= 5


@pytest.mark.parametrize("width", WIDTHS)
def test_every_delta_config_matches(width):
    """delta = rowsum(out * dout) with each GPU row count, on a permuted (strided) view."""
    out = randn(1, 40, 3, 20, seed=5).permute(0, 2, 1, 3)      # (1, 3, 40, 20), strided
    dout = randn(1, 3, 40, 20, seed=6)
    want = (out.double() * dout.double()).sum(-1)
    for c in fb.delta_configs(width, interpret=False):
        got = fb.attention_delta(out, dout, block_m=c.kwargs["BLOCK_M"], num_warps=c.num_warps)
        assert got.shape == (1, 3, 40) and err(got, want) < TOL


def test_interpreter_runs_one_small_config():
    for configs in (fa.fwd_configs, fb.dkdv_configs, fb.dq_configs):
        (c,) = configs(128, torch.float32)
        assert (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == _utils.INTERPRET_TILES
    assert len(fb.delta_configs(128)) == 1


def test_autotune_keys_and_length_rounding():
    """Tuned per (head dim, causal, lengths rounded to powers of two) (+ the tensors' dtypes,
    which triton.autotune adds itself); one autotuner per (head dim, dtype)."""
    assert fa._tuned_fwd(64, torch.float32).keys == ["HEAD_DIM", "CAUSAL", "DOCS", "SQ_KEY", "SK_KEY"]
    assert fb._tuned("dkdv", 64, torch.float32).keys == ["HEAD_DIM", "CAUSAL", "DOCS", "SQ_KEY", "SK_KEY"]
    assert fb._tuned("delta", 64, torch.float32).keys == ["HEAD_DIM", "SQ_KEY"]
    assert fa._tuned_fwd(64, torch.float32) is fa._tuned_fwd(64, torch.float32)
    assert [_utils.seq_key(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
    widths = [_utils.config_width(d) for d in (8, 32, 64, 80, 96, 128, 160, 256)]
    assert widths == [64] * 3 + [128] * 3 + [256] * 2


# -- (b) strided inputs are read in place -----------------------------------------------------------

class Launches:
    """Records the tensors each kernel launch receives (wrapping launch_tiles)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = _utils.launch_tiles

        def record(kernel, tuned, config, grid, *args, **consts):
            fn = kernel
            while hasattr(fn, "fn"):  # heuristics -> jit (or interpreted) function -> python function
                fn = fn.fn
            self.calls.append((fn.__name__, args))
            return original(kernel, tuned, config, grid, *args, **consts)

        monkeypatch.setattr(fa, "launch_tiles", record)
        monkeypatch.setattr(fb, "launch_tiles", record)

    def args(self, name):
        (args,) = [a for n, a in self.calls if n == name]
        return args


def fused_qkv(b, s, groups, per_group, d, seed=0):
    """q, k, v as megalite.model.gpt.SelfAttention makes them from a fused qkv (s, b, ...):
    k, v are permuted views; q is one too (a view of a separate projection here, since the
    model's reshape of the query heads copies unless there is one group)."""
    qkv = randn(s, b, groups * (per_group + 2) * d, seed=seed).view(s, b, groups, per_group + 2, d)
    qkv = qkv.permute(1, 2, 3, 0, 4)                        # (b, groups, per_group + 2, s, d)
    q = randn(s, b, groups * per_group, d, seed=seed + 1).permute(1, 2, 0, 3)
    return q, qkv[:, :, per_group], qkv[:, :, per_group + 1]


def test_permuted_views_are_read_in_place(monkeypatch):
    q, k, v = fused_qkv(2, 29, 2, 2, 24)
    dout = randn(29, 2, 4, 24, seed=7).permute(1, 2, 0, 3)  # as the gradient of out.permute(2, 0, 1, 3)
    assert not any(t.is_contiguous() for t in (q, k, v, dout))
    assert all(t.stride(-1) == 1 for t in (q, k, v, dout))
    launches = Launches(monkeypatch)
    out, lse = fa.flash_attention_forward(q, k, v, True)
    dq, dk, dv = fb.flash_attention_backward(q, k, v, out, dout, lse, True)
    fwd = launches.args("_fwd_kernel")
    assert fwd[0] is q and fwd[1] is k and fwd[2] is v
    assert fwd[7:16] == (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])  # after O, LSE, DS, TILES
    for name in ("_dkdv_kernel", "_dq_kernel"):
        args = launches.args(name)
        assert args[0] is q and args[1] is k and args[2] is v and args[3] is dout and args[4] is lse
    delta = launches.args("_delta_kernel")
    assert delta[0] is out and delta[1] is dout
    # the same numbers, bit for bit, as from contiguous copies; outputs contiguous
    c_out, c_lse = fa.flash_attention_forward(*(t.contiguous() for t in (q, k, v)), True)
    c_grads = fb.flash_attention_backward(*(t.contiguous() for t in (q, k, v)), c_out, dout.contiguous(),
                                          c_lse)
    assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
    for g, c in zip((dq, dk, dv), c_grads):
        assert g.is_contiguous() and torch.equal(g, c)
    ref_out, _, *ref_grads = reference(q, k, v, dout, True)
    assert err(out, ref_out) < TOL and all(err(g, r) < TOL for g, r in zip((dq, dk, dv), ref_grads))


def test_autograd_through_views_of_a_fused_qkv(monkeypatch):
    """flash_attention on views of one fused leaf (the model's path): the kernels get the views
    and the gradient reaches the fused tensor, as with contiguous copies."""
    b, s, groups, per_group, d = 1, 21, 1, 3, 16
    fused = randn(s, b, groups * (per_group + 2) * d, seed=3).requires_grad_()
    qkv = fused.view(s, b, groups, per_group + 2, d).permute(1, 2, 3, 0, 4)
    q = qkv[:, :, :per_group].reshape(b, -1, s, d)           # one group: a view, no copy
    k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]
    assert q._base is not None and q.stride(-1) == 1
    launches = Launches(monkeypatch)
    fa.flash_attention(q, k, v).backward(randn(b, per_group, s, d, seed=4))
    assert launches.args("_fwd_kernel")[0] is q and launches.args("_dq_kernel")[1] is k
    fused2 = fused.detach().clone().requires_grad_()
    qkv2 = fused2.view(s, b, groups, per_group + 2, d).permute(1, 2, 3, 0, 4)
    fa.flash_attention(*(t.contiguous() for t in (qkv2[:, :, :per_group].reshape(b, -1, s, d),
                                                  qkv2[:, :, per_group], qkv2[:, :, per_group + 1]))
                       ).backward(randn(b, per_group, s, d, seed=4))
    assert torch.equal(fused.grad, fused2.grad)


def test_sequence_chunks_are_read_in_place(monkeypatch):
    """Ring attention's pieces: q, k, v, out, dout, lse and delta chunked along the sequence."""
    q, dout = randn(2, 4, 40, 16, seed=1), randn(2, 4, 40, 16, seed=2)
    k, v = randn(2, 2, 40, 16, seed=3), randn(2, 2, 40, 16, seed=4)
    out, lse = fa.flash_attention_forward(q, k, v, True)
    delta = fb.attention_delta(out, dout)
    (q1, q2), (k1, _), (v1, _) = q.chunk(2, 2), k.chunk(2, 2), v.chunk(2, 2)
    o2, do2, l2, d2 = out.chunk(2, 2)[1], dout.chunk(2, 2)[1], lse.chunk(2, 2)[1], delta.chunk(2, 2)[1]
    assert not any(t.is_contiguous() for t in (q2, k1, v1, do2, l2, d2))
    launches = Launches(monkeypatch)
    got = fb.flash_attention_backward(q2, k1, v1, o2, do2, l2, False, delta=d2)
    args = launches.args("_dkdv_kernel")
    assert all(a is t for a, t in zip(args[:6], (q2, k1, v1, do2, l2, d2)))
    want = fb.flash_attention_backward(*(t.contiguous() for t in (q2, k1, v1, o2, do2, l2)), False,
                                       delta=d2.contiguous())
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_non_unit_last_stride_is_copied_and_right():
    q = randn(1, 2, 24, 19, seed=1).transpose(2, 3)          # (1, 2, 19, 24), last stride 19
    k, v = randn(1, 2, 19, 24, seed=2), randn(1, 2, 19, 24, seed=3)
    out, lse = fa.flash_attention_forward(q, k, v, True)
    want, want_lse = fa.flash_attention_forward(q.contiguous(), k, v, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# -- (c) head dims 96 and 256 -----------------------------------------------------------------------

@pytest.mark.parametrize("d", [96, 256])
def test_large_head_dims_match_the_reference(d):
    q, dout = randn(1, 2, 33, d, seed=1), randn(1, 2, 33, d, seed=2)
    k, v = randn(1, 1, 33, d, seed=3), randn(1, 1, 33, d, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fa.flash_attention(*leaves, return_lse=True)
    out.backward(dout)
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, True)
    assert err(out, ref_out) < TOL and err(lse, ref_lse) < TOL
    for x, r in zip(leaves, ref_grads):
        assert err(x.grad, r) < TOL


def test_head_dim_limit_and_its_message():
    """The kernels and the config check agree on 256: head dim 256 validates with the triton
    backend, 288 is refused with the limit and the way out."""
    from megalite.config import (Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig,
                                 validate)
    from megalite.layers.attention import TRITON_MAX_HEAD_DIM

    assert TRITON_MAX_HEAD_DIM == _utils.MAX_HEAD_DIM == 256
    q = torch.zeros(1, 1, 4, 264)
    with pytest.raises(ValueError, match="head dim 264 is above 256"):
        fa.flash_attention_forward(q, q, q)

    def config(head_dim):
        model = ModelConfig(num_layers=2, hidden_size=2 * head_dim, num_attention_heads=2, vocab_size=100,
                            seq_length=32, attention_backend="triton", attention_dropout=0.0)
        return Config(model, ParallelConfig(), TrainConfig(), DataConfig(mock_data=True))

    assert validate(config(256), 1) == []
    with pytest.raises(ConfigError, match="supports head dims up to 256, got hidden/heads = 288"):
        validate(config(288), 1)
