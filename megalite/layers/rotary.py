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

YaRN (``rope_type: yarn``, DeepSeek-V3; Megatron's ``--rope-type yarn``; Peng et al. 2023,
"YaRN: Efficient Context Window Extension of Large Language Models"). With s = factor,
L = original_max_position_embeddings, d the rotary size and i = 0 .. d/2-1 the pair index,
pair i turns r_i = L f_i / (2 pi) times over the original context. The pair index that turns
exactly r times is
    c(r) = d ln(L / (2 pi r)) / (2 ln base)
and the ramp runs from lo = c(beta_fast) to hi = c(beta_slow) (rounded out to floor / ceil
with ``truncate``, Megatron's --yarn-correction-range-round-to-int; clipped to [0, d-1]):
    gamma_i = clamp((i - lo) / (hi - lo), 0, 1)
    f'_i    = (1 - gamma_i) f_i + gamma_i f_i / s
so the fast pairs (many turns: i < lo) keep their frequency (extrapolation), the slow ones
(i > hi) are divided by s (interpolation), linearly in i between. The attention temperature:
with mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1,
    cos and sin are multiplied by   mscale(s, mscale) / mscale(s, mscale_all_dim)
    the softmax scale is            d_qk^(-1/2) * mscale(s, mscale_all_dim)^2   (:func:`softmax_scale`)
(DeepSeek-V3: s = 40, L = 4096, betas 32 / 1, mscale = mscale_all_dim = 1: cos/sin unchanged,
softmax scale times (0.1 ln 40 + 1)^2. With mscale 1 and mscale_all_dim 0, Megatron's defaults,
cos and sin carry the paper's sqrt(1/t) = 0.1 ln s + 1 and the softmax scale is plain.)
Hugging Face uses the same ratio when both mscales are non-zero, else mscale(s, 1) on cos/sin.
"""
from __future__ import annotations

import math

import torch

from megalite.errors import ConfigError

ROPE_SCALING_TYPES = ("llama3", "yarn")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def scaling_kind(scaling: dict | None) -> str | None:
    """``rope_type`` of a ``rope_scaling`` dict (Hugging Face's older key: ``type``); None: no scaling."""
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1 (the module docstring)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_ramp_bounds(scaling: dict, dim: int, base: float) -> tuple[float, float]:
    """(lo, hi): the pair indices turning beta_fast and beta_slow times over the original context."""
    context = scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:
        return dim * math.log(context / (2 * math.pi * turns)) / (2 * math.log(base))

    lo, hi = pair_turning(scaling["beta_fast"]), pair_turning(scaling["beta_slow"])
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    return max(lo, 0), min(hi, dim - 1)


def yarn_frequencies(dim: int, base: float, scaling: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    """The d/2 YaRN frequencies f'_i (float32, computed in float64 on ``device``, the positions'
    one: no host-to-device copy in the forward); see the module docstring."""
    freq = float(base) ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    lo, hi = yarn_ramp_bounds(scaling, dim, base)
    width = hi - lo if hi != lo else 1e-3  # one index: a step
    gamma = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - lo) / width).clamp(0, 1)
    return ((1 - gamma) * freq + gamma * freq / scaling["factor"]).float()


def rotary_amplitude(scaling: dict | None) -> float:
    """The factor on cos and sin: mscale(s, mscale) / mscale(s, mscale_all_dim) for YaRN, else 1."""
    if scaling_kind(scaling) != "yarn":
        return 1.0
    factor = scaling["factor"]
    return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])


def softmax_scale(cfg, d_qk: int) -> float:
    """The attention's softmax scale for query/key heads of size ``d_qk`` under model config
    ``cfg``: d_qk^(-1/2), times mscale(s, mscale_all_dim)^2 with YaRN (module docstring). Every
    attention of the model takes its scale from here (:class:`megalite.model.attention.SelfAttention`
    multiplies q by ``softmax_scale * sqrt(d_qk)``, so each backend keeps its default 1/sqrt(d_qk))."""
    scaling = cfg.rope_scaling
    scale = d_qk ** -0.5
    if scaling_kind(scaling) == "yarn":
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def check_rope_scaling(scaling: dict | None) -> None:
    """Validation hook (megalite.config.validate): ConfigError naming the value, the rule and the fix."""
    kind = scaling_kind(scaling)
    if kind is None:
        return
    if kind == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(k not in scaling for k in need):
            raise ConfigError(f"rope_scaling {scaling!r}: the llama3 schedule needs {', '.join(need)}. "
                              f"Fix: give them all, or no scaling.")
        return
    if kind != "yarn":
        raise ConfigError(f"rope_scaling {scaling!r}: megalite implements the llama3 and yarn schedules "
                          f"(rope_type {' or '.join(map(repr, ROPE_SCALING_TYPES))}). Fix: use one, or no scaling.")
    missing = [k for k in YARN_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"rope_scaling {scaling!r}: yarn needs {', '.join(missing)}. Fix: give "
                          f"{', '.join(YARN_KEYS)}.")
    factor, fast, slow = scaling["factor"], scaling["beta_fast"], scaling["beta_slow"]
    context = scaling["original_max_position_embeddings"]
    if not factor > 0:
        raise ConfigError(f"--rotary-scaling-factor {factor}: the YaRN context factor must be > 0 (1: the "
                          f"original context; DeepSeek-V3: 40). Fix: give a positive factor.")
    if not (isinstance(context, int) and context > 0):
        raise ConfigError(f"--yarn-original-max-position-embeddings {context!r}: the context the model was "
                          f"trained on must be a positive integer (DeepSeek-V3: 4096). Fix: give it.")
    if not slow > 0:
        raise ConfigError(f"--yarn-beta-slow {slow}: a number of turns over the original context, must be "
                          f"> 0 (default 1). Fix: give a positive value.")
    if not fast > slow:
        raise ConfigError(f"--yarn-beta-fast {fast} <= --yarn-beta-slow {slow}: the ramp runs from the pairs "
                          f"turning beta_fast times to those turning beta_slow times, so beta_fast must be "
                          f"the larger (defaults 32 and 1). Fix: swap or raise --yarn-beta-fast.")
    for key, flag in (("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim")):
        if not scaling[key] >= 0:
            raise ConfigError(f"{flag} {scaling[key]}: the attention temperature coefficient must be >= 0 "
                              f"(0: no correction). Fix: give a non-negative value.")


def scaled_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """The per-pair frequencies after ``scaling`` (None: unchanged); see the module docstring."""
    if not scaling:
        return inv_freq
    kind = scaling_kind(scaling)
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported here (only llama3; yarn: yarn_frequencies)")
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
    """cos and sin of shape (b, 1, s, head_dim) for integer positions of shape (b, s) (with YaRN
    both times :func:`rotary_amplitude`)."""
    if scaling_kind(scaling) == "yarn":
        inv_freq = yarn_frequencies(head_dim, base, scaling, position_ids.device)
    else:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
        inv_freq = scaled_frequencies(base ** -exponents, scaling)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # (b, s, d/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    amplitude = rotary_amplitude(scaling)
    if amplitude != 1.0:
        return angles.cos() * amplitude, angles.sin() * amplitude
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
