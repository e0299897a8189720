#!/usr/bin/env python
"""Will my layout fit? Dry-run one rank of every role of a layout, measure, compare with the planner.

    python tools/dry_run.py --world-size 1024 --gpus-per-node 8 --gpu-memory-gb 80 \\
        --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8 \\
        --ffn-hidden-size 28672 --seq-length 8192 --vocab-size 128256 --swiglu --normalization RMSNorm \\
        --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel \\
        --zero-stage 1 --micro-batch-size 1 --global-batch-size 1024 --bf16 --json plan.json

Ranks that differ only in their TP, CP or DP position do the same work, so a layout has one
*role* per pipeline stage (the first also embeds, the last also computes the logits and the
loss; with virtual stages each holds its chunks). For each role, one rank runs one full
training iteration (forward, backward, the pipeline schedule, the DP/ZeRO reductions, the
optimizer step) as a ``--fake-process-group`` rank on meta tensors (``--device meta``: no
memory, no compute) with ``--track-memory``. Printed per role: weights, gradients, optimizer
state, activations and communication buffers at the peak, the peak itself, bytes handed to
each group's collectives per step, and the planner's estimate for the same rank with the
difference. With experts (``--num-experts``) the planner gets the layout's EP too, and a
line compares the wire bytes per step on the 'ep' (token all-to-all) and 'edp' (expert
gradients) groups with the planner's (when EP equals TP the two kinds share one communicator
and their bytes are reported under 'tp'). With ``--device cuda`` (one GPU) the roles run for
real on it and ``torch.cuda.max_memory_allocated`` is reported beside the tracker's peak.
All other flags are pretrain_gpt.py's; --train-iters and logging flags are set here.
With ``--reset-attention-mask`` a line states the attention work of the run's batch (the mock
data packs about four documents per sample): the mean attended length against s and the model
FLOPs per token both ways (:mod:`megalite.planner.documents`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megalite.arguments import build_parser, config_from_args, parse_settings  # noqa: E402
from megalite.config import ConfigError, validate  # noqa: E402
from megalite.device import meta_stand_ins  # noqa: E402
from megalite.flag_spec import flagless  # noqa: E402
from megalite.parallel.grid import GridLayout  # noqa: E402
from megalite.moe.planning import wire_from_handed  # noqa: E402
from megalite.planner import DEFAULT_HEADROOM, Hardware, Layout, communication, stage_memory  # noqa: E402
from megalite.planner.types import precision_of_run  # noqa: E402
from megalite.planner.documents import dry_run_line  # noqa: E402
from tools.tool_errors import one_line_errors, writable  # noqa: E402

GiB = 2**30


def roles(layout: GridLayout) -> list[dict]:
    """One rank per pipeline stage (TP, CP and DP positions do the same work)."""
    out = []
    for stage in range(layout.pp):
        what = ["embeddings" if stage == 0 else "", "output and loss" if stage == layout.pp - 1 else ""]
        ranks = [layout.rank_of(pp=stage), layout.rank_of(tp=layout.tp - 1, cp=layout.cp - 1, dp=layout.dp - 1,
                                                        pp=stage)]
        out.append({"role": f"stage {stage}" + (f" ({', '.join(w for w in what if w)})" if any(what) else ""),
                    "stage": stage, "ranks": sorted(set(ranks))})
    return out


def mock_eod(vocab_size: int) -> int:
    """The end-of-document id of the dry run's mock data: its NullTokenizer's, as pretrain builds it."""
    from megalite.data.tokenizer import build_tokenizer

    return build_tokenizer("NullTokenizer", vocab_size=vocab_size).eod


def host_batches(config, layout: GridLayout) -> list[dict]:
    """The first step's micro-batches of data-parallel rank 0, as pretrain reads them (host tensors)."""
    from megalite.data.builder import build_data_iterators_from

    t = config.train
    num_micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
    mock = dataclasses.replace(config, data=dataclasses.replace(config.data, data_path=None, mock_data=True))
    train, _, _ = build_data_iterators_from(mock, dp_rank=0, dp_size=layout.dp, train_samples=t.global_batch_size)
    return [next(train) for _ in range(num_micro)]


def documents_line(config, layout: GridLayout) -> str | None:
    """With --reset-attention-mask: the attention work of the dry run's batch
    (:func:`megalite.planner.documents.dry_run_line`), else None."""
    if not config.data.reset_attention_mask:
        return None
    return dry_run_line(config.model, host_batches(config, layout))


