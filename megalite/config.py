"""The run's settings (re-exported from the ground floor, :mod:`megalite.config_types`) and
every rule between them, checked before any process group or model is built.

``validate(config, world_size, gpus_per_node)`` checks the rules between the settings of
:mod:`megalite.config` itself and calls down into the checks each part owns for its own options
(attention backends, packed documents, transformer-engine, context parallelism, MoE, pipeline
schedules), which import nothing from here. Each violated rule raises :class:`ConfigError`
(:mod:`megalite.errors`) whose message names the values involved, the rule, and a fix. Rules that
only cost performance (a tensor-parallel group that spans nodes) are returned as warnings instead.
This module sits above the layers it asks; the settings themselves sit on the ground floor,
where the grid and the layers import them from.
"""
from __future__ import annotations

from megalite.config_types import (MOE, Config, ConfigError, DataConfig, ModelConfig,  # noqa: F401 - re-exported
                                   ParallelConfig, TrainConfig, _positive, llama3_rope_scaling, validate_layout)
from megalite.context_parallel.checks import check_context_parallel
from megalite.data.blended import parse_data_path
from megalite.data_parallel.update_rule import RULES, rule_named
from megalite.layers.attention import (TRITON_MAX_HEAD_DIM, BackendUnavailable, check_attention_backend,
                                       refuse_flash_value_head_size)
from megalite.layers.attention_kinds import check_attention_kind
from megalite.layers.documents import check_documents_attention
from megalite.layers.rotary import check_rope_scaling
from megalite.layers.transformer_engine import check_tp_comm_overlap, check_transformer_impl
from megalite.moe.settings import validate_moe
from megalite.pipeline.checks import check_pipeline_schedule


def _divides(what: str, n: int, by_what: str, d: int, fix: str) -> None:
    if d <= 0 or n % d != 0:
        raise ConfigError(f"{what} ({n}) must be divisible by {by_what} ({d}). Fix: {fix}")


def check_multi_latent_attention(m) -> None:
    """The rules of ``--multi-latent-attention`` (megalite.model.mla): positive latent ranks and
    head parts, an even RoPE part, RoPE positions, no key/value groups or QK-norm (MLA has its own
    latent norms), megalite's layers, and no flash-attn when the value head differs from d_qk."""
    if not m.multi_latent_attention:
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _positive("--" + name.replace("_", "-"), getattr(m, name))
    if m.q_lora_rank is not None:
        _positive("--q-lora-rank", m.q_lora_rank)
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim must be even (RoPE rotates pairs), got {m.qk_pos_emb_head_dim}. "
                          f"Fix: pass an even size (64 in DeepSeek-V3).")
    if m.position_embedding_type != "rope":
        raise ConfigError(f"--multi-latent-attention needs --position-embedding-type rope (its decoupled RoPE key), "
                          f"got {m.position_embedding_type}. Fix: pass --position-embedding-type rope.")
    if m.num_query_groups != m.num_attention_heads or m.qk_layernorm:
        raise ConfigError("--multi-latent-attention has no key/value groups and no QK-norm (keys and values come "
                          "from one latent per token, normalized itself). Fix: drop --num-query-groups and "
                          "--qk-layernorm.")
    if m.transformer_impl != "local":
        raise ConfigError("--multi-latent-attention is built from megalite's own layers; with transformer-engine "
                          "it is not wired in. Fix: --transformer-impl local.")
    d_qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.attention_backend == "triton" and max(d_qk, m.v_head_dim) > TRITON_MAX_HEAD_DIM:
        raise ConfigError(f"--attention-backend triton supports head sizes up to {TRITON_MAX_HEAD_DIM}, got "
                          f"--qk-head-dim + --qk-pos-emb-head-dim = {d_qk} and --v-head-dim = {m.v_head_dim}. "
                          f"Fix: smaller head parts, or --attention-backend torch.")
    if m.attention_backend == "flash":
        try:
            refuse_flash_value_head_size("--attention-backend flash", d_qk, m.v_head_dim)
        except BackendUnavailable as why:
            raise ConfigError(f"--multi-latent-attention: {why}") from None


