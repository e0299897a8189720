"""The update rule under the distributed optimizer: what state it keeps and how it steps.

An :class:`UpdateRule` is the one place that knows an optimizer's per-parameter state:

- ``state_names``: the fp32 tensors it keeps beside each fp32 master shard (AdamW: the two
  moments ``exp_avg`` and ``exp_avg_sq``); the checkpoint stores each under that name, after
  the master weights (``weight``);
- ``state_bytes`` and ``bytes_per_parameter``: the bytes of that state per parameter, and of
  state plus fp32 master weights (AdamW: 8 and 12), which the ZeRO arithmetic, the planner,
  the MoE planner and the preflight disk check count;
- per parameter class, optionally: ``takes_matrix`` (which parameters are the rule's matrices)
  and ``matrix_state`` (the state tensors a matrix keeps; the rest keep all): Muon's matrices
  keep ``momentum`` only, so ``bytes_of(True)`` is 8 and ``bytes_of(False)`` 12; ``keeps``
  answers per parameter, :class:`StateLayout` lays such a state out compactly, and the byte
  counts above go per class (``state_bytes_total``);
- ``build``: its step on flat shards, made from the master shards, the state shards by name,
  the decayed index ranges and the training config (AdamW:
  :class:`megalite.data_parallel.adamw.FlatAdamW`);
- ``wants_geometry``: a rule whose math is not elementwise (Muon orthogonalises whole matrices)
  also gets ``geometry=`` a :class:`ShardGeometry` (where each parameter lies in the flat
  shards, with the parameter itself: its shape, name and TP split metadata; each shard's bucket
  and the group that shards it; the TP group; the model config). Elementwise rules (AdamW) are built exactly as before, without it.

:class:`megalite.data_parallel.zero.DistributedOptimizer` takes a rule (``ADAMW`` unless
told otherwise), allocates its state from ``state_names`` and steps with ``build``'s object,
which has ``step(grads, lr, grad_scale, found_inf)`` and a ``step_count`` property. A rule's
stepper inherits the count from :class:`DeviceStepCount` (``steps`` on the device,
``step_count`` as an int) and writes only its math.

A checkpoint records the rule that wrote it (:meth:`UpdateRule.record`: its name and each
state tensor's name, dtype and bytes per parameter), so the tools that read it take the state
kinds from the checkpoint itself. Rules are found by name in :data:`RULES` (Megatron's
``--optimizer`` names: AdamW is ``"adam"``); :func:`register_rule` adds one, :func:`rule_named`
looks one up.
"""
from __future__ import annotations

from megalite.data_parallel.muon import MUON
from megalite.data_parallel.rule_types import (ADAMW, DEFAULT_RULE, FP32_BYTES, MASTER_KIND, NUMBER_WORDS,  # noqa: F401
                                               STATE_DTYPE, BucketLayout, DeviceStepCount, ParamPlace,
                                               ShardGeometry, StateLayout, UpdateRule)

RULES: dict[str, UpdateRule] = {}  # by the name a run asks for (Megatron's --optimizer NAME)


def register_rule(name: str, rule: UpdateRule) -> UpdateRule:
    """Make ``rule`` the one a run asking for ``name`` gets; refuses to rebind a taken name."""
    if RULES.get(name, rule) is not rule:
        raise ValueError(f"update rule name {name!r} is taken by {RULES[name].name!r}")
    RULES[name] = rule
    return rule


def rule_named(name: str) -> UpdateRule:
    """The rule registered as ``name`` (or whose own name it is): one lookup for ``--optimizer``."""
    found = RULES.get(name) or next((r for r in RULES.values() if r.name == name), None)
    if found is None:
        raise ValueError(f"unknown update rule {name!r}: the registered ones are {', '.join(sorted(RULES))}")
    return found


register_rule("adam", ADAMW)  # Megatron's --optimizer adam is AdamW (decoupled weight decay)
register_rule("muon", MUON)  # Megatron's --optimizer muon (megalite.data_parallel.muon)
