"""The MLP of a transformer block as a mixture of experts, inside the parallel GPT.

``MoEMLP(cfg, ...)(x) -> out``, with x and out (s, b, h) sequence-first like the rest of the
block; under sequence parallelism this rank's s/TP positions, under context parallelism its
chunks of each sequence. Experts are whole on their rank (expert-tensor-parallel size 1), so
nothing here communicates over TP: each TP rank routes and dispatches its own positions.

**The auxiliary losses enter the backward here**, not through the return value, so the block
reads as serial code and the pipeline schedules need not know about them: ``attach_loss``
is the identity on ``out`` in forward; in backward it passes ``out``'s gradient through and
gives the loss share (:mod:`megalite.moe.router`) the gradient ``scale``, as if
``scale * moe_loss`` had been added to the objective whose gradient arrives. The scale is
the one the main loss gets (loss scale / micro-batches, set each step by the training loop
through :func:`megalite.moe.stats.start_step`) times CP: every CP rank's objective is
the mean over *its* tokens and CP averages gradients, while the shares of one micro-batch
add up over the TP x CP token group to its loss.

With a capacity factor, the tokens' serial order (position * batch + sample, the serial
model's flattened (s, b)) is handed to the router so first-come dropping matches serial.
"""
from __future__ import annotations

import torch

from megalite.context_parallel.data import context_parallel_slice
from megalite.moe.layer import MoELayer
from megalite.parallel import comm
from megalite.parallel.sharding import mark_sequence_parallel


class _AttachLoss(torch.autograd.Function):
    """fwd: identity on ``out``; bwd: ``out``'s gradient, and ``scale`` for ``loss``."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.scale  # a host number, or the fp16 loss scale's device scalar (no host read)
        if isinstance(scale, torch.Tensor):
            return grad, scale.detach().to(device=grad.device, dtype=grad.dtype).reshape(()), None
        return grad, torch.full((), scale, dtype=grad.dtype, device=grad.device), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    return _AttachLoss.apply(out, loss, scale)


def serial_token_index(s_local: int, batch: int, tp_rank: int, tp: int, cp_rank: int, cp: int,
                       device) -> torch.Tensor:
    """For this rank's rows of a flattened (s_local, b) block: their row in the serial model's
    flattened (s, b) micro-batch. ``tp``: the sequence-parallel size (1 without SP)."""
    positions = torch.arange(s_local * tp * cp, device=device)[None]
    positions = context_parallel_slice({"p": positions}, cp_rank, cp)["p"][0]  # this CP rank's chunks
    positions = positions.chunk(tp)[tp_rank]  # sequence parallel: this TP rank's part
    return (positions[:, None] * batch + torch.arange(batch, device=device)).reshape(-1)


def routing_options(cfg) -> dict:
    """The router's DeepSeek-V3 options from the config (:class:`megalite.moe.router.TopKRouter`)."""
    return dict(score_function=cfg.moe_router_score_function, num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
                expert_bias=cfg.moe_router_enable_expert_bias)


class MoEMLP(MoELayer):
    """See the module docstring. ``shared_expert``: a dense MLP every token also goes through
    (DeepSeek / Qwen-MoE), added to the routed output."""

    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, cp_group=None, ep_group=None,
                 token_group=None, shared_expert: torch.nn.Module | None = None):
        aux = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0
        super().__init__(cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts, cfg.moe_router_topk,
                         ep_group=ep_group, token_group=token_group,
                         capacity_factor=cfg.moe_expert_capacity_factor, swiglu=cfg.swiglu,
                         aux_loss_coeff=aux, z_loss_coeff=cfg.moe_z_loss_coeff or 0.0,
                         grouped_gemm=cfg.moe_grouped_gemm, routing=routing_options(cfg))
        if sequence_parallel:  # replicated over TP, sees this rank's positions: gradient summed over TP
            mark_sequence_parallel(self.router.weight)
        self.sp_size = comm.group_size(tp_group) if sequence_parallel else 1
        self.sp_rank = comm.group_rank(tp_group) if sequence_parallel else 0
        self.cp_size, self.cp_rank = comm.group_size(cp_group), comm.group_rank(cp_group)
        self.shared_expert = shared_expert
        self.backward_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = None
        if self.router.capacity_factor is not None and comm.group_size(self.token_group) > 1:
            index = serial_token_index(x.shape[0], x.shape[1], self.sp_rank, self.sp_size, self.cp_rank,
                                       self.cp_size, x.device)
        out, moe_loss = super().forward(x, index)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.training and torch.is_grad_enabled():
            out = attach_loss(out, moe_loss, self.cp_size * self.backward_scale)
        return out
