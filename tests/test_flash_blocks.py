"""The flash-attn adapter of ring attention (megalite/context_parallel/flash_blocks.py).

flash-attn installs only on a CUDA machine and neither test machine has it, so the adapter's
own logic (layouts, the LSE it takes from the result, filling each 2.x signature by name,
the causal-alignment rule) is tested here against two stand-ins of flash-attn's interface
with the 2.3-2.6 and the 2.7-2.8 signatures, whose numbers come from megalite's torch block
functions with flash-attn's documented semantics ((b, s, h, d) layout, bottom-right causal
alignment, delta computed inside the backward, results written into dq/dk/dv). The real
flash-attn is tested by the ``gpu`` test at the end wherever it is installed (its CPU case runs
the same body on the stand-in), and its real
Python interface of each 2.5-2.8 release (custom ops from 2.7) over a fake of the compiled
extension by tests/test_flash_attn_real_interface.py.
"""
import functools
import sys
import types

import pytest
import torch

from megalite.context_parallel.flash_blocks import flash_block_backward, flash_block_forward
from megalite.kernels.attention_reference import (attention_block_backward, attention_block_delta,
                                                  attention_block_forward, attention_reference)
from megalite.testing import run_world
from tests.device_twins import DEVICES, kernel_device


def _megalite(t):  # (b, s, h, d) -> (b, h, s, d)
    return t.transpose(1, 2)


def _fwd(q, k, v, softmax_scale, causal):
    s_q, s_k = q.shape[1], k.shape[1]  # bottom-right: query i sees keys up to i + s_k - s_q
    out, lse = attention_block_forward(_megalite(q), _megalite(k), _megalite(v), causal=causal,
                                       q_offset=s_k - s_q, scale=softmax_scale)
    return out.transpose(1, 2), lse


def _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):
    s_q, s_k = q.shape[1], k.shape[1]
    g = attention_block_backward(_megalite(q), _megalite(k), _megalite(v), _megalite(out), _megalite(dout),
                                 softmax_lse, causal=causal, q_offset=s_k - s_q, scale=softmax_scale,
                                 delta=attention_block_delta(_megalite(out), _megalite(dout)))
    for target, grad in zip((dq, dk, dv), g):
        target.copy_(grad.transpose(1, 2))


def v23():
    """flash-attn 2.3-2.6: window_size tuple, 8-tuple result."""
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, return_softmax):
        assert dropout_p == 0.0 and window_size == (-1, -1) and not return_softmax
        assert q.stride(-1) == 1
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, rng_state=None):
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


def v27():
    """flash-attn 2.7-2.8: window_size_left/right, softcap, ALiBi, 4-tuple result."""
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        assert (window_size_left, window_size_right, softcap, alibi_slopes) == (-1, -1, 0.0, None)
        out, lse = _fwd(q, k, v, softmax_scale, causal)
        return out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                             rng_state=None):
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


def _inputs(s_q=12, s_k=12, heads=4, groups=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, groups, s_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, heads, s_q, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("interface", [v23, v27])
@pytest.mark.parametrize("causal,s_k", [(True, 12), (False, 12), (False, 7)])
def test_adapter_gives_the_block_functions_results(interface, causal, s_k):
    q, k, v, dout = _inputs(s_k=s_k)
    api = interface()
    out, lse = flash_block_forward(q, k, v, causal=causal, scale=0.3, interface=api)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.3)
    assert out.shape == q.shape and torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse.float())
    grads = flash_block_backward(q, k, v, out, dout, lse, causal=causal, scale=0.3, interface=api)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    attention_reference(qr, kr, vr, causal=causal, scale=0.3)[0].backward(dout)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)


def test_non_square_causal_block_and_unknown_parameters_are_refused():
    q, k, v, _ = _inputs(s_q=8, s_k=12)
    with pytest.raises(ValueError, match="bottom-right.*top-left.*8 queries x 12 keys"):
        flash_block_forward(q, k, v, causal=True, interface=v27())

    def _flash_attn_forward(q, k, v, softmax_scale, causal, seqused_k):
        raise AssertionError("not called")
    api = types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward)
    with pytest.raises(RuntimeError, match="parameter 'seqused_k'.*Fix: use --attention-backend triton"):
        flash_block_forward(*_inputs()[:3], causal=False, interface=api)


