"""The planner's types, on its lowest floor: the machine (:class:`Hardware`), the number formats
(:class:`Precision`), one layout (:class:`Layout`), one layout's figures (:class:`Estimate`) and a
search's result (:class:`Plan`). Every other planner module imports down to this one; the
arithmetic that fills them is in :mod:`megalite.planner.estimate` (see its docstring).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalite.config import ModelConfig, ParallelConfig, TrainConfig
from megalite.context_parallel.comm_types import DEFAULT_CP_COMM_TYPE, cp_comm_type
from megalite.data_parallel.update_rule import DEFAULT_RULE, RULES, UpdateRule, rule_named
from megalite.parallel.grid import GridLayout

GiB = 2**30
DEFAULT_HEADROOM = 0.10  # fraction of GPU memory kept free (tools/dry_run.py's "fits" uses it too)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gb: float  # per GPU, as on the spec sheet (GiB)
    gpus_per_node: int
    nodes: int = 1
    nvlink_gbps: float = 450.0  # GB/s per GPU inside a node
    ib_gbps: float = 50.0  # GB/s per GPU across nodes
    headroom: float = DEFAULT_HEADROOM  # fraction kept free: CUDA context, allocator fragmentation, workspaces
    achieved_tflops: float = 400.0  # per GPU (~40% of an H100's dense bf16): step time (planner_pipeline)
    # what a step-time model and a calibrated profile add (issue 40); the defaults: an H100 SXM
    peak_tflops: float = 989.0  # dense bf16 per GPU, the spec sheet's: MFU's denominator
    hbm_gbps: float = 3350.0  # GB/s of device memory per GPU
    nvlink_latency_us: float = 10.0  # a collective's fixed cost inside a node (per call)
    ib_latency_us: float = 20.0  # a collective's fixed cost across nodes (per call)
    name: str = "h100-sxm"  # the profile these figures come from
    # what a collective hidden behind compute still costs, per second of its link time (step_time.py's
    # "overlap"); 0.10 an assumption for a GPU, a calibrated profile measures it (calibrate_hardware.py)
    overlap_cost: float = 0.10
    # TFLOP/s of the CP attention blocks (ring, allgather: Triton's on a GPU, torch's reference on a CPU),
    # the planner's attention FLOPs over their time; None: achieved_tflops (step_time.py's "cp")
    cp_block_tflops: float | None = None

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gb * GiB * (1 - self.headroom)


@dataclass(frozen=True)
class UpdatePlan:
    """The update rule a plan trains with, as ``pretrain_gpt.py``'s flags name it (``--optimizer``;
    for Muon also how it meets tensor parallelism): the rule's state bytes go into
    :class:`Precision`, its collectives into :mod:`megalite.planner.update_traffic`."""
    optimizer: str = "adam"
    muon_tp_mode: str = "blockwise"
    muon_num_ns_steps: int = 5
    muon_split_qkv: bool = True

    @classmethod
    def of_run(cls, t: TrainConfig) -> UpdatePlan:
        return cls(t.optimizer, t.muon_tp_mode, t.muon_num_ns_steps, t.muon_split_qkv)

    @property
    def rule(self) -> UpdateRule:
        return rule_named(self.optimizer)

    @property
    def muon(self) -> bool:
        return self.rule.name == "muon"


@dataclass(frozen=True)
class Precision:
    name: str = "bf16"
    weight_bytes: int = 2
    grad_bytes: int = 2
    act_bytes: int = 2  # activations (dropout masks are 1 byte regardless)
    optimizer_bytes: int = DEFAULT_RULE.bytes_per_parameter  # fp32 master + the update rule's state (Adam m, v)
    optimizer_state: str = DEFAULT_RULE.state_label  # that state in words, for explanations
    # per parameter of the rule's matrix class (the layers' weight matrices; Muon: 8), else optimizer_bytes
    matrix_optimizer_bytes: int | None = None
    update: UpdatePlan = UpdatePlan()  # the rule these bytes are of, and its settings that move data

    @property
    def matrix_bytes(self) -> int:
        """fp32 master + state bytes per parameter of the rule's matrix class."""
        return self.optimizer_bytes if self.matrix_optimizer_bytes is None else self.matrix_optimizer_bytes

    @property
    def bytes_per_param(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def precision(name: str = "bf16", fp32_grads: bool = False, rule: UpdateRule | None = None,
              update: UpdatePlan | None = None) -> Precision:
    """Byte widths for a precision; master weights and optimizer state as the update rule keeps
    them: ``update``'s (:class:`UpdatePlan`), or ``rule`` with its settings' defaults (AdamW)."""
    if name not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision {name!r} is unknown; use bf16, fp16 or fp32")
    if update is None:  # the rule by the name --optimizer gives it (AdamW is 'adam')
        update = UpdatePlan(next((k for k, r in RULES.items() if r is rule), rule.name)) if rule else UpdatePlan()
    rule = update.rule
    w = 4 if name == "fp32" else 2
    return Precision(name, w, 4 if fp32_grads else w, w, rule.bytes_per_parameter, rule.state_label,
                     rule.bytes_of(True) if rule.bytes_of(True) != rule.bytes_per_parameter else None, update)


def precision_of_run(t: TrainConfig) -> Precision:
    """The :class:`Precision` of a configured run: its number format, gradient buffers and update rule."""
    return precision("bf16" if t.bf16 else "fp16" if t.fp16 else "fp32",
                     fp32_grads=bool(t.accumulate_allreduce_grads_in_fp32) and (t.bf16 or t.fp16),
                     update=UpdatePlan.of_run(t))


# The planner's order of a layout's fields: Layout's positional arguments and its to_dict() keys.
PLANNED_FIELDS = ("tp", "pp", "dp", "cp", "zero", "recompute", "ep", "cp_comm_type", "cp_inner", "schedule",
                  "virtual")


@dataclass(frozen=True, init=False)
class Layout(GridLayout):
    """One layout as the planner, the dry run and the printed flags see it: the grid's sizes and
    rank order (:class:`megalite.parallel.grid.GridLayout`: tp, cp, dp, pp, ep, cp_inner, whose
    ``groups`` say which links a kind of traffic crosses) plus the run's choices that change
    memory, time and flags but no rank's coordinate: the ZeRO stage, recomputation, the CP type
    and the pipeline schedule with its virtual stages. Positional arguments in the order of
    :data:`PLANNED_FIELDS`."""

    zero: int = 0
    recompute: str = "none"
    cp_comm_type: str = DEFAULT_CP_COMM_TYPE  # --cp-comm-type (:mod:`megalite.planner.cp`); p2p without CP
    schedule: str = "1f1b"  # --pipeline-schedule with PP > 1 (:mod:`megalite.planner.pipeline`)
    virtual: int = 1  # model chunks per rank of the interleaved 1F1B (V); 1: not interleaved

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, zero: int = 0, recompute: str = "none",
                 ep: int = 1, cp_comm_type: str = DEFAULT_CP_COMM_TYPE, cp_inner: int = 1, schedule: str = "1f1b",
                 virtual: int = 1, experts: bool = False):
        super().__init__(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, experts=experts, cp_inner=cp_inner)
        for name, value in (("zero", zero), ("recompute", recompute), ("cp_comm_type", cp_comm_type),
                            ("schedule", schedule), ("virtual", virtual)):
            object.__setattr__(self, name, value)

    @classmethod
    def of_run(cls, grid: GridLayout, model: ModelConfig, train: TrainConfig,
               layers_per_virtual_stage: int | None = None) -> Layout:
        """The layout of a configured run: its grid with the run's ZeRO stage, recomputation, CP
        type (p2p without CP, as the planner writes it), pipeline schedule and, with
        ``layers_per_virtual_stage`` (--num-layers-per-virtual-pipeline-stage k), its V = L / (PP k)."""
        virtual = model.num_layers // (grid.pp * layers_per_virtual_stage) if layers_per_virtual_stage else 1
        return cls(**grid.grid_sizes(), zero=train.zero_stage, recompute=model.recompute_granularity or "none",
                   cp_comm_type=model.cp_comm_type if grid.cp > 1 else DEFAULT_CP_COMM_TYPE,
                   schedule=train.pipeline_schedule, virtual=virtual)

    def layers_per_virtual_stage(self, num_layers: int) -> int | None:
        """--num-layers-per-virtual-pipeline-stage of an interleaved layout (L / (PP V)), else None."""
        return num_layers // (self.pp * self.virtual) if self.virtual > 1 else None

    @property
    def schedule_label(self) -> str:
        """The schedule as tables print it: '1f1b', 'zb-h1', 'zbv', 'i1f1b/2' (interleaved, V = 2)."""
        return f"i{self.schedule}/{self.virtual}" if self.virtual > 1 else self.schedule

    @property
    def sp(self) -> bool:  # sequence parallelism always accompanies TP here (Megatron practice)
        return self.tp > 1

    @property
    def cp_sizes(self) -> tuple[int, int] | None:
        """--hierarchical-context-parallel-sizes A B of a hierarchical CP type, else None."""
        return (self.cp_inner, self.cp // self.cp_inner) if cp_comm_type(self.cp_comm_type).hierarchical else None

    def parallel_config(self, num_layers: int | None = None) -> ParallelConfig:
        """The layout's ``ParallelConfig`` (what ``GridLayout.from_config`` reads back); with the
        model's ``num_layers``, an interleaved layout's layers per virtual stage too."""
        return ParallelConfig(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                              context_parallel_size=self.cp, sequence_parallel=self.sp,
                              hierarchical_context_parallel_sizes=self.cp_sizes,
                              expert_model_parallel_size=self.ep,
                              num_layers_per_virtual_pipeline_stage=self.layers_per_virtual_stage(num_layers)
                              if num_layers else None)

    def to_dict(self) -> dict:
        """The planned fields, in the planner's order (tools/plan_parallel.py --json)."""
        return {name: getattr(self, name) for name in PLANNED_FIELDS}

    def describe(self) -> str:
        parts = [f"TP {self.tp}" + (" (SP)" if self.sp else "")] if self.tp > 1 else []
        parts += [describe_cp(self)] if self.cp > 1 else []
        schedule = f"interleaved {self.schedule}, V {self.virtual}" if self.virtual > 1 else self.schedule
        parts += [f"PP {self.pp} ({schedule})"] if self.pp > 1 else []
        parts.append(f"DP {self.dp}")
        ep = f", EP {self.ep}" if self.ep > 1 else ""
        return " x ".join(parts) + f"{ep}, ZeRO-{self.zero}, recompute {self.recompute}"


def cp_type_name(layout: Layout) -> str:
    """'a2a', 'a2a+p2p 2x4': the CP type and for a hierarchical type its sizes A x B."""
    sizes = layout.cp_sizes
    return layout.cp_comm_type + (f" {sizes[0]}x{sizes[1]}" if sizes else "")


def describe_cp(layout: Layout) -> str:
    """'CP 4 (a2a)', 'CP 8 (a2a+p2p 2x4)'."""
    return f"CP {layout.cp} ({cp_type_name(layout)})"


@dataclass
class Estimate:
    layout: Layout
    num_micro: int
    stage: int  # the pipeline stage with the most memory
    psi: int  # parameters on that stage's ranks
    memory: dict  # weights, gradients, master_and_optimizer, activations, buffers, data, total (bytes)
    bubble: float  # of its schedule, F = B = W (:func:`megalite.planner.pipeline.bubble`)
    comm: dict
    fits: bool
    held: tuple = ()  # (micro-batches of activations, of W inputs) per chunk at that stage's peak
    w_inputs: float = 0.0  # bytes of W inputs held then (part of memory["activations"])
    compute_seconds: float = 0.0  # per step at Hardware.achieved_tflops (:func:`megalite.planner.search.plan` sets it)
    step: dict = field(default_factory=dict)  # the step time's named terms, seconds (megalite.planner.step_time)

    @property
    def comm_seconds(self) -> float:
        return sum(c["seconds"] for c in self.comm.values())

    @property
    def step_seconds(self) -> float:
        """The step-time model's sum of terms; without them compute / (1 - bubble) + communication."""
        if self.step:
            return sum(self.step.values())
        return self.compute_seconds / (1 - self.bubble) + self.comm_seconds

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layout": self.layout.to_dict(), "description":
                self.layout.describe(), "comm_seconds": self.comm_seconds, "step_seconds": self.step_seconds}


@dataclass
class Plan:
    model: ModelConfig
    hardware: Hardware
    precision: Precision
    global_batch: int
    micro: int
    estimates: list[Estimate]  # valid layouts, in ladder order
    invalid: dict = field(default_factory=dict)  # Layout -> reason megalite refuses it
    choice: Estimate | None = None
    reasons: list[str] = field(default_factory=list)
    cp_comm_type: str | None = None  # the CP type the user fixed (None: every type searched)
    train_tokens: float | None = None  # tokens to train on: the explanation's days to train

    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]
