"""MoE flags: every rule gives one clear error naming the values and the fix; the flags reach
the config; the layer pattern and active-parameter count."""
import pytest

from megalite.arguments import build_parser, config_from_args
from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from megalite.model.gpt import count_active_parameters, count_parameters
from megalite.moe.settings import moe_layers


def _config(world=4, tp=1, sp=False, pp=1, ep=1, zero=0, **moe):
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97,
                        **{"num_experts": 8, **moe})
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                              expert_model_parallel_size=ep)
    return Config(model, parallel, TrainConfig(micro_batch_size=1, zero_stage=zero), DataConfig(mock_data=True)), world


BAD = [
    (dict(ep=3), "--num-experts (8) must be divisible by --expert-model-parallel-size (3)"),
    (dict(world=2, ep=4, num_experts=8), "--expert-model-parallel-size (4) must divide the ranks of one pipeline stage"),
    (dict(ep=2, num_experts=None), "--expert-model-parallel-size 2 without --num-experts"),
    (dict(moe_router_topk=9), "--moe-router-topk 9 must be in [1, --num-experts 8]"),
    (dict(tp=2), "needs --sequence-parallel"),
    (dict(zero=3), "--zero-stage 3 with --num-experts"),
    (dict(moe_layer_freq="[1,0,1]"), "--moe-layer-freq lists 3 layers but the model has --num-layers 4"),
    (dict(moe_layer_freq="[1,2,1,0]"), "a list must hold 0s and 1s"),
    (dict(moe_layer_freq="every"), "is neither a number nor a list"),
    (dict(moe_layer_freq=0), "--moe-layer-freq 0 must be >= 1"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be positive"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn' is not implemented"),
    (dict(moe_aux_loss_coeff=-1.0), "must be >= 0"),
    (dict(tp=2, sp=True, moe_shared_expert_intermediate_size=15), "must be a positive multiple of --tensor-model"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_moe_settings_are_refused(kwargs, message):
    config, world = _config(**kwargs)
    with pytest.raises(ConfigError) as e:
        validate(config, world)
    assert message in str(e.value)
    assert str(e.value).count("Fix:") == 1


def test_expert_tensor_parallel_is_refused_with_the_way_out():
    config, world = _config()
    config.parallel.expert_tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="Fix: --expert-tensor-parallel-size 1"):
        validate(config, world)


def test_flags_reach_the_config_and_layer_pattern():
    args = build_parser().parse_args(
        ["--mock-data", "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "1",
         "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "[0,1,1,1]", "--moe-aux-loss-coeff", "0.01",
         "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.25",
         "--moe-shared-expert-intermediate-size", "32", "--expert-model-parallel-size", "2"])
    config = config_from_args(args, vocab_size=100)
    validate(config, 2)
    m = config.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_expert_capacity_factor) == (8, 1, 64, 1.25)
    assert m.moe_layer_freq == [0, 1, 1, 1] and moe_layers(m) == [False, True, True, True]
    assert config.parallel.expert_model_parallel_size == 2
    assert moe_layers(ModelConfig(num_layers=5, num_experts=4, moe_layer_freq=2)) == [True, False, True, False, True]


def test_active_parameters_count_topk_experts():
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, swiglu=True,
                    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24)
    per_expert = 3 * 32 * 24
    assert count_parameters(m) - count_active_parameters(m) == 2 * 6 * per_expert
