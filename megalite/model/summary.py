"""The start of a run's line about the experts of an MoE model. It counts parameters on the
model (:func:`megalite.model.gpt.count_parameters`), so it lives on the model's floor."""
from __future__ import annotations

from megalite.model.gpt import count_active_parameters, count_parameters
from megalite.moe.settings import moe_layers


def moe_summary(cfg, layout) -> str:
    """One line for the start of a run: experts, routing, where they live."""
    n = sum(moe_layers(cfg))
    drop = (f"capacity factor {cfg.moe_expert_capacity_factor:g}" if cfg.moe_expert_capacity_factor
            else "dropless")
    shared = (f", shared expert {cfg.moe_shared_expert_intermediate_size}"
              if cfg.moe_shared_expert_intermediate_size else "")
    return (f"experts: {n} MoE layer(s) x {cfg.num_experts} experts (FFN {cfg.moe_ffn_hidden_size}{shared}), "
            f"top-{cfg.moe_router_topk}, {drop}, aux coeff {cfg.moe_aux_loss_coeff:g}; EP {layout.ep}: "
            f"{cfg.num_experts // layout.ep} experts per rank; {count_active_parameters(cfg) / 1e6:.2f}M of "
            f"{count_parameters(cfg) / 1e6:.2f}M parameters active per token")
