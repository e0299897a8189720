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
(d) pruning by shared memory, in plain Python: configs over a limit are dropped.
Marked ``gpu`` (skipped here; scripts/gpu_check.sh runs them): the autotuned kernels in bf16
against torch SDPA at a few sizes, including the model's fused-qkv views. Their ``cpu`` cases
(tests/device_twins.py) run the same checks here in fp16 on small ragged shapes: the
interpreter's one config, a shared-memory limit of an sm_86 GPU given to the check of the
picked configs.
"""
from __future__ import annotations

import pytest
import torch

from megalite.kernels import _utils
from megalite.kernels import flash_attention as fa
from megalite.kernels import flash_attention_bwd as fb
from megalite.kernels.attention_reference import attention_reference
from tests.device_twins import device_cases, kernel_device, synchronize

TOL = 1e-5
WIDTHS = (64, 128, 256)
SM80, SM86, SM90 = 163 * 1024, 99 * 1024, 227 * 1024  # opt-in shared memory per block


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


# -- (d) pruning by shared memory ---------------------------------------------------------------------

class FakeCudaTensor:
    """What the pruner reads of a launch's tensor argument."""
    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, element_size):
        self._size = element_size

    def element_size(self):
        return self._size


ESTIMATES = (("fwd", fa.fwd_configs, fa.fwd_shared_bytes), ("dkdv", fb.dkdv_configs, fb.dkdv_shared_bytes),
             ("dq", fb.dq_configs, fb.dq_shared_bytes))


@pytest.mark.parametrize("limit", [SM86, SM80, SM90], ids=["sm86", "sm80", "sm90"])
def test_pruning_drops_the_configs_over_the_device_limit(monkeypatch, limit):
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: limit)
    for kind, configs, nbytes in ESTIMATES:
        for d in (64, 96, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                all_configs = configs(d, dtype, interpret=False)
                size, width = dtype.itemsize, _utils.block_d(d)
                prune = _utils.shared_memory_pruner("Q", nbytes)
                kept = prune(all_configs, {"Q": FakeCudaTensor(size)}, BLOCK_D=width)
                assert kept == [c for c in all_configs if nbytes(c, width, size) <= limit], (kind, d, dtype)
                assert kept, "every list keeps a config on a ~100 KB GPU"
                if limit == SM90:
                    assert kept == all_configs, (kind, d, dtype)  # sm_90 runs every config
                # on a CPU tensor (the interpreter) nothing is pruned
                assert prune(all_configs, {"Q": torch.zeros(1)}, BLOCK_D=width) == all_configs


def test_pruning_by_hand_and_the_smallest_fallback():
    configs = [_utils.tile_config(bm, bn, 4, 2) for bm, bn in ((128, 128), (128, 64), (64, 32))]
    nbytes = lambda c: fa.fwd_shared_bytes(c, 128, 2)  # noqa: E731
    # bf16, width 128: q BLOCK_M x 128, 2 stages of k and v BLOCK_N x 128, p BLOCK_M x BLOCK_N
    # 128x128: (16K + 64K + 16K) x 2 B = 192 KB; 128x64: (16K + 32K + 8K) x 2 = 112 KB; 64x32: 52 KB
    assert [nbytes(c) // 1024 for c in configs] == [192, 112, 52]
    assert _utils.fit_shared(configs, 150 * 1024, nbytes) == configs[1:]
    assert _utils.fit_shared(configs, 60 * 1024, nbytes) == configs[2:]
    assert _utils.fit_shared(configs, 10 * 1024, nbytes) == configs[2:]  # none fits: the smallest


def test_estimates_grow_with_tiles_and_stages():
    for kind, configs, nbytes in ESTIMATES:
        small, big = _utils.tile_config(32, 32, 4, 2), _utils.tile_config(64, 64, 4, 3)
        assert nbytes(small, 128, 2) < nbytes(big, 128, 2) < nbytes(big, 128, 4)
        assert nbytes(small, 64, 2) < nbytes(small, 128, 2)


# -- on a GPU: the autotuned kernels against torch SDPA ---------------------------------------------

# (batch, heads, groups, s, head_dim, causal)
GPU_SHAPES = [
    (2, 16, 16, 1024, 64, True),
    (1, 8, 2, 2048, 128, True),      # GQA
    (2, 8, 8, 777, 96, False),       # ragged, head dim 96 (tiles of 128)
    (1, 4, 4, 600, 256, True),       # head dim 256
]
BF16_TOL = 1.6e-2  # about 4x a bf16 output's rounding (tests/test_gpu.py)
# the CPU case (interpreter tiles of 32): fp16, GQA with partial tiles and a padded head dim; no mask
CPU_SHAPES = [
    (1, 4, 2, 45, 24, True),
    (1, 2, 2, 37, 16, False),
]


@pytest.fixture
def low_precision(monkeypatch):
    """(device, dtype) of a case: cuda, the kernels compiled, bf16; cpu, the interpreter, fp16
    (it cannot hold bf16), and an sm_86 GPU's shared-memory limit for the check of the configs."""
    def pick(device: str):
        dev = kernel_device(device)
        torch.manual_seed(0)
        if dev.type == "cuda":
            return dev, torch.bfloat16
        monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: SM86)
        return dev, torch.float16
    return pick


def sdpa_reference(q, k, v, dout, causal):
    """torch SDPA in fp32 on copies of the 16-bit inputs (output and gradients)."""
    import torch.nn.functional as F

    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout.float())
    return out, *(x.grad for x in leaves)


