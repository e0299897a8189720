"""Command-line flags (Megatron-LM's names wherever Megatron has the flag) -> Config."""
from __future__ import annotations

import argparse
import importlib.util

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.pipeline.schedule_kinds import DEFAULT_SCHEDULE, SCHEDULES
from megalite.resilience.flags import add_resilience_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a GPT with megalite.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4*hidden (SwiGLU: ~8/3*hidden)")
    g.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias on the q/k/v projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1 RoPE frequency scaling (original context 8192, low/high freq factors 1/4)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention-backend", choices=["auto", "triton", "flash", "torch"], default="auto",
                   help="auto: the fastest exact backend for each call (triton on a GPU, torch on a CPU)")
    g.add_argument("--fused-kernels", action="store_true", help="Triton LayerNorm/RMSNorm and cross-entropy")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="megalite's own layers, or transformer-engine's (a GPU with transformer-engine)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 training through transformer-engine (delayed scaling)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap TP communication with the GEMMs (transformer-engine userbuffers; TP > 1 with SP)")
    g.add_argument("--tp-comm-bootstrap-backend", choices=["nccl", "mpi", "gloo"], default="nccl",
                   help="backend that sets up the userbuffers of --tp-comm-overlap")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute activations in backward: full layers, or only core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size (--mock-data / NullTokenizer); otherwise from the tokenizer")

    g = p.add_argument_group("mixture of experts (megalite.moe)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=str, default="1",
                   help="N: layers 0, N, 2N, ... are MoE; or a 0/1 list per layer such as [1,0,1,0]")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                   help="aux_loss (Switch/GShard load-balancing loss) or none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss (ST-MoE)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert keeps at most factor * tokens * topk / experts assignments (default: dropless)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of a dense shared expert every token also takes (DeepSeek / Qwen-MoE)")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="the experts' matmuls as one Triton grouped GEMM")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall"], default="alltoall",
                   help="tokens travel to their experts by all-to-all over the expert-parallel group")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="experts split over this many ranks of each pipeline stage (carved out of TP x CP x DP)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1, help="only 1: each expert whole on its rank")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", choices=["p2p", "a2a", "allgather", "a2a+p2p"], default="p2p",
                   help="context-parallel attention: p2p ring, a2a (Ulysses, heads/TP divisible by CP), "
                        "allgather of K/V, or a2a+p2p (all-to-all inside, ring across)")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None,
                   metavar=("A", "B"),
                   help="with --cp-comm-type a2a+p2p: all-to-all over A consecutive CP ranks, ring "
                        "over B; A*B = --context-parallel-size")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                   help="0 DDP; 1 shard optimizer state + master weights; 2 + gradients; 3 + weights")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="Megatron's name for --zero-stage 1")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's reduction during backward")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000, help="parameters per gradient bucket")
    g.add_argument("--offload-optimizer", action="store_true", help="optimizer state and step on the CPU")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="fp32 gradient buffers (default: on with --bf16/--fp16)")
    g.add_argument("--pipeline-schedule", choices=list(SCHEDULES), default=DEFAULT_SCHEDULE,
                   help="with PP > 1 and no virtual stages; gpipe = all forward, then all backward; "
                        "zb-h1 / zbv = zero-bubble (backward split into input and weight gradients, "
                        "zbv with two chunks per rank in a V; docs/pipeline.md)")

    g = p.add_argument_group("device")
    g.add_argument("--device", choices=["auto", "cuda", "cpu", "meta"], default="auto",
                   help="auto: this rank's GPU (LOCAL_RANK) when there is one, else the CPU; meta: "
                        "shapes only, nothing computed (a dry run)")
    g.add_argument("--fake-process-group", action="store_true",
                   help="play rank RANK of a world of WORLD_SIZE alone, on torch's fake backend "
                        "(collectives return at once); with --device meta a placement and memory dry run")
    g.add_argument("--disable-tf32", action="store_true",
                   help="exact fp32 matmuls on Ampere and later (TF32 is on by default there)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16 static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", type=str, nargs="+", default=None,
                   help="prefix of a .bin/.idx pair, or a blend: weights and prefixes "
                        "(0.7 A 0.3 B; weights are normalized)")
    g.add_argument("--split", type=str, default="969,30,1", help="train,valid,test by documents "
                   "(of each dataset of a blend)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart at 0 after each end-of-document (EOD) token")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention stops at document boundaries (EOD tokens) inside a sequence")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the EOD token")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="SentencePiece .model file; for HuggingFaceTokenizer a local folder "
                        "holding tokenizer.json")

    g = p.add_argument_group("logging and outputs")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-json", type=str, default=None, help="write one JSON object per iteration")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="write TensorBoard scalars here")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="log the same scalars to this Weights & Biases project (pip install wandb; "
                        "WANDB_MODE=offline keeps the run on disk)")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="the W&B run name (None: wandb picks one)")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="the W&B run files go to DIR/wandb/ (None: the working directory)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per GPU for MFU (default: detected GPU's dense bf16 peak)")
    g.add_argument("--profile", action="store_true", help="torch.profiler trace per rank")
    g.add_argument("--profile-step-start", type=int, default=2)
    g.add_argument("--profile-step-end", type=int, default=3)
    g.add_argument("--profile-dir", type=str, default="profile")
    g.add_argument("--track-memory", action="store_true",
                   help="count every tensor storage of each iteration by category, with the peak "
                        "(memory_tracked in the JSON log; tools/dry_run.py uses it)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that does not complete in time raises a clear error on every rank")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None, help="checkpoint directory (also saved at the end and on SIGTERM)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints")
    g.add_argument("--load", type=str, default=None,
                   help="resume from this directory's 'latest' checkpoint, or from an iteration directory "
                        "(DIR/iter_0000010)")
    g.add_argument("--ckpt-step", type=int, default=None, help="with --load DIR: load iteration N instead of 'latest'")
    g.add_argument("--no-load-optim", action="store_true", help="load weights only; fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--finetune", action="store_true", help="load the weights only (no optimizer state, no RNG state, as Megatron), restart at iteration 0")
    g.add_argument("--pipeline-trace", type=str, default=None,
                   help="directory: each rank writes its schedule trace of the last iteration")
    add_resilience_args(p)
    return p


