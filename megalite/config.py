"""Settings as plain dataclasses, and one function that applies every rule.

``validate(config, world_size, gpus_per_node)`` is called before any process group
or model is built. It checks the rules between settings itself and calls down into the
checks each part owns for its own options (attention backends, packed documents,
transformer-engine, context parallelism, MoE), which import nothing from here. Each
violated rule raises :class:`ConfigError` (:mod:`megalite.errors`) whose message
names the values involved, the rule, and a fix. Rules that only cost performance
(a tensor-parallel group that spans nodes) are returned as warnings instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalite.errors import ConfigError  # noqa: F401 - defined on the ground floor, used here and re-exported


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4*hidden (GPT-2); 8/3*hidden rounded for SwiGLU
    num_query_groups: int | None = None  # grouped-query attention; None = multi-head (= heads)
    vocab_size: int = 4096  # tokenizer vocabulary (before padding)
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # bias on the q/k/v projection even without add_bias_linear (Qwen2)
    # RoPE frequency scaling: None, or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (see megalite.layers.rotary)
    rope_scaling: dict | None = None
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    attention_backend: str = "auto"  # auto, triton, flash, torch (see megalite.layers.attention)
    fused_kernels: bool = False  # Triton norms and cross-entropy
    recompute_granularity: str | None = None  # None, "full" or "selective"
    recompute_method: str = "uniform"  # full: "uniform" (groups of N layers) or "block" (first N)
    recompute_num_layers: int = 1
    # context-parallel attention: p2p (ring), a2a (Ulysses), allgather, a2a+p2p (hierarchical);
    # see megalite.context_parallel.attention. Changes no weight, so a resume may switch it.
    cp_comm_type: str = "p2p"
    # Mixture of experts (megalite.moe; Megatron's --num-experts, --moe-* flags). None = dense.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # each expert's FFN size; default ffn_hidden_size
    moe_layer_freq: int | list = 1  # every N-th layer is MoE (0, N, 2N, ...), or a 0/1 list per layer
    moe_router_load_balancing_type: str = "aux_loss"  # or "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None = dropless
    moe_shared_expert_intermediate_size: int | None = None  # a dense expert every token also takes
    moe_grouped_gemm: bool = False  # Triton grouped GEMM for the experts (else a loop of matmuls)
    # transformer-engine and FP8 (megalite.layers.transformer_engine; Megatron's flags)
    transformer_impl: str = "local"
    fp8_format: str | None = None
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    tp_comm_overlap: bool = False  # TE userbuffers: TP all-gathers / reduce-scatters inside the GEMMs
    tp_comm_bootstrap_backend: str = "nccl"

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
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP``.

        Padding rows exist so the embedding splits evenly over TP; their logits are
        masked to -inf, so a padding id is never predicted.
        """
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    # a2a+p2p: (A, B), all-to-all over A consecutive CP ranks, the ring over B of them; A*B = CP
    hierarchical_context_parallel_sizes: tuple[int, int] | None = None
    expert_model_parallel_size: int = 1  # experts split over this many ranks of one stage
    expert_tensor_parallel_size: int = 1  # only 1: each expert whole on its rank (see megalite.moe)

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # default micro_batch_size * DP
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default train_iters
    lr_decay_style: str = "cosine"  # cosine, linear, constant
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # fp16: static scale; None = dynamic
    initial_loss_scale: float = 2.0**16
    zero_stage: int = 0  # 0 DDP, 1 optimizer state, 2 + gradients, 3 + weights sharded over DP
    overlap_grad_reduce: bool = False  # start each bucket's reduction during backward
    ddp_bucket_size: int = 40_000_000  # parameters per gradient bucket
    offload_optimizer: bool = False  # optimizer state and step on the CPU (stages 1, 2)
    accumulate_allreduce_grads_in_fp32: bool | None = None  # default: True with --bf16/--fp16
    pipeline_schedule: str = "1f1b"  # gpipe, zb-h1, zbv (megalite.pipeline.op_lists); V > 1: interleaved
    log_interval: int = 1
    eval_interval: int = 1000
    eval_iters: int = 10


@dataclass
class DataConfig:
    # prefix of a .bin/.idx pair from tools/preprocess_data.py, or a blend's --data-path
    # values: weights and prefixes, ["0.7", "A", "0.3", "B"] (see megalite/data/blended.py)
    data_path: str | list[str] | None = None
    mock_data: bool = False
    split: str = "969,30,1"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    # Packed documents (Megatron's flags; megalite/data/packing.py): positions restart after
    # each EOD token, attention stops at documents, no loss where the input is EOD.
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_token: int | None = None  # the tokenizer's end-of-document id (None: it has none)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _divides(what: str, n: int, by_what: str, d: int, fix: str) -> None:
    if d <= 0 or n % d != 0:
        raise ConfigError(f"{what} ({n}) must be divisible by {by_what} ({d}). Fix: {fix}")


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


