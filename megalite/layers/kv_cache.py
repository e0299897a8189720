"""The key/value cache of autoregressive generation.

Generating token t needs the keys and values of every earlier position in every layer.
Recomputing them is O(t) work per layer per token; the cache keeps them: for each layer a
buffer of shape (b, groups, max_length, d) for keys and one for values, filled in order.
A forward pass over n new tokens (the prompt at first, then one token at a time) writes
their keys and values at positions [start, start + n) and attends their queries over
[0, start + n): query i sits at absolute position start + i and sees keys j <= start + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.kernels.attention_reference import causal_visible


class LayerCache:
    """One layer's keys and values, (b, groups, max_length, d) each."""

    def __init__(self, owner: "KVCache", k: torch.Tensor, v: torch.Tensor):
        self.owner, self.k, self.v = owner, k, v

    def extend(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v; return the keys and values of all positions so far."""
        start, n = self.owner.length, k_new.shape[2]
        if start + n > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} positions; {start} + {n} do not fit. "
                             f"Fix: a larger max_length (prompt + new tokens).")
        self.k[:, :, start: start + n] = k_new
        self.v[:, :, start: start + n] = v_new
        return self.k[:, :, : start + n], self.v[:, :, : start + n]


class KVCache:
    """Every layer's cache; ``length`` positions are filled. A model forward with the cache
    reads ``length`` as the first new position and advances it by the tokens it consumed."""

    def __init__(self, layers, batch: int, groups: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, groups, max_length, head_dim)
        self.length = 0
        self.layers = {str(i): LayerCache(self, torch.zeros(shape, dtype=dtype, device=device),
                                          torch.zeros(shape, dtype=dtype, device=device)) for i in layers}

    def layer(self, name: str) -> LayerCache:
        return self.layers[str(name)]

    def advance(self, n: int) -> None:
        self.length += n


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for the newest q.shape[2] positions of a sequence of
    k.shape[2]: query i is position s_k - s_q + i (causal, aligned bottom-right); GQA as in
    :func:`megalite.layers.attention.attention`."""
    s_q, s_k = q.shape[2], k.shape[2]
    mask = None if s_q == 1 else causal_visible(s_q, s_k, s_k - s_q, 0, q.device)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                          enable_gqa=k.shape[1] != q.shape[1])
