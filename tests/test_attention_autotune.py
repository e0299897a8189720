"""Flash attention's autotuning: the configs pruned by shared memory, and the autotuned kernels
against torch SDPA (the tile configs themselves: tests/test_attention_configs.py).

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
from tests.test_attention_configs import err

SM80, SM86, SM90 = 163 * 1024, 99 * 1024, 227 * 1024  # opt-in shared memory per block


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
