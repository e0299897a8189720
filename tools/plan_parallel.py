#!/usr/bin/env python
"""Plan a parallel layout: memory per GPU, pipeline bubble, communication and estimated step
time of every candidate (TP, PP, DP, CP, ZeRO stage, recomputation), and a recommendation in
plain words: the fastest estimated step that fits (megalite/planner/step_time.py), its terms,
tokens/s, MFU, days to train (--train-tokens) and the runner-up.

The arithmetic (and its sources) is in ``megalite/planner/estimate.py``, the search and the ranking in
``megalite/planner/search.py``. Memory per GPU = weights +
gradients + fp32 master and Adam state under the layout's ZeRO stage + activations of the
micro-batches in flight (+ ZeRO-3's gathered layers), against the GPU memory less a headroom.

Its defaults are pretrain_gpt.py's (read from megalite.arguments.build_parser: fp32 gradient
accumulation under --bf16, dropout 0.1, micro batch 4, ...), and the recommendation is printed as
the exact pretrain_gpt.py flags it assumed, with the tools/dry_run.py command that measures it.

    python tools/plan_parallel.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 4096 --vocab-size 32000 --global-batch-size 64 --micro-batch-size 1 \\
        --gpu-memory-gb 24 --gpus-per-node 8 --nodes 1 [--json plan.json]
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import ModelConfig  # noqa: E402
from megalite.moe.settings import moe_layers  # noqa: E402
from megalite.planner.search import plan, ranked, runner_up  # noqa: E402
from megalite.planner.step_time import days_to_train, mfu, pipeline_imbalance, tokens_per_second  # noqa: E402
from megalite.planner import DEFAULT_HEADROOM, WIRE_MEASURE, GiB, Hardware, precision, total_parameters  # noqa: E402
from megalite.planner.cp import CP_COMM_TYPES, cp_type_name  # noqa: E402
from megalite.planner.hardware import (HARDWARE_FLAGS, ProfileError, hardware_from_flags,  # noqa: E402
                                       known_profiles)
from megalite.planner.documents import plan_lines as document_lines  # noqa: E402
from megalite.planner.flags import add_update_flags, grads_in_fp32, pretrain_flags, training_defaults, update_from_args  # noqa: E402
from megalite.planner.flags import add_model_flags, model_from_args as planned_model  # noqa: E402
from tools.tool_errors import one_line_errors, writable  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    d = training_defaults()  # pretrain_gpt.py's defaults: the one source
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model: pretrain_gpt.py's model flags, names, defaults and help (megalite.planner."
                             "flags; with --num-experts, every expert-parallel size EP dividing E and TP*CP*DP "
                             "is planned)")
    add_model_flags(g)
    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, default=d["micro_batch_size"], help="pretrain_gpt.py's default")
    g = p.add_argument_group("packed documents (Megatron's flags; printed in the recommended flags)")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart in each document")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention within each document only: the report adds the model FLOPs with "
                        "documents of --document-length tokens and the attention FLOPs saved")
    g.add_argument("--document-length", type=int, default=None, metavar="N",
                   help="the typical document length in tokens (with --reset-attention-mask; default: the "
                        "whole sequence); taken as equal documents of N: attention 12 L h N per token")
    g = p.add_argument_group("hardware (each flag below wins over --hardware's figure; without --hardware the "
                             "defaults are an H100 SXM's, megalite.planner.types.Hardware)")
    g.add_argument("--hardware", default=None, metavar="NAME|FILE",
                   help=f"a hardware profile: built-in {known_profiles()} (datasheet figures, sources in "
                        "megalite/planner/hardware.py), or a JSON file tools/calibrate_hardware.py wrote; it fills "
                        "the flags of this group that are not given")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="per GPU, as on the spec sheet (GiB); required without --hardware")
    g.add_argument("--gpus-per-node", type=int, default=None, help="default 8, or the profile's")
    g.add_argument("--nodes", type=int, default=None, help="default 1")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="GB/s per GPU inside a node, one direction "
                   f"(default {Hardware.nvlink_gbps:g}, or the profile's)")
    g.add_argument("--ib-gbps", type=float, default=None,
                   help=f"GB/s per GPU across nodes (default {Hardware.ib_gbps:g}, or the profile's)")
    g.add_argument("--headroom", type=float, default=None,
                   help=f"fraction of GPU memory kept free (CUDA context, fragmentation, workspaces; default "
                        f"{DEFAULT_HEADROOM:g})")
    g.add_argument("--achieved-tflops", type=float, default=None,
                   help="TFLOP/s a GPU achieves in training: the step-time model's compute term, which "
                        "with the bubble and the exposed communication ranks every layout that fits (default "
                        f"{Hardware.achieved_tflops:g}, or the profile's; tools/calibrate_hardware.py measures it)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help=f"dense bf16 TFLOP/s per GPU, MFU's denominator (default {Hardware.peak_tflops:g}, or the "
                        "profile's)")
    g.add_argument("--hbm-gbps", type=float, default=None,
                   help=f"GB/s of device memory per GPU (default {Hardware.hbm_gbps:g}, or the profile's)")
    g.add_argument("--nvlink-latency-us", type=float, default=None,
                   help=f"fixed cost of a collective inside a node (default {Hardware.nvlink_latency_us:g}, or the "
                        "profile's)")
    g.add_argument("--ib-latency-us", type=float, default=None,
                   help=f"fixed cost of a collective across nodes (default {Hardware.ib_latency_us:g}, or the "
                        "profile's)")
    g = p.add_argument_group("update rule: pretrain_gpt.py's flags (the state bytes each keeps; Muon's ZeRO and "
                             "TP collectives in the communication; Muon refuses ZeRO-3)")
    add_update_flags(g)
    g = p.add_argument_group("precision and options")
    g.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="bf16/fp16: mixed precision with fp32 master weights and Adam (16 bytes/param)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", dest="accumulate", action=argparse.BooleanOptionalAction,
                   default=d["accumulate_allreduce_grads_in_fp32"],
                   help="pretrain_gpt.py's flag: fp32 gradient buffers (18 bytes/param), its default with "
                        "--bf16/--fp16; --no-accumulate-allreduce-grads-in-fp32 plans 2-byte gradients (16 "
                        "bytes/param) and prints that flag in the recommendation")
    g.add_argument("--fp32-grads", dest="accumulate", action="store_const", const=True,
                   help="old name of --accumulate-allreduce-grads-in-fp32 (now the default: a no-op)")
    g.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="the attention kernel never stores the s x s scores (flash-attn, SDPA, Triton: what "
                        "--attention-backend auto runs on a GPU, and what the dry run measures); "
                        "--no-flash-attention counts them (the math path)")
    g.add_argument("--max-context-parallel", type=int, default=8, help="largest CP considered")
    g.add_argument("--cp-comm-type", choices=list(CP_COMM_TYPES), default=None,
                   help="fix the context-parallel type (default: search p2p, a2a, allgather and a2a+p2p with "
                        "every inner size, and pick the fastest that fits)")
    g.add_argument("--top", type=int, default=15, help="rows of the table of layouts that fit")
    g.add_argument("--train-tokens", type=float, default=None, metavar="N",
                   help="tokens to train on: the explanation adds the days to train at the estimated step")
    g.add_argument("--json", default=None, help="write the whole plan (every candidate) as JSON")
    g.add_argument("--verify", type=int, default=0, metavar="K",
                   help="dry-run the first K fitting layouts (tools/dry_run.py: one rank per pipeline "
                        "stage on meta tensors) and print measured peak memory next to the estimate")
    return p


def model_from_args(a) -> ModelConfig:
    """The model of the parsed flags, read as pretrain_gpt.py reads them (megalite.planner.flags)."""
    return planned_model(a)


def table(estimates, usable: float) -> list[str]:
    experts = any(e.layout.ep > 1 for e in estimates)
    kinds = any(e.layout.cp > 1 for e in estimates)  # a column for the CP type
    kind = lambda lay: f"{cp_type_name(lay) if lay.cp > 1 else '-':>13} "  # noqa: E731
    pipelined = any(e.layout.pp > 1 for e in estimates)  # a column for the pipeline schedule
    sched = lambda lay: f"{lay.schedule_label if lay.pp > 1 else '-':>8} "  # noqa: E731
    head = (f"{'TP':>3} {'PP':>3} " + (f"{'schedule':>8} " if pipelined else "") + f"{'CP':>3} "
            + (f"{'CP type':>13} " if kinds else "") + f"{'DP':>4} "
            + (f"{'EP':>3} " if experts else "")
            + f"{'ZeRO':>4} {'recompute':>9} | {'total':>6} {'weights':>7} "
            f"{'grads':>6} {'m+Adam':>6} {'activ':>6} {'bufs':>5} | {'M':>4} {'bubble':>6} | {'step s':>8} "
            f"{'exposed':>7} | comm ms/step "
            f"(N = NVLink, I = InfiniBand)")
    rows = [head, "-" * len(head)]
    for e in estimates:
        lay, mem = e.layout, e.memory
        comm = " ".join(f"{k.upper()} {c['seconds'] * 1e3:.0f}{c['link'][0]}" for k, c in e.comm.items())
        rows.append(f"{lay.tp:>3} {lay.pp:>3} " + (sched(lay) if pipelined else "") + f"{lay.cp:>3} "
                    + (kind(lay) if kinds else "") + f"{lay.dp:>4} "
                    + (f"{lay.ep:>3} " if experts else "")
                    + f"{lay.zero:>4} {lay.recompute:>9} | "
                    f"{mem['total'] / GiB:>6.1f} {mem['weights'] / GiB:>7.1f} {mem['gradients'] / GiB:>6.1f} "
                    f"{mem['master_and_optimizer'] / GiB:>6.1f} {mem['activations'] / GiB:>6.1f} "
                    f"{mem['buffers'] / GiB:>5.1f} | {e.num_micro:>4} {e.bubble:>6.1%} | {e.step_seconds:>8.4g} "
                    f"{exposed_ms(e):>5.3g}ms | {comm or '-'}")
    rows.append(f"(GiB per GPU on the fullest pipeline stage; {usable / GiB:.1f} GiB usable; step s: the estimated "
                f"step (megalite/planner/step_time.py), exposed: its communication and latency that compute does not "
                f"hide; comm: the time of the {WIRE_MEASURE.split(':')[0]} on its link, no overlap)")
    return rows


def exposed_ms(e) -> float:
    """The estimated step's communication terms and latency (what nothing hides), in ms."""
    return 1e3 * sum(v for k, v in e.step.items() if k not in ("compute", "bubble", "optimizer"))


