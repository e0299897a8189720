"""The update rule under the distributed optimizer: what state it keeps and how it steps.

An :class:`UpdateRule` is the one place that knows an optimizer's per-parameter state:

- ``state_names``: the fp32 tensors it keeps beside each fp32 master shard (AdamW: the two
  moments ``exp_avg`` and ``exp_avg_sq``); the checkpoint stores each under that name, after
  the master weights (``weight``);
- ``state_bytes`` and ``bytes_per_parameter``: the bytes of that state per parameter, and of
  state plus fp32 master weights (AdamW: 8 and 12), which the ZeRO arithmetic, the planner,
  the MoE planner and the preflight disk check count;
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

from dataclasses import dataclass
from typing import Callable

from megalite.data_parallel.adamw import FlatAdamW
from megalite.data_parallel.step_counter import DeviceStepCount  # noqa: F401  (the steppers' base, for a new rule)

MASTER_KIND = "weight"  # the checkpoint's name for the fp32 master weights
FP32_BYTES = 4
STATE_DTYPE = "float32"  # every state tensor's dtype (one element per parameter)
NUMBER_WORDS = {0: "no", 1: "one", 2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class ParamPlace:
    """One parameter's elements in the flat shards: ``master[shard][start:stop]`` holds its
    flattened elements ``[first, first + stop - start)``. ``param`` is the model's parameter
    (its shape, ``tp_split``, ``expert_parallel``), ``name`` its name in its model chunk."""
    name: str
    param: object
    shard: int
    start: int
    stop: int
    first: int

    @property
    def whole(self) -> bool:
        """All of the parameter lies in this shard (always so without ZeRO)."""
        return self.first == 0 and self.stop - self.start == self.param.numel()


@dataclass(frozen=True)
class BucketLayout:
    """The flat bucket a master shard is cut from: this rank's ``[lo, hi)`` of its ``numel``
    (padded) elements, the group that shards it (``sharded``: ZeRO >= 1 over more than one
    rank, the shards all-gather into the bucket in rank order) and every parameter in it as
    ``(name, param, start)``, also those held by other ranks."""
    lo: int
    hi: int
    numel: int
    group: object
    sharded: bool
    members: tuple


@dataclass(frozen=True)
class ShardGeometry:
    """What a non-elementwise rule needs of the layout: every parameter piece of this rank's
    shards (:class:`ParamPlace`, in shard order), each shard's bucket (:class:`BucketLayout`),
    the tensor-parallel group the TP-split parameters are split over (None: one process) and
    the model config (heads, groups, SwiGLU)."""
    places: tuple
    tp_group: object = None
    model: object = None
    buckets: tuple = ()


@dataclass(frozen=True)
class UpdateRule:
    """An optimizer's state (names, fp32, one element per parameter each) and its step."""
    name: str
    state_names: tuple[str, ...]
    build: Callable  # (masters, states: dict[name, list of shards], decay_ranges, t: TrainConfig) -> stepper
    state_label: str = "optimizer state"  # how messages name the state tensors, e.g. "Adam moments"
    master_bytes: int = FP32_BYTES  # per parameter, the fp32 master weights
    wants_geometry: bool = False  # build also gets geometry=ShardGeometry (module docstring)

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the state tensors (not counting the master weights)."""
        return FP32_BYTES * len(self.state_names)

    @property
    def bytes_per_parameter(self) -> int:
        """Bytes per parameter of master weights and state: what ZeRO shards and a checkpoint stores."""
        return self.master_bytes + self.state_bytes

    def describe_state(self) -> str:
        """The state tensors in words, for messages: "two Adam moments"."""
        count = len(self.state_names)
        return f"{NUMBER_WORDS.get(count, str(count))} {self.state_label}"

    @property
    def checkpoint_kinds(self) -> tuple[str, ...]:
        """The names a checkpoint stores per parameter: the master weights, then each state."""
        return (MASTER_KIND, *self.state_names)

    def record(self) -> dict:
        """What a checkpoint's metadata.json keeps of the rule that wrote it: its name and,
        per state tensor in order, its name, dtype and bytes per parameter."""
        return {"name": self.name, "state": [{"name": n, "dtype": STATE_DTYPE, "bytes_per_parameter": FP32_BYTES}
                                             for n in self.state_names]}


def _build_adamw(masters, states, decay_ranges, t) -> FlatAdamW:
    return FlatAdamW(masters, states["exp_avg"], states["exp_avg_sq"], decay_ranges,
                     betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)


ADAMW = UpdateRule("adamw", ("exp_avg", "exp_avg_sq"), _build_adamw, state_label="Adam moments")
DEFAULT_RULE = ADAMW

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
