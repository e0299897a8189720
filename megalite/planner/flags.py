"""What the planner assumes about a training run, and the run as ``pretrain_gpt.py`` flags.

One source of truth: every default the planner models (gradient accumulation dtype, dropout,
micro batch, ZeRO stage, recomputation, sequence parallelism, the DDP bucket size) is read from
``megalite.arguments.build_parser()``, the parser of ``pretrain_gpt.py``, never copied here, and
every flag printed is named by the setting's own mark (``megalite.arguments.flag_for``).
:func:`pretrain_flags` writes a planned layout as the exact flags that train it, so that
``tools/dry_run.py`` with those flags measures what the planner estimated, and
``tools/plan_parallel.py --verify`` dry-runs nothing else.

Beyond the parser's defaults the planner assumes, and prints in the flags:
``--sequence-parallel`` with TP > 1 (Megatron practice); ``--overlap-grad-reduce`` under ZeRO-2/3
(without it megalite's ZeRO-2/3 stage every bucket's gradients until the end of the step, a full
gradient more than the one bucket the planner counts); ``--attention-dropout 0`` under CP (no
CP type has attention dropout); the CP type (``--cp-comm-type``, and for a2a+p2p
``--hierarchical-context-parallel-sizes A B``) when CP > 1 and it is not the default p2p; the
precision flag (``--bf16`` by default); Megatron's packed-document flags ``--reset-position-ids``
and ``--reset-attention-mask`` when the planner was asked with them (the batch then carries the
documents' arrays, which the estimate counts: :mod:`megalite.planner_documents`); the pipeline
schedule (``--pipeline-schedule zb-h1`` or ``zbv``, :mod:`megalite.planner_pipeline`) when PP > 1
and it is not the parser's default.
"""
from __future__ import annotations

import functools

from megalite.arguments import build_parser, flag_for
from megalite.config import ModelConfig
from megalite.planner.model_flags import model_flags


@functools.lru_cache(maxsize=1)
def _defaults() -> tuple:
    return tuple(sorted(vars(build_parser().parse_args([])).items()))


def training_defaults() -> dict:
    """``pretrain_gpt.py``'s defaults (its parser with no flags), by destination name."""
    return dict(_defaults())


def grads_in_fp32(precision: str, accumulate: bool | None = None) -> bool:
    """Whether gradients are accumulated and reduced in fp32: ``--accumulate-allreduce-grads-in-fp32``
    (default from the parser: None, which ``megalite.config.validate`` turns on under --bf16/--fp16)."""
    if accumulate is None:
        accumulate = training_defaults()["accumulate_allreduce_grads_in_fp32"]
    if accumulate is None:
        return precision in ("bf16", "fp16")
    return bool(accumulate) or precision == "fp32"


def _flag(name: str) -> str:
    """The flag of setting ``name``, from the settings' own marks (megalite.flag_spec), never a copy."""
    return flag_for(name)


def _model_flags(m: ModelConfig) -> list[str]:
    """The model's flags: every ModelConfig setting that differs from what ``pretrain_gpt.py``
    would make of its absence (:func:`megalite.planner.model_flags.model_flags`)."""
    return model_flags(m)


def pretrain_flags(m: ModelConfig, layout, global_batch: int, micro: int, precision: str = "bf16",
                   accumulate: bool | None = None, reset_position_ids: bool = False,
                   reset_attention_mask: bool = False) -> list[str]:
    """The ``pretrain_gpt.py`` flags of a planned layout (``megalite.planner.Layout``): the model,
    the batch, the layout and every assumption the planner made (module docstring); flags left
    at the parser's defaults are left out. Data flags are the user's (``--mock-data`` for a try)."""
    d = training_defaults()
    flags = _model_flags(m)
    flags += [f"{_flag('global_batch_size')}={global_batch}", f"{_flag('micro_batch_size')}={micro}"]
    flags += [f"{_flag(k)}={v}" for k, v in (("tensor_model_parallel_size", layout.tp),
                                             ("pipeline_model_parallel_size", layout.pp),
                                             ("context_parallel_size", layout.cp), ("zero_stage", layout.zero),
                                             ("expert_model_parallel_size", layout.ep)) if v != d[k]]
    if layout.pp > 1 and layout.schedule != d["pipeline_schedule"]:
        flags.append(f"{_flag('pipeline_schedule')}={layout.schedule}")
    if layout.sp and not d["sequence_parallel"]:
        flags.append(_flag("sequence_parallel"))
    if layout.recompute != (d["recompute_granularity"] or "none"):
        flags.append(f"{_flag('recompute_granularity')}={layout.recompute}")
    if layout.zero >= 2 and not d["overlap_grad_reduce"]:
        flags.append(_flag("overlap_grad_reduce"))
    if layout.cp > 1 and m.attention_dropout > 0:
        flags.append(f"{_flag('attention_dropout')}=0")
    kind = layout.cp_comm_type
    if layout.cp > 1 and kind != d["cp_comm_type"]:
        flags.append(f"{_flag('cp_comm_type')}={kind}")
        if layout.cp_sizes:  # a hierarchical type: A inner (all-to-all) ranks, B = CP/A outer (ring) ranks
            flags += [_flag("hierarchical_context_parallel_sizes"), *map(str, layout.cp_sizes)]
    if precision != "fp32":
        flags.append(_flag(precision))  # --bf16 or --fp16
    if accumulate is not None and grads_in_fp32(precision, accumulate) != grads_in_fp32(precision, None):
        option = _flag("accumulate_allreduce_grads_in_fp32")  # a BooleanOptionalAction: --no-... turns it off
        flags.append(option if accumulate else "--no-" + option[2:])
    flags += [_flag(k) for k, on in (("reset_position_ids", reset_position_ids),
                                     ("reset_attention_mask", reset_attention_mask)) if on]
    return flags

