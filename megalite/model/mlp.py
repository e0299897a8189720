"""The dense MLP, the default MLP part of a layer: ``fc2(act(fc1(x)))``, GELU (GPT-2's tanh
approximation) or SwiGLU (``fc1`` = [gate; up], ``silu(gate) * up``), split over TP along the
FFN dimension (fc1 column-, fc2 row-parallel). An MoE layer's MLP is
:class:`megalite.moe.block.MoEMLP` (chosen by :func:`megalite.model.parts.layer_spec`); its
shared expert is this MLP with its own FFN size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.layers.part_shape import MLPShape
from megalite.model.linears import linears_for, mark_residual_output


class MLP(nn.Module, MLPShape):
    """fc2(act(fc1(x))), split over TP along the FFN dimension (fc1 column-, fc2 row-parallel).
    ``ffn``: the FFN size (default ``cfg.ffn_hidden_size``; an MoE shared expert has its own)."""

    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, ffn: int | None = None,
                 norm_inside: bool = False):
        """``norm_inside``: with transformer-engine, the block's norm runs inside fc1."""
        super().__init__()
        self.swiglu = cfg.swiglu
        linears = linears_for(cfg)
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        fc1, fc2 = self.linears(cfg, ffn or cfg.ffn_hidden_size)
        self.fc1 = linears.column(cfg, fc1.in_features, fc1.out_features, bias=fc1.bias, sections=2 if cfg.swiglu else 1,
                                  norm_inside=norm_inside, name="fc1", **par)
        self.fc2 = mark_residual_output(linears.row(cfg, fc2.in_features, fc2.out_features, bias=fc2.bias,
                                                    name="fc2", **par))

    @property
    def input_linear(self) -> nn.Module:
        """The linear the block's norm feeds (transformer-engine may fuse the norm into it)."""
        return self.fc1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's gelu_new
        return self.fc2(h)
