"""megalite against flash-attn's *real* Python interface, every minor release setup.py allows.

tests/test_flash_blocks.py checks the adapter's logic against hand-written stand-ins; those are
plain functions, so they could not show that 2.7+ wraps ``_flash_attn_forward`` /
``_flash_attn_backward`` in ``torch.library.custom_op`` (signature ``(*args, **kwargs)``, no
``__name__``). Here the release's own ``flash_attn_interface.py`` runs (fetched once and cached,
see tests/flash_attn_real.py) over a torch fake of the compiled extension, for ring attention's
block adapter and for the plain ``--attention-backend flash`` path (``flash_attn_func``).
"""
import pytest
import torch

from megalite.context_parallel.flash_blocks import flash_block_backward, flash_block_forward
from megalite.kernels.attention_reference import attention_reference
from megalite.layers import attention as attention_module
from tests.flash_attn_real import VERSIONS, real_interface


@pytest.fixture(scope="module", params=VERSIONS)
def flash(request):
    with real_interface(request.param) as module:
        yield module


def _inputs(s_q=12, s_k=12, heads=4, groups=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, groups, s_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64)


def _reference_grads(q, k, v, dout, causal, scale=None):
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(qr, kr, vr, causal=causal, scale=scale)
    out.backward(dout)
    return out.detach(), lse, (qr.grad, kr.grad, vr.grad)


@pytest.mark.parametrize("causal,s_k", [(True, 12), (False, 7)])
def test_block_adapter_calls_the_real_interface(flash, causal, s_k):
    """flash_block_forward/backward through the release's _flash_attn_forward/_backward (custom
    ops from 2.7): forward, LSE, and the gradients from the global out and LSE."""
    q, k, v, dout = _inputs(s_k=s_k)
    before = dict(flash.ext.calls)
    out, lse = flash_block_forward(q, k, v, causal=causal, scale=0.3, interface=flash)
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, dout, causal, scale=0.3)
    assert out.shape == q.shape and torch.allclose(out, ref_out)
    assert lse.dtype == torch.float32 and torch.allclose(lse, ref_lse.float())
    grads = flash_block_backward(q, k, v, out, dout, lse, causal=causal, scale=0.3, interface=flash)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    assert flash.ext.calls == {"fwd": before["fwd"] + 1, "bwd": before["bwd"] + 1}


def test_block_adapter_finds_the_installed_interface(flash):
    """Without ``interface=``, the adapter imports flash_attn.flash_attn_interface itself. (And
    from 2.7 the block functions really are custom ops, which these tests are about.)"""
    import flash_attn

    custom_op = tuple(int(x) for x in flash_attn.__version__.split(".")[:2]) >= (2, 7)
    assert (type(flash._flash_attn_forward).__name__ == "CustomOpDef") == custom_op
    q, k, v, _ = _inputs()
    out, _ = flash_block_forward(q, k, v, causal=True)
    assert torch.allclose(out, attention_reference(q, k, v, causal=True)[0])


@pytest.mark.parametrize("causal,heads,groups,d", [(True, 4, 2, 8), (False, 4, 4, 16)])
def test_attention_backend_flash_calls_flash_attn_func(flash, monkeypatch, causal, heads, groups, d):
    """The plain ``--attention-backend flash`` path: megalite.layers.attention.attention runs the
    release's flash_attn_func (its autograd function over the fake kernels), forward and backward.
    Only the GPU/dtype check is bypassed (this runs on a CPU in float64)."""
    monkeypatch.setattr(attention_module, "resolve_backend", lambda backend, q, dropout_p: "flash")
    q, k, v, dout = _inputs(heads=heads, groups=groups, d=d)
    before = dict(flash.ext.calls)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention_module.attention(qf, kf, vf, causal=causal, backend="flash")
    out.backward(dout)
    ref_out, _, ref_grads = _reference_grads(q, k, v, dout, causal)
    assert out.shape == q.shape and torch.allclose(out.detach(), ref_out)
    for got, want in zip((qf.grad, kf.grad, vf.grad), ref_grads):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    assert flash.ext.calls == {"fwd": before["fwd"] + 1, "bwd": before["bwd"] + 1}
