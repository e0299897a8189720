"""The rules of the pipeline schedules, checked by ``megalite.config.validate`` before any
group or model exists. Each raises :class:`ConfigError` naming the values, the rule and a fix.

- ``zb-h1`` and ``zbv`` split every backward into B (input gradient) and W (weight
  gradient); with one pipeline stage there is no bubble to fill, so they need PP > 1.
- ``zbv`` places two model chunks per rank in a V (rank p: global chunks p and 2P-1-p): the
  layers must divide into 2P equal chunks, and the virtual-stage flag, which sets the
  interleaved schedule's chunking, does not apply; ``zb-h1`` is a one-chunk schedule.
- The B/W split lives in megalite's own linears (local transformer implementation):
  transformer-engine modules (and so FP8) compute their weight gradient inside one fused
  backward that megalite cannot defer.
"""
from __future__ import annotations

from megalite.errors import ConfigError
from megalite.pipeline.schedule_kinds import SCHEDULES, ZERO_BUBBLE, schedule  # noqa: F401 (ZERO_BUBBLE: re-exported)


def check_pipeline_schedule(model, parallel, train) -> None:
    name, pp = train.pipeline_schedule, parallel.pipeline_model_parallel_size
    if name not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {name!r} is unknown. Fix: use one of "
                          f"{', '.join(SCHEDULES)} (interleaving is chosen by "
                          f"--num-layers-per-virtual-pipeline-stage).")
    kind = schedule(name)
    if not kind.split_backward:
        return
    if pp < 2:
        raise ConfigError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size > 1 "
                          f"(got {pp}): it fills the pipeline's idle slots with weight-gradient "
                          f"work, and one stage has none. Fix: raise PP or drop the flag.")
    if parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(f"--pipeline-schedule {name} with --num-layers-per-virtual-pipeline-stage: "
                          + (f"{name} always holds 2 chunks per rank in a V" if kind.v_shape
                             else f"{name} holds one chunk per rank")
                          + ", the flag sets the interleaved schedule's chunks. Fix: drop "
                          "--num-layers-per-virtual-pipeline-stage.")
    if kind.v_shape and model.num_layers % kind.pipeline_chunks(pp) != 0:
        raise ConfigError(f"--pipeline-schedule zbv cuts the {model.num_layers} layers into 2 x PP = "
                          f"{2 * pp} equal chunks (rank p holds chunks p and {2 * pp - 1}-p), but "
                          f"{model.num_layers} is not divisible by {2 * pp}. Fix: use a multiple of "
                          f"{2 * pp} layers, or --pipeline-schedule zb-h1.")
    if model.transformer_impl != "local":
        raise ConfigError(f"--pipeline-schedule {name} with --transformer-impl {model.transformer_impl}: "
                          f"the B/W split defers the weight gradients of megalite's own linears; "
                          f"transformer-engine computes them inside its fused backward. Fix: use "
                          f"--transformer-impl local, or --pipeline-schedule 1f1b.")
