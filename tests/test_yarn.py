"""YaRN RoPE scaling (``--rope-type yarn``, DeepSeek-V3's long-context RoPE).

The frequencies, the cos/sin amplitude and the softmax scale are checked against a float64
reference written here from the YaRN paper (Peng et al. 2023, section 3.2-3.4), not from
megalite's code: pair m of d/2 has wavelength lambda_m = 2 pi base^(2m/d) and turns
r_m = L / lambda_m times over the original context L; the blend gamma goes linearly from 0 at
the pair turning beta_fast times to 1 at the one turning beta_slow times (solved from
r_m = beta for m, the ends rounded out to whole pairs as DeepSeek does), and

    theta'_m = (1 - gamma_m) theta_m + gamma_m theta_m / s,   sqrt(1/t) = 0.1 ln s + 1

(DeepSeek's split of sqrt(1/t) between cos/sin and the softmax scale: mscale and mscale_all_dim).
Then against transformers' DeepSeek-V3 (no download: a tiny config), an attention layer against
the reference attention, TP 2 x CP 2 training against serial, the flags and bad input.
"""
from __future__ import annotations

import math

import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, validate
from megalite.config_types import yarn_rope_scaling
from megalite.layers.rotary import rotary_amplitude, rotary_angles, softmax_scale, yarn_frequencies
from megalite.model.attention import SelfAttention
from megalite.testing import run_world

V3 = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
          mscale_all_dim=1.0)
CASES = {  # (rotary size, base, scaling)
    "deepseek-v3": (64, 10000.0, V3),
    "megatron defaults, s 4": (64, 10000.0, dict(V3, factor=4.0, mscale_all_dim=0.0)),
    "no rounding": (128, 500000.0, dict(V3, factor=8.0, original_max_position_embeddings=8192, truncate=False,
                                        mscale=0.707, mscale_all_dim=0.707)),
    "ramp clipped at both ends": (16, 10000.0, dict(V3, original_max_position_embeddings=16, beta_fast=4.0)),
    "factor 1": (32, 10000.0, dict(V3, factor=1.0)),
}


def paper_frequencies(d, base, sc):
    """theta'_m for m = 0 .. d/2-1, float64, from the equations in the module docstring."""
    m = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2 * m / d)
    L = sc["original_max_position_embeddings"]

    def pair_turning(beta):  # L / (2 pi base^(2m/d)) = beta  <=>  m = d/2 * log_base(L / (2 pi beta))
        return d / 2 * math.log(L / (2 * math.pi * beta)) / math.log(base)

    lo, hi = pair_turning(sc["beta_fast"]), pair_turning(sc["beta_slow"])
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    gamma = torch.clamp((m - lo) / max(hi - lo, 1e-3), 0.0, 1.0)
    return (1 - gamma) * theta + gamma * theta / sc["factor"]


def paper_mscale(s, coefficient):
    return 1.0 if s <= 1 else 0.1 * coefficient * math.log(s) + 1.0