def validate(config: Config, world_size: int = 1, gpus_per_node: int | None = None) -> list[str]:
    """Check every rule; raise ConfigError on the first violation, return warnings."""
    m, p, t, d = config.model, config.parallel, config.train, config.data
    warnings = validate_layout(p, world_size, gpus_per_node)
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    dp = p.data_parallel_size(world_size)

    # Model shape.
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
        _positive("--" + name.replace("_", "-"), getattr(m, name))
    _positive("--ffn-hidden-size", m.ffn_hidden_size)
    _positive("--num-query-groups", m.num_query_groups)
    _positive("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)
    _divides("--hidden-size", m.hidden_size, "--num-attention-heads", m.num_attention_heads,
             "pick a hidden size that is a multiple of the head count (head dim = hidden/heads).")
    _divides("--num-attention-heads", m.num_attention_heads, "--num-query-groups",
             m.num_query_groups, "each key/value group must serve a whole number of query heads.")
    if m.position_embedding_type == "rope" and m.head_dim % 2 != 0:
        raise ConfigError(f"rotary embeddings need an even head dim, got hidden/heads = "
                          f"{m.hidden_size}/{m.num_attention_heads} = {m.head_dim}. Fix: change "
                          f"--hidden-size or --num-attention-heads.")
    if m.rope_scaling is not None:
        if m.position_embedding_type != "rope":
            raise ConfigError("RoPE scaling (--use-rope-scaling, or a checkpoint's rope_scaling) needs "
                              "--position-embedding-type rope.")
        kind = m.rope_scaling.get("rope_type", m.rope_scaling.get("type"))
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if kind != "llama3" or any(k not in m.rope_scaling for k in need):
            raise ConfigError(f"rope_scaling {m.rope_scaling!r}: megalite implements the llama3 schedule "
                              f"(rope_type 'llama3' with {', '.join(need)}). Fix: use that, or no scaling.")
    if m.position_embedding_type not in ("learned_absolute", "rope"):
        raise ConfigError(f"--position-embedding-type {m.position_embedding_type!r} is unknown. "
                          f"Fix: use learned_absolute or rope.")
    if m.recompute_granularity not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity {m.recompute_granularity!r} is unknown. Fix: full "
                          f"or selective.")
    if m.recompute_method not in ("uniform", "block"):
        raise ConfigError(f"--recompute-method {m.recompute_method!r} is unknown. Fix: uniform or block.")
    _positive("--recompute-num-layers", m.recompute_num_layers)
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"--normalization {m.normalization!r} is unknown. Fix: use LayerNorm or "
                          f"RMSNorm.")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length ({m.seq_length}) exceeds --max-position-embeddings "
                          f"({m.max_position_embeddings}): learned positions exist only up to "
                          f"that length. Fix: raise --max-position-embeddings or shorten "
                          f"--seq-length.")
    from megalite.layers.documents import check_documents_attention

    check_documents_attention(m, d.reset_attention_mask)  # before "not installed": the fix differs
    from megalite.layers.attention import check_attention_backend

    check_attention_backend(m)  # raises ConfigError naming what is missing and how to install it
    from megalite.layers.transformer_engine import check_tp_comm_overlap, check_transformer_impl

    check_transformer_impl(m, tp)
    check_tp_comm_overlap(m, tp, p.sequence_parallel, t.bf16 or t.fp16)
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}.")

    # Model shape against the layout.
    _divides("--num-attention-heads", m.num_attention_heads, "--tensor-model-parallel-size", tp,
             "attention is split by heads over TP; choose TP dividing the head count.")
    _divides("--num-query-groups", m.num_query_groups, "--tensor-model-parallel-size", tp,
             "key/value groups are split over TP; choose TP dividing the group count.")
    _divides("--ffn-hidden-size", m.ffn_hidden_size, "--tensor-model-parallel-size", tp,
             "the MLP is split over TP along the FFN dimension.")
    _divides("--num-layers", m.num_layers, "--pipeline-model-parallel-size", pp,
             "every pipeline stage holds the same number of layers.")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        k = p.num_layers_per_virtual_pipeline_stage
        _positive("--num-layers-per-virtual-pipeline-stage", k)
        _divides("--num-layers", m.num_layers, "PP * layers-per-virtual-stage", pp * k,
                 f"with PP={pp} and {k} layers per virtual stage, use a multiple of {pp * k} layers.")
        if pp < 2:
            raise ConfigError(f"the interleaved schedule needs --pipeline-model-parallel-size >= 2 "
                              f"(got {pp}): --num-layers-per-virtual-pipeline-stage splits each "
                              f"pipeline rank's layers into chunks. Fix: raise PP or drop the flag.")
        if m.num_layers // (pp * k) < 2:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {k} with {m.num_layers} layers "
                              f"and PP={pp} gives 1 virtual stage per rank, i.e. no interleaved "
                              f"schedule. Fix: use at most {m.num_layers // (2 * pp)} layers per "
                              f"virtual stage, or drop the flag for plain 1F1B.")
    if cp > 1:
        _divides("--seq-length", m.seq_length, "2 * --context-parallel-size", 2 * cp,
                 "the load-balanced causal split cuts each sequence into 2*CP equal chunks.")
    from megalite.context_parallel.checks import check_context_parallel

    warnings += check_context_parallel(m, p, gpus_per_node)  # --cp-comm-type and its sizes
    if p.sequence_parallel:
        if tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it "
                              "shards the sequence inside the TP group). Fix: raise TP or drop "
                              "the flag.")
        _divides("--seq-length / CP", m.seq_length // cp, "--tensor-model-parallel-size", tp,
                 "sequence parallelism splits each rank's sequence over TP.")

    from megalite.moe.settings import validate_moe

    validate_moe(m, p, t, world_size)

    # Batch arithmetic: global = micro * DP * accumulation steps.
    _positive("--micro-batch-size", t.micro_batch_size)
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _positive("--global-batch-size", t.global_batch_size)
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"--global-batch-size ({t.global_batch_size}) must be divisible by "
            f"--micro-batch-size * data-parallel size = {t.micro_batch_size} * {dp} = "
            f"{t.micro_batch_size * dp} (global batch = micro batch x DP x accumulation steps). "
            f"Fix: use a global batch that is a multiple of {t.micro_batch_size * dp}."
        )

    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if p.num_layers_per_virtual_pipeline_stage is not None and num_micro % pp != 0:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({num_micro} = global "
            f"batch {t.global_batch_size} / (micro batch {t.micro_batch_size} x DP {dp})) to be a "
            f"multiple of --pipeline-model-parallel-size ({pp}): micro-batches go round the ring "
            f"in groups of PP. Fix: use a global batch that is a multiple of "
            f"{t.micro_batch_size * dp * pp}.")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {t.zero_stage}.")
    if t.zero_stage == 3 and pp > 1:
        raise ConfigError(f"--zero-stage 3 with --pipeline-model-parallel-size {pp}: sharded weights "
                          f"are gathered layer by layer around each forward and backward, which the "
                          f"pipeline schedules interleave across micro-batches (DeepSpeed refuses this "
                          f"too). Fix: use --zero-stage 2 (or 1) with pipeline parallelism, or PP=1.")
    if t.offload_optimizer and t.zero_stage not in (1, 2):
        raise ConfigError(f"--offload-optimizer works with --zero-stage 1 or 2 (the sharded optimizer "
                          f"state moves to the CPU), got --zero-stage {t.zero_stage}. Fix: add "
                          f"--zero-stage 1 or 2.")
    _positive("--ddp-bucket-size", t.ddp_bucket_size)
    if t.accumulate_allreduce_grads_in_fp32 is None:
        t.accumulate_allreduce_grads_in_fp32 = t.bf16 or t.fp16
    from megalite.pipeline.checks import check_pipeline_schedule

    check_pipeline_schedule(m, p, t)

    # Training.
    _positive("--train-iters", t.train_iters)
    _positive("--log-interval", t.log_interval)
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={t.lr}, "
                          f"min_lr={t.min_lr}.")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"--lr-decay-style {t.lr_decay_style!r} is unknown. Fix: use cosine, "
                          f"linear or constant.")
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    if t.lr_warmup_iters < 0 or t.lr_warmup_iters > t.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters ({t.lr_warmup_iters}) must be in "
                          f"[0, --lr-decay-iters ({t.lr_decay_iters})].")
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive. Fix: pick one.")
    if t.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {t.clip_grad}.")

    # Data.
    if d.mock_data and d.data_path:
        raise ConfigError("--mock-data and --data-path are exclusive. Fix: pick one.")
    if not d.mock_data and not d.data_path:
        raise ConfigError("no training data: pass --data-path PREFIX (a .bin/.idx pair written "
                          "by tools/preprocess_data.py) or --mock-data.")
    packing = [f"--{name.replace('_', '-')}" for name in
               ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(d, name)]
    if packing and d.eod_token is None:
        flags = " ".join(packing)
        raise ConfigError(
            f"{flags} needs an end-of-document (EOD) token to find where documents end, but the "
            f"tokenizer ({d.tokenizer_type}{' ' + d.tokenizer_model if d.tokenizer_model else ''}) has none. Fix: use a "
            f"tokenizer that names one (eos_token in tokenizer_config.json of a Hugging Face "
            f"folder) and preprocess with --append-eod, or drop {flags}.")
    if d.data_path and not d.mock_data:
        from megalite.data.blended import parse_data_path
        try:
            parse_data_path(d.data_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return warnings