def llama3_rope_scaling(factor: float = 8.0) -> dict:
    """Megatron's --use-rope-scaling: the Llama 3.1 schedule (see megalite.layers.rotary)."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def explicit_args(argv=None) -> set[str]:
    """The destinations of the flags given on the command line (not left at their defaults)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


WANDB_MISSING = ("--wandb-project needs the wandb package, which is not installed. Fix: pip install wandb "
                 "(or pip install 'megalite[wandb]'), or drop --wandb-project.")


def check_logging_args(args: argparse.Namespace) -> None:
    """W&B flags: the package is there (checked on every rank, before any group or model) and
    the run options come with a project."""
    if getattr(args, "wandb_project", None):
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(WANDB_MISSING)
    else:
        for flag in ("wandb_exp_name", "wandb_save_dir"):
            if getattr(args, flag, None):
                raise ConfigError(f"--{flag.replace('_', '-')} is set without --wandb-project. Fix: add "
                                  f"--wandb-project NAME, or drop --{flag.replace('_', '-')}.")


def config_from_args(args: argparse.Namespace, vocab_size: int, eod_token: int | None = None) -> Config:
    """``eod_token``: the tokenizer's end-of-document id (None: it has none), which the
    packed-document flags need."""
    check_logging_args(args)
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        rope_scaling=llama3_rope_scaling(args.rope_scaling_factor) if args.use_rope_scaling else None,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, attention_backend=args.attention_backend,
        fused_kernels=args.fused_kernels, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_layer_freq=args.moe_layer_freq,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_grouped_gemm=args.moe_grouped_gemm, transformer_impl=args.transformer_impl,
        fp8_format=args.fp8_format, fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo, tp_comm_overlap=args.tp_comm_overlap,
        tp_comm_bootstrap_backend=args.tp_comm_bootstrap_backend, cp_comm_type=args.cp_comm_type,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        sequence_parallel=args.sequence_parallel,
        hierarchical_context_parallel_sizes=(tuple(args.hierarchical_context_parallel_sizes)
                                             if args.hierarchical_context_parallel_sizes else None),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr,
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, seed=args.seed, bf16=args.bf16, fp16=args.fp16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        pipeline_schedule=args.pipeline_schedule,
        zero_stage=1 if args.use_distributed_optimizer and args.zero_stage == 0 else args.zero_stage,
        overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
        offload_optimizer=args.offload_optimizer,
        accumulate_allreduce_grads_in_fp32=args.accumulate_allreduce_grads_in_fp32, log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
    )
    data = DataConfig(data_path=args.data_path, mock_data=args.mock_data, split=args.split,
                      tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                      reset_position_ids=getattr(args, "reset_position_ids", False),
                      reset_attention_mask=getattr(args, "reset_attention_mask", False),
                      eod_mask_loss=getattr(args, "eod_mask_loss", False), eod_token=eod_token)
    return Config(model=model, parallel=parallel, train=train, data=data)
