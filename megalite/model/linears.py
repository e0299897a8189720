"""Which linears and norms a layer is built from: megalite's own, or transformer-engine's.

``--transformer-impl`` names an implementation in :data:`LINEARS`; a part asks
:func:`linears_for` for it and calls its ``column`` / ``row`` / ``norm`` / ``norm_before``, so no
part branches on the implementation. Both shard alike (column: output rows split over TP, by
sections for SwiGLU's [gate; up]; row: input columns split) and name their parameters alike
(``megalite.layers.transformer_engine``), so a checkpoint moves between them as it is.
"""
from __future__ import annotations

from torch import nn

from megalite.layers import transformer_engine as te_layers
from megalite.layers.norms import build_norm
from megalite.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.sharding import mark_sequence_parallel


def mark_residual_output(linear: nn.Module) -> nn.Module:
    """Mark the weight of a branch's last linear, the one that writes into the residual stream:
    GPT-2's init draws it with std / sqrt(2 * layers) (:meth:`megalite.model.gpt.GPTModel.init_weights`),
    so the residual's variance does not grow with depth. The part that builds the linear marks it."""
    linear.weight.residual_output = True
    return linear


class LocalLinears:
    """megalite's ColumnParallelLinear / RowParallelLinear; norms apart from the linears."""
    fused_norm = None  # the norms' kernels: --fused-kernels

    @classmethod
    def norm(cls, cfg, sequence_parallel: bool) -> nn.Module:
        """The block's norm (LayerNorm or RMSNorm), marked sequence-parallel under SP."""
        norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, fused=cls.fused_norm or cfg.fused_kernels)
        if sequence_parallel:
            for p in norm.parameters():
                mark_sequence_parallel(p)
        return norm

    @classmethod
    def norm_before(cls, linear: nn.Module, cfg, sequence_parallel: bool) -> nn.Module:
        """The norm in front of ``linear`` (a module of its own here)."""
        return cls.norm(cfg, sequence_parallel)

    @staticmethod
    def column(cfg, in_features: int, out_features: int, *, bias: bool, sections: int = 1,
               norm_inside: bool = False, name: str | None = None, **par) -> nn.Module:
        """``norm_inside`` and ``name`` matter to transformer-engine only."""
        return ColumnParallelLinear(in_features, out_features, bias=bias, sections=sections, **par)

    @staticmethod
    def row(cfg, in_features: int, out_features: int, *, bias: bool, name: str | None = None, **par) -> nn.Module:
        return RowParallelLinear(in_features, out_features, bias=bias, **par)


class TransformerEngineLinears(LocalLinears):
    """transformer-engine's Linear and LayerNormLinear (the norm before qkv and fc1 runs inside
    the linear; :class:`FusedNormParameters` names its parameters as the local norm's)."""
    fused_norm = "te"

    @classmethod
    def norm_before(cls, linear: nn.Module, cfg, sequence_parallel: bool) -> nn.Module:
        if te_layers.has_norm_inside(linear):
            return te_layers.FusedNormParameters(linear)
        return cls.norm(cfg, sequence_parallel)

    @staticmethod
    def column(cfg, in_features: int, out_features: int, *, bias: bool, sections: int = 1,
               norm_inside: bool = False, name: str | None = None, **par) -> nn.Module:
        return te_layers.column_parallel_linear(cfg, in_features, out_features, bias=bias, sections=sections,
                                                norm_inside=norm_inside, name=name, **par)

    @staticmethod
    def row(cfg, in_features: int, out_features: int, *, bias: bool, name: str | None = None, **par) -> nn.Module:
        return te_layers.row_parallel_linear(cfg, in_features, out_features, bias=bias, name=name, **par)


LINEARS: dict[str, type[LocalLinears]] = {"local": LocalLinears, "transformer_engine": TransformerEngineLinears}


def linears_for(cfg) -> type[LocalLinears]:
    """The implementation ``cfg.transformer_impl`` names (validated by the TE layer's check)."""
    return LINEARS[cfg.transformer_impl]
