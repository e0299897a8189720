"""Fused norms for wide rows (hidden sizes above WHOLE_ROW_MAX): the chunked kernels, which
walk a row in column chunks instead of holding it in registers, against float64 torch, in the
interpreter. Small chunks are forced to make several chunks and a ragged last one cheap."""
import pytest
import torch

from megalite.kernels import norms
from megalite.kernels.norms import (CHUNK, WHOLE_ROW_MAX, _chunk, layer_norm, layer_norm_reference, norm_backward, norm_forward,
                                    rms_norm, rms_norm_reference)
from tests.device_twins import DEVICES, kernel_device


def _reference(x, w, b, dy, rms):
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    br = None if b is None else b.double().requires_grad_()
    y = rms_norm_reference(xr, wr) if rms else layer_norm_reference(xr, wr, br)
    y.backward(dy.double())
    return y, xr.grad, wr.grad, None if br is None else br.grad


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n,chunk", [(200, 64), (130, 32), (64, 64), (33, 128)])
def test_chunked_kernels_match_float64(rms, n, chunk):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=g) * 3 + 1  # an offset mean, as LayerNorm inputs have
    w, dy = torch.randn(n, generator=g), torch.randn(7, n, generator=g)
    b = None if rms else torch.randn(n, generator=g)
    y, mean, rstd = norm_forward(x, w, b, 1e-5, rms, chunk=chunk)
    dx, dw, db = norm_backward(dy, x, w, b is not None, mean, rstd, rms, chunk=chunk)
    ref = _reference(x, w, b, dy, rms)
    for name, got, want in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), ref):
        if want is not None:
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (name, err)


def test_wide_rows_take_the_chunked_path_through_autograd():
    """Above WHOLE_ROW_MAX features the autograd functions use the chunked kernels by default."""
    n = WHOLE_ROW_MAX + 808
    assert _chunk(n, None) == CHUNK and _chunk(WHOLE_ROW_MAX, None) is None  # which kernel runs
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, generator=g, requires_grad=True)
    w, b, dy = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(2, n, generator=g)
    for fused, rms in ((lambda t: layer_norm(t, w, b), False), (lambda t: rms_norm(t, w), True)):
        x.grad = None
        fused(x).backward(dy)
        ref = _reference(x.detach(), w, None if rms else b, dy, rms)
        assert (x.grad.double() - ref[1]).abs().max() / ref[1].abs().max() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_kernels_compiled_on_the_gpu(device, monkeypatch):
    """On a GPU (scripts/gpu_check.sh): the compiled chunked kernels in bf16 (a ragged last chunk,
    6 rows: fewer rows than programs) against float64, LayerNorm and RMSNorm (4 variants). The
    CPU case: the interpreter in fp16, with WHOLE_ROW_MAX and CHUNK lowered (128, 64) so that a
    row of 200 takes the same chunked path through autograd, its last chunk ragged."""
    dev = kernel_device(device)
    if dev.type == "cuda":
        n, dtype = 12296, torch.bfloat16  # above WHOLE_ROW_MAX, not a multiple of CHUNK
    else:
        monkeypatch.setattr(norms, "WHOLE_ROW_MAX", 128)
        monkeypatch.setattr(norms, "CHUNK", 64)
        n, dtype = 200, torch.float16
    assert norms._chunk(n, None) is not None and n % norms.CHUNK  # the chunked kernels, a ragged chunk
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(6, n, device=dev, generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dtype)
    b = torch.randn(n, device=dev, generator=g).to(dtype)
    dy = torch.randn(6, n, device=dev, generator=g).to(dtype)
    for rms in (False, True):
        leaves = [t.clone().requires_grad_() for t in ((x, w) if rms else (x, w, b))]
        y = rms_norm(*leaves) if rms else layer_norm(*leaves)
        y.backward(dy)
        ref = _reference(x, w, None if rms else b, dy, rms)
        for name, got, want in zip(("y", "dx", "dw", "db"), (y, *(t.grad for t in leaves)), ref):
            if want is not None:
                err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()
                assert got.dtype == dtype and err < 1.6e-2, (rms, name, err)
