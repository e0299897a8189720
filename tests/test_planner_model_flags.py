"""The planner prints a model as the pretrain_gpt.py flags that rebuild it (megalite.planner.flags):
every ModelConfig setting that differs from what the parser makes of its absence, derived from the
settings' marks, so a new model flag is printed with no edit in the planner.

Round trip: the flags the planner prints for a layout, parsed with pretrain_gpt.py's parser and
validated for the layout's world, give back an equal ModelConfig, for GPT-2, a Llama with Llama
3.1 RoPE scaling, a Qwen3-MoE and a DeepSeek-V3-tiny (MLA, YaRN, sigmoid group-limited routing with
a scaling factor and the expert bias, dense first layers, a shared expert); each model flag printed
is needed (dropping it changes the model); and every setting with a flag, moved off its default
alone, comes back. Single process, well under a second.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest

from megalite.arguments import build_parser, settings_from_args
from megalite.config import ModelConfig, llama3_rope_scaling, validate
from megalite.config_types import yarn_rope_scaling
from megalite.flag_spec import flags_of_field, settings_of
from megalite.moe.settings import parse_layer_freq
from megalite.planner import Layout
from megalite.planner.flags import pretrain_flags
from megalite.planner.flags import ALWAYS, LAYOUT_SETTINGS, model_flags, pattern_text, unwritable_settings

GPT2 = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257,
                   max_position_embeddings=1024)
LLAMA = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=704,
                    seq_length=128, max_position_embeddings=8192, vocab_size=1000, position_embedding_type="rope",
                    rotary_base=500000.0, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, rope_scaling=llama3_rope_scaling(4.0),
                    hidden_dropout=0.0, attention_dropout=0.0)
QWEN3_MOE = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
                        qk_layernorm=True, seq_length=64, vocab_size=1000, position_embedding_type="rope",
                        rotary_base=1000000.0, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                        add_bias_linear=False, untie_embeddings_and_output_weights=True, num_experts=8,
                        moe_router_topk=4, moe_ffn_hidden_size=32, hidden_dropout=0.0, attention_dropout=0.0)
DEEPSEEK_V3_TINY = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=160, seq_length=32, vocab_size=1000,
    position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
    untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=12, rope_scaling=yarn_rope_scaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0),
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1],
    moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid", moe_router_num_groups=4,
    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=2e-3, moe_router_load_balancing_type="none")
MODELS = {"gpt2": GPT2, "llama-llama3-rope": LLAMA, "qwen3-moe": QWEN3_MOE, "deepseek-v3-tiny": DEEPSEEK_V3_TINY}


@functools.lru_cache(maxsize=1)
def _parser():
    return build_parser()


def parsed_model(flags: list[str], world: int | None = None) -> ModelConfig:
    """The model pretrain_gpt.py makes of ``flags`` (validated for ``world`` ranks when given)."""
    config = settings_from_args(_parser().parse_args(flags + ["--mock-data"])).config
    if world is not None:
        validate(config, world)
    config.model.moe_layer_freq = parse_layer_freq(config.model.moe_layer_freq)  # as validate() reads it
    return config.model


@pytest.mark.parametrize("name", MODELS)
def test_printed_flags_rebuild_the_model(name):
    m = MODELS[name]
    layout = Layout(tp=2, dp=2, ep=2 if m.num_experts else 1, experts=bool(m.num_experts))
    flags = pretrain_flags(m, layout, 8, 1)
    assert parsed_model(flags, world=4) == m, flags
    model = model_flags(m)
    for i, one in enumerate(model):  # each printed model flag is needed (the shape is always printed)
        if i < len(ALWAYS):
            continue
        assert parsed_model(model[:i] + model[i + 1:]) != m, one


def test_the_deepseek_flags_are_the_ones_megatron_names():
    flags = model_flags(DEEPSEEK_V3_TINY)
    for one in ("--moe-router-score-function=sigmoid", "--moe-router-num-groups=4", "--moe-router-group-topk=2",
                "--moe-router-topk-scaling-factor=2.5", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate=0.002", "--rope-type=yarn", "--rotary-scaling-factor=40.0",
                "--mscale-all-dim=1.0", "--moe-layer-freq=([0]+[1]*3)", "--multi-latent-attention"):
        assert one in flags, (one, flags)
    assert "--use-rope-scaling" in model_flags(LLAMA) and "--rope-scaling-factor=4.0" in model_flags(LLAMA)
    assert "--rotary-base=1000000.0" in model_flags(QWEN3_MOE)


def _off_default(f: dataclasses.Field, base: ModelConfig) -> list:
    """Values other than the default (and other than what it derives to) for setting ``f``."""
    special = {"moe_layer_freq": [[0, 1, 1, 1], 2], "add_bias_linear": [False],
               "rope_scaling": [llama3_rope_scaling(), llama3_rope_scaling(2.0), yarn_rope_scaling(),
                                yarn_rope_scaling(40.0, 2048, 16.0, 2.0, 0.5, 0.7, truncate=False)]}
    if f.name in special:
        return special[f.name]
    (one,) = flags_of_field(f)
    kwargs, now = dict(one.kwargs), getattr(base, f.name)
    if "choices" in kwargs:
        return [c for c in kwargs["choices"] if c != now]
    if isinstance(now, bool) or kwargs.get("action") == "store_true":
        return [not now]
    kind = kwargs.get("type", type(now))
    if kind is str:
        return ["none"]
    return [kind(3) if now != 3 else kind(5)]


def test_every_setting_off_its_default_comes_back():
    """Each ModelConfig setting with a flag, alone off its default, is printed and parsed back: a
    new flag of the ordinary shape needs no edit in the planner. Settings of another shape have a
    writer (megalite.planner.flags.WRITERS)."""
    assert unwritable_settings() == []
    base = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)
    checked = 0
    for f, _ in settings_of(ModelConfig):
        if not flags_of_field(f) or f.name in ALWAYS or f.name in LAYOUT_SETTINGS:
            continue
        for value in _off_default(f, base):
            m = dataclasses.replace(base, **{f.name: value})
            assert parsed_model(model_flags(m)) == m, \
                (f.name, value, model_flags(m))
            checked += 1
    assert checked > 50


def test_layer_patterns_and_unprintable_models():
    assert pattern_text([0, 0, 0] + [1] * 58) == "([0]*3+[1]*58)" and pattern_text([1, 0, 1]) == "([1]+[0]+[1])"
    with pytest.raises(ValueError, match="attention_kind"):
        model_flags(dataclasses.replace(GPT2, attention_kind="other"))
    with pytest.raises(ValueError, match="has no pretrain_gpt.py flags"):
        model_flags(dataclasses.replace(LLAMA, rope_scaling={**llama3_rope_scaling(), "low_freq_factor": 2.0}))


@pytest.mark.parametrize("name", MODELS)
def test_the_planner_command_line_takes_the_same_model(name):
    """tools/plan_parallel.py takes pretrain_gpt.py's model flags from the same marks: the printed
    flags given to it plan the same model."""
    from tools import plan_parallel

    m = MODELS[name]
    argv = model_flags(m) + ["--global-batch-size", "8", "--gpu-memory-gb", "80"]
    assert plan_parallel.model_from_args(plan_parallel.build_parser().parse_args(argv)) == m
