"""flash-attn's real Python interface on a CPU: its ``flash_attn/flash_attn_interface.py`` of a
given release with only the compiled extension (``flash_attn_2_cuda``) replaced by a torch fake.

The interface file comes from the release's source archive, pinned with its sha256 in
tests/reference_archives.json and fetched before the tests by tools/fetch_test_references.py
(scripts/setup_env.sh runs it; nothing is built); the tests read only that cache, and nothing of
flash-attn is kept in this repository. Everything the adapter meets is the release's own:
signatures, the ``torch.library.custom_op`` wrapping of 2.7+ (whose CUDA-only kernel is registered
for the CPU too, the same Python body), the tuples it unpacks and returns, ``flash_attn_func``'s
autograd function. Only the C++ ``fwd``/``bwd`` are fakes: attention in torch with flash-attn's
semantics ((b, s, h, d), bottom-right causal alignment, natural-log LSE (b, h, s_q) float32, delta
computed inside bwd, dq/dk/dv written into the given buffers), taking the positional arguments and
returning the tuple of that release's C++ API.
"""
from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import types

import torch

from megalite.kernels.attention_reference import (attention_block_backward, attention_block_delta,
                                                  attention_block_forward)
from tests.reference_cache import extracted_file

# One release of each minor version setup.py allows (flash-attn>=2.5), the last of each line when
# pinned (tests/reference_archives.json pins each with its sha256).
VERSIONS = ("2.5.9.post1", "2.6.3", "2.7.4.post1", "2.8.3")


def interface_file(version: str) -> pathlib.Path:
    """The release's ``flash_attn/flash_attn_interface.py``, from the test-reference cache (its
    sha256 checked; tests/reference_cache.py says what happens when it is not there)."""
    return extracted_file("flash-attn", version, f"flash_attn-{version}/flash_attn/flash_attn_interface.py")


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _megalite(t):  # (b, s, h, d) -> (b, h, s, d)
    return t.transpose(1, 2)


def fake_extension(version: str) -> types.ModuleType:
    """``flash_attn_2_cuda`` with the positional API of ``version``'s C++ ``fwd`` and ``bwd``.

    fwd(q, k, v, out, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
    [softcap (2.6+),] return_softmax, gen) -> 8-tuple (out, q, k, v, out_padded, lse, S_dmask,
    rng_state) before 2.7, 4-tuple (out, lse, S_dmask, rng_state) from 2.7.
    bwd(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale, causal,
    window_left, window_right, [softcap (2.6+),] deterministic, gen, rng_state) -> (dq, dk, dv,
    softmax_d), dq/dk/dv written in place.
    Asserts megalite asks for what it means to: no ALiBi, dropout, window, softcap or probabilities.
    """
    has_softcap = _minor(version) >= (2, 6)
    four_tuple = _minor(version) >= (2, 7)
    ext = types.ModuleType("flash_attn_2_cuda")
    ext.calls = {"fwd": 0, "bwd": 0}

    def fwd(q, k, v, out, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, *rest):
        softcap, return_softmax, _gen = rest if has_softcap else (0.0, *rest)
        assert len(rest) == (3 if has_softcap else 2), rest
        assert alibi_slopes is None and dropout_p == 0.0 and (window_left, window_right) == (-1, -1)
        assert softcap == 0.0 and not return_softmax and out is None
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        ext.calls["fwd"] += 1
        s_q, s_k = q.shape[1], k.shape[1]
        o, lse = attention_block_forward(_megalite(q), _megalite(k), _megalite(v), causal=causal,
                                         q_offset=s_k - s_q, scale=softmax_scale)
        o = o.transpose(1, 2).contiguous()
        lse = lse.float().contiguous()
        s_dmask = torch.empty((0,), dtype=q.dtype)
        rng_state = torch.zeros((2,), dtype=torch.int64)
        return (o, lse, s_dmask, rng_state) if four_tuple else (o, q, k, v, o, lse, s_dmask, rng_state)

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale, causal,
            window_left, window_right, *rest):
        softcap, _deterministic, _gen, _rng = rest if has_softcap else (0.0, *rest)
        assert len(rest) == (4 if has_softcap else 3), rest
        assert alibi_slopes is None and dropout_p == 0.0 and (window_left, window_right) == (-1, -1)
        assert softcap == 0.0 and dq is not None and dk is not None and dv is not None
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        ext.calls["bwd"] += 1
        s_q, s_k = q.shape[1], k.shape[1]
        delta = attention_block_delta(_megalite(out), _megalite(dout))  # computed inside, as flash-attn does
        grads = attention_block_backward(
            _megalite(q), _megalite(k), _megalite(v), _megalite(out), _megalite(dout), softmax_lse,
            causal=causal, q_offset=s_k - s_q, scale=softmax_scale, delta=delta)
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad.transpose(1, 2))
        return dq, dk, dv, delta.float()

    ext.fwd, ext.bwd = fwd, bwd
    return ext


_NAMES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_2_cuda")


@contextlib.contextmanager
def real_interface(version: str):
    """``flash_attn`` (with ``flash_attn_func``) and ``flash_attn.flash_attn_interface`` of
    ``version`` in ``sys.modules`` over the fake extension; yields the interface module (its
    ``flash_attn_2_cuda`` as ``.ext``). ``sys.modules`` is restored afterwards."""
    path = interface_file(version)
    saved = {name: sys.modules.get(name) for name in _NAMES}
    try:
        ext = fake_extension(version)
        package = types.ModuleType("flash_attn")
        package.__path__ = []  # a package, so "from .x import" inside resolves
        package.__version__ = version
        sys.modules.update({"flash_attn": package, "flash_attn_2_cuda": ext})
        spec = importlib.util.spec_from_file_location("flash_attn.flash_attn_interface", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["flash_attn.flash_attn_interface"] = module
        spec.loader.exec_module(module)
        for name in ("_flash_attn_forward", "_flash_attn_backward"):
            op = getattr(module, name)
            if hasattr(op, "register_kernel"):  # a custom_op with device_types="cuda": same body on CPU
                op.register_kernel("cpu", op._init_fn)
        package.flash_attn_interface = module
        package.flash_attn_func = module.flash_attn_func  # as flash_attn/__init__.py exports it
        module.ext = ext
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
