"""Which parts a transformer layer is built from: the spec a layer asks instead of branching.

A layer holds an attention part and an MLP part, built from linears of one implementation:

- the attention: ``ATTENTIONS[cfg.attention_kind]`` ("self": :class:`SelfAttention`; an
  attention variant, e.g. Multi-head Latent Attention, is one class and one
  :func:`register_attention`);
- the MLP: the dense :class:`MLP`, or an MoE layer's :class:`megalite.moe.block.MoEMLP` on the
  layers ``moe_layers(cfg)`` picks;
- the linears and norms: ``LINEARS[cfg.transformer_impl]`` (:mod:`megalite.model.linears`).

Each part class carries its shape (:class:`megalite.layers.part_shape.PartShape`: parameters,
FLOPs, activations), which the counting in :mod:`megalite.model.counting` adds up per layer.

Which attention: the setting ``ModelConfig.attention_kind`` (default "self"; a checkpoint fixes
it), looked up in the registry of :mod:`megalite.layers.attention_kinds`, which
:func:`megalite.config.validate` checks the name against.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.layers.attention_kinds import (ATTENTIONS, DEFAULT_ATTENTION,  # noqa: F401 - re-exported
                                             attention_names, register_attention)
from megalite.model.attention import SelfAttention
from megalite.model.linears import LocalLinears, linears_for
from megalite.model.mla import MLA_KIND, MultiLatentAttention
from megalite.model.mlp import MLP
from megalite.moe.settings import moe_layers

register_attention(DEFAULT_ATTENTION, SelfAttention)
register_attention(MLA_KIND, MultiLatentAttention)


def attention_part(cfg) -> type[SelfAttention]:
    """The attention class the config picks (ValueError naming the registered ones if unknown):
    Multi-head Latent Attention under ``--multi-latent-attention``, else ``attention_kind``'s."""
    kind = MLA_KIND if getattr(cfg, "multi_latent_attention", False) else cfg.attention_kind
    if kind not in ATTENTIONS:
        raise ValueError(f"attention_kind {kind!r} is not registered; registered: {', '.join(attention_names())}")
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
