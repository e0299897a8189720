"""MoELayer: router + dispatch + grouped experts, serial or expert-parallel.

``MoELayer(hidden, ffn, num_experts, topk, ep_group=None, token_group=None, ...)`` replaces a
dense MLP: ``forward(x (..., h), token_index=None) -> (out (..., h), moe_loss)`` where
``moe_loss = aux_loss_coeff * aux + z_loss_coeff * z`` is this rank's share of the routed
batch's losses (see :mod:`megalite.moe.router`), a differentiable scalar for the caller's
backward. The statistics of the last call are in ``last_stats``; training calls also add to
``stat_losses`` (aux, z shares) and ``stat_tokens`` (kept assignments per expert), which
:mod:`megalite.moe.stats` reduces for the log line.

Two groups, two roles:
- ``token_group``: the ranks holding one routed batch together (TP x CP in the GPT: sequence
  and context parallel shards of one micro-batch). Routing statistics and capacity are
  computed over it.
- ``ep_group`` of size P: this rank holds the E/P experts ``[rank*E/P, (rank+1)*E/P)`` and the
  full (replicated) router; tokens travel to their experts' owners and back by all-to-all
  (:mod:`megalite.moe.dispatch`). Its ranks may hold different micro-batches.

Gradients under EP (what the data-parallel wiring respects): the backward all-to-all brings
every EP rank's token gradients to the expert's owner, so an expert weight's local gradient is
the gradient of the *sum over the EP group* of the ranks' losses. Dense parameters are
averaged over DP x CP; so expert gradients are **summed** over the ranks that replicate the
expert (expert-data-parallel, EDP = TP*CP*DP/EP ranks) and divided by DP x CP: the same
overall scale, every token of the stage counted once. The router, replicated everywhere,
is averaged like any dense weight (summed over TP first under sequence parallelism).

Initialization is layout-independent: expert e's weights come from
``init_full_tensor(shape, seed, f"{prefix}experts.{e}.fc1.weight", std)`` for its *global*
index e, so EP = 1, 2, 4 hold the same experts; :meth:`global_named_parameters` lists
``(global name, local tensor)`` pairs, and each stacked parameter carries ``expert_parallel``,
``expert_first`` and ``expert_leaf`` so checkpoints name every expert globally
(``layers.3.mlp.experts.7.fc1.weight``).
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
    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, ep_group=None, token_group=None,
                 capacity_factor: float | None = None, swiglu: bool = True,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, grouped_gemm: bool = False,
                 routing: dict | None = None):
        """``routing``: :class:`TopKRouter`'s keyword options (score_function, num_groups,
        group_topk, scaling_factor, expert_bias); default the softmax router."""
        super().__init__()
        ep = comm.group_size(ep_group)
        if num_experts % ep != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {ep}")
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.ep_group, self.ep_size, self.token_group = ep_group, ep, token_group
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = TopKRouter(hidden, num_experts, topk, capacity_factor, **(routing or {}))
        local = num_experts // ep
        self.experts = GroupedExperts(local, hidden, ffn, swiglu, first=comm.group_rank(ep_group) * local,
                                      grouped_gemm=grouped_gemm)
        for w, leaf in ((self.experts.w1, "fc1.weight"), (self.experts.w2, "fc2.weight")):
            w.expert_parallel, w.expert_first, w.expert_leaf = True, self.experts.first, leaf
        self.last_stats = None
        self.stat_losses = self.stat_tokens = None  # training sums since reset_stats()

    @property
    def local_experts(self) -> range:
        return range(self.experts.first, self.experts.first + self.experts.num_local)

    def forward(self, x: torch.Tensor, token_index: torch.Tensor | None = None):
        shape = x.shape
        tokens = x.reshape(-1, self.hidden)
        r = self.router(tokens, self.token_group, token_index)
        kept = None if self.router.capacity_factor is None else r.kept
        if self.ep_size == 1:
            out = dispatch_serial(tokens, r.expert_ids, r.weights, kept, self.experts, self.num_experts)
        else:
            out = dispatch_ep(tokens, r.expert_ids, r.weights, kept, self.experts, self.num_experts,
                              self.ep_group)
        self._record(r)
        moe_loss = self.aux_loss_coeff * r.aux_loss + self.z_loss_coeff * r.z_loss
        return out.reshape(shape), moe_loss

    # -- statistics for the log line -------------------------------------------------------------
    def reset_stats(self) -> None:
        self.stat_losses = self.stat_tokens = None

    @torch.no_grad()
    def _record(self, r) -> None:
        """Training forwards only; not the recomputation of a checkpointed layer, which runs
        inside backward and would count the micro-batch twice."""
        if torch._C._current_graph_task_id() != -1:
            return
        # detached: holding the router's outputs must not hold the layer's autograd graph
        self.last_stats = type(r)(*(t.detach() for t in r))
        if not self.training:
            return
        losses = torch.stack([r.aux_loss.detach().float(), r.z_loss.detach().float()])
        if self.stat_losses is None:
            self.stat_losses, self.stat_tokens = torch.zeros_like(losses), torch.zeros_like(r.tokens_per_expert)
        self.stat_losses += losses
        self.stat_tokens += r.tokens_per_expert
        if self.router.bias_tokens is not None:  # the expert bias's load (megalite.moe.balancing)
            self.router.bias_tokens += r.tokens_per_expert

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
        self.init_expert_weights(seed, name_prefix, std, output_std, router=True)

    @torch.no_grad()
    def init_expert_weights(self, seed: int, name_prefix: str = "", std: float = 0.02,
                            output_std: float | None = None, router: bool = False) -> None:
        """The experts only (and the router with ``router``): the GPT draws the router with
        its other parameters, by the same rule (N(0, std) from (seed, name))."""
        output_std = std if output_std is None else output_std
        if self.router.weight.device.type == "meta":
            return
        if self.router.expert_bias is not None:  # starts at zero (materialize leaves it uninitialized)
            self.router.expert_bias.zero_()
            self.router.bias_tokens.zero_()
        for name, tensor in self.global_named_parameters(name_prefix):
            if name.endswith("router.weight") and not router:
                continue
            s = output_std if name.endswith("fc2.weight") else std
            tensor.copy_(init_full_tensor(tuple(tensor.shape), seed, name, s))
