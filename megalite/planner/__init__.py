"""The layout planner: memory, bubble and communication per GPU of every candidate layout, and
the recommendation (``tools/plan_parallel.py`` is its command line). Pure arithmetic.

Floors inside the package, each importing only those below it:

1. :mod:`.types`: Hardware, Precision, Layout, Estimate, Plan (dataclasses only);
2. :mod:`.flags` (pretrain_gpt.py's defaults, a model and a layout as flags), :mod:`.layers` (one layer's
   activations), :mod:`.cp` (CP types), :mod:`.documents` (packed documents), :mod:`.checks`
   (megalite's validation of a layout), :mod:`.update_traffic` (the update rule's own collectives: Muon's);
3. :mod:`.pipeline` (schedules: bubble, micro-batches held), then :mod:`.step_time` (one step's
   time in named terms: compute, bubble, exposed communication, optimizer, latency);
4. :mod:`.estimate` (parameters, model state, communication, one layout's estimate; the math
   is in its docstring);
5. :mod:`.search` (every candidate layout; the fastest estimated step that fits recommended, with the reasons).

This module only re-exports what callers import from ``megalite.planner``.
"""
from megalite.planner.checks import check_layout
from megalite.planner.estimate import (DEFAULT_BUCKET, WIRE_MEASURE, communication, estimate, format_communication,
                                       group_spans_nodes, layer_parameters, model_state_bytes, stage_expert_parameters,
                                       stage_memory, stage_parameters, total_parameters)
from megalite.planner.layers import layer_activation_bytes
from megalite.planner.pipeline import in_flight, pipeline_bubble, stage_activation_bytes
from megalite.planner.search import candidate_layouts, explain, ladder_key, plan
from megalite.planner.types import (DEFAULT_HEADROOM, RECOMPUTE, Estimate, GiB, Hardware, Layout, Plan, Precision,
                                    cp_type_name, describe_cp, precision)

__all__ = ["DEFAULT_BUCKET", "DEFAULT_HEADROOM", "RECOMPUTE", "WIRE_MEASURE", "Estimate", "GiB", "Hardware", "Layout",
           "Plan", "Precision", "candidate_layouts", "check_layout", "communication", "cp_type_name", "describe_cp",
           "estimate", "explain", "format_communication", "group_spans_nodes", "in_flight", "ladder_key",
           "layer_activation_bytes", "layer_parameters", "model_state_bytes", "pipeline_bubble", "plan", "precision",
           "stage_activation_bytes", "stage_expert_parameters", "stage_memory", "stage_parameters",
           "total_parameters"]
