"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron's ``--mtp-num-layers``).

D extra depths sit after the main model, on the last pipeline stage. Depth k = 1..D predicts,
at position t, the token t+k+1 (the main model predicts t+1)::

    h_0[t] = FinalNorm(main model's last hidden state)[t]          (after the final norm, as Megatron)
    u_k[t] = W_k [ENorm_k(Emb(token t+k)); HNorm_k(h_{k-1}[t])]      (W_k: 2h -> h, no bias)
    h_k    = FinalNorm_k(Block_k(u_k))                               (causal attention over positions t)
    CE_k[t] = -log softmax(Out(h_k[t]))[token t+k+1]

``Emb`` and ``Out`` are the main model's word embedding and output layer (tied or not); the norms
are the model's normalization (RMSNorm in DeepSeek-V3), one each per depth; the concatenation
puts the embedding first, as Megatron and the DeepSeek-V3 checkpoints (``eh_proj``) do. The
token embedding enters without dropout. The loss of a micro-batch::

    L = L_main + (lambda / D) * sum_k  sum_t m_k[t] CE_k[t] / sum_t m_k[t]

with lambda = ``--mtp-loss-scaling-factor`` and the mask of depth k ``m_k[t] = m[t+k]`` (the main
loss mask of the position whose label is the target) where ``t+k`` is inside the sequence and
inside the document of t (packed documents: no depth reads or predicts across a document
boundary), 0 otherwise. The depths' attention is the main model's: within documents, the same
positions (RoPE angles) and context parallelism.

Targets: with ``labels[t]`` = token t+1, depth k reads ``token t+k = labels[t+k-1]`` and predicts
``labels[t+k]``: the labels shifted left by k-1 and k. :func:`shifted_targets` builds them, and the
masks, on the whole sequence, before a context-parallel split (position t+k may live on another
CP rank): the batch then carries them as (b, s, D) arrays that CP slices like every (b, s) one.

Each depth's block is a transformer layer from the layer spec of the model's last layer (MoE
when that one is, as Megatron builds it), named ``mtp.layers.{k-1}.{enorm,hnorm,eh_proj,block.*,
final_norm}`` whatever the layout, so checkpoints, resharding and the (seed, name) init do not
depend on it. Under TP ``eh_proj`` is column-parallel with its output gathered (and split over the
sequence again under SP); the block is split as every layer is.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from megalite.config_types import mtp_depths  # noqa: F401  (the model and the train step read it here)
from megalite.layers.documents import Documents
from megalite.layers.tensor_parallel import ColumnParallelLinear
from megalite.model.linears import linears_for
from megalite.model.recompute import run_layers
from megalite.parallel import comm

# The batch keys of the shifted targets and their masks, (b, s, D), built before a CP split.
MTP_LABELS = "mtp_labels"
MTP_LOSS_MASK = "mtp_loss_mask"


class MTPLosses(NamedTuple):
    """What the last stage of a model with MTP returns given labels: the main per-token losses
    (b, s), each depth's (b, s, D), and the depths' weight lambda / D."""
    main: torch.Tensor
    mtp: torch.Tensor
    weight: float


def shifted_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None, depths: int,
                    documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth k's targets ``labels[t+k]`` and masks ``m[t+k] * [t+k < s] * [t+k in t's document]``,
    stacked as (b, s, D) (k = 1..D on the last axis), from the whole sequence's (b, s) labels,
    loss mask (None: all ones) and packed documents. Positions past the end take token 0, masked."""
    b, s = labels.shape
    positions = torch.arange(s, device=labels.device)
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    targets, masks = [], []
    for k in range(1, depths + 1):
        target = torch.zeros_like(labels)
        target[:, : s - k] = labels[:, k:]
        keep = torch.zeros_like(mask)
        keep[:, : s - k] = mask[:, k:]
        if documents is not None:  # t+k must lie before the end of t's document
            keep = keep * ((positions + k).unsqueeze(0) < documents.end.long()).float()
        targets.append(target)
        masks.append(keep)
    return torch.stack(targets, -1), torch.stack(masks, -1)


def with_mtp_targets(batch: dict, depths: int) -> dict:
    """The micro-batch with :data:`MTP_LABELS` and :data:`MTP_LOSS_MASK` added (whole sequence)."""
    if not depths or MTP_LABELS in batch:
        return batch
    docs = Documents(batch["doc_start"], batch["doc_end"]) if "doc_start" in batch else None
    labels, masks = shifted_targets(batch["labels"], batch.get("loss_mask"), depths, docs)
    return {**batch, MTP_LABELS: labels, MTP_LOSS_MASK: masks}


class MTPLayer(nn.Module):
    """One depth: the two norms, the 2h -> h projection, a transformer block and its final norm."""

    def __init__(self, cfg, block: nn.Module, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.tp_group, self.sequence_parallel = cfg, tp_group, sequence_parallel
        norm = linears_for(cfg).norm
        self.enorm = norm(cfg, sequence_parallel)
        self.hnorm = norm(cfg, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False, tp_group=tp_group,
                                            sequence_parallel=sequence_parallel, gather_output=True)
        self.block = block
        self.final_norm = norm(cfg, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope=None,
                documents: Documents | None = None) -> torch.Tensor:
        """(s, b, h) in and out (this rank's s/TP positions under SP)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:  # the gathered output covers the whole sequence: keep this rank's part
            x = comm.scatter_to_sp(x, self.tp_group)
        cfg = self.cfg

        def block(h, r):
            return self.block(h, r, None, documents)

        x = run_layers([block], x, rope, cfg.recompute_granularity, cfg.recompute_method,
                       cfg.recompute_num_layers, self.training)
        return self.final_norm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths (module docstring). ``blocks``: one transformer block per depth."""

    def __init__(self, cfg, blocks: list[nn.Module], tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, block, tp_group, sequence_parallel)
                                     for k, block in enumerate(blocks)})

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, mtp_labels: torch.Tensor,
                embed: Callable, token_losses: Callable, rope=None,
                documents: Documents | None = None) -> torch.Tensor:
        """Each depth's per-token losses, (b, s, D). ``hidden``: h_0 (s, b, h), the main model's
        normalised last hidden state; ``labels`` (b, s) and ``mtp_labels`` (b, s, D) this rank's
        positions; ``embed(tokens (b, s)) -> (s, b, h)`` the word embedding; ``token_losses(x, targets)
        -> (b, s)`` the shared output layer and cross-entropy."""
        inputs, out = labels, []
        for k, layer in enumerate(self.layers.values()):
            hidden = layer(hidden, embed(inputs), rope, documents)
            targets = mtp_labels[..., k]
            out.append(token_losses(hidden, targets))
            inputs = targets
        return torch.stack(out, dim=-1)
