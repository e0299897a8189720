"""Every validation rule raises before anything is built, with a message naming values and fix."""
import pytest

from megalite.config import (Config, ConfigError, DataConfig, ModelConfig, ParallelConfig,
                             TrainConfig, validate)


def cfg(model=None, parallel=None, train=None, data=None):
    m = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=32)
    m.update(model or {})
    return Config(ModelConfig(**m), ParallelConfig(**(parallel or {})), TrainConfig(**(train or {})),
                  DataConfig(**(data if data is not None else {"mock_data": True})))


def check(config, world, *fragments):
    with pytest.raises(ConfigError) as e:
        validate(config, world)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_valid_config_passes_and_fills_defaults():
    c = cfg(train={"micro_batch_size": 2})
    assert validate(c, 4) == []
    assert c.train.global_batch_size == 8 and c.train.lr_decay_iters == c.train.train_iters
    assert c.model.ffn_hidden_size == 256 and c.model.num_query_groups == 4


RULES = [  # (config, world, fragments of the message)
    (cfg(parallel={"tensor_model_parallel_size": 3}), 8, ["world size (8)", "3*1*1 = 3"]),
    (cfg(model={"hidden_size": 66}), 1, ["--hidden-size (66)", "--num-attention-heads (4)"]),
    (cfg(model={"num_query_groups": 3}), 1, ["--num-attention-heads (4)", "--num-query-groups (3)"]),
    (cfg(model={"num_attention_heads": 6, "hidden_size": 96, "num_query_groups": 6},
         parallel={"tensor_model_parallel_size": 4}), 4,
     ["--num-attention-heads (6)", "--tensor-model-parallel-size (4)", "split by heads"]),
    (cfg(model={"num_attention_heads": 8, "num_query_groups": 2},
         parallel={"tensor_model_parallel_size": 4}), 4,
     ["--num-query-groups (2)", "--tensor-model-parallel-size (4)"]),
    (cfg(model={"ffn_hidden_size": 130}, parallel={"tensor_model_parallel_size": 4}), 4,
     ["--ffn-hidden-size (130)", "FFN dimension"]),
    (cfg(model={"num_layers": 6}, parallel={"pipeline_model_parallel_size": 4}), 4,
     ["--num-layers (6)", "--pipeline-model-parallel-size (4)"]),
    (cfg(model={"num_layers": 8}, parallel={"pipeline_model_parallel_size": 2,
                                            "num_layers_per_virtual_pipeline_stage": 3}), 2,
     ["--num-layers (8)", "PP * layers-per-virtual-stage (6)"]),
    (cfg(train={"pipeline_schedule": "zb"}), 1, ["--pipeline-schedule 'zb' is unknown"]),
    (cfg(train={"zero_stage": 4}), 1, ["--zero-stage must be 0, 1, 2 or 3, got 4"]),
    (cfg(train={"zero_stage": 3}, parallel={"pipeline_model_parallel_size": 2}), 2,
     ["--zero-stage 3 with --pipeline-model-parallel-size 2", "Fix: use --zero-stage 2"]),
    (cfg(train={"offload_optimizer": True}), 1, ["--offload-optimizer works with --zero-stage 1 or 2",
                                                 "got --zero-stage 0"]),
    (cfg(train={"ddp_bucket_size": 0}), 1, ["--ddp-bucket-size must be a positive integer"]),
    (cfg(model={"seq_length": 36}, parallel={"context_parallel_size": 4}), 4,
     ["--seq-length (36)", "2 * --context-parallel-size (8)", "2*CP equal chunks"]),
    (cfg(model={"seq_length": 30}, parallel={"tensor_model_parallel_size": 4,
                                             "sequence_parallel": True}), 4,
     ["--seq-length / CP (30)", "--tensor-model-parallel-size (4)"]),
    (cfg(parallel={"sequence_parallel": True}), 1, ["--sequence-parallel needs"]),
    (cfg(train={"micro_batch_size": 4, "global_batch_size": 20}), 2,
     ["--global-batch-size (20)", "4 * 2 = 8", "accumulation"]),
    (cfg(model={"seq_length": 64, "max_position_embeddings": 32}), 1,
     ["--seq-length (64)", "--max-position-embeddings (32)"]),
    (cfg(model={"position_embedding_type": "rope", "hidden_size": 20, "num_attention_heads": 4}), 1,
     ["even head dim", "20/4 = 5"]),
    (cfg(model={"position_embedding_type": "alibi"}), 1, ["'alibi' is unknown"]),
    (cfg(model={"normalization": "BatchNorm"}), 1, ["'BatchNorm' is unknown"]),
    (cfg(model={"hidden_dropout": 1.0}), 1, ["--hidden-dropout must be in [0, 1)"]),
    (cfg(model={"num_layers": 0}), 1, ["--num-layers must be a positive integer, got 0"]),
    (cfg(train={"micro_batch_size": 0}), 1, ["--micro-batch-size must be a positive integer"]),
    (cfg(train={"lr": 1e-4, "min_lr": 1e-3}), 1, ["--min-lr <= --lr", "min_lr=0.001"]),
    (cfg(train={"lr_decay_style": "step"}), 1, ["'step' is unknown"]),
    (cfg(train={"lr_warmup_iters": 200, "train_iters": 100}), 1, ["--lr-warmup-iters (200)"]),
    (cfg(train={"bf16": True, "fp16": True}), 1, ["--bf16 and --fp16 are exclusive"]),
    (cfg(train={"clip_grad": -1.0}), 1, ["--clip-grad must be >= 0"]),
    (cfg(train={"train_iters": 0}), 1, ["--train-iters must be a positive integer"]),
    (cfg(data={}), 1, ["no training data", "--mock-data"]),
    (cfg(data={"mock_data": True, "data_path": "x"}), 1, ["exclusive"]),
]


