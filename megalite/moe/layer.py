"""MoELayer: router + dispatch + grouped experts, serial or expert-parallel.

``MoELayer(hidden, ffn, num_experts, topk, ep_group=None, ...)`` replaces a dense MLP:
``forward(x (..., h)) -> (out (..., h), moe_loss)`` where
``moe_loss = aux_loss_coeff * aux_loss + z_loss_coeff * z_loss`` is a differentiable scalar the
caller adds to its loss (the statistics of the last call are kept in ``last_stats``).

Expert parallelism: with an ``ep_group`` of size P, this rank holds the E/P experts
``[rank*E/P, (rank+1)*E/P)`` and the full (replicated) router. The EP ranks are data-parallel
ranks holding different tokens; see :mod:`megalite.moe.dispatch` for the collectives.

Gradients under EP (what the wiring must respect): the backward all-to-all brings every EP
rank's token gradients to the expert's owner, so an expert weight's local gradient is the
gradient of the *sum over the EP ranks* of their losses. With megalite's data-parallel
convention (objective = mean over DP ranks of the per-rank mean loss), expert gradients must
therefore be divided by the EP size and summed (not averaged) over the ranks that replicate the
expert (expert-data-parallel = DP/EP), i.e. the same overall 1/DP scale as dense parameters,
while the router (replicated on all DP ranks) is averaged over DP as usual. The tests check
exactly this: EP gradients / P equal the serial gradients of the whole batch.

Initialization is layout-independent: expert e's weights come from
``init_full_tensor(shape, seed, f"{prefix}experts.{e}.fc1.weight", std)`` for its *global*
index e, so EP = 1, 2, 4 hold the same experts; :meth:`global_named_parameters` lists
``(global name, local tensor)`` pairs for checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from megalite.moe.dispatch import dispatch_ep, dispatch_serial
from megalite.moe.experts import GroupedExperts
from megalite.moe.router import TopKRouter
from megalite.parallel import comm
from megalite.parallel.random import init_full_tensor


class MoELayer(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, ep_group=None,
                 capacity_factor: float | None = None, swiglu: bool = True,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0):
        super().__init__()
        ep = comm.group_size(ep_group)
        if num_experts % ep != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {ep}")
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.ep_group, self.ep_size = ep_group, ep
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = TopKRouter(hidden, num_experts, topk, capacity_factor)
        local = num_experts // ep
        self.experts = GroupedExperts(local, hidden, ffn, swiglu, first=comm.group_rank(ep_group) * local)
        self.last_stats = None

    @property
    def local_experts(self) -> range:
        return range(self.experts.first, self.experts.first + self.experts.num_local)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, self.hidden)
        r = self.router(tokens, self.ep_group)
        kept = None if self.router.capacity_factor is None else r.kept
        if self.ep_size == 1:
            out = dispatch_serial(tokens, r.expert_ids, r.weights, kept, self.experts, self.num_experts)
        else:
            out = dispatch_ep(tokens, r.expert_ids, r.weights, kept, self.experts, self.num_experts,
                              self.ep_group)
        self.last_stats = r
        moe_loss = self.aux_loss_coeff * r.aux_loss + self.z_loss_coeff * r.z_loss
        return out.reshape(shape), moe_loss

    # -- names and init ------------------------------------------------------------------------
    def global_named_parameters(self, prefix: str = ""):
        """``[(global name, local tensor)]``: the router weight, then for each local expert e
        (global index) ``experts.{e}.fc1.weight`` / ``experts.{e}.fc2.weight`` as views into the
        stacked parameters (so ``.grad`` slices line up with ``param.grad[i]``)."""
        out = [(f"{prefix}router.weight", self.router.weight)]
        for i, e in enumerate(self.local_experts):
            out.append((f"{prefix}experts.{e}.fc1.weight", self.experts.w1[i]))
            out.append((f"{prefix}experts.{e}.fc2.weight", self.experts.w2[i]))
        return out

    def global_named_grads(self, prefix: str = ""):
        """``{global name: gradient}`` of this rank's parameters (tests, checkpoints)."""
        grads = {f"{prefix}router.weight": self.router.weight.grad}
        for i, e in enumerate(self.local_experts):
            grads[f"{prefix}experts.{e}.fc1.weight"] = self.experts.w1.grad[i]
            grads[f"{prefix}experts.{e}.fc2.weight"] = self.experts.w2.grad[i]
        return grads

    @torch.no_grad()
    def init_weights(self, seed: int, name_prefix: str = "", std: float = 0.02,
                     output_std: float | None = None) -> None:
        """Every tensor drawn in full from (seed, global name) on the CPU, copied to the
        parameter's device; fc2 uses ``output_std`` (GPT-2's scaled init; default ``std``).
        On meta there is nothing to draw."""
        output_std = std if output_std is None else output_std
        if self.router.weight.device.type == "meta":
            return
        for name, tensor in self.global_named_parameters(name_prefix):
            s = output_std if name.endswith("fc2.weight") else std
            tensor.copy_(init_full_tensor(tuple(tensor.shape), seed, name, s))
