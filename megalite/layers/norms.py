"""Normalization layers: LayerNorm (GPT-2) and RMSNorm (Llama), in three implementations.

- torch (default): ``nn.LayerNorm`` and :class:`RMSNorm` below.
- Triton (``fused=True``, ``--fused-kernels``): :class:`FusedLayerNorm` and
  :class:`FusedRMSNorm`, which call ``megalite.kernels.norms`` (one pass per row forward,
  weight/bias gradients reduced across rows in the backward).
- transformer-engine (``fused="te"``): its LayerNorm/RMSNorm, GPU only, imported only here.

All keep the parameter names ``weight`` (and ``bias``), so checkpoints, initialization and
the sequence-parallel marks do not depend on the implementation.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.layers.backends import te_missing


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class FusedLayerNorm(nn.Module):
    """LayerNorm through the Triton kernel: (x - mean) / sqrt(var + eps) * weight + bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

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
    return nn.LayerNorm(hidden_size, eps=eps) if kind == "LayerNorm" else RMSNorm(hidden_size, eps)