def flagless_settings(config) -> dict:
    """``{section: {field: value}}`` of ``config``'s settings that no flag sets (the attention part,
    the update rule): what a dry run of that config hands pretrain beside its flags."""
    sections = {name: flagless(getattr(config, name)) for name in ("model", "parallel", "train", "data")}
    return {name: values for name, values in sections.items() if values}


def run_role(flags: list[str], world: int, rank: int, gpus_per_node: int, device: str,
             unflagged: dict | None = None) -> dict:
    """One fake-process-group rank, one iteration, memory tracked; its last log record.
    ``unflagged``: the settings no flag sets (:func:`flagless_settings`)."""
    from megalite.train.pretrain import pretrain

    role_env = dict(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank % gpus_per_node),
                    LOCAL_WORLD_SIZE=str(gpus_per_node))
    saved_env = {k: os.environ.get(k) for k in role_env}
    os.environ.update(role_env)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet):
            # One iteration; the learning-rate schedule is cut to it (it moves no memory or bytes, and a
            # warm-up longer than one iteration would not validate).
            record = pretrain(flags + ["--fake-process-group", "--device", device, "--track-memory",
                                       "--train-iters", "1", "--lr-warmup-iters", "0", "--lr-decay-iters", "1",
                                       "--eval-interval", "1000000", "--log-interval", "1"], unflagged)[-1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved_env.items():  # leave the caller's environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if device == "cuda":
        record["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return record


def _plan_inputs(config, layout: GridLayout):
    t, m = config.train, config.model
    prec = precision_of_run(t)  # its number format, gradient buffers and update rule
    plan_layout = Layout.of_run(layout, m, t, config.parallel.num_layers_per_virtual_pipeline_stage)
    num_micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
    return m, plan_layout, t.micro_batch_size, num_micro, prec


def planned(config, layout: GridLayout, stage: int) -> dict:
    """The planner's memory for one rank of ``stage`` (megalite.planner.stage_memory)."""
    m, plan_layout, micro, num_micro, prec = _plan_inputs(config, layout)
    return stage_memory(m, plan_layout, stage, micro, num_micro, prec, flash_attention=True,
                        documents=config.data.reset_attention_mask)[1]


def planned_comm(config, layout: GridLayout, stage: int, gpus_per_node: int) -> dict:
    """The planner's wire bytes per step per kind for one rank of ``stage`` (megalite.planner.communication)."""
    m, plan_layout, micro, num_micro, prec = _plan_inputs(config, layout)
    psi, _ = stage_memory(m, plan_layout, stage, micro, num_micro, prec, flash_attention=True)
    hw = Hardware(80.0, gpus_per_node, -(-layout.world_size // gpus_per_node))
    return {k: c["bytes"] for k, c in communication(m, plan_layout, psi, micro, num_micro, prec, hw, stage).items()}


def wire_factor(kind: str, config, layout: GridLayout) -> float | None:
    """The wire bytes per rank for each byte handed to one group's collectives, as the planner
    counts them (ring collectives: (n-1)/n of the tensor for an all-gather, a reduce-scatter or an
    all-to-all, twice that for an all-reduce; all of a p2p send), by the collective that carries
    the group's traffic in this configuration; None for a group the planner does not count."""
    zero, m = config.train.zero_stage, config.model
    try:
        n = len(layout.group_of(kind, 0))
    except (KeyError, ValueError):
        return None
    ring = (n - 1) / n
    if kind in ("dp", "dp_cp", "edp"):  # gradients: all-reduce under ZeRO-0, else reduce-scatter + all-gather
        return 2 * ring if zero == 0 else ring
    if kind == "tp":  # all-reduces, or the all-gather / reduce-scatter pairs of sequence parallelism
        return ring if config.parallel.sequence_parallel else 2 * ring
    if kind in ("pp", "cp_outer") or (kind == "cp" and m.cp_comm_type == "p2p"):
        return 1.0  # p2p sends: every byte handed crosses the wire
    if kind in ("cp", "cp_inner", "ep"):  # all-to-alls, or allgather's gather + reduce-scatter
        return ring
    return None


# The dry run's group names against the planner's kinds (the gradient group of CP is dp_cp).
PLANNER_KIND = {"dp_cp": "dp"}


def wire_bytes(comm_bytes: dict, config, layout: GridLayout) -> dict:
    """The measured bytes handed to each group's collectives as wire bytes per rank
    (:func:`wire_factor`); groups the planner does not count are left out."""
    out = {}
    for kind, handed in comm_bytes.items():
        factor = wire_factor(kind, config, layout)
        if factor is not None:
            out[kind] = handed * factor
    return out


def expert_wire_bytes(comm_bytes: dict, layout: GridLayout, zero: int) -> dict:
    """The measured bytes handed to the 'ep' (all-to-all) and 'edp' (expert gradients: all-reduce
    under ZeRO-0, reduce-scatter + all-gather otherwise) groups, as ring wire bytes per rank."""
    out = {}
    if "ep" in comm_bytes:
        out["ep"] = wire_from_handed(comm_bytes["ep"], layout.ep)
    if "edp" in comm_bytes:
        out["edp"] = wire_from_handed(comm_bytes["edp"], layout.edp, all_reduce=zero == 0)
    return out


def measure_layout(flags: list[str], config, layout: GridLayout, gpus_per_node: int, device: str = "meta",
                   budget: float = float("inf")):
    """Yield, per role, the measured peak and categories, the planner's estimate, the bytes per
    group and whether it fits ``budget`` bytes."""
    for role in roles(layout):
        record = run_role(flags, layout.world_size, role["ranks"][0], gpus_per_node, device,
                          flagless_settings(config))
        tracked = record["memory_tracked"]
        plan = planned(config, layout, role["stage"])
        result = {**role, "measured_bytes": tracked["peak"], "planned_bytes": plan["total"],
                  "difference": (tracked["peak"] - plan["total"]) / plan["total"],
                  "categories": tracked["peak_by_category"], "planned_categories": plan,
                  "comm_bytes": record["comm_bytes_by_group"], "fits": tracked["peak"] <= budget,
                  "comm_wire_bytes": wire_bytes(record["comm_bytes_by_group"], config, layout),
                  "planned_comm_wire_bytes": planned_comm(config, layout, role["stage"], gpus_per_node),
                  "expert_comm_wire_bytes": expert_wire_bytes(record["comm_bytes_by_group"], layout,
                                                              config.train.zero_stage)}
        if "cuda_max_memory_allocated" in record:
            result["cuda_max_memory_allocated"] = record["cuda_max_memory_allocated"]
        yield result


# -- the printed tables ------------------------------------------------------------------------------

MEMORY_COLUMNS = (("weights", "parameters"), ("grads", "gradients"), ("optim", "optimizer state"),
                  ("activ.", "activations"), ("comm", "communication"))
COMMUNICATION_NOTE = ("handed: the bytes given to the group's collectives (all-reduce, reduce-scatter and all-to-all "
                      "input, all-gather output, p2p sends); wire: what one rank sends over its links, the "
                      "planner's measure (tools/plan_parallel.py): (n-1)/n of it for n ranks, twice for an "
                      "all-reduce, all of a p2p send; planned: the planner's wire bytes for this rank "
                      "(- where it counts none)")


def ranks_text(role: dict) -> str:
    return ",".join(map(str, role["ranks"]))


def role_widths(all_roles: list[dict]) -> tuple[int, int]:
    """The widths of the role and ranks columns: their longest entry (or heading)."""
    return (max([len("role")] + [len(r["role"]) for r in all_roles]),
            max([len("ranks")] + [len(ranks_text(r)) for r in all_roles]))


def memory_header(widths: tuple[int, int]) -> str:
    role, ranks = widths
    return (f"{'role':<{role}}  {'ranks':<{ranks}} " + "".join(f"{h:>9}" for h, _ in MEMORY_COLUMNS)
            + f"{'peak':>9}{'planned':>9}{'diff':>8}  fits   (GiB)")


def memory_row(result: dict, widths: tuple[int, int]) -> str:
    """One role's categories at the peak, the peak, the planner's figure and whether it fits, in GiB."""
    role, ranks = widths
    at_peak = result["categories"]
    return (f"{result['role']:<{role}}  {ranks_text(result):<{ranks}} "
            + "".join(f"{at_peak.get(k, 0) / GiB:9.2f}" for _, k in MEMORY_COLUMNS)
            + f"{result['measured_bytes'] / GiB:9.2f}{result['planned_bytes'] / GiB:9.2f}"
            f"{100 * result['difference']:+7.1f}%  {'yes' if result['fits'] else 'NO'}")


def communication_table(results: list[dict], role_width: int) -> list[str]:
    """Per role and group: the bytes handed to its collectives, the same as wire bytes, and the
    planner's wire bytes, all per step per rank in GiB; the last line says what each counts."""
    head = f"{'role':<{role_width}}  {'group':<8}{'handed':>9}{'wire':>9}{'planned':>9}{'diff':>8}"
    rows = ["communication bytes per step per rank (GiB)", head]
    for result in results:
        planned_wire = result["planned_comm_wire_bytes"]
        for i, (kind, handed) in enumerate(sorted(result["comm_bytes"].items())):
            wire = result["comm_wire_bytes"].get(kind)
            plan = planned_wire.get(PLANNER_KIND.get(kind, kind))
            cells = [f"{handed / GiB:9.2f}", "-" if wire is None else f"{wire / GiB:9.2f}",
                     "-" if plan is None else f"{plan / GiB:9.2f}",
                     f"{100 * (wire - plan) / plan:+7.1f}%" if wire is not None and plan else "-"]
            rows.append(f"{result['role'] if i == 0 else '':<{role_width}}  {kind:<8}"
                        + "".join(f"{c:>9}" for c in cells[:3]) + f"{cells[3]:>8}")
    rows.append(COMMUNICATION_NOTE)
    return rows


def main(argv=None) -> int:
    own = one_line_errors(argparse.ArgumentParser(add_help=False))
    own.add_argument("--world-size", type=int, required=True)
    own.add_argument("--gpus-per-node", type=int, default=8)
    own.add_argument("--gpu-memory-gb", type=float, default=80.0)
    own.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                     help="fraction of GPU memory kept free, as tools/plan_parallel.py keeps it (CUDA context, "
                          "allocator fragmentation, workspaces): a role fits when its peak is within the rest")
    own.add_argument("--device", choices=["meta", "cuda"], default="meta")
    own.add_argument("--json", default=None, help="write the per-role results here")
    args, flags = own.parse_known_args(argv)
    if "-h" in flags or "--help" in flags:
        print(__doc__)
        return 0
    writable(own, "--json", args.json)
    pre = parse_settings(flags, one_line_errors(build_parser()))
    vocab_size = pre.run.vocab_size
    if vocab_size is None:
        print("dry_run: --vocab-size is required (the run uses mock data)", file=sys.stderr)
        return 2
    flags = flags + ([] if pre.config.data.mock_data else ["--mock-data"])
    try:
        config = config_from_args(build_parser().parse_args(flags), vocab_size, eod_token=mock_eod(vocab_size))
    except ConfigError as e:
        print(f"dry_run: configuration error: {e}", file=sys.stderr)
        return 2
    swapped = meta_stand_ins(config.model) if args.device == "meta" else []
    if swapped:
        print(f"dry run on meta: megalite's torch layers and kernels stand in for {', '.join(swapped)} "
              f"(same parameters and communication; kernel workspaces not counted)")
    try:
        validate(config, args.world_size, args.gpus_per_node)
    except ConfigError as e:
        print(f"dry_run: configuration error: {e}", file=sys.stderr)
        return 2
    layout = GridLayout.from_config(config.parallel, args.world_size, experts=bool(config.model.num_experts))
    budget = args.gpu_memory_gb * GiB * (1 - args.headroom)  # the planner's allowance (Hardware.usable_bytes)
    allowance = (f"{budget / GiB:.1f} GiB ({1 - args.headroom:.0%} of {args.gpu_memory_gb:g} GiB, the planner's "
                 f"{args.headroom:.0%} headroom)")
    experts = f" (EP {layout.ep} x EDP {layout.edp} per stage)" if layout.experts else ""
    print(f"dry run: world {args.world_size} = TP {layout.tp} x CP {layout.cp} x DP {layout.dp} x PP {layout.pp}"
          f"{experts}, "
          f"{args.gpus_per_node} GPUs per node, {args.gpu_memory_gb:g} GiB each; one iteration per role on "
          f"{args.device}")
    documents = documents_line(config, layout)
    if documents:
        print(documents)
    print(f"fits: the peak within {allowance}")
    widths = role_widths(roles(layout))
    print(memory_header(widths))
    results = []
    for result in measure_layout(flags, config, layout, args.gpus_per_node, args.device, budget):
        results.append(result)
        print(memory_row(result, widths))
    print()
    for line in communication_table(results, widths[0]):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "layout": layout.record(), "roles": results}, f, indent=1)
        print(f"wrote {args.json}")
    fits = all(r["fits"] for r in results)
    print(f"fits within {allowance}: {'yes' if fits else 'no'}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
