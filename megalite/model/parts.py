"""Which parts a transformer layer is built from: the spec a layer asks instead of branching.

A layer holds an attention part and an MLP part, built from linears of one implementation:

- the attention: ``ATTENTIONS[attention_kind(cfg)]`` ("self": :class:`SelfAttention`; an
  attention variant, e.g. Multi-head Latent Attention, is one class and one
  :func:`register_attention`);
- the MLP: the dense :class:`MLP`, or an MoE layer's :class:`megalite.moe.block.MoEMLP` on the
  layers ``moe_layers(cfg)`` picks;
- the linears and norms: ``LINEARS[cfg.transformer_impl]`` (:mod:`megalite.model.linears`).

Each part class carries its shape (:class:`megalite.layers.part_shape.PartShape`: parameters,
FLOPs, activations), which the counting in :mod:`megalite.model.counting` adds up per layer.

Which attention: ``ModelConfig`` has no attention setting yet, so ``attention_kind`` reads a
config's ``attention_kind`` attribute where it has one and is "self" otherwise (issue 37: the
field to add is ``attention_kind: str = "self"``, a setting a checkpoint fixes).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.layers.part_shape import PartShape
from megalite.model.attention import SelfAttention
from megalite.model.linears import LocalLinears, linears_for
from megalite.model.mlp import MLP
from megalite.moe.settings import moe_layers

DEFAULT_ATTENTION = "self"
ATTENTIONS: dict[str, type[SelfAttention]] = {DEFAULT_ATTENTION: SelfAttention}


def register_attention(name: str, part: type) -> type:
    """Make ``part`` (a module taking SelfAttention's constructor arguments and forward, with a
    PartShape) the attention of configs whose ``attention_kind`` is ``name``; returns ``part``."""
    if not issubclass(part, PartShape):
        raise TypeError(f"attention {name!r}: {part.__name__} does not describe its shape (PartShape)")
    ATTENTIONS[name] = part
    return part


def attention_kind(cfg) -> str:
    return getattr(cfg, "attention_kind", DEFAULT_ATTENTION)


def attention_part(cfg) -> type[SelfAttention]:
    """The attention class the config picks (ValueError naming the registered ones if unknown)."""
    kind = attention_kind(cfg)
    if kind not in ATTENTIONS:
        raise ValueError(f"attention_kind {kind!r} is not registered; registered: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[kind]


@dataclass(frozen=True)
class LayerSpec:
    """The parts of one layer: its attention class, whether its MLP is MoE (else the dense
    :class:`MLP`), and the linears implementation."""
    attention: type
    moe: bool
    linears: type[LocalLinears]

    @property
    def mlp(self) -> type[MLP]:
        """The dense MLP (an MoE layer's shared expert too)."""
        return MLP


def layer_spec(cfg, layer: int) -> LayerSpec:
    """The spec of layer ``layer`` (global index) under ``cfg``."""
    moe = bool(cfg.num_experts) and moe_layers(cfg)[layer]
    return LayerSpec(attention_part(cfg), moe, linears_for(cfg))
