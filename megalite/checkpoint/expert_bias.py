"""The routers' expert biases (aux-loss-free balancing, :mod:`megalite.moe.balancing`) in checkpoints.

A bias is a buffer, not a parameter: no optimizer shard holds it, so it travels beside the
parameters as its own kind ``expert_bias``, one full (E,) fp32 tensor per MoE layer, named by
module with the layer's global index (``layers.3.mlp.router.expert_bias``). Every rank of a
pipeline stage holds the same bias (the update is computed from all-reduced loads), so the
stage's TP/CP/DP rank 0 writes it and any layout reads it back whole: resharding it is only
finding each layer on the stage that now holds it. A checkpoint without biases (saved without
``--moe-router-enable-expert-bias``) leaves them at zero; a run without biases ignores saved ones.
"""
from __future__ import annotations

import torch
import torch.nn as nn

KIND = "expert_bias"
SUFFIX = "router.expert_bias"


def expert_biases(chunk: nn.Module) -> dict[str, torch.Tensor]:
    """``{global module name: bias}`` of a model chunk's routers that have one (the live tensors)."""
    return {name: buf for name, buf in chunk.named_buffers() if name.endswith(SUFFIX)}


def load_expert_biases(chunk: nn.Module, saved: dict[str, torch.Tensor]) -> int:
    """Copy the saved biases of this chunk's layers in; returns how many were found."""
    done = 0
    for name, buf in expert_biases(chunk).items():
        if name in saved:
            buf.copy_(saved[name].reshape(buf.shape).to(buf.device, buf.dtype))
            done += 1
    return done