def check_multi_token_prediction(m) -> None:
    """The rules of ``--mtp-num-layers`` (megalite.model.mtp): a positive depth count below the
    sequence length (depth k needs token t+k+1), a non-negative loss factor, RoPE positions (the
    MTP block embeds token t+k with the word embedding alone: learned absolute positions live on
    the first stage only) and megalite's own layers."""
    if m.mtp_num_layers is None or m.mtp_num_layers == 0:  # Megatron: None or 0 is off
        return
    if m.mtp_num_layers < 0 or m.mtp_num_layers >= m.seq_length:
        raise ConfigError(f"--mtp-num-layers must be in [1, --seq-length) (depth k predicts token t+k+1 of the "
                          f"sequence), got {m.mtp_num_layers} with --seq-length {m.seq_length}. Fix: 1 as in "
                          f"DeepSeek-V3, or drop the flag.")
    if m.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp-loss-scaling-factor must be >= 0, got {m.mtp_loss_scaling_factor}. "
                          f"Fix: 0.1 (Megatron's default; DeepSeek-V3 used 0.3, then 0.1).")
    if m.position_embedding_type != "rope":
        raise ConfigError(f"--mtp-num-layers needs --position-embedding-type rope, got {m.position_embedding_type}: "
                          f"the MTP blocks on the last pipeline stage embed token t+k with the word embedding "
                          f"only, and learned absolute positions live on the first stage. Fix: pass "
                          f"--position-embedding-type rope.")
    if m.transformer_impl != "local":
        raise ConfigError("--mtp-num-layers is built from megalite's own layers; with transformer-engine it is not "
                          "wired in. Fix: --transformer-impl local.")


MUON_TP_MODES = ("blockwise", "duplicated", "distributed")


def _check_muon(t) -> None:
    """What Muon (megalite.data_parallel.muon, registered by importing it: pretrain does) does not
    do yet, refused with the value, the rule and the fix; nothing for another rule."""
    if t.optimizer != "muon":
        return
    if t.muon_tp_mode not in MUON_TP_MODES:
        raise ConfigError(f"--muon-tp-mode {t.muon_tp_mode!r} is unknown. Fix: duplicated or distributed (equal "
                          f"to one process) or blockwise (Newton-Schulz per TP shard, Megatron's default).")
    if t.zero_stage == 3:
        raise ConfigError("--optimizer muon with --zero-stage 3: the weights' shards are gathered per layer for "
                          "use, and Muon's ownership of whole matrices is built for stages 1 and 2 only. Fix: "
                          "--zero-stage 1 or 2 (or --use-distributed-optimizer).")
    if t.offload_optimizer:
        raise ConfigError("--optimizer muon with --offload-optimizer: Muon's gathers and Newton-Schulz run on the "
                          "model's device, not on offloaded host shards. Fix: drop --offload-optimizer.")
    if t.muon_num_ns_steps < 1:
        raise ConfigError(f"--muon-num-ns-steps must be >= 1, got {t.muon_num_ns_steps}. Fix: 5 (Megatron's).")
    if not 0 <= t.muon_momentum < 1:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {t.muon_momentum}. Fix: 0.9 to 0.95.")


