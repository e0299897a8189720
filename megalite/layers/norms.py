"""Normalization layers: LayerNorm (GPT-2) and RMSNorm (Llama)."""
from __future__ import annotations

import torch
from torch import nn


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


def build_norm(kind: str, hidden_size: int, eps: float, fused: bool = False) -> nn.Module:
    if fused:
        raise NotImplementedError("fused (Triton) norms are not implemented yet")
    if kind == "LayerNorm":
        return nn.LayerNorm(hidden_size, eps=eps)
    if kind == "RMSNorm":
        return RMSNorm(hidden_size, eps)
    raise ValueError(f"unknown normalization {kind!r}; use LayerNorm or RMSNorm")
