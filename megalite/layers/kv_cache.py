"""The cache of autoregressive generation.

Generating token t needs what every earlier position left in every layer. Recomputing it is
O(t) work per layer per token; the cache keeps it. What a layer keeps is its attention part's
choice (:meth:`megalite.layers.part_shape.PartShape.cache_buffers`): a list of buffers, each
(b, n, max_length, w) with n x w elements per token, filled in order:

- grouped-query self-attention: keys and values, two buffers of (groups, head_dim):
  2 g d elements per token per layer;
- Multi-head Latent Attention: one buffer of (1, r_kv + d_r), the normed key/value latent and
  the rotated RoPE key shared by the heads (:mod:`megalite.model.mla`).

A forward pass over n new tokens (the prompt at first, then one token at a time) writes their
entries at positions [start, start + n) and attends their queries over [0, start + n): query i
sits at absolute position start + i and sees keys j <= start + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.kernels.attention_reference import causal_visible


class LayerCache:
    """One layer's buffers, (b, n, max_length, w) each: keys and values for self-attention."""

    def __init__(self, owner: "KVCache", *buffers: torch.Tensor):
        self.owner, self.buffers = owner, buffers

    @property
    def k(self) -> torch.Tensor:
        return self.buffers[0]

    @property
    def v(self) -> torch.Tensor:
        return self.buffers[1]

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new positions' entries (one tensor per buffer, (b, n, s_new, w)); return
        every buffer's entries of all positions so far."""
        start, n, room = self.owner.length, new[0].shape[2], self.buffers[0].shape[2]
        if start + n > room:
            raise ValueError(f"the KV cache holds {room} positions; {start} + {n} do not fit. "
                             f"Fix: a larger max_length (prompt + new tokens).")
        for buffer, entries in zip(self.buffers, new, strict=True):
            buffer[:, :, start: start + n] = entries
        return tuple(buffer[:, :, : start + n] for buffer in self.buffers)


class KVCache:
    """Every layer's cache; ``length`` positions are filled. A model forward with the cache
    reads ``length`` as the first new position and advances it by the tokens it consumed.

    ``KVCache(layers, batch, groups, head_dim, max_length, dtype, device)`` holds self-attention's
    keys and values; :meth:`for_layers` takes each layer's own buffer sizes."""

    def __init__(self, layers, batch: int, groups: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device):
        self._fill({str(i): ((groups, head_dim), (groups, head_dim)) for i in layers},
                   batch, max_length, dtype, device)

    @classmethod
    def for_layers(cls, buffers: dict, batch: int, max_length: int, dtype: torch.dtype,
                   device: torch.device) -> "KVCache":
        """A cache whose layer ``name`` holds ``buffers[name]``: (n, w) per buffer, per token."""
        cache = cls.__new__(cls)
        cache._fill({str(name): sizes for name, sizes in buffers.items()}, batch, max_length, dtype, device)
        return cache

    def _fill(self, buffers: dict, batch: int, max_length: int, dtype, device) -> None:
        self.length, self.batch, self.max_length = 0, batch, max_length
        self.layers = {name: LayerCache(self, *(torch.zeros((batch, n, max_length, w), dtype=dtype, device=device)
                                                for n, w in sizes))
                       for name, sizes in buffers.items()}

    def layer(self, name: str) -> LayerCache:
        return self.layers[str(name)]

    def advance(self, n: int) -> None:
        self.length += n

    def allocated_bytes(self) -> int:
        """Bytes of every buffer allocated, all layers."""
        return sum(buffer.nbytes for layer in self.layers.values() for buffer in layer.buffers)

    def bytes_per_token(self) -> float:
        """Allocated bytes per cached position of one sequence, all layers (measured: the
        buffers' sizes over batch x max_length)."""
        return self.allocated_bytes() / (self.batch * self.max_length)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for the newest q.shape[2] positions of a sequence of
    k.shape[2]: query i is position s_k - s_q + i (causal, aligned bottom-right); GQA as in
    :func:`megalite.layers.attention.attention` (k, v of fewer heads than q, one of them
    included). ``scale``: 1/sqrt(q.shape[-1]) unless given."""
    s_q, s_k = q.shape[2], k.shape[2]
    mask = None if s_q == 1 else causal_visible(s_q, s_k, s_k - s_q, 0, q.device)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def shared_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`cached_attention` for one key/value head (k, v: (b, 1, s_k, .)) shared by every head
    of q (b, heads, s_q, d): the heads are folded into the query rows, row ``i * s_q + j`` = head i,
    position j (its mask row is position j's), so the cache is read once by one matmul instead of
    being repeated per head. The absorbed form of Multi-head Latent Attention attends this way."""
    b, heads, s_q, _ = q.shape
    s_k = k.shape[2]
    mask = None if s_q == 1 else causal_visible(s_q, s_k, s_k - s_q, 0, q.device).repeat(heads, 1)
    out = F.scaled_dot_product_attention(q.reshape(b, 1, heads * s_q, -1), k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask, scale=scale)
    return out.view(b, heads, s_q, -1)
