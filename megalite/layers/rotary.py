"""Rotary position embeddings (RoPE), the rotate-half convention of GPT-NeoX / Llama.

For position p and frequency f_i = base^(-2i/d), the pair (x_i, x_{i+d/2}) is rotated by
the angle p * f_i. Positions are passed explicitly so a shard of the sequence (context
parallel) uses its true positions.
"""
from __future__ import annotations

import torch


def rotary_angles(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (b, 1, s, head_dim) for integer positions of shape (b, s)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = base ** -exponents
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # (b, s, d/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
