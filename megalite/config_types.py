"""The run's model, layout, training and data settings: plain dataclasses on the ground floor.

Each field is defined once, with its Megatron flag, default, help and whether a checkpoint
fixes it (:mod:`megalite.flag_spec`): the parser of ``pretrain_gpt.py`` (:mod:`megalite.arguments`),
the checkpoint's fixed settings (:mod:`megalite.checkpoint.settings`) and the planner's printed
flags are derived from these marks. The rules between settings live floors above, in
:func:`megalite.config.validate` (which re-exports these names and asks each layer's own check);
here only the rules of the (tp, cp, dp, pp) grid (:func:`validate_layout`), which the grid applies.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from megalite.context_parallel.comm_types import CP_COMM_TYPES
from megalite.errors import ConfigError  # noqa: F401 - defined on the ground floor, used here and re-exported
from megalite.flag_spec import NO_FLAG, flag, setting

MOE = "mixture of experts (megalite.moe)"


def mtp_depths(m) -> int:
    """D, the multi-token prediction depths of model config ``m`` (``--mtp-num-layers``; 0 without
    them): the one reading of the setting, for the model, its counting and the MoE layer pattern."""
    return getattr(m, "mtp_num_layers", None) or 0


def llama3_rope_scaling(factor: float = 8.0) -> dict:
    """Megatron's --use-rope-scaling: the Llama 3.1 schedule (see megalite.layers.rotary)."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def yarn_rope_scaling(factor: float = 1.0, original_max_position_embeddings: int = 4096, beta_fast: float = 32.0,
                      beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                      truncate: bool = True) -> dict:
    """Megatron's --rope-type yarn (DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1), in Hugging
    Face's ``rope_scaling`` keys (see megalite.layers.rotary)."""
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            "truncate": truncate}


def _read_rope_scaling(ns: argparse.Namespace) -> dict | None:
    """rope_scaling from --use-rope-scaling (llama3) or --rope-type yarn and its flags."""
    if ns.rope_type == "yarn":
        if ns.use_rope_scaling:
            raise ConfigError("--use-rope-scaling (Llama 3.1's schedule) and --rope-type yarn both scale the RoPE "
                              "frequencies. Fix: give one of them.")
        return yarn_rope_scaling(ns.rotary_scaling_factor, ns.yarn_original_max_position_embeddings,
                                 ns.yarn_beta_fast, ns.yarn_beta_slow, ns.mscale, ns.mscale_all_dim,
                                 ns.yarn_correction_range_round_to_int)
    return llama3_rope_scaling(ns.rope_scaling_factor) if ns.use_rope_scaling else None


