"""Packed documents: position ids, document bounds and loss mask of a micro-batch.

Pretraining packs documents back to back, each closed by the end-of-document
(EOD) token, and cuts the stream into windows that ignore document
boundaries.  Megatron's three flags say what a window should know about them;
everything here is computed on the host with numpy, in the data pipeline, so
the training step never has to look at token values on the device.

The EOD rule: the EOD token belongs to the document it closes; the token after
it starts a new document.  For inputs ``tokens`` (b, s):

* ``--reset-position-ids``: ``position_ids[i] = i - doc_start[i]`` (0 at the
  first token of every document), else ``0 .. s-1``;
* ``--reset-attention-mask``: ``doc_start[i]`` is the position where the
  document of token ``i`` starts inside the window (0 for a document that
  began before the window), ``doc_end[i]`` the position after its EOD token
  (exclusive; ``s`` for a document still open at the end of the window).
  Token ``i`` may attend to ``j`` iff ``doc_start[i] <= j <= i``;
* ``--eod-mask-loss``: ``loss_mask[i] = 0`` where the *input* ``tokens[i]`` is
  EOD, as Megatron's ``_get_ltor_masks_and_position_ids`` does (predicting
  the first token of the next document from the EOD is not learnt; predicting
  the EOD itself is).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACKING_FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


@dataclass(frozen=True)
class Packing:
    """Which of Megatron's document flags are on, and the EOD id they look for."""
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_token: int | None = None

    @property
    def any(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def flags(self) -> list[str]:
        """The command-line names of the flags that are on."""
        return ["--" + name.replace("_", "-") for name in PACKING_FLAGS if getattr(self, name)]


def check_packing(packing: Packing, where: str) -> None:
    """The flags need an EOD id to find documents; ``where`` names the tokenizer or data."""
    if packing.any and packing.eod_token is None:
        flags = " ".join(packing.flags())
        raise ValueError(
            f"{flags} needs an end-of-document (EOD) token to find where documents end, but "
            f"{where} has none. Fix: use a tokenizer that names one (eos_token in "
            f"tokenizer_config.json of a Hugging Face folder) and preprocess with --append-eod, "
            f"or drop {flags}.")


def document_bounds(tokens: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    """``(doc_start, doc_end)`` (both like ``tokens``, int64) for rows of input tokens."""
    tokens = np.atleast_2d(tokens)
    b, s = tokens.shape
    pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    is_eod = tokens == eod
    starts = np.zeros((b, s), dtype=np.int64)
    starts[:, 1:] = np.where(is_eod[:, :-1], pos[:, 1:], 0)  # a document starts after each EOD
    doc_start = np.maximum.accumulate(starts, axis=1)
    ends = np.where(is_eod, pos + 1, s)
    doc_end = np.minimum.accumulate(ends[:, ::-1], axis=1)[:, ::-1]
    return doc_start, np.ascontiguousarray(doc_end)


def batch_fields(tokens: np.ndarray, label_mask: np.ndarray | None,
                 packing: Packing) -> dict[str, np.ndarray]:
    """``position_ids``, ``loss_mask`` (and with ``reset_attention_mask`` the document
    bounds) for input rows ``tokens`` (b, s); ``label_mask`` (b, s) is the stored mask
    of each label token (SFT: 1 on response tokens), or ``None`` for all ones."""
    b, s = tokens.shape
    loss_mask = (np.ones((b, s), dtype=np.float32) if label_mask is None
                 else label_mask.astype(np.float32))
    out = {}
    if packing.any:
        check_packing(packing, "this dataset's tokenizer")
        doc_start, doc_end = document_bounds(tokens, packing.eod_token)
        if packing.eod_mask_loss:
            loss_mask[tokens == packing.eod_token] = 0.0
        if packing.reset_attention_mask:
            out["doc_start"] = doc_start.astype(np.int32)
            out["doc_end"] = doc_end.astype(np.int32)
    position_ids = np.repeat(np.arange(s, dtype=np.int64)[None], b, axis=0)
    if packing.reset_position_ids:
        position_ids -= doc_start
    out["position_ids"] = position_ids
    out["loss_mask"] = loss_mask
    return out