def layout_flags(a, m, e) -> list[str]:
    """The exact pretrain_gpt.py flags of a planned layout (what the estimate assumed)."""
    return pretrain_flags(m, e.layout, a.global_batch_size, a.micro_batch_size, a.precision, a.accumulate,
                          a.reset_position_ids, a.reset_attention_mask, update_from_args(a))


def dry_run_command(a, flags: list[str], world: int) -> str:
    return (f"python tools/dry_run.py --world-size {world} --gpus-per-node {a.gpus_per_node} "
            f"--gpu-memory-gb {a.gpu_memory_gb:g} --headroom {a.headroom:g} " + " ".join(flags))


def communication_line(e, results: list[dict]) -> str:
    """The estimate's wire bytes per kind beside the dry run's, measured on a rank of the same
    pipeline stage, both per step per rank in GiB (:data:`megalite.planner.WIRE_MEASURE`)."""
    from tools.dry_run import PLANNER_KIND

    role = next(r for r in results if r["stage"] == e.stage)
    measured = {PLANNER_KIND.get(k, k): v for k, v in role["comm_wire_bytes"].items()}
    pairs = [f"{k.upper()} {c['bytes'] / GiB:.2f} / {measured[k] / GiB:.2f}" if k in measured
             else f"{k.upper()} {c['bytes'] / GiB:.2f} / -" for k, c in e.comm.items()]
    return (f"communication (wire GiB per step per rank, planned / measured on stage {e.stage}): "
            + (", ".join(pairs) or "none"))


