"""Normalization layers: LayerNorm (GPT-2) and RMSNorm (Llama), in three implementations.

- torch (default): :class:`LayerNorm` and :class:`RMSNorm` below. Both keep for backward only
  their input as given (bf16 in a bf16 run) and one fp32 mean / 1/std per row, as the fused
  kernels do: plain autograd would keep fp32 copies (RMSNorm its fp32 input and normalized
  output, 8 bytes per element; LayerNorm under autocast an fp32 copy of its input). The
  LayerNorm runs torch's own kernels (``native_layer_norm`` and its backward); the RMSNorm
  backward is dx = r (g - x̂ mean(g x̂)), dw = sum over rows of dy x̂, with x̂ = x r, g = dy w,
  r = 1/sqrt(mean(x²) + eps), in fp32.
- Triton (``fused=True``, ``--fused-kernels``): :class:`FusedLayerNorm` and
  :class:`FusedRMSNorm`, which call ``megalite.kernels.norms`` (one pass per row forward,
  weight/bias gradients reduced across rows in the backward).
- transformer-engine (``fused="te"``): its LayerNorm/RMSNorm, GPU only, imported only here.

All keep the parameter names ``weight`` (and ``bias``), so checkpoints, initialization and
the sequence-parallel marks do not depend on the implementation.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from megalite.layers.backends import te_missing


def _without_autocast(x: torch.Tensor):
    """Autocast would run the norm on an fp32 copy of x (and keep it): the kernels accumulate
    in fp32 themselves."""
    kind = x.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        n = [x.shape[-1]]
        with _without_autocast(x):
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, n, weight.to(x.dtype), bias.to(x.dtype), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        with _without_autocast(x):
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy.to(x.dtype), x, [x.shape[-1]], mean, rstd, weight.to(x.dtype), bias.to(x.dtype),
                [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]])
        dw = dw.to(weight.dtype) if dw is not None else None
        return dx, dw, db.to(bias.dtype) if db is not None else None, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dy32 = dy.float()
        g = dy32 * weight.float()
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (dy32 * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (``nn.LayerNorm``'s numbers and
    parameter names), keeping only x and the row statistics for backward."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNorm.apply(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, keeping only x and 1/rms per row for backward."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class FusedLayerNorm(LayerNorm):
    """LayerNorm through the Triton kernel: (x - mean) / sqrt(var + eps) * weight + bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megalite.kernels.norms import layer_norm

        return layer_norm(x, self.weight, self.bias, self.eps)


class FusedRMSNorm(RMSNorm):
    """RMSNorm through the Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megalite.kernels.norms import rms_norm

        return rms_norm(x, self.weight, self.eps)


def _te_norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    why = te_missing()
    if why:
        raise RuntimeError(f"transformer-engine norms were asked for but cannot run: {why}. "
                           f"Fix: install it on a GPU machine, or use the torch or Triton norms.")
    import transformer_engine.pytorch as te

    cls = te.LayerNorm if kind == "LayerNorm" else te.RMSNorm
    # fp32 parameters on the device the model is built on (meta: TE defers its init)
    return cls(hidden_size, eps=eps, params_dtype=torch.get_default_dtype(), device=torch.get_default_device())


def build_norm(kind: str, hidden_size: int, eps: float, fused: bool | str = False) -> nn.Module:
    """``kind`` LayerNorm or RMSNorm; ``fused``: False (torch), True or "triton", or "te"."""
    if kind not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"unknown normalization {kind!r}; use LayerNorm or RMSNorm")
    if fused == "te":
        return _te_norm(kind, hidden_size, eps)
    if fused in (True, "triton"):
        return FusedLayerNorm(hidden_size, eps) if kind == "LayerNorm" else FusedRMSNorm(hidden_size, eps)
    if fused not in (False, None, "torch"):
        raise ValueError(f"unknown norm implementation fused={fused!r}; use False, True/'triton' or 'te'")
    return LayerNorm(hidden_size, eps=eps) if kind == "LayerNorm" else RMSNorm(hidden_size, eps)
