#!/usr/bin/env python
"""Plan a parallel layout: memory per GPU, pipeline bubble and communication of every
candidate (TP, PP, DP, CP, ZeRO stage, recomputation), and a recommendation in plain words.

The arithmetic (and its sources) is in ``megalite/planner.py``, the search and the ranking in
``megalite/layout_search.py``. Memory per GPU = weights +
gradients + fp32 master and Adam state under the layout's ZeRO stage + activations of the
micro-batches in flight (+ ZeRO-3's gathered layers), against the GPU memory less a headroom.

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
from megalite.moe.settings import moe_layers, parse_layer_freq  # noqa: E402
from megalite.layout_search import plan  # noqa: E402
from megalite.planner import GiB, Hardware, precision, total_parameters  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (megalite / Megatron-LM flag names)")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4*hidden (SwiGLU: ~8/3*hidden)")
    g.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, required=True)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g = p.add_argument_group("mixture of experts (planned with every expert-parallel size EP dividing E and TP*CP*DP)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=str, default="1", help="every N-th layer is MoE, or a 0/1 list [1,0,1,0]")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu-memory-gb", type=float, required=True, help="per GPU, as on the spec sheet (GiB)")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--nvlink-gbps", type=float, default=450.0, help="GB/s per GPU inside a node")
    g.add_argument("--ib-gbps", type=float, default=50.0, help="GB/s per GPU across nodes")
    g.add_argument("--headroom", type=float, default=0.10,
                   help="fraction of GPU memory kept free (CUDA context, fragmentation, workspaces)")
    g = p.add_argument_group("precision and options")
    g.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="bf16/fp16: mixed precision with fp32 master weights and Adam (16 bytes/param)")
    g.add_argument("--fp32-grads", action="store_true",
                   help="4-byte gradient buffers (megalite's default with --bf16: 18 bytes/param)")
    g.add_argument("--flash-attention", action="store_true",
                   help="the attention kernel never stores the s x s scores (flash-attn, SDPA, Triton)")
    g.add_argument("--max-context-parallel", type=int, default=8, help="largest CP considered")
    g.add_argument("--top", type=int, default=15, help="rows of the table of layouts that fit")
    g.add_argument("--json", default=None, help="write the whole plan (every candidate) as JSON")
    g.add_argument("--verify", type=int, default=0, metavar="K",
                   help="dry-run the first K fitting layouts (tools/dry_run.py: one rank per pipeline "
                        "stage on meta tensors) and print measured peak memory next to the estimate")
    return p


def model_from_args(a) -> ModelConfig:
    moe = {}
    if a.num_experts:
        moe = dict(num_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
                   moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_layer_freq=parse_layer_freq(a.moe_layer_freq),
                   moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size)
    return ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       ffn_hidden_size=a.ffn_hidden_size, num_query_groups=a.num_query_groups,
                       vocab_size=a.vocab_size, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                       seq_length=a.seq_length, max_position_embeddings=a.max_position_embeddings,
                       position_embedding_type=a.position_embedding_type, normalization=a.normalization,
                       swiglu=a.swiglu, add_bias_linear=not a.disable_bias_linear,
                       untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights, **moe)


def table(estimates, usable: float) -> list[str]:
    experts = any(e.layout.ep > 1 for e in estimates)
    head = (f"{'TP':>3} {'PP':>3} {'CP':>3} {'DP':>4} " + (f"{'EP':>3} " if experts else "")
            + f"{'ZeRO':>4} {'recompute':>9} | {'total':>6} {'weights':>7} "
            f"{'grads':>6} {'m+Adam':>6} {'activ':>6} {'bufs':>5} | {'M':>4} {'bubble':>6} | comm ms/step "
            f"(N = NVLink, I = InfiniBand)")
    rows = [head, "-" * len(head)]
    for e in estimates:
        lay, mem = e.layout, e.memory
        comm = " ".join(f"{k.upper()} {c['seconds'] * 1e3:.0f}{c['link'][0]}" for k, c in e.comm.items())
        rows.append(f"{lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.dp:>4} " + (f"{lay.ep:>3} " if experts else "")
                    + f"{lay.zero:>4} {lay.recompute:>9} | "
                    f"{mem['total'] / GiB:>6.1f} {mem['weights'] / GiB:>7.1f} {mem['gradients'] / GiB:>6.1f} "
                    f"{mem['master_and_optimizer'] / GiB:>6.1f} {mem['activations'] / GiB:>6.1f} "
                    f"{mem['buffers'] / GiB:>5.1f} | {e.num_micro:>4} {e.bubble:>6.1%} | {comm or '-'}")
    rows.append(f"(GiB per GPU on the fullest pipeline stage; {usable / GiB:.1f} GiB usable)")
    return rows


def verify(a, m, estimates) -> None:
    """Dry-run each layout (one rank per role, meta tensors) and compare its peak with the estimate."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for dry_run
    from dry_run import measure_layout

    from megalite.arguments import build_parser as pretrain_parser, config_from_args

    print("\nverified by a dry run (one iteration per pipeline stage on meta tensors; the estimate with\n"
          "flash-style attention, as the dry run and a GPU run it):")
    for e in estimates:
        lay = e.layout
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in (
            ("num_layers", m.num_layers), ("hidden_size", m.hidden_size), ("num_attention_heads", m.num_attention_heads),
            ("ffn_hidden_size", m.ffn_hidden_size), ("num_query_groups", m.num_query_groups),
            ("seq_length", m.seq_length), ("max_position_embeddings", m.max_position_embeddings),
            ("vocab_size", m.vocab_size), ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
            ("normalization", m.normalization), ("position_embedding_type", m.position_embedding_type),
            ("global_batch_size", a.global_batch_size), ("micro_batch_size", a.micro_batch_size),
            ("tensor_model_parallel_size", lay.tp), ("pipeline_model_parallel_size", lay.pp),
            ("context_parallel_size", lay.cp), ("zero_stage", lay.zero))]
        if m.num_experts:
            flags += [f"--{k.replace('_', '-')}={v}" for k, v in (
                ("num_experts", m.num_experts), ("moe_router_topk", m.moe_router_topk),
                ("moe_ffn_hidden_size", m.moe_ffn_hidden_size),
                ("moe_layer_freq", json.dumps(m.moe_layer_freq).replace(" ", "")),
                ("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
                ("expert_model_parallel_size", lay.ep)) if v is not None]
        flags += [f for f, on in (("--swiglu", m.swiglu), ("--disable-bias-linear", not m.add_bias_linear),
                                  ("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights),
                                  ("--sequence-parallel", lay.sp), (f"--{a.precision}", a.precision != "fp32"),
                                  ("--no-accumulate-allreduce-grads-in-fp32", not a.fp32_grads))
                  if on]
        flags += ["--mock-data", "--overlap-grad-reduce", "--attention-dropout", "0", "--hidden-dropout", "0"]
        flags += [] if lay.recompute == "none" else ["--recompute-granularity", lay.recompute]
        config = config_from_args(pretrain_parser().parse_args(flags), m.vocab_size)
        from megalite.config import validate
        from megalite.parallel.grid import GridLayout

        world = lay.tp * lay.pp * lay.cp * lay.dp
        validate(config, world, a.gpus_per_node)
        grid = GridLayout.from_config(config.parallel, world, experts=bool(m.num_experts))
        results = list(measure_layout(flags, config, grid, a.gpus_per_node))
        worst = max(results, key=lambda r: r["measured_bytes"])  # the fullest stage, as in the estimate
        print(f"  {lay.describe():<48} estimated {worst['planned_bytes'] / GiB:7.2f} GiB, measured "
              f"{worst['measured_bytes'] / GiB:7.2f} GiB ({worst['role']}, {100 * worst['difference']:+.1f}%)")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    m = model_from_args(a)
    hw = Hardware(a.gpu_memory_gb, a.gpus_per_node, a.nodes, a.nvlink_gbps, a.ib_gbps, a.headroom)
    prec = precision(a.precision, a.fp32_grads)
    result = plan(m, hw, a.global_batch_size, a.micro_batch_size, prec, a.flash_attention, a.max_context_parallel)
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
          f"{prec.name}" + (" (fp32 gradients)" if a.fp32_grads else ""))
    if not result.estimates:
        print("\nmegalite refuses every layout for this model and cluster:", file=sys.stderr)
        for reason in sorted(set(result.invalid.values()))[:8]:
            print(f"  - {reason}", file=sys.stderr)
        return 2
    print()
    for line in result.reasons:
        print(line)
    fitting = result.fitting()
    print(f"\n{len(fitting)} of {len(result.estimates)} valid layouts fit ({len(result.invalid)} refused by "
          f"megalite's validation); the first {min(a.top, len(fitting))} in the practitioners' order:")
    for row in table(fitting[: a.top], hw.usable_bytes):
        print(row)
    refused = {}  # one example per rule (the message with its numbers taken out)
    for layout, reason in result.invalid.items():
        refused.setdefault(re.sub(r"\d+", "N", reason), (layout, reason.split(" Fix:")[0]))
    if refused:
        print("\nrefused by megalite's validation (one example per rule):")
        for layout, reason in refused.values():
            print(f"  {layout.describe()}: {reason}")
    if a.verify:
        verify(a, m, fitting[: a.verify])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": vars(m), "hardware": vars(hw), "precision": vars(prec),
                       "global_batch_size": a.global_batch_size, "micro_batch_size": a.micro_batch_size,
                       "model_parameters": total_parameters(m),
                       "recommendation": result.choice.to_dict() if result.choice else None,
                       "reasons": result.reasons, "candidates": [e.to_dict() for e in result.estimates],
                       "refused": [{"layout": vars(k), "reason": v} for k, v in result.invalid.items()]},
                      f, indent=1)
        print(f"plan written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
