"""Packed documents: several documents share one training sequence and attend only within their own.

Pretraining packs documents end to end into sequences of ``s`` tokens. With Megatron's
``--reset-attention-mask`` a token sees only the earlier tokens of its own document; the batch
then carries, per row, two (b, s) int32 arrays in *absolute* sequence positions:

- ``doc_start[i]``: where token i's document begins;
- ``doc_end[j]``: where token j's document ends (exclusive).

Documents are contiguous, so ``doc_start`` is non-decreasing along a row, and key j is visible
to query i iff ``doc_start[i] <= j <= i`` (causal attention; ``doc_end`` only tells kernels
which query tiles can skip a key tile: no query at or past ``doc_end[j]`` sees key j). A token
always sees itself, so no row is empty.

The arrays stay whole under context parallelism (they are tiny): every rank knows the
boundaries of every key, and a block of queries at absolute offset ``q_offset`` against keys at
``k_offset`` reads ``start[:, q_offset: q_offset + s_q]`` and ``end[:, k_offset: k_offset + s_k]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megalite.errors import ConfigError


class Documents(NamedTuple):
    """The packed documents of a micro-batch: ``start`` and ``end``, (b, s) int32, absolute."""
    start: torch.Tensor
    end: torch.Tensor

    def block(self, q_offset: int, s_q: int, k_offset: int, s_k: int) -> dict:
        """The keyword arguments of a block function (the Triton kernels' and the torch
        reference's ``doc_start`` / ``doc_end``) for queries [q_offset, q_offset + s_q) against
        keys [k_offset, k_offset + s_k): causal with those absolute offsets."""
        return {"causal": True, "q_offset": q_offset, "k_offset": k_offset,
                "doc_start": self.start[:, q_offset: q_offset + s_q],
                "doc_end": self.end[:, k_offset: k_offset + s_k]}


def batch_documents(batch: dict) -> Documents | None:
    """The micro-batch's documents (``doc_start``, ``doc_end``), or None when it carries none
    (attention over the whole sequence, as without ``--reset-attention-mask``)."""
    if "doc_start" not in batch:
        return None
    return Documents(batch["doc_start"], batch["doc_end"])


def documents_from_lengths(lengths: list[list[int]], device=None) -> Documents:
    """Documents of given lengths, one list per batch row (each summing to s): for tests and
    hand-built batches. Returns (b, s) int32 ``start`` and ``end``."""
    starts, ends = [], []
    for row in lengths:
        s, e, pos = [], [], 0
        for n in row:
            s += [pos] * n
            e += [pos + n] * n
            pos += n
        starts.append(s)
        ends.append(e)
    return Documents(torch.tensor(starts, dtype=torch.int32, device=device),
                     torch.tensor(ends, dtype=torch.int32, device=device))


def reset_positions(documents: Documents) -> torch.Tensor:
    """Position ids that restart at 0 in each document, (b, s) int64 (``--reset-position-ids``)."""
    s = documents.start.shape[1]
    positions = torch.arange(s, device=documents.start.device).expand_as(documents.start)
    return (positions - documents.start.long()).contiguous()


def visible_mask(documents: Documents, s_q: int, s_k: int, q_offset: int = 0, k_offset: int = 0) -> torch.Tensor:
    """Boolean (b, 1, s_q, s_k): key j visible to query i iff ``start[i] <= j + k_offset <= i + q_offset``
    (the mask SDPA takes; the same math as the reference's ``causal_visible``)."""
    device = documents.start.device
    i = torch.arange(s_q, device=device).unsqueeze(1) + q_offset
    j = torch.arange(s_k, device=device).unsqueeze(0) + k_offset
    first = documents.start[:, q_offset: q_offset + s_q].unsqueeze(-1)  # (b, s_q, 1)
    return ((j <= i) & (j >= first)).unsqueeze(1)


def check_documents_attention(model_config, reset_attention_mask: bool) -> None:
    """Validation hook for megalite.config.validate: raise ConfigError when the chosen attention
    cannot take packed documents (``--reset-attention-mask``). flash-attn cannot (its varlen
    API is not wired in: it is untestable without a GPU); triton, torch and auto can
    (auto never picks flash for documents); transformer-engine's core attention is given no
    document mask, so with documents megalite's attention runs beside TE's linears."""
    if not reset_attention_mask:
        return
    if model_config.attention_backend == "flash":
        raise ConfigError("--reset-attention-mask with --attention-backend flash: megalite does not hand packed "
                          "documents to flash-attn (its varlen API is not wired in). Fix: --attention-backend "
                          "triton (or auto, or torch).")
