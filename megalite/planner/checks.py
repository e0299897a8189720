"""Whether megalite accepts a planned layout (:func:`check_layout`): its validation, judged for
the target cluster rather than this machine. Part of the planner (:mod:`megalite.planner`)."""
from __future__ import annotations

import dataclasses

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, validate
from megalite.context_parallel.checks import check_context_parallel
from megalite.planner.types import Hardware, Layout, UpdatePlan


def check_layout(m: ModelConfig, layout: Layout, global_batch: int, micro: int, hw: Hardware,
                 update: UpdatePlan = UpdatePlan()) -> str | None:
    """None if megalite's validation accepts the layout, else its message (the reason).

    The layout is judged for the target cluster, not this machine: the attention backend is
    set to torch (its local availability is not the question), and CP is folded into the
    world (CP ranks replaced by a world CP times smaller: the same DP) after checking the
    two CP rules here (sequence in 2 CP chunks; under SP, s/CP divisible by TP) and megalite's
    rules of the CP type (:func:`check_context_parallel`: a2a needs the heads per TP rank
    divisible by CP, a2a+p2p by its inner size A), with the attention dropout the planned flags
    set under CP (0). ``update``: the update rule the run trains with (Muon refuses ZeRO-3). An
    interleaved layout is checked with its --num-layers-per-virtual-pipeline-stage (the layers
    divide into PP x V chunks, the micro-batches into groups of PP)."""
    s, cp, tp = m.seq_length, layout.cp, layout.tp
    if cp > 1 and s % (2 * cp):
        return (f"--seq-length ({s}) must be divisible by 2 * --context-parallel-size ({2 * cp}): the "
                f"load-balanced causal split cuts each sequence into 2*CP equal chunks.")
    if cp > 1 and layout.sp and (s // cp) % tp:
        return f"--seq-length / CP ({s // cp}) must be divisible by TP ({tp}) for sequence parallelism."
    if cp > 1 and m.num_attention_heads % tp == 0:  # else validate() names the TP rule below
        try:
            check_context_parallel(dataclasses.replace(m, cp_comm_type=layout.cp_comm_type, attention_dropout=0.0),
                                   layout.parallel_config())
        except ConfigError as e:
            return str(e)
    ep = layout.ep
    if cp > 1 and ep > 1:  # the EP rule on the unfolded stage (TP*CP*DP ranks), then EP 1 for the rest
        if (tp * cp * layout.dp) % ep or (m.num_experts or 1) % ep:
            return (f"--expert-model-parallel-size ({ep}) must divide --num-experts ({m.num_experts}) and the "
                    f"ranks of one pipeline stage, TP*CP*DP = {tp * cp * layout.dp}.")
        ep = 1
    model = dataclasses.replace(m, attention_backend="torch", fused_kernels=False)
    folded = dataclasses.replace(layout.parallel_config(m.num_layers), context_parallel_size=1,  # CP folded into the world
                                 hierarchical_context_parallel_sizes=None, expert_model_parallel_size=ep)
    cfg = Config(model, folded,
                 TrainConfig(micro_batch_size=micro, global_batch_size=global_batch, zero_stage=layout.zero,
                             optimizer=update.optimizer, muon_tp_mode=update.muon_tp_mode,
                             muon_num_ns_steps=update.muon_num_ns_steps, muon_split_qkv=update.muon_split_qkv),
                 DataConfig(mock_data=True))
    try:
        validate(cfg, hw.world_size // cp, hw.gpus_per_node)
    except ConfigError as e:
        return str(e)
    return None