def verify(a, m, estimates) -> list[dict]:
    """Dry-run each layout with exactly its printed flags (one rank per role, meta tensors; the
    dry run adds --mock-data as it always does) and compare its peak with the stated estimate."""
    from tools import dry_run  # the repository root is on sys.path (above)

    from megalite.arguments import build_parser as pretrain_parser, config_from_args
    from megalite.config import validate
    from megalite.parallel.grid import GridLayout

    print("\nverified by a dry run (tools/dry_run.py with exactly the flags printed; one iteration per "
          f"pipeline stage on meta tensors); communication in {WIRE_MEASURE}:")
    out = []
    for e in estimates:
        lay = e.layout
        flags = layout_flags(a, m, e)
        config = config_from_args(pretrain_parser().parse_args(flags + ["--mock-data"]), m.vocab_size,
                                  eod_token=dry_run.mock_eod(m.vocab_size))
        world = lay.tp * lay.pp * lay.cp * lay.dp
        validate(config, world, a.gpus_per_node)
        grid = GridLayout.from_config(config.parallel, world, experts=bool(m.num_experts))
        results = list(dry_run.measure_layout(flags + ["--mock-data"], config, grid, a.gpus_per_node))
        worst = max(results, key=lambda r: r["measured_bytes"])  # the fullest stage, as in the estimate
        stated = e.memory["total"]
        diff = (worst["measured_bytes"] - stated) / stated
        print(f"  {lay.describe():<48} stated {stated / GiB:7.2f} GiB, measured "
              f"{worst['measured_bytes'] / GiB:7.2f} GiB ({worst['role']}, {100 * diff:+.1f}%)\n"
              f"    flags: {' '.join(flags)}")
        print(f"    {communication_line(e, results)}")
        out.append({"layout": lay, "flags": flags, "stated_bytes": stated, "measured_bytes": worst["measured_bytes"],
                    "role": worst["role"], "difference": diff})
    return out


