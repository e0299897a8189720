"""flash-attn as ring attention's block functions: forward with its log-sum-exp, backward
from the *global* output and log-sum-exp.

Ring attention (:mod:`megalite.context_parallel.ring_attention`) merges per-block partial
outputs through each row's LSE and recomputes every block's gradients from the merged
(global) output O and LSE. flash-attn's public ``flash_attn_func`` returns neither in a form
the ring can use, but its interface module has the two functions it is built on:

- ``_flash_attn_forward(q, k, v, ...) -> ... out, softmax_lse ...``: the block's output and
  its natural-log LSE, (b, heads, s_q) float32;
- ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, ...)``: writes dq, dk,
  dv given *any* out and LSE; given the global O and LSE it computes, inside, delta =
  rowsum(dO * O) and P_ij = exp(S_ij - LSE_i), which is exactly the block's share of the
  global gradient (the same rule as megalite's Triton backward).

**Their signatures moved across 2.x** (2.0-2.2: ``causal, return_softmax``; 2.3: +
``window_size``; 2.4: + ``alibi_slopes``; 2.6: + ``softcap``; 2.7: ``window_size_left /
window_size_right`` and a 4-tuple result instead of 8). The adapter reads the installed
function's parameter names (``inspect.signature``) and fills every one it knows by name
(no dropout, no window, no ALiBi, no softcap, not deterministic), and takes the LSE from the
result by its length. A parameter it does not know raises with the version it found.
Since 2.7 both functions are ``torch.library.custom_op`` objects (``CustomOpDef``), whose own
``inspect.signature`` is ``(*args, **kwargs)`` and which have no ``__name__``: the adapter
reads the wrapped Python function (``_init_fn``) instead, or else the op's schema.

**Layouts.** megalite holds (b, heads, s, d); flash-attn takes (b, s, heads, d) with a unit
last stride, so the adapter passes transposed *views* (no copy) and transposes the results
back. Grouped-query attention is native to flash-attn (k, v with fewer heads).

**Causal alignment.** flash-attn aligns the causal mask bottom-right (query i sees keys up to
i + s_k - s_q); megalite's blocks are top-left with offsets. They agree exactly when the block
is square, which is the only causal block ring attention makes (a chunk against itself; the
other visible blocks are unmasked). A non-square causal block is refused rather than
silently shifted.
"""
from __future__ import annotations

import importlib
import inspect

import torch

from megalite.layers.attention import refuse_flash_value_head_size

# Every parameter of the 2.x block functions besides the tensors, and the value megalite wants.
_DEFAULTS = {"dropout_p": 0.0, "return_softmax": False, "window_size": (-1, -1), "window_size_left": -1,
             "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
             "rng_state": None}


def _interface(module=None):
    """flash-attn's interface module (``flash_attn.flash_attn_interface``), or the one given."""
    return module if module is not None else importlib.import_module("flash_attn.flash_attn_interface")


def _parameters(fn) -> list[tuple[str, bool]]:
    """(name, required) of every parameter ``fn`` declares. A ``torch.library.custom_op``
    (flash-attn 2.7+) shows ``(*args, **kwargs)`` itself: read the function it wraps
    (``_init_fn``), or else its operator schema."""
    inner = getattr(fn, "_init_fn", None)
    if inner is not None:
        fn = inner
    else:
        schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
        if schema is not None:
            return [(a.name, not a.has_default_value()) for a in schema.arguments]
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise RuntimeError(f"flash-attn {_version()}: {_name(fn)} declares {inspect.signature(fn)}, so "
                           f"megalite's adapter cannot read its parameters. Fix: use --attention-backend "
                           f"triton with context parallelism, or a flash-attn 2.x release from 2.0 to 2.8.")
    return [(p.name, p.default is inspect.Parameter.empty) for p in params]


def _name(fn) -> str:
    """A function's name; a ``CustomOpDef`` has none, but its ``_qualname`` or ``_name``."""
    return (getattr(fn, "__name__", None) or getattr(fn, "_qualname", None) or getattr(fn, "_name", None)
            or repr(fn))


def _version() -> str:
    try:
        return getattr(importlib.import_module("flash_attn"), "__version__", "?")
    except Exception:  # noqa: BLE001 -- only for a message
        return "?"


def _call(fn, tensors: dict, scale: float, causal: bool):
    """Call ``fn`` with the named tensors and, by name, every other parameter it declares."""
    values = {**_DEFAULTS, **tensors, "softmax_scale": scale, "causal": causal}
    kwargs = {}
    for name, required in _parameters(fn):
        if name in values:
            kwargs[name] = values[name]
        elif required:
            raise RuntimeError(f"flash-attn {_version()}: {_name(fn)} takes a parameter {name!r} megalite's "
                               f"adapter does not know. Fix: use --attention-backend triton with context "
                               f"parallelism, or a flash-attn 2.x release from 2.0 to 2.8.")
    return fn(**kwargs)


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool, v: torch.Tensor | None = None) -> None:
    if v is not None:
        refuse_flash_value_head_size("context-parallel attention on flash-attn blocks", q.shape[-1], v.shape[-1])
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"flash-attn aligns a causal mask bottom-right, megalite top-left: they agree only "
                         f"for square blocks, got {q.shape[2]} queries x {k.shape[2]} keys.")


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """(b, h, s, d) -> a (b, s, h, d) view; flash-attn needs a unit last stride."""
    return (t if t.stride(-1) == 1 else t.contiguous()).transpose(1, 2)


def flash_block_forward(q, k, v, causal: bool = True, scale: float | None = None, interface=None):
    """(out (b, heads, s_q, d) like q, lse (b, heads, s_q) float32) of one block."""
    _check_causal(q, k, causal, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    result = _call(_interface(interface)._flash_attn_forward, {"q": _bshd(q), "k": _bshd(k), "v": _bshd(v)},
                   scale, causal)
    out, lse = (result[0], result[5]) if len(result) == 8 else (result[0], result[1])
    return out.transpose(1, 2), lse.float()


def flash_block_backward(q, k, v, out, dout, lse, causal: bool = True, scale: float | None = None,
                         delta=None, interface=None):
    """(dq, dk, dv) of one block from the global ``out`` and ``lse`` (flash-attn computes delta =
    rowsum(dout * out) itself, so ``delta`` is not needed)."""
    _check_causal(q, k, causal, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    _call(_interface(interface)._flash_attn_backward,
          {"dout": _bshd(dout.to(q.dtype)), "q": qs, "k": ks, "v": vs, "out": _bshd(out.to(q.dtype)),
           "softmax_lse": lse.float().contiguous(), "dq": dq, "dk": dk, "dv": dv}, scale, causal)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