@pytest.mark.parametrize("config,world,fragments", RULES, ids=[f[0][:30] for _, _, f in RULES])
def test_rule_message(config, world, fragments):
    check(config, world, *fragments)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_context_parallel_config_accepts_every_cpu_backend(backend):
    """The configuration check only: CP=2 is accepted with each backend that runs on a CPU (the
    torch math blocks, or the Triton kernels in the interpreter). The runs themselves, against the
    non-CP model, are tests/test_context_parallel.py::test_gpt_context_parallel_matches_serial
    (auto and triton on the llama variant, torch under TP2 x CP2) and
    test_pretrain_context_parallel_matches_single_process (the default and triton)."""
    c = cfg(model={"attention_backend": backend, "attention_dropout": 0.0},
            parallel={"context_parallel_size": 2})
    assert validate(c, 2) == []


def test_default_attention_backend_is_auto():
    assert ModelConfig().attention_backend == "auto"


def test_context_parallel_accepts_flash_where_it_runs(monkeypatch):
    """Ring attention runs on flash-attn's blocks (megalite.context_parallel.flash_blocks)."""
    import megalite.layers.attention as attention
    monkeypatch.setattr(attention, "flash_missing", lambda *a: None)  # as if on a GPU with flash-attn
    validate(cfg(model={"attention_backend": "flash", "attention_dropout": 0.0},
                 parallel={"context_parallel_size": 2}), 2)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather"])
def test_context_parallel_refuses_attention_dropout(comm_type):
    check(cfg(model={"attention_dropout": 0.1, "cp_comm_type": comm_type},
              parallel={"context_parallel_size": 2}), 2,
          "--context-parallel-size 2 with --attention-dropout 0.1",
          "context-parallel attention (every --cp-comm-type) has no attention dropout",
          "Fix: --attention-dropout 0.")


def cp_cfg(comm_type, cp, sizes=None, tp=1, heads=4):
    return cfg(model={"cp_comm_type": comm_type, "attention_dropout": 0.0, "num_attention_heads": heads},
               parallel={"context_parallel_size": cp, "tensor_model_parallel_size": tp,
                         "hierarchical_context_parallel_sizes": sizes})