@dataclass
class ModelConfig:
    num_layers: int = setting(4, fixed=True)
    hidden_size: int = setting(128, fixed=True)
    num_attention_heads: int = setting(4, fixed=True)
    # default 4*hidden (GPT-2); 8/3*hidden rounded for SwiGLU
    ffn_hidden_size: int | None = setting(None, "default 4*hidden (SwiGLU: ~8/3*hidden)", fixed=True, type=int)
    # grouped-query attention; None = multi-head (= heads)
    num_query_groups: int | None = setting(None, "grouped-query attention", fixed=True, type=int)
    # tokenizer vocabulary (before padding); the flag is read for --mock-data / NullTokenizer only
    vocab_size: int = setting(4096, "vocabulary size (--mock-data / NullTokenizer); otherwise from the tokenizer",
                              fixed=True, type=int, flag_default=None)
    make_vocab_size_divisible_by: int = setting(128)
    seq_length: int = setting(128)
    max_position_embeddings: int | None = setting(None, "default: --seq-length", fixed=True, type=int)
    position_embedding_type: str = setting("learned_absolute", fixed=True, choices=["learned_absolute", "rope"])
    rotary_base: float = setting(10000.0, fixed=True)
    normalization: str = setting("LayerNorm", fixed=True, choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = setting(1e-5, fixed=True)
    swiglu: bool = setting(False, fixed=True)
    add_bias_linear: bool = setting(True, fixed=True, flags=[flag("--disable-bias-linear", action="store_true")],
                                    read=lambda ns: not ns.disable_bias_linear)
    # bias on the q/k/v projection even without add_bias_linear (Qwen2)
    add_qkv_bias: bool = setting(False, "bias on the q/k/v projection even with --disable-bias-linear (Qwen2)",
                                 fixed=True)
    # Qwen3: the model's norm over each head's q and k before RoPE (one head_dim weight each, shared
    # by the heads; see megalite.model.attention)
    qk_layernorm: bool = setting(False, "normalize each attention head's query and key before RoPE (the "
                                 "--normalization, RMSNorm for Qwen3; eps --norm-epsilon)", fixed=True)
    # the head size apart from hidden/heads (Qwen3-0.6B: hidden 1024, 16 heads of 128); None = hidden/heads
    kv_channels: int | None = setting(None, "attention head size (default hidden/heads); the attention width "
                                      "heads*kv-channels may differ from the hidden size", fixed=True, type=int)
    # RoPE frequency scaling: None, Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} or YaRN's (yarn_rope_scaling)
    # (see megalite.layers.rotary)
    rope_scaling: dict | None = setting(
        None, fixed=True,
        flags=[flag("--use-rope-scaling", action="store_true",
                    help="Llama 3.1 RoPE frequency scaling (original context 8192, low/high freq factors 1/4)"),
               flag("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling"),
               flag("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                    help="yarn: YaRN RoPE scaling (DeepSeek-V3) with the --rotary-scaling-factor, --yarn-* "
                         "and --mscale* flags; rope (or none): plain RoPE"),
               flag("--rotary-scaling-factor", type=float, default=1.0,
                    help="YaRN context factor s (DeepSeek-V3: 40)"),
               flag("--yarn-original-max-position-embeddings", type=int, default=4096,
                    help="YaRN: the context the model was first trained on"),
               flag("--yarn-beta-fast", type=float, default=32.0,
                    help="YaRN: pairs turning more often than this over the original context keep their frequency"),
               flag("--yarn-beta-slow", type=float, default=1.0,
                    help="YaRN: pairs turning less often than this are slowed by the factor"),
               flag("--mscale", type=float, default=1.0,
                    help="YaRN: cos/sin times mscale(s, mscale)/mscale(s, mscale-all-dim), "
                         "mscale(s, m) = 0.1 m ln s + 1"),
               flag("--mscale-all-dim", type=float, default=0.0,
                    help="YaRN: softmax scale times mscale(s, mscale-all-dim)^2 (0: none)"),
               flag("--yarn-correction-range-round-to-int", action=argparse.BooleanOptionalAction, default=True,
                    help="YaRN: round the ramp's ends out to whole pair indices")],
        read=_read_rope_scaling)
    untie_embeddings_and_output_weights: bool = setting(False, fixed=True)
    # DeepSeek-V3's Multi-head Latent Attention (megalite.model.mla; Megatron's flags and defaults)
    multi_latent_attention: bool = setting(False, "Multi-head Latent Attention (DeepSeek-V2/V3): queries, keys "
                                           "and values from low-rank latents, a decoupled shared RoPE key",
                                           fixed=True)
    q_lora_rank: int | None = setting(None, "MLA: rank of the query latent (default: no query compression)",
                                      fixed=True, type=int)
    kv_lora_rank: int = setting(32, "MLA: rank of the key/value latent", fixed=True)
    qk_head_dim: int = setting(128, "MLA: each query/key head's part without RoPE", fixed=True)
    qk_pos_emb_head_dim: int = setting(64, "MLA: each query/key head's RoPE part (the shared RoPE key's size)",
                                       fixed=True)
    v_head_dim: int = setting(128, "MLA: each value head's size", fixed=True)
    # DeepSeek-V3's multi-token prediction (megalite.model.mtp; Megatron's flags and defaults)
    mtp_num_layers: int | None = setting(None, "multi-token prediction: D extra blocks on the last stage, depth k "
                                         "predicting token t+k+1 (default: none)", fixed=True, type=int)
    mtp_loss_scaling_factor: float = setting(0.1, "multi-token prediction: the loss is L_main + factor / D * "
                                             "sum of the D depths' losses")
    # the attention part of every layer, by its registered name (megalite.layers.attention_kinds;
    # "self": softmax self-attention); its weights differ, so a checkpoint fixes it. No flag yet (issue 38).
    attention_kind: str = setting("self", "the attention part's registered name", fixed=True, flags=NO_FLAG)
    hidden_dropout: float = setting(0.1)
    attention_dropout: float = setting(0.1)
    init_method_std: float = setting(0.02)
    attention_backend: str = setting("auto", "auto: the fastest exact backend for each call (triton on a GPU, "
                                     "torch on a CPU)", choices=["auto", "triton", "flash", "torch"])
    fused_kernels: bool = setting(False, "Triton LayerNorm/RMSNorm and cross-entropy")
    recompute_granularity: str | None = setting(None, "recompute activations in backward: full layers, or only "
                                                "core attention", choices=["full", "selective"])
    # full: "uniform" (groups of N layers) or "block" (first N)
    recompute_method: str = setting("uniform", choices=["uniform", "block"])
    recompute_num_layers: int = setting(1)
    # context-parallel attention: p2p (ring), a2a (Ulysses), allgather, a2a+p2p (hierarchical);
    # see megalite.context_parallel.attention. Changes no weight, so a resume may switch it.
    cp_comm_type: str = setting("p2p", "context-parallel attention: p2p ring, a2a (Ulysses, heads/TP divisible "
                                "by CP), allgather of K/V, or a2a+p2p (all-to-all inside, ring across)",
                                group="parallelism", choices=list(CP_COMM_TYPES))
    # Mixture of experts (megalite.moe; Megatron's --num-experts, --moe-* flags). None = dense.
    num_experts: int | None = setting(None, "experts per MoE layer (default: a dense model)", fixed=True,
                                      group=MOE, type=int)
    moe_router_topk: int = setting(2, "experts each token is routed to", fixed=True, group=MOE)
    moe_ffn_hidden_size: int | None = setting(None, "each expert's FFN size (default --ffn-hidden-size)",
                                              fixed=True, group=MOE, type=int)
    # every N-th layer is MoE (0, N, 2N, ...), or a 0/1 list per layer (the flag's text as given)
    moe_layer_freq: int | list = setting(1, "N: layers 0, N, 2N, ... are MoE; or a 0/1 list per layer such as "
                                         "[1,0,1,0]", fixed=True, group=MOE, type=str, flag_default="1")
    moe_router_load_balancing_type: str = setting("aux_loss", "aux_loss (Switch/GShard load-balancing loss) or "
                                                  "none", group=MOE, type=str)
    moe_aux_loss_coeff: float = setting(0.0, "weight of the load-balancing loss", group=MOE)
    moe_z_loss_coeff: float | None = setting(None, "weight of the router z-loss (ST-MoE)", group=MOE, type=float)
    moe_expert_capacity_factor: float | None = setting(  # None = dropless
        None, "each expert keeps at most factor * tokens * topk / experts assignments (default: dropless)",
        group=MOE, type=float)
    moe_shared_expert_intermediate_size: int | None = setting(  # a dense expert every token also takes
        None, "FFN size of a dense shared expert every token also takes (DeepSeek / Qwen-MoE)", fixed=True,
        group=MOE, type=int)
    moe_grouped_gemm: bool = setting(False, "the experts' matmuls as one Triton grouped GEMM", group=MOE)
    # DeepSeek-V3 routing (megalite.moe.router, megalite.moe.balancing); Megatron's names and defaults
    moe_router_score_function: str = setting("softmax", "router scores: softmax over the experts, or each "
                                             "expert's sigmoid (DeepSeek-V3)", fixed=True, group=MOE,
                                             choices=["softmax", "sigmoid"])
    moe_router_num_groups: int | None = setting(None, "group-limited routing: the experts split into this many "
                                                "groups (DeepSeek-V3's node-limited routing)", fixed=True, group=MOE,
                                                type=int)
    moe_router_group_topk: int | None = setting(None, "group-limited routing: the groups each token may use, "
                                                "those with the best sum of their top-2 scores", fixed=True, group=MOE,
                                                type=int)
    moe_router_topk_scaling_factor: float | None = setting(None, "the top-k weights times this factor (DeepSeek-V3's "
                                                           "routed scaling factor; default 1)", fixed=True,
                                                           group=MOE, type=float)
    moe_router_enable_expert_bias: bool = setting(False, "aux-loss-free balancing: a per-expert bias added to the "
                                                  "scores for the selection only, nudged after each step",
                                                  fixed=True, group=MOE)
    moe_router_bias_update_rate: float = setting(1e-3, "the expert bias's step: bias += rate * sign(mean load - "
                                                 "load)", group=MOE)
    # megalite has one dispatcher; the flag is Megatron's and accepted for its command lines
    moe_token_dispatcher_type: str = setting("alltoall", "tokens travel to their experts by all-to-all over the "
                                             "expert-parallel group", group=MOE, choices=["alltoall"])
    # transformer-engine and FP8 (megalite.layers.transformer_engine; Megatron's flags)
    transformer_impl: str = setting("local", "megalite's own layers, or transformer-engine's (a GPU with "
                                    "transformer-engine)", choices=["local", "transformer_engine"])
    fp8_format: str | None = setting(None, "FP8 training through transformer-engine (delayed scaling)",
                                     choices=["e4m3", "hybrid"])
    fp8_amax_history_len: int = setting(1)
    fp8_amax_compute_algo: str = setting("most_recent", choices=["most_recent", "max"])
    # TE userbuffers: TP all-gathers / reduce-scatters inside the GEMMs
    tp_comm_overlap: bool = setting(False, "overlap TP communication with the GEMMs (transformer-engine "
                                    "userbuffers; TP > 1 with SP)")
    tp_comm_bootstrap_backend: str = setting("nccl", "backend that sets up the userbuffers of --tp-comm-overlap",
                                             choices=["nccl", "mpi", "gloo"])

    def __post_init__(self):
        if self.ffn_hidden_size is None and self.hidden_size > 0:
            if self.swiglu:
                # Keep the parameter count of a 4h GELU MLP: 2/3 * 4h, rounded up to 64.
                self.ffn_hidden_size = ((int(8 * self.hidden_size / 3) + 63) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_experts and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """Each head's size: ``kv_channels``, else hidden/heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The size RoPE rotates per head: the head size, or MLA's decoupled RoPE part."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim


    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP``.

        Padding rows exist so the embedding splits evenly over TP; their logits are
        masked to -inf, so a padding id is never predicted.
        """
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = setting(1)
    pipeline_model_parallel_size: int = setting(1)
    context_parallel_size: int = setting(1)
    num_layers_per_virtual_pipeline_stage: int | None = setting(None, type=int)
    sequence_parallel: bool = setting(False)
    # a2a+p2p: (A, B), all-to-all over A consecutive CP ranks, the ring over B of them; A*B = CP
    hierarchical_context_parallel_sizes: tuple[int, int] | None = setting(
        None, "with --cp-comm-type a2a+p2p: all-to-all over A consecutive CP ranks, ring over B; "
        "A*B = --context-parallel-size", type=int, nargs=2, metavar=("A", "B"),
        read=lambda ns: tuple(ns.hierarchical_context_parallel_sizes) if ns.hierarchical_context_parallel_sizes
        else None)
    # experts split over this many ranks of one stage
    expert_model_parallel_size: int = setting(1, "experts split over this many ranks of each pipeline stage "
                                              "(carved out of TP x CP x DP)", group=MOE)
    # only 1: each expert whole on its rank (see megalite.moe)
    expert_tensor_parallel_size: int = setting(1, "only 1: each expert whole on its rank", group=MOE)

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size


def _zero_stage(ns) -> int:
    """``--use-distributed-optimizer`` is Megatron's name for ZeRO-1 (a stage given beside it wins)."""
    return 1 if ns.use_distributed_optimizer and ns.zero_stage == 0 else ns.zero_stage


@dataclass
class TrainConfig:
    micro_batch_size: int = setting(4)
    global_batch_size: int | None = setting(None, "default: micro batch x DP", type=int)
    train_iters: int = setting(100)
    lr: float = setting(3e-4)
    min_lr: float = setting(0.0)
    lr_warmup_iters: int = setting(0)
    lr_decay_iters: int | None = setting(None, "default: --train-iters", type=int)
    lr_decay_style: str = setting("cosine", choices=["cosine", "linear", "constant"])
    weight_decay: float = setting(0.01)
    clip_grad: float = setting(1.0)
    # the update rule, by its registered name (megalite.data_parallel.update_rule.rule_named;
    # Megatron's names: "adam" is AdamW, "muon" Muon); validate() refuses a name not registered
    optimizer: str = setting("adam", "the update rule by its registered name: adam (AdamW) or muon (Muon for the "
                             "hidden matrices, AdamW for the rest); a rule registered in code by its name", type=str)
    # Muon (megalite.data_parallel.muon; chosen by optimizer="muon"): Megatron-LM's flags and defaults
    muon_momentum: float = setting(0.9, "Muon's momentum coefficient beta (m <- beta m + (1 - beta) g)")
    muon_split_qkv: bool = setting(True, "orthogonalise a fused QKV weight per q, k, v (off: as one matrix)",
                                   flags=[flag("--muon-no-split-qkv", action="store_true",
                                               help="orthogonalise a fused QKV weight as one matrix")],
                                   read=lambda ns: not ns.muon_no_split_qkv)
    muon_use_nesterov: bool = setting(False, "Nesterov momentum in Muon (orthogonalise (1 - beta) g + beta m)")
    muon_scale_mode: str = setting("spectral", "the orthogonalised update's scale: spectral sqrt(max(m, n)), "
                                   "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n))",
                                   choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_fp32_matmul_prec: str = setting("medium", "fp32 matmul precision of the Newton-Schulz products "
                                         "(torch.set_float32_matmul_precision)", choices=["low", "medium", "high"])
    muon_num_ns_steps: int = setting(5, "Newton-Schulz iterations")
    muon_tp_mode: str = setting("blockwise", "Newton-Schulz of a TP-split matrix: blockwise (each rank's shard, "
                                "a different update), duplicated (gathered, every rank), distributed",
                                choices=["blockwise", "duplicated", "distributed"])
    muon_extra_scale_factor: float = setting(1.0, "a factor on every Muon update (0.2 with spectral: "
                                             "AdamW's update RMS, so its lr and decay carry over)")
    # QK-clip (megalite.model.qk_clip; MuonClip with --optimizer muon): Megatron-LM's flags and defaults
    qk_clip: bool = setting(False, "after each step, shrink the query and key weights of every head (GQA: group) "
                                   "whose largest attention logit of the step exceeded --qk-clip-threshold")
    qk_clip_threshold: float = setting(100.0, "QK-clip's tau: eta = min(1, tau / max logit); the query weights "
                                              "take eta^alpha, the key weights eta^(1 - alpha)")
    qk_clip_alpha: float = setting(0.5, "QK-clip's balance alpha between the query (eta^alpha) and key "
                                        "(eta^(1 - alpha)) weights")
    log_max_attention_logit: bool = setting(False, "log the model's largest attention logit of each step "
                                                   "(max_attention_logit; always with --qk-clip)")
    adam_beta1: float = setting(0.9)
    adam_beta2: float = setting(0.999)
    adam_eps: float = setting(1e-8)
    seed: int = setting(1234)
    bf16: bool = setting(False)
    fp16: bool = setting(False)
    loss_scale: float | None = setting(None, "fp16 static loss scale (default dynamic)", type=float)
    initial_loss_scale: float = setting(2.0**16)
    # 0 DDP, 1 optimizer state, 2 + gradients, 3 + weights sharded over DP
    zero_stage: int = setting(
        0, group="parallelism", read=_zero_stage,
        flags=[flag("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                    help="0 DDP; 1 shard optimizer state + master weights; 2 + gradients; 3 + weights"),
               flag("--use-distributed-optimizer", action="store_true", help="Megatron's name for --zero-stage 1")])
    overlap_grad_reduce: bool = setting(False, "start each gradient bucket's reduction during backward",
                                        group="parallelism")
    ddp_bucket_size: int = setting(40_000_000, "parameters per gradient bucket", group="parallelism")
    # optimizer state and step on the CPU (stages 1, 2)
    offload_optimizer: bool = setting(False, "optimizer state and step on the CPU", group="parallelism")
    accumulate_allreduce_grads_in_fp32: bool | None = setting(  # default: True with --bf16/--fp16
        None, "fp32 gradient buffers (default: on with --bf16/--fp16)", group="parallelism",
        action=argparse.BooleanOptionalAction)
    # gpipe, zb-h1, zbv (megalite.pipeline.op_lists); V > 1: interleaved. Its choices are the
    # schedule table's (megalite.pipeline.schedule_kinds, a floor above: the parser supplies them).
    pipeline_schedule: str = setting("1f1b", "with PP > 1 and no virtual stages; gpipe = all forward, then all "
                                     "backward; zb-h1 / zbv = zero-bubble (backward split into input and weight "
                                     "gradients, zbv with two chunks per rank in a V; docs/pipeline.md)",
                                     group="parallelism", choices=None)  # choices: the parser's
    log_interval: int = setting(1, group="logging and outputs")
    eval_interval: int = setting(1000, group="logging and outputs")
    eval_iters: int = setting(10, group="logging and outputs")


@dataclass
class DataConfig:
    # prefix of a .bin/.idx pair from tools/preprocess_data.py, or a blend's --data-path
    # values: weights and prefixes, ["0.7", "A", "0.3", "B"] (see megalite/data/blended.py)
    data_path: str | list[str] | None = setting(None, "prefix of a .bin/.idx pair, or a blend: weights and "
                                                "prefixes (0.7 A 0.3 B; weights are normalized)",
                                                type=str, nargs="+")
    mock_data: bool = setting(False)
    split: str = setting("969,30,1", "train,valid,test by documents (of each dataset of a blend)")
    # None on the command line: NullTokenizer with --mock-data, else SentencePieceTokenizer (pretrain)
    tokenizer_type: str | None = setting(None, type=str, choices=["SentencePieceTokenizer",
                                                                  "GPTSentencePieceTokenizer",
                                                                  "HuggingFaceTokenizer", "NullTokenizer"])
    tokenizer_model: str | None = setting(None, "SentencePiece .model file; for HuggingFaceTokenizer a local "
                                          "folder holding tokenizer.json", type=str)
    # Packed documents (Megatron's flags; megalite/data/packing.py): positions restart after
    # each EOD token, attention stops at documents, no loss where the input is EOD.
    reset_position_ids: bool = setting(False, "position ids restart at 0 after each end-of-document (EOD) token")
    reset_attention_mask: bool = setting(False, "attention stops at document boundaries (EOD tokens) inside a "
                                         "sequence")
    eod_mask_loss: bool = setting(False, "no loss where the input token is the EOD token")
    eod_token: int | None = None  # the tokenizer's end-of-document id (None: it has none); no flag


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive(name: str, value, fix: str = "") -> None:
    if value is None or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value}. {fix}".rstrip())


def validate_layout(parallel: ParallelConfig, world_size: int, gpus_per_node: int | None = None,
                    num_layers: int | None = None) -> list[str]:
    """Rules of the (tp, cp, dp, pp) grid. Returns warnings (performance only)."""
    tp = parallel.tensor_model_parallel_size
    cp = parallel.context_parallel_size
    pp = parallel.pipeline_model_parallel_size
    _positive("--tensor-model-parallel-size", tp)
    _positive("--context-parallel-size", cp)
    _positive("--pipeline-model-parallel-size", pp)
    _positive("world size", world_size)
    mp = tp * cp * pp
    if world_size % mp != 0:
        raise ConfigError(
            f"world size ({world_size}) must be divisible by TP*CP*PP = {tp}*{cp}*{pp} = {mp}; "
            f"the data-parallel size is world/(TP*CP*PP). Fix: launch a multiple of {mp} "
            f"processes, or choose sizes whose product divides {world_size}."
        )
    warnings = []
    if gpus_per_node is not None and gpus_per_node > 0:
        if tp > gpus_per_node or gpus_per_node % tp != 0:
            warnings.append(
                f"tensor-parallel group of {tp} ranks spans nodes ({gpus_per_node} GPUs per node): "
                f"TP all-reduces run on every layer, forward and backward, and across nodes they "
                f"travel over InfiniBand (~50 GB/s) instead of NVLink (~450 GB/s), typically a "
                f"several-fold slowdown. Fix: keep TP <= {gpus_per_node} and a divisor of it; use "
                f"pipeline or data parallelism across nodes."
            )
    return warnings


