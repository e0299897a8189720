"""Rotary position embeddings (RoPE), the rotate-half convention of GPT-NeoX / Llama.

For position p and frequency f_i = base^(-2i/d), the pair (x_i, x_{i+d/2}) is rotated by
the angle p * f_i. Positions are passed explicitly so a shard of the sequence (context
parallel) uses its true positions. (Hugging Face's Llama/Qwen2 q/k rows are already laid
out for this half-split rotation, so their weights load without a permutation.)

Llama 3.1's frequency scaling (``rope_scaling`` with ``rope_type: llama3``) stretches long
wavelengths to a longer context: with L = original_max_position_embeddings, lambda_i = 2 pi / f_i,
    lambda_i < L / high_freq_factor   ->  f_i                     (high frequencies kept)
    lambda_i > L / low_freq_factor    ->  f_i / factor            (low frequencies slowed)
    otherwise                         ->  (1 - a) f_i / factor + a f_i,
                                          a = (L / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor)
"""
from __future__ import annotations

import math

import torch

ROPE_SCALING_TYPES = ("llama3",)


def scaled_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """The per-pair frequencies after ``scaling`` (None: unchanged); see the module docstring."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (only {', '.join(ROPE_SCALING_TYPES)})")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    smoothed = (1 - blend) * slowed / factor + blend * slowed
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, smoothed, slowed)


def rotary_angles(position_ids: torch.Tensor, head_dim: int, base: float,
                  scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (b, 1, s, head_dim) for integer positions of shape (b, s)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = scaled_frequencies(base ** -exponents, scaling)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # (b, s, d/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