CP_RULES = [  # --cp-comm-type and --hierarchical-context-parallel-sizes, one case per rule
    (cp_cfg("ring", 2), 2, ["--cp-comm-type 'ring' is unknown", "p2p, a2a, allgather, a2a+p2p"]),
    (cp_cfg("a2a", 4, tp=2), 8,
     ["--cp-comm-type a2a with --num-attention-heads 4, --tensor-model-parallel-size 2 and "
      "--context-parallel-size 4", "heads per TP rank (4/2 = 2) must be divisible by CP (4)",
      "Fix: --cp-comm-type p2p or allgather, or a2a+p2p with an inner size dividing 2 "
      "(--hierarchical-context-parallel-sizes 2 2)"]),
    (cp_cfg("a2a+p2p", 4), 4, ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B",
                               "Fix: add the sizes, e.g. --hierarchical-context-parallel-sizes 4 1"]),
    (cp_cfg("a2a+p2p", 4, (2, 3)), 4, ["--hierarchical-context-parallel-sizes 2 3: A*B = 6 must equal "
                                       "--context-parallel-size (4)", "1 4, 2 2, 4 1"]),
    (cp_cfg("a2a+p2p", 4, (4, 1), tp=2), 8,
     ["--hierarchical-context-parallel-sizes 4 1 with --num-attention-heads 4 and "
      "--tensor-model-parallel-size 2", "heads per TP rank (4/2 = 2) must be divisible by A",
      "--hierarchical-context-parallel-sizes 2 2"]),
    (cp_cfg("p2p", 4, (2, 2)), 4, ["--hierarchical-context-parallel-sizes 2 2 is given with "
                                   "--cp-comm-type p2p", "Fix: add --cp-comm-type a2a+p2p, or drop the sizes"]),
]


@pytest.mark.parametrize("config,world,fragments", CP_RULES, ids=[f[0][:30] for _, _, f in CP_RULES])
def test_context_parallel_comm_type_rule(config, world, fragments):
    check(config, world, *fragments)


def test_context_parallel_comm_types_accepted_and_node_warning():
    """Each type passes where its rule holds; an all-to-all group across nodes only warns."""
    assert validate(cp_cfg("a2a", 4), 4) == []
    assert validate(cp_cfg("allgather", 4, tp=2), 8) == []
    assert validate(cp_cfg("a2a+p2p", 4, (2, 2), tp=2), 8, gpus_per_node=4) == []
    assert validate(cp_cfg("a2a", 1), 1) == []  # no CP: the type is never used
    (w,) = validate(cp_cfg("a2a+p2p", 4, (2, 2), tp=2), 8, gpus_per_node=2)
    assert "all-to-all group of 2 CP ranks x TP 2 = 4 consecutive ranks spans nodes (2 GPUs per node)" in w
    (w,) = validate(cp_cfg("a2a", 4, tp=1), 4, gpus_per_node=2)
    assert "Fix: use --cp-comm-type a2a+p2p with an inner size A where TP*A divides" in w


@pytest.mark.parametrize("flags,message", [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine cannot run: "
                                                   "transformer-engine is not installed"),
    (["--fp8-format", "hybrid"], "Fix: add --transformer-impl transformer_engine"),
    (["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "a history of at least 1"),
])
def test_transformer_engine_and_fp8_flags_refused_where_they_cannot_run(flags, message):
    from megalite.arguments import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--mock-data"] + flags), vocab_size=100)
    with pytest.raises(ConfigError) as e:
        validate(config, 1)
    assert message in str(e.value) and str(e.value).count("Fix:") == 1


@pytest.mark.parametrize("fields,message", [
    (dict(hidden_size=72, num_attention_heads=4), "hidden size 72"),
    (dict(recompute_granularity="full"), "--recompute-granularity full with --fp8-format"),
])
def test_fp8_shapes_and_full_recompute_refused_where_transformer_engine_runs(monkeypatch, fields, message):
    import megalite.layers.transformer_engine as te

    monkeypatch.setattr(te, "te_missing", lambda: None)  # as on a GPU with transformer-engine
    model = dict(transformer_impl="transformer_engine", fp8_format="hybrid", hidden_size=64, num_attention_heads=4)
    config = Config(ModelConfig(**{**model, **fields}), data=DataConfig(mock_data=True))
    with pytest.raises(ConfigError) as e:
        validate(config, 1)
    assert message in str(e.value) and str(e.value).count("Fix:") == 1
    validate(Config(ModelConfig(**model), data=DataConfig(mock_data=True)), 1)  # the sizes that fit pass
