"""The update rule's types, below the registry (:mod:`megalite.data_parallel.update_rule`): the
:class:`UpdateRule` record, the layout a non-elementwise rule is given (:class:`ShardGeometry`,
:class:`ParamPlace`, :class:`BucketLayout`), where a rule's per-class state lies in the flat
shards (:class:`StateLayout`) and AdamW's rule. A rule module (such as
:mod:`megalite.data_parallel.muon`) builds on these; the registry imports the built-in rules."""
from __future__ import annotations

import bisect
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
    the model config (heads, groups, SwiGLU) and where the rule's scoped state lies
    (:class:`StateLayout`; None: made from ``places``)."""
    places: tuple
    tp_group: object = None
    model: object = None
    buckets: tuple = ()
    state_layout: object = None


@dataclass(frozen=True)
class UpdateRule:
    """An optimizer's state (names, fp32, one element per parameter each) and its step.

    Per parameter class: a rule may step its *matrices* (``takes_matrix(name, param)``: Muon's
    hidden weight matrices) differently from the rest, and keep fewer state tensors for them
    (``matrix_state``, a subset of ``state_names``: Muon's ``momentum``); every other parameter
    keeps all of ``state_names``. A state tensor not in ``matrix_state`` exists only for the
    non-matrix parameters (:meth:`keeps`): the distributed optimizer allocates it over their
    elements only, a checkpoint holds no piece of it for a matrix, and the byte counts below say
    so. Without ``takes_matrix`` (AdamW) every parameter keeps every state."""
    name: str
    state_names: tuple[str, ...]
    build: Callable  # (masters, states: dict[name, list of shards], decay_ranges, t: TrainConfig) -> stepper
    state_label: str = "optimizer state"  # how messages name the state tensors, e.g. "Adam moments"
    master_bytes: int = FP32_BYTES  # per parameter, the fp32 master weights
    wants_geometry: bool = False  # build also gets geometry=ShardGeometry (module docstring)
    takes_matrix: Callable | None = None  # (name, param) -> bool: the rule's matrix class (None: no classes)
    matrix_state: tuple[str, ...] = ()  # the state tensors a matrix keeps (with takes_matrix)

    def is_matrix(self, name: str, param) -> bool:
        """Whether parameter ``name`` is in the rule's matrix class (never, for a rule without classes)."""
        return self.takes_matrix is not None and self.takes_matrix(name, param)

    def keeps(self, state: str, name: str, param) -> bool:
        """Whether parameter ``name`` keeps state tensor ``state``: the one definition of which
        state exists where, asked by the allocation, the steppers and the checkpoints."""
        return state in self.state_names_of(self.is_matrix(name, param))

    def state_names_of(self, matrix: bool) -> tuple[str, ...]:
        """The state tensors a parameter of the matrix class (``matrix``) or of the rest keeps."""
        return self.matrix_state if matrix and self.takes_matrix is not None else self.state_names

    def scoped(self, state: str) -> bool:
        """Whether ``state`` exists for the non-matrix parameters only (not for every parameter)."""
        return self.takes_matrix is not None and state not in self.matrix_state

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the state tensors (not counting the master weights), for a
        parameter keeping all of them (every parameter but a rule's matrices)."""
        return FP32_BYTES * len(self.state_names)

    @property
    def bytes_per_parameter(self) -> int:
        """Bytes per parameter of master weights and state of a non-matrix parameter (every
        parameter of a rule without classes: AdamW's 12): what ZeRO shards and a checkpoint stores."""
        return self.master_bytes + self.state_bytes

    def bytes_of(self, matrix: bool) -> int:
        """Bytes per parameter of master weights and state for the matrix class (``matrix``) or the
        rest (Muon: 8 and 12; AdamW: 12 either way)."""
        return self.master_bytes + FP32_BYTES * len(self.state_names_of(matrix))

    def state_bytes_total(self, matrix_params: int, other_params: int) -> int:
        """Bytes of master weights and state over ``matrix_params`` parameters of the matrix class
        and ``other_params`` others: what the accounting, the planners and preflight count."""
        return self.bytes_of(True) * matrix_params + self.bytes_of(False) * other_params

    def describe_bytes(self) -> str:
        """Master + state bytes per parameter in words: "12 bytes per parameter", or per class."""
        if self.bytes_of(True) == self.bytes_of(False):
            return f"{self.bytes_per_parameter} bytes per parameter"
        return f"{self.bytes_of(True)} bytes per matrix parameter, {self.bytes_of(False)} per other"

    def describe_state(self) -> str:
        """The state tensors in words, for messages: "two Adam moments"."""
        count = len(self.state_names)
        words = f"{NUMBER_WORDS.get(count, str(count))} {self.state_label}"
        if self.takes_matrix is None:
            return words
        kept = len(self.matrix_state)
        return f"{words} ({NUMBER_WORDS.get(kept, str(kept))} for a matrix)"

    @property
    def checkpoint_kinds(self) -> tuple[str, ...]:
        """The names a checkpoint stores per parameter: the master weights, then each state."""
        return (MASTER_KIND, *self.state_names)

    def record(self) -> dict:
        """What a checkpoint's metadata.json keeps of the rule that wrote it: its name and,
        per state tensor in order, its name, dtype and bytes per parameter, and for a state the
        rule's matrices do not keep, ``"held_by": "non-matrix"`` (their pieces are absent)."""
        return {"name": self.name, "state": [{"name": n, "dtype": STATE_DTYPE, "bytes_per_parameter": FP32_BYTES,
                                              **({"held_by": "non-matrix"} if self.scoped(n) else {})}
                                             for n in self.state_names]}


class StateLayout:
    """Where each state tensor's elements lie, when a rule keeps a state for some parameters only.

    An :class:`UpdateRule` says per parameter class which state tensors it keeps
    (:meth:`UpdateRule.keeps`; Muon: a matrix keeps ``momentum`` only, every other parameter
    ``momentum`` and ``exp_avg_sq``). A state every parameter keeps is a flat shard parallel to the
    master shard (element ``k`` of the state is the state of master element ``k``): AdamW's layout,
    unchanged. A *scoped* state (kept by the non-matrix parameters only) is a **compact** flat
    tensor per master shard: the runs ``[a, z)`` of the master shard held by its keepers, laid end
    to end (adjacent keepers: one run)::

        master shard   | embedding | qkv (matrix) | norm | fc1 (matrix) | output layer |
        exp_avg_sq     | embedding | norm | output layer |
                         run 0       run 1  run 2

    so a Muon matrix costs no byte of it (8 bytes per parameter: master + momentum; 12 for the
    rest). One compact tensor per shard, rather than one per class, keeps the allocation and the
    checkpoints' views one tensor per shard, as AdamW's are; a stepper and a checkpoint reach a
    parameter's slice of it through :meth:`view` (no copy: a piece lies inside one run, as a run
    never splits a parameter). Each state's runs are made once, from ``places``, on every rank.

    ``places``: every parameter piece of this rank's shards (objects with ``name``, ``param``,
    ``shard``, ``start``, ``stop``: :class:`~megalite.data_parallel.rule_types.ParamPlace`);
    ``shard_sizes``: each master shard's length."""

    def __init__(self, rule, places, shard_sizes):
        self.rule, self.shard_sizes = rule, list(shard_sizes)
        self.runs: dict[str, list[list[tuple[int, int, int]]]] = {}  # state -> per shard [(a, z, compact offset)]
        for state in rule.state_names:
            if not rule.scoped(state):
                continue
            per_shard = [[] for _ in self.shard_sizes]
            for place in sorted(places, key=lambda pl: (pl.shard, pl.start)):
                if not rule.keeps(state, place.name, place.param):
                    continue
                runs = per_shard[place.shard]
                at = runs[-1][2] + runs[-1][1] - runs[-1][0] if runs else 0
                if runs and runs[-1][1] == place.start:  # adjacent keepers: one run
                    runs[-1] = (runs[-1][0], place.stop, runs[-1][2])
                else:
                    runs.append((place.start, place.stop, at))
            self.runs[state] = per_shard

    def numel(self, state: str, shard: int) -> int:
        """Elements of ``state``'s tensor for master shard ``shard``."""
        if state not in self.runs:
            return self.shard_sizes[shard]
        return sum(z - a for a, z, _ in self.runs[state][shard])

    def view(self, tensor, state: str, shard: int, a: int, z: int):
        """``tensor`` (``state``'s tensor of shard ``shard``) at master elements ``[a, z)``, a view;
        None where those elements keep no ``state`` (a Muon matrix's ``exp_avg_sq``)."""
        if state not in self.runs:
            return tensor[a:z]
        runs = self.runs[state][shard]
        k = bisect.bisect_right(runs, (a, float("inf"), 0)) - 1
        if k < 0 or not (runs[k][0] <= a and z <= runs[k][1]):
            return None
        offset = runs[k][2] + a - runs[k][0]
        return tensor[offset: offset + z - a]


def _build_adamw(masters, states, decay_ranges, t) -> FlatAdamW:
    return FlatAdamW(masters, states["exp_avg"], states["exp_avg_sq"], decay_ranges,
                     betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)


ADAMW = UpdateRule("adamw", ("exp_avg", "exp_avg_sq"), _build_adamw, state_label="Adam moments")
DEFAULT_RULE = ADAMW
