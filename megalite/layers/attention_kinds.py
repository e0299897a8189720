"""The attention parts a layer may be built with, found by the name ``ModelConfig.attention_kind`` gives.

A part registers under a name (:func:`register_attention`); :mod:`megalite.model.parts` builds
every layer's attention from ``ATTENTIONS[cfg.attention_kind]`` and registers the default,
"self" (softmax self-attention, :class:`megalite.model.attention.SelfAttention`). The registry
sits on the layers' floor, below :func:`megalite.config.validate`, so that the config check
(:func:`check_attention_kind`) can refuse an unknown name before anything is built; "self" is a
known name even before the model's modules are imported.
"""
from __future__ import annotations

from megalite.errors import ConfigError
from megalite.layers.part_shape import PartShape

DEFAULT_ATTENTION = "self"
ATTENTIONS: dict[str, type] = {}  # name -> the part class (a module with a PartShape)


def register_attention(name: str, part: type) -> type:
    """Make ``part`` (a module taking SelfAttention's constructor arguments and forward, with a
    PartShape) the attention of configs whose ``attention_kind`` is ``name``; returns ``part``."""
    if not issubclass(part, PartShape):
        raise TypeError(f"attention {name!r}: {part.__name__} does not describe its shape (PartShape)")
    ATTENTIONS[name] = part
    return part


def attention_names() -> list[str]:
    """The names a config may pick, sorted."""
    return sorted(set(ATTENTIONS) | {DEFAULT_ATTENTION})


def check_attention_kind(m) -> None:
    """ConfigError unless ``m.attention_kind`` names a registered attention part."""
    if m.attention_kind not in attention_names():
        raise ConfigError(f"attention_kind {m.attention_kind!r} is not a registered attention part; registered: "
                          f"{', '.join(attention_names())}. Fix: set ModelConfig.attention_kind to one of them, or "
                          f"register the part first (megalite.model.parts.register_attention(name, part)).")