def speed_fields(result, train_tokens) -> dict | None:
    """The recommendation's estimated step, its terms, tokens/s, MFU, days to train and the runner-up."""
    e = result.choice
    if e is None:
        return None
    m, gb, step = result.model, result.global_batch, e.step_seconds
    second = runner_up(result)
    return {"seconds": step, "terms": e.step, "pipeline_imbalance": pipeline_imbalance(m, e.layout),
            "tokens_per_second": tokens_per_second(m, gb, step),
            "mfu": mfu(m, gb, step, result.hardware),
            "days_to_train": days_to_train(m, gb, step, train_tokens) if train_tokens else None,
            "runner_up": ({"description": second.layout.describe(), "layout": second.layout.to_dict(),
                           "seconds": second.step_seconds, "margin": second.step_seconds / step - 1,
                           "pipeline_imbalance": pipeline_imbalance(m, second.layout)}
                          if second else None)}


def main(argv=None) -> int:
    parser = one_line_errors(build_parser())
    a = parser.parse_args(argv)
    writable(parser, "--json", a.json)
    if a.document_length is not None and not a.reset_attention_mask:
        parser.error("--document-length N needs --reset-attention-mask (without it every token attends "
                     "the whole sequence)")
    if a.document_length is not None and not 1 <= a.document_length <= a.seq_length:
        parser.error(f"--document-length ({a.document_length}) must be between 1 and --seq-length ({a.seq_length})")
    m = model_from_args(a)
    try:  # a profile's figures, then the flags given (explicit flags win)
        hw = hardware_from_flags(a.hardware, {k: getattr(a, k) for k in HARDWARE_FLAGS})
    except ProfileError as e:
        parser.error(str(e))
    a.gpu_memory_gb, a.gpus_per_node, a.nodes, a.headroom = hw.gpu_memory_gb, hw.gpus_per_node, hw.nodes, hw.headroom
    prec = precision(a.precision, grads_in_fp32(a.precision, a.accumulate), update=update_from_args(a))
    result = plan(m, hw, a.global_batch_size, a.micro_batch_size, prec, a.flash_attention, a.max_context_parallel,
                  a.cp_comm_type, documents=a.reset_attention_mask, train_tokens=a.train_tokens)
    experts = ""
    if m.num_experts:
        experts = (f", {sum(moe_layers(m))} MoE layers x {m.num_experts} experts (FFN {m.moe_ffn_hidden_size}, "
                   f"top-{m.moe_router_topk}" + (f", shared expert {m.moe_shared_expert_intermediate_size}"
                                                  if m.moe_shared_expert_intermediate_size else "") + ")")
    print(f"model: {total_parameters(m) / 1e9:.2f}B parameters, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"{m.num_attention_heads} heads ({m.num_query_groups} KV groups), FFN {m.ffn_hidden_size}"
          f"{' SwiGLU' if m.swiglu else ''}{experts}, vocab {m.vocab_size}, seq {m.seq_length}; global batch "
          f"{a.global_batch_size}, micro batch {a.micro_batch_size}")
    print(f"hardware: {hw.world_size} GPUs = {hw.nodes} node(s) x {hw.gpus_per_node}, {hw.gpu_memory_gb:g} GiB each; "
          f"NVLink {hw.nvlink_gbps:g} GB/s inside a node, InfiniBand {hw.ib_gbps:g} GB/s across; precision "
          f"{prec.name}, {prec.grad_bytes}-byte gradients"
          + (" (pretrain_gpt.py's default)" if a.accumulate is None else ""))
    if not result.estimates:
        reasons = set(result.invalid.values())
        simplest = min(result.invalid, key=lambda lay: (lay.tp * lay.pp * lay.cp * lay.ep, lay.describe()))
        print(f"plan_parallel.py: megalite refuses every layout for this model and cluster ({len(reasons)} "
              f"reason(s)); the simplest layout, {simplest.describe()}: {result.invalid[simplest]}", file=sys.stderr)
        return 2
    if a.reset_attention_mask:
        print("\n".join(document_lines(m, a.document_length or m.seq_length, a.global_batch_size * m.seq_length)))
    print()
    for line in result.reasons:
        print(line)
    if result.choice is not None:
        flags = layout_flags(a, m, result.choice)
        lay = result.choice.layout
        print(f"\nThe recommendation as pretrain_gpt.py flags (every assumption of the estimate; add your data "
              f"flags, or --mock-data):\n  {' '.join(flags)}\nMeasure it first: "
              f"{dry_run_command(a, flags, lay.tp * lay.pp * lay.cp * lay.dp)}")
    fitting = ranked(result.fitting())
    print(f"\n{len(fitting)} of {len(result.estimates)} valid layouts fit ({len(result.invalid)} refused by "
          f"megalite's validation); the first {min(a.top, len(fitting))} by estimated step (ties within 1% in the "
          f"practitioners' order):")
    for row in table(fitting[: a.top], hw.usable_bytes):
        print(row)
    refused = {}  # one example per rule (the message with its numbers taken out)
    for layout, reason in result.invalid.items():
        rule = reason.split(" Fix:")[0]
        refused.setdefault(re.sub(r"\d+", "N", rule), (layout, rule))
    if refused:
        print("\nrefused by megalite's validation (one example per rule):")
        for layout, reason in refused.values():
            print(f"  {layout.describe()}: {reason}")
    if a.verify:
        verify(a, m, fitting[: a.verify])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": vars(m), "hardware": vars(hw), "precision": {**vars(prec), "update": vars(prec.update)},
                       "global_batch_size": a.global_batch_size, "micro_batch_size": a.micro_batch_size,
                       "model_parameters": total_parameters(m),
                       "document_length": (a.document_length or m.seq_length) if a.reset_attention_mask else None,
                       "recommendation": ({**result.choice.to_dict(), "pretrain_flags": layout_flags(a, m, result.choice)}
                                          if result.choice else None),
                       "step_time": speed_fields(result, a.train_tokens),
                       "reasons": result.reasons, "candidates": [e.to_dict() for e in result.estimates],
                       "refused": [{"layout": k.to_dict(), "reason": v} for k, v in result.invalid.items()]},
                      f, indent=1)
        print(f"plan written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
