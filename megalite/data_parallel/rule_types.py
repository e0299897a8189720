"""The update rule's types, below the registry (:mod:`megalite.data_parallel.update_rule`): the
:class:`UpdateRule` record, the layout a non-elementwise rule is given (:class:`ShardGeometry`,
:class:`ParamPlace`, :class:`BucketLayout`) and AdamW's rule. A rule module (such as
:mod:`megalite.data_parallel.muon`) builds on these; the registry imports the built-in rules."""
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