def test_custom_op_block_functions_are_read_through_the_function_they_wrap():
    """flash-attn 2.7+ wraps the block functions in torch.library.custom_op: the op's own
    signature is (*args, **kwargs) and it has no __name__. The adapter reads the wrapped
    function; an unknown parameter still gets the message (not an AttributeError), and a
    signature it cannot read is refused with a message rather than called with nothing."""
    @torch.library.custom_op("megalite_test::flash_fwd_unknown", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                            causal: bool, seqused_k: int) -> torch.Tensor:
        raise AssertionError("not called")
    api = types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward)
    with pytest.raises(RuntimeError, match="megalite_test::flash_fwd_unknown takes a parameter 'seqused_k'"):
        flash_block_forward(*_inputs()[:3], causal=False, interface=api)

    def opaque(*args, **kwargs):
        raise AssertionError("not called")
    with pytest.raises(RuntimeError, match=r"opaque declares \(\*args, \*\*kwargs\).*cannot read"):
        flash_block_forward(*_inputs()[:3], causal=False, interface=types.SimpleNamespace(_flash_attn_forward=opaque))


def _ring_worker(rank, world, which):
    from megalite.context_parallel import ring_attention as ra
    from megalite.context_parallel.data import context_parallel_slice
    from megalite.parallel.grid import build_grid
    from megalite.config import ParallelConfig

    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    api = {"v23": v23, "v27": v27}[which]()
    ops = ra.BlockOps("flash", functools.partial(flash_block_forward, interface=api),
                      functools.partial(flash_block_backward, interface=api), attention_block_delta)
    q, k, v, dout = _inputs(s_q=16, s_k=16)

    def mine(t):
        return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world)["x"].view(t.shape[0], t.shape[1], -1, t.shape[3])

    ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
    out = ra._RingAttention.apply(ql, kl, vl, grid.cp_group, True, None, ra.RingExchange(grid.cp_group), ops)
    out.backward(mine(dout))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qr, kr, vr, causal=True)
    ref.backward(dout)
    return [(a - mine(b)).abs().max().item() for a, b in
            ((out, ref.detach()), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))]


@pytest.mark.parametrize("which", ["v23", "v27"])
def test_ring_attention_through_the_adapter_equals_full_attention(which):
    """CP=2 and 4, causal, GQA: the ring merges the adapter's blocks through their LSE and
    recomputes them from the global output and LSE. float64 inputs; the LSE is float32 as
    flash-attn's is, hence ~1e-7."""
    for world in (2, 4):
        errors = run_world(_ring_worker, world, which)
        assert max(max(e) for e in errors) < 1e-6, errors


@pytest.mark.parametrize("device", DEVICES)
def test_real_flash_attn_blocks_match_the_triton_blocks(device, monkeypatch):
    """On a GPU with flash-attn: the adapter around the real library, bf16, against megalite's
    Triton block functions (forward, LSE and the three gradients from a global out/LSE).

    flash-attn cannot be installed without CUDA, so the CPU case runs this body with the
    2.7-2.8 stand-in above installed as ``flash_attn`` and the Triton blocks in the interpreter,
    fp32, small shapes: it checks the test's own logic, not the real library."""
    if device == "cpu":
        kernel_device("cpu")
        api = v27()
        package = types.ModuleType("flash_attn")
        package.__version__, package.flash_attn_interface = "2.8.3 (stand-in)", api
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", api)
        dtype, shape = torch.float32, dict(s_q=24, s_k=24, heads=2, groups=1, d=16)
    else:
        dtype, shape = torch.bfloat16, dict(s_q=256, s_k=256, heads=8, groups=2, d=128)
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (it builds only on a CUDA machine)")
    from megalite.kernels.flash_attention import flash_attention_forward
    from megalite.kernels.flash_attention_bwd import flash_attention_backward

    q, k, v, dout = (t.to(device, dtype) for t in _inputs(**shape))
    for causal in (True, False):
        out, lse = flash_block_forward(q, k, v, causal=causal)
        ref_out, ref_lse = flash_attention_forward(q, k, v, causal=causal)
        assert (out.float() - ref_out.float()).abs().max() < 2e-2 and (lse - ref_lse).abs().max() < 5e-3
        got = flash_block_backward(q, k, v, ref_out, dout, ref_lse, causal=causal)
        want = flash_attention_backward(q, k, v, ref_out, dout, ref_lse, causal=causal)
        for a, b in zip(got, want):
            assert (a.float() - b.float()).abs().max() < 5e-2
