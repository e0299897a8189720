"""Attention: one function that every part of the model calls, so backends can be swapped.

``attention(q, k, v)`` computes ``softmax(q k^T / sqrt(d) + mask) v`` per head, with
q of shape (b, heads, s_q, d) and k, v of shape (b, groups, s_k, d). Grouped-query
attention: each key/value group serves ``heads / groups`` consecutive query heads.
The torch backend is ``scaled_dot_product_attention``; the Triton kernels and
flash-attn plug in here (issue: Triton kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("torch",)


def check_attention_backend(model_config) -> None:
    """Validation hook called by megalite.config.validate: raise ConfigError when the chosen
    backend is unknown or unavailable, or cannot run this model (the message names the fix)."""
    from megalite.config import ConfigError

    if model_config.attention_backend not in BACKENDS:
        raise ConfigError(f"--attention-backend {model_config.attention_backend!r} is not available; "
                          f"available: {', '.join(BACKENDS)}.")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              dropout_p: float = 0.0, backend: str = "torch") -> torch.Tensor:
    if backend != "torch":
        raise ValueError(f"attention backend {backend!r} is not available; available: {BACKENDS}")
    groups, heads = k.shape[1], q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p,
                                          enable_gqa=groups != heads)
