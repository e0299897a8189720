"""Per-step MoE figures for the log line, and the per-step backward scale of the aux losses
(:func:`start_step`).

After a train step (after the optimizer's and the expert biases' update,
:func:`megalite.moe.balancing.balance_after_step`), :func:`step_stats` reduces what every MoE layer recorded
(:meth:`MoELayer._record`) over the whole world (the DP x CP group, then TP x PP):

- ``moe_aux_loss`` / ``moe_z_loss``: the load-balancing and z losses of a micro-batch,
  averaged over MoE layers and micro-batches (without their coefficients; 1.0 is perfectly
  balanced routing for the aux loss);
- ``moe_load_min`` / ``moe_load_max``: tokens routed to an expert (kept assignments), relative
  to the mean over that layer's experts: the least and the most loaded expert of any layer.
  1.0 / 1.0 is perfect balance; max 2.0 means some expert got twice its share (with a capacity
  factor, at most that factor).
"""
from __future__ import annotations

import torch

from megalite.config_types import mtp_depths
from megalite.moe.layer import MoELayer
from megalite.moe.settings import moe_layers
from megalite.parallel import comm


def moe_modules(chunks) -> list[tuple[int, MoELayer]]:
    """(global layer index, MoE layer) of every MoE layer of this rank's chunks; the multi-token
    prediction depths' layers (``chunk.mtp``, megalite.model.mtp) count after the model's, as
    num_layers + depth."""
    out = []
    for chunk in chunks:
        blocks = list(getattr(chunk, "layers", {}).items())
        mtp = getattr(chunk, "mtp", None)
        if mtp is not None:
            blocks += [(chunk.cfg.num_layers + int(k), depth.block) for k, depth in mtp.layers.items()]
        for name, block in blocks:
            if isinstance(getattr(block, "mlp", None), MoELayer):
                out.append((int(name), block.mlp))
    return out


def moe_pattern(cfg) -> list[bool]:
    """Whether each layer is MoE, then each MTP depth (which takes the last layer's spec)."""
    pattern = moe_layers(cfg)
    return pattern + pattern[-1:] * mtp_depths(cfg)


def start_step(chunks, scale: float) -> None:
    """Before a step's micro-batches: the aux losses get the scale the main loss's backward
    gets (loss scale / micro-batches), and the statistics start from zero."""
    for _, layer in moe_modules(chunks):
        layer.backward_scale = scale
        layer.reset_stats()


def step_stats(chunks, grid, num_micro_global: int) -> torch.Tensor | None:
    """The step's MoE figures (see the module docstring), the same on every rank, as a device
    vector (aux loss, z loss, load min, load max: :data:`megalite.observe.step_values.MOE_KEYS`, read on
    the host with the step's other values, no sync here); None for a dense model. A
    collective: every rank calls it."""
    cfg = chunks[0].cfg
    if not cfg.num_experts:
        return None
    pattern = moe_pattern(cfg)
    index = {layer: i for i, layer in enumerate(i for i, moe in enumerate(pattern) if moe)}
    device = next(chunks[0].parameters()).device
    losses = torch.zeros(2, dtype=torch.float32, device=device)
    tokens = torch.zeros(len(index), cfg.num_experts, dtype=torch.float32, device=device)
    for layer_index, layer in moe_modules(chunks):
        if layer.stat_losses is None:
            continue
        losses += layer.stat_losses
        tokens[index[layer_index]] += layer.stat_tokens.float()
    both = torch.cat([losses, tokens.reshape(-1)])
    if grid is not None:
        comm.all_reduce(both, grid.dp_cp_group)
        comm.all_reduce(both, grid.mp_group)
    losses, tokens = both[:2] / max(1, len(index) * num_micro_global), both[2:].view(len(index), -1)
    load = tokens / tokens.mean(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.stack([losses[0], losses[1], load.min(), load.max()])  # read with the step's values