def check_against_sdpa(q, k, v, dout, causal):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fa.flash_attention(*leaves, causal=causal)
    out.backward(dout)
    synchronize(q.device)
    ref, *ref_grads = sdpa_reference(q, k, v, dout, causal)
    assert out.dtype == q.dtype and not torch.isnan(out).any()
    assert err(out, ref) < BF16_TOL, err(out, ref)
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref_grads):
        assert err(x.grad, r) < BF16_TOL, (name, err(x.grad, r))


def chosen(tuned) -> list:
    """The configs the autotuner picked, per key; each fits the device's shared memory. Under
    MEGALITE_KERNEL_TUNING=fixed it holds one config and launches it without a per-key cache."""
    return list(tuned.cache.values()) if len(tuned.configs) > 1 else list(tuned.configs)


@pytest.mark.parametrize("device,shape", device_cases([(s,) for s in CPU_SHAPES], [(s,) for s in GPU_SHAPES],
                                                      ids=lambda c: "x".join(map(str, c[0]))))
def test_autotuned_bf16_attention_matches_sdpa_on_cuda(low_precision, device, shape):
    dev, dt = low_precision(device)
    b, h, g, s, d, causal = shape
    q, dout = (torch.randn(b, h, s, d, device=dev).to(dt) for _ in range(2))
    k, v = (torch.randn(b, g, s, d, device=dev).to(dt) for _ in range(2))
    check_against_sdpa(q, k, v, dout, causal)
    limit = _utils.shared_memory_limit(dev.index)
    width = _utils.block_d(d)
    for tuned, nbytes in ((fa._tuned_fwd(d, dt), fa.fwd_shared_bytes),
                          (fb._tuned("dkdv", d, dt), fb.dkdv_shared_bytes),
                          (fb._tuned("dq", d, dt), fb.dq_shared_bytes)):
        picked = chosen(tuned)
        print(f"{shape}: {tuned.base_fn.__name__} picked {picked}")
        assert picked and all(nbytes(c, width, 2) <= limit for c in picked)


@pytest.mark.parametrize("device,b,s,groups,d", device_cases([(1, 45, 2, 16)], [(2, 1000, 4, 128)],
                                                              ids=lambda c: "b{}-s{}-g{}-d{}".format(*c)))
def test_autotuned_bf16_attention_on_fused_qkv_views_on_cuda(low_precision, device, b, s, groups, d):
    """The model's layout: k, v (and q, with one group) are views of a fused (s, b, ...) qkv.
    (GPU: batch 2, s 1000, 4 groups, head dim 128, bf16; CPU: 1, 45, 2, 16, fp16.)"""
    dev, dt = low_precision(device)
    per_group = 2
    qkv = torch.randn(s, b, groups * (per_group + 2) * d, device=dev).to(dt)
    qkv = qkv.view(s, b, groups, per_group + 2, d).permute(1, 2, 3, 0, 4)
    q = torch.randn(s, b, groups * per_group, d, device=dev).to(dt).permute(1, 2, 0, 3)
    k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]
    dout = torch.randn(s, b, groups * per_group, d, device=dev).to(dt).permute(1, 2, 0, 3)
    assert not k.is_contiguous() and k.stride(-1) == 1
    check_against_sdpa(q, k, v, dout, True)
    out_view, _ = fa.flash_attention_forward(q, k, v, True)
    out_copy, _ = fa.flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), True)
    assert torch.equal(out_view, out_copy)  # same config (strides are not in the key), same sums


def test_backward_gradients_in_fp32_on_request():
    """grad_dtype=float32 (what ring attention asks for): fp16 inputs, fp32 dq/dk/dv, closer to
    the float64 reference than the fp16 gradients (the kernel accumulates in fp32 either way)."""
    from megalite.kernels.flash_attention import flash_attention_forward
    from megalite.kernels.flash_attention_bwd import flash_attention_backward

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, 40, 16, generator=g).half() for _ in range(4))
    out, lse = flash_attention_forward(q, k, v, causal=True)
    low = flash_attention_backward(q, k, v, out, dout, lse, causal=True)
    high = flash_attention_backward(q, k, v, out, dout, lse, causal=True, grad_dtype=torch.float32)
    assert [t.dtype for t in low] == [torch.float16] * 3 and [t.dtype for t in high] == [torch.float32] * 3
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attention_reference(*leaves, causal=True)[0].backward(dout.double())
    for lo, hi, ref in zip(low, high, (t.grad for t in leaves)):
        assert torch.equal(hi.half(), lo)  # the same sums, rounded once more for the fp16 output
        assert (hi.double() - ref).abs().max() <= (lo.double() - ref).abs().max()