def _check_qk_clip(m, t) -> None:
    """QK-clip (megalite.model.qk_clip) or its max-logit log, refused with what cannot give or
    use the per-head max: the value, the rule and the fix."""
    if not (t.qk_clip or t.log_max_attention_logit):
        return
    what = "--qk-clip" if t.qk_clip else "--log-max-attention-logit"
    if t.qk_clip and not t.qk_clip_threshold > 0:
        raise ConfigError(f"--qk-clip-threshold must be > 0, got {t.qk_clip_threshold}: the largest attention "
                          f"logit a head may keep. Fix: 100 (Megatron's default; Kimi K2 used 100).")
    if t.qk_clip and not 0 < t.qk_clip_alpha < 1:
        raise ConfigError(f"--qk-clip-alpha must be in (0, 1), got {t.qk_clip_alpha}: the query takes eta^alpha "
                          f"and the key eta^(1-alpha). Fix: 0.5 (Megatron's default).")
    if m.transformer_impl != "local":
        raise ConfigError(f"{what} with --transformer-impl {m.transformer_impl}: transformer-engine's "
                          f"attention gives no per-head max logit here. Fix: --transformer-impl local.")
    if m.attention_backend == "flash":
        raise ConfigError(f"{what} with --attention-backend flash: flash-attn returns no per-head max "
                          f"attention logit. Fix: --attention-backend triton (or auto, or torch).")
    if t.qk_clip and m.qk_layernorm:
        raise ConfigError("--qk-clip with --qk-layernorm: the norm rescales each head's query and key to a "
                          "fixed RMS, undoing any scale of their projection, so the clip would change "
                          "nothing. Fix: drop one of them (QK-norm bounds the logits by itself).")
    if t.qk_clip and t.offload_optimizer:
        raise ConfigError("--qk-clip with --offload-optimizer: the rescale's factors are on the device and "
                          "the masters on the host (a copy that waits). Fix: drop --offload-optimizer.")


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
    if m.kv_channels is None and not m.multi_latent_attention:  # MLA's heads have sizes of their own
        _divides("--hidden-size", m.hidden_size, "--num-attention-heads", m.num_attention_heads,
                 "pick a hidden size that is a multiple of the head count (head dim = hidden/heads), or set "
                 "the head size with --kv-channels.")
    elif m.kv_channels is not None:
        _positive("--kv-channels", m.kv_channels)
    _divides("--num-attention-heads", m.num_attention_heads, "--num-query-groups",
             m.num_query_groups, "each key/value group must serve a whole number of query heads.")
    if m.position_embedding_type == "rope" and not m.multi_latent_attention and m.head_dim % 2 != 0:
        raise ConfigError(f"rotary embeddings need an even head dim, got "
                          f"{'--kv-channels' if m.kv_channels else f'hidden/heads = {m.hidden_size}/{m.num_attention_heads}'}"
                          f" = {m.head_dim}. Fix: change --kv-channels, --hidden-size or --num-attention-heads.")
    if m.rope_scaling is not None:
        if m.position_embedding_type != "rope":
            raise ConfigError("RoPE scaling (--use-rope-scaling, --rope-type yarn, or a checkpoint's rope_scaling) "
                              "needs --position-embedding-type rope.")
        check_rope_scaling(m.rope_scaling)
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
    check_attention_kind(m)  # a registered attention part
    check_multi_latent_attention(m)  # before the backend's check: flash's refusal names the head sizes
    check_multi_token_prediction(m)
    check_documents_attention(m, d.reset_attention_mask)  # before "not installed": the fix differs
    check_attention_backend(m)  # raises ConfigError naming what is missing and how to install it
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
    warnings += check_context_parallel(m, p, gpus_per_node)  # --cp-comm-type and its sizes
    if p.sequence_parallel:
        if tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it "
                              "shards the sequence inside the TP group). Fix: raise TP or drop "
                              "the flag.")
        _divides("--seq-length / CP", m.seq_length // cp, "--tensor-model-parallel-size", tp,
                 "sequence parallelism splits each rank's sequence over TP.")

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
    try:
        rule_named(t.optimizer)
    except ValueError:
        raise ConfigError(f"optimizer {t.optimizer!r} is not a registered update rule; registered: "
                          f"{', '.join(sorted(RULES))}. Fix: set TrainConfig.optimizer (--optimizer) to one of them, or register "
                          f"the rule first (megalite.data_parallel.update_rule.register_rule(name, rule))."
                          ) from None
    _check_muon(t)
    _check_qk_clip(m, t)
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
        try:
            parse_data_path(d.data_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return warnings