@pytest.mark.parametrize("name", CASES)
def test_frequencies_amplitude_and_softmax_scale_equal_the_paper(name):
    d, base, sc = CASES[name]
    scaling = yarn_rope_scaling(**sc)
    want = paper_frequencies(d, base, sc)
    got = yarn_frequencies(d, base, scaling)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0), (got, want)
    s = sc["factor"]
    amplitude = paper_mscale(s, sc["mscale"]) / paper_mscale(s, sc["mscale_all_dim"])
    assert rotary_amplitude(scaling) == pytest.approx(amplitude, rel=1e-12)
    cfg = ModelConfig(position_embedding_type="rope", rope_scaling=scaling)
    assert softmax_scale(cfg, 192) == pytest.approx(192 ** -0.5 * paper_mscale(s, sc["mscale_all_dim"]) ** 2,
                                                    rel=1e-12)
    # the angles the model uses: position * theta', cos and sin times the amplitude
    positions = torch.tensor([[0, 1, 7, 4000]])
    cos, sin = rotary_angles(positions, d, base, scaling)
    angle = positions[0, :, None].double() * want
    assert torch.allclose(cos[0, 0, :, : d // 2].double(), amplitude * angle.cos(), atol=2e-4)
    assert torch.allclose(sin[0, 0, :, d // 2:].double(), amplitude * angle.sin(), atol=2e-4)


def test_the_paper_temperature_for_deepseek_v3():
    """V3 (mscale = mscale_all_dim = 1): cos/sin unchanged, the whole sqrt(1/t)^2 on the softmax;
    Megatron's defaults (mscale 1, mscale_all_dim 0): sqrt(1/t) on cos and sin, so on both q and k."""
    v3 = ModelConfig(position_embedding_type="rope", rope_scaling=yarn_rope_scaling(**V3))
    assert rotary_amplitude(v3.rope_scaling) == 1.0
    assert softmax_scale(v3, 192) * math.sqrt(192) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    plain = ModelConfig(position_embedding_type="rope", rope_scaling=yarn_rope_scaling(40.0))
    assert rotary_amplitude(plain.rope_scaling) == pytest.approx(0.1 * math.log(40) + 1)
    assert softmax_scale(plain, 64) == 64 ** -0.5
    assert softmax_scale(ModelConfig(), 64) == 64 ** -0.5  # no scaling


@pytest.mark.parametrize("name", CASES)
def test_transformers_deepseek_v3_computes_the_same(name):
    """transformers' DeepSeek-V3 rope (its yarn init function) and attention scale from a tiny
    config: inv_freq, attention factor and softmax scale within 1e-6."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    d, base, sc = CASES[name]
    # (transformers puts mscale(s, 1) on cos/sin whenever mscale_all_dim is 0, Megatron and megalite
    # mscale(s, mscale) / 1: the same for every case here, whose mscale is 1 where mscale_all_dim is 0)
    assert sc["mscale_all_dim"] != 0 or sc["mscale"] == 1
    hf_scaling = {"rope_type": "yarn", "rope_theta": base, **sc}
    config = transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=d,
        qk_nope_head_dim=32, v_head_dim=32, rope_parameters=hf_scaling,
        max_position_embeddings=int(sc["factor"] * sc["original_max_position_embeddings"]))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = yarn_rope_scaling(**sc)
    assert torch.allclose(yarn_frequencies(d, base, scaling), inv_freq.float(), rtol=1e-6, atol=0)
    assert rotary_amplitude(scaling) == pytest.approx(attention_factor, rel=1e-6)
    hf_attention = DeepseekV3Attention(config, layer_idx=0)
    cfg = ModelConfig(position_embedding_type="rope", rope_scaling=scaling)
    assert softmax_scale(cfg, config.qk_head_dim) == pytest.approx(hf_attention.scaling, rel=1e-6)


def reference_attention(x, wq, wk, wv, wo, heads, d, cos, sin, scale):
    """softmax(rope(q) rope(k)^T * scale + causal) v, float64, multi-head; cos/sin (s, d)."""
    s = x.shape[0]

    def rope(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    q, k, v = ((x @ w.T).view(s, heads, d).transpose(0, 1) for w in (wq, wk, wv))
    scores = rope(q) @ rope(k).transpose(1, 2) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, heads * d) @ wo.T


@pytest.mark.parametrize("backend, dtype, tolerance", [("torch", torch.float64, 1e-5),
                                                     ("triton", torch.float32, 1e-4)])
def test_the_attention_layer_takes_the_yarn_softmax_scale(backend, dtype, tolerance):
    """SelfAttention with YaRN (mscale 1, mscale_all_dim 0.5: both corrections on) equals the
    reference with the paper's scale (q k^T / sqrt(d) alone is 2.3x off in the scores), on
    torch's SDPA and on megalite's Triton kernel (CPU: TRITON_INTERPRET=1); context parallel:
    the TP 2 x CP 2 test below."""
    if backend == "triton":
        from megalite.layers.backends import triton_missing
        if triton_missing():
            pytest.skip(triton_missing())
    torch.manual_seed(0)
    h, heads, d, s, base = 32, 2, 16, 12, 10000.0
    sc = dict(V3, original_max_position_embeddings=16, mscale_all_dim=0.5)
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, position_embedding_type="rope",
                      rope_scaling=yarn_rope_scaling(**sc), add_bias_linear=False, attention_dropout=0.0,
                      attention_backend=backend)
    attn = SelfAttention(cfg).to(dtype)
    wq, wk, wv, wo = (torch.randn(h, h, dtype=torch.float64) * 0.5 for _ in range(4))
    with torch.no_grad():  # one group per head: (q, k, v) rows of each head in turn
        attn.qkv.weight.copy_(torch.cat([torch.cat([w.view(heads, d, h)[i] for w in (wq, wk, wv)])
                                         for i in range(heads)]))
        attn.proj.weight.copy_(wo)
    x = torch.randn(s, 1, h, dtype=torch.float64)
    positions = torch.arange(s)
    cos, sin = rotary_angles(positions[None], d, base, cfg.rope_scaling)
    got = attn(x.to(dtype), (cos.to(dtype), sin.to(dtype)))[:, 0].double()
    angle = positions[:, None].double() * paper_frequencies(d, base, sc)
    amplitude = paper_mscale(40, 1.0) / paper_mscale(40, 0.5)
    ref_cos, ref_sin = (amplitude * torch.cat([f(angle)] * 2, -1) for f in (torch.cos, torch.sin))
    scale = d ** -0.5 * paper_mscale(40, 0.5) ** 2
    want = reference_attention(x[:, 0], wq, wk, wv, wo, heads, d, ref_cos, ref_sin, scale)
    assert (got - want).abs().max().item() < tolerance * want.abs().max().item()


YARN_FLAGS = ["--rope-type", "yarn", "--rotary-scaling-factor", "40", "--yarn-original-max-position-embeddings",
              "16", "--yarn-beta-fast", "32", "--yarn-beta-slow", "1", "--mscale", "1", "--mscale-all-dim", "0.5"]


def test_the_flags_build_the_scaling():
    from megalite.arguments import build_parser, config_from_args

    def scaling(argv):
        return config_from_args(build_parser().parse_args(["--position-embedding-type", "rope", *argv]),
                                1234, eod_token=3).model.rope_scaling

    assert scaling(YARN_FLAGS) == yarn_rope_scaling(40.0, 16, 32.0, 1.0, 1.0, 0.5, True)
    assert scaling(["--rope-type", "yarn", "--no-yarn-correction-range-round-to-int"]) == \
        yarn_rope_scaling(truncate=False)  # Megatron's defaults otherwise
    assert scaling([]) is None and scaling(["--rope-type", "rope"]) is None
    assert scaling(["--use-rope-scaling"])["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="--use-rope-scaling .* and --rope-type yarn"):
        scaling(["--use-rope-scaling", "--rope-type", "yarn"])


def test_deepseek_v3s_own_rope_scaling_dict_is_taken_as_it_stands():
    """DeepSeek-V3's config.json form (older key ``type``, integer betas, no ``truncate``): valid,
    and the same frequencies and scales as the flags' form."""
    as_published = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    model = ModelConfig(position_embedding_type="rope", rope_scaling=as_published)
    validate(Config(model=model, data=DataConfig(mock_data=True)))
    ours = yarn_rope_scaling(**V3)
    assert torch.equal(yarn_frequencies(64, 10000.0, as_published), yarn_frequencies(64, 10000.0, ours))
    assert rotary_amplitude(as_published) == rotary_amplitude(ours)
    assert softmax_scale(model, 192) == softmax_scale(ModelConfig(rope_scaling=ours), 192)


@pytest.mark.parametrize("change, message", [
    (dict(factor=0.0), r"--rotary-scaling-factor 0.0: .* must be > 0"),
    (dict(factor=-2.0), r"--rotary-scaling-factor -2.0"),
    (dict(beta_fast=1.0), r"--yarn-beta-fast 1.0 <= --yarn-beta-slow 1.0"),
    (dict(beta_slow=0.0), r"--yarn-beta-slow 0.0: .* > 0"),
    (dict(original_max_position_embeddings=0), r"--yarn-original-max-position-embeddings 0"),
    (dict(mscale=-1.0), r"--mscale -1.0"),
    (dict(mscale_all_dim=-0.5), r"--mscale-all-dim -0.5"),
])
def test_bad_yarn_settings_are_one_message(change, message):
    model = ModelConfig(position_embedding_type="rope", rope_scaling=yarn_rope_scaling(**dict(V3, **change)))
    with pytest.raises(ConfigError, match=message):
        validate(Config(model=model, data=DataConfig(mock_data=True)))


def test_a_scaling_dict_without_its_keys_or_rope_is_one_message():
    partial = {"rope_type": "yarn", "factor": 40.0}
    with pytest.raises(ConfigError, match="yarn needs original_max_position_embeddings, beta_fast"):
        validate(Config(model=ModelConfig(position_embedding_type="rope", rope_scaling=partial),
                        data=DataConfig(mock_data=True)))
    with pytest.raises(ConfigError, match="needs --position-embedding-type rope"):
        validate(Config(model=ModelConfig(rope_scaling=yarn_rope_scaling(**V3)), data=DataConfig(mock_data=True)))
    with pytest.raises(ConfigError, match="llama3 and yarn schedules"):
        validate(Config(model=ModelConfig(position_embedding_type="rope", rope_scaling={"rope_type": "ntk"}),
                        data=DataConfig(mock_data=True)))


GPT = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
       "4", "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--swiglu", "--disable-bias-linear", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
       "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2_CP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
           "--cp-comm-type", "p2p"]


def _runs(rank, world, runs):
    from megalite.train.pretrain import pretrain
    return [[(r["loss"], r["grad_norm"]) for r in pretrain(argv)] for argv in runs]


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_yarn_under_tp2_and_cp2_equals_serial():
    """A GPT with YaRN (both corrections on) trains under TP 2 + SP x CP 2 (ring) as serially,
    losses and grad norms within 1e-5 (fp32); and YaRN changes the losses (it is on)."""
    serial, plain = run_world(_runs, 1, [GPT + YARN_FLAGS, GPT])[0]
    assert len(serial) == 3 and abs(serial[0][0] - plain[0][0]) > 1e-6
    got = run_world(_runs, 4, [GPT + YARN_FLAGS + TP2_CP2])[0][0]
    worst = max(abs(a - b) / abs(b) for pair, ref in zip(got, serial) for a, b in zip(pair, ref))
    assert worst < 1e-5, (got, serial)


def test_a_checkpoint_fixes_yarn(tmp_path, monkeypatch):
    """rope_scaling is a fixed setting: a run loading a YaRN checkpoint takes its scaling, and a
    YaRN flag typed against it is refused with both values (the checkpoint's files: not read here)."""
    import dataclasses

    from megalite.checkpoint import serial, settings
    from megalite.checkpoint.settings import FIXED, adopt_checkpoint_model

    monkeypatch.setattr(serial, "_checkpoint_dir", lambda load: load)
    monkeypatch.setattr(settings, "checkpoint_record", lambda directory: None)

    saved_model = ModelConfig(position_embedding_type="rope", rope_scaling=yarn_rope_scaling(**V3))
    saved = {field: getattr(saved_model, field) for field in FIXED}
    run = dataclasses.replace(saved_model, rope_scaling=None)
    assert "rope_scaling" in adopt_checkpoint_model(run, saved, set(), saved["vocab_size"], str(tmp_path))
    assert run.rope_scaling == saved["rope_scaling"]
    typed = dataclasses.replace(saved_model, rope_scaling=yarn_rope_scaling(**dict(V3, factor=8.0)))
    with pytest.raises(ConfigError, match="the checkpoint has .*'factor': 40.0.*the command line gives .*'factor': 8.0"):
        adopt_checkpoint_model(typed, saved, {"rotary_scaling_factor"}, saved["vocab_size"], str(tmp_path))
