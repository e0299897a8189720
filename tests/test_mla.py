"""Multi-head Latent Attention (``--multi-latent-attention``, DeepSeek-V2/V3).

The layer is checked against a float64 reference written from the DeepSeek-V2 paper's equations
(section 2.1), not from megalite's code: separate matrices W_DQ (r_q x h), W_UQ (a d_n x r_q),
W_QR (a d_r x r_q), W_DKV (r_kv x h), W_UK (a d_n x r_kv), W_UV (a d_v x r_kv), W_KR (d_r x h)
and W_O (h x a d_v):

    c_q = RMSNorm(W_DQ x);  q_n = W_UQ c_q;  q_r = RoPE(W_QR c_q)
    c_kv = RMSNorm(W_DKV x);  k_n = W_UK c_kv;  v = W_UV c_kv;  k_r = RoPE(W_KR x)  (one, shared)
    o_i = softmax([q_n,i; q_r,i] [k_n,i; k_r]^T / sqrt(d_n + d_r) + causal) v_i;  y = W_O [o_1 ... o_a]

megalite fuses some of them (per head [q_n; q_r] rows, [c_kv; k_r] and per head [k_n; v]): the
test lays the separate matrices out that way. The shapes (parameters, FLOPs) are the built
model's; bad settings get one message each. Every layout equals serial: tests/test_mla_layouts.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, validate
from megalite.layers.part_shape import MLAShape
from megalite.model.counting import flops_per_token, total_parameters
from megalite.model.gpt import GPTModel, count_parameters
from megalite.model.mla import MultiLatentAttention
from megalite.model.parts import attention_part

H, A, DN, DR, DV, RQ, RKV, EPS, BASE = 32, 4, 8, 4, 6, 12, 10, 1e-6, 10000.0


def mla_config(**kw) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=A, multi_latent_attention=True,
                  q_lora_rank=RQ, kv_lora_rank=RKV, qk_head_dim=DN, qk_pos_emb_head_dim=DR, v_head_dim=DV,
                  normalization="RMSNorm", norm_epsilon=EPS, position_embedding_type="rope", swiglu=True,
                  add_bias_linear=False, vocab_size=100, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**fields, **kw})


def rope(t, positions):
    """Rotate the pairs (m, m + d_r/2) of t (..., s, d_r) by the angle position * base^(-2m/d_r)."""
    theta = BASE ** (-torch.arange(0, DR, 2, dtype=torch.float64) / DR)
    angle = positions[:, None].double() * theta[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    return t * cos + torch.cat([-t[..., DR // 2:], t[..., :DR // 2]], -1) * sin


def rms(t, w):
    return w * t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS)


def reference(x, w, positions, scale=None, rotate=None):
    """x (s, h) float64 -> (s, h) from the equations of the module docstring; w: the matrices.
    ``scale``: the softmax scale (default 1/sqrt(d_n + d_r)); ``rotate``: RoPE (default :func:`rope`)."""
    scale = 1 / math.sqrt(DN + DR) if scale is None else scale
    rope_ = rope if rotate is None else rotate
    s = x.shape[0]
    c_q = rms(x @ w["dq"].T, w["q_norm"])
    q_n = (c_q @ w["uq"].T).view(s, A, DN)
    q_r = rope_((c_q @ w["qr"].T).view(s, A, DR).transpose(0, 1), positions)  # (a, s, d_r)
    c_kv = rms(x @ w["dkv"].T, w["kv_norm"])
    k_n, v = (c_kv @ w["uk"].T).view(s, A, DN), (c_kv @ w["uv"].T).view(s, A, DV)
    k_r = rope_(x @ w["kr"].T, positions)  # (s, d_r): one for every head
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    out = []
    for i in range(A):
        q = torch.cat([q_n[:, i], q_r[i]], -1)
        k = torch.cat([k_n[:, i], k_r], -1)
        scores = (q @ k.T * scale).masked_fill(causal, float("-inf"))
        out.append(scores.softmax(-1) @ v[:, i])
    return torch.cat(out, -1) @ w["o"].T


def _reference_weights(attn):
    torch.manual_seed(0)
    shapes = dict(dq=(RQ, H), uq=(A * DN, RQ), qr=(A * DR, RQ), dkv=(RKV, H), uk=(A * DN, RKV), uv=(A * DV, RKV),
                  kr=(DR, H), o=(H, A * DV))
    w = {name: torch.randn(*shape, dtype=torch.float64) / math.sqrt(shape[1]) for name, shape in shapes.items()}
    w["q_norm"] = 1 + 0.5 * torch.randn(RQ, dtype=torch.float64)
    w["kv_norm"] = 1 + 0.5 * torch.randn(RKV, dtype=torch.float64)
    with torch.no_grad():  # megalite's fused layouts, from the separate matrices
        attn.q_down.weight.copy_(w["dq"])
        attn.q_up.weight.copy_(torch.cat([w["uq"].view(A, DN, RQ), w["qr"].view(A, DR, RQ)], 1).reshape(-1, RQ))
        attn.kv_down.weight.copy_(torch.cat([w["dkv"], w["kr"]]))
        attn.kv_up.weight.copy_(torch.cat([w["uk"].view(A, DN, RKV), w["uv"].view(A, DV, RKV)], 1).reshape(-1, RKV))
        attn.proj.weight.copy_(w["o"])
        attn.q_norm.weight.copy_(w["q_norm"])
        attn.kv_norm.weight.copy_(w["kv_norm"])
    return w


def test_the_layer_equals_the_float64_reference():
    attn = MultiLatentAttention(mla_config()).double()
    w = _reference_weights(attn)
    s = 12
    x = torch.randn(s, 1, H, dtype=torch.float64)
    positions = torch.arange(s)
    from megalite.layers.rotary import rotary_angles
    cos, sin = rotary_angles(positions[None], mla_config().rotary_dim, BASE)
    got = attn(x, (cos.double(), sin.double()))[:, 0]
    want = reference(x[:, 0], w, positions)
    # the core attention's softmax runs in fp32: 1e-6 of the largest output
    assert (got - want).abs().max().item() < 1e-6 * want.abs().max().item()
    got.sum().backward()
    for p in attn.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_yarn_scales_the_latent_attention_softmax():
    """DeepSeek-V3's YaRN: the softmax scale is 1/sqrt(d_qk) times mscale(S, mscale_all_dim)^2,
    mscale(S, m) = 0.1 m ln S + 1 (S = 40, mscale_all_dim = 1 here), and the RoPE part rotates by
    YaRN's angles (megalite.layers.rotary, checked against the paper and transformers in test_yarn)."""
    from megalite.config_types import yarn_rope_scaling
    from megalite.layers.rotary import rotary_angles

    scaling = yarn_rope_scaling(factor=40.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0)
    cfg = mla_config(rope_scaling=scaling)
    attn = MultiLatentAttention(cfg).double()
    w = _reference_weights(attn)
    s = 12
    x = torch.randn(s, 1, H, dtype=torch.float64)
    positions = torch.arange(s)
    cos, sin = (a.double() for a in rotary_angles(positions[None], cfg.rotary_dim, BASE, scaling))
    c, sn = cos[0, 0], sin[0, 0]  # (s, d_r)

    def yarn_rope(t, _positions):
        return t * c + torch.cat([-t[..., DR // 2:], t[..., :DR // 2]], -1) * sn

    scale = (0.1 * 1.0 * math.log(40.0) + 1) ** 2 / math.sqrt(DN + DR)
    got = attn(x, (cos, sin))[:, 0]
    want = reference(x[:, 0], w, positions, scale=scale, rotate=yarn_rope)
    assert (got - want).abs().max().item() < 1e-6 * want.abs().max().item()


def test_without_a_query_latent_it_is_one_query_matrix():
    cfg = mla_config(q_lora_rank=None)
    attn = MultiLatentAttention(cfg)
    assert attn.q_down is None and attn.q_norm is None and attn.q_proj.weight.shape == (A * (DN + DR), H)
    assert attention_part(cfg) is MultiLatentAttention
    assert attention_part(mla_config(multi_latent_attention=False)).__name__ == "SelfAttention"


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=None), dict(normalization="LayerNorm"),
                                dict(add_bias_linear=True)])
def test_the_shape_is_the_built_model(kw):
    """Parameters (total and per tensor, TP 1) and FLOPs (2 a (d_qk + d_v) per attended position)."""
    cfg = mla_config(**kw)
    assert total_parameters(cfg) == count_parameters(cfg)
    assert MLAShape.parameter_list(cfg, 1) == [p.numel() for p in MultiLatentAttention(cfg).parameters()]
    n, L, s = count_parameters(cfg), cfg.num_layers, cfg.seq_length
    assert flops_per_token(cfg) == 6 * n + 3 * L * 2 * A * (DN + DR + DV) * s
    names = {name for name, _ in GPTModel(cfg).named_parameters()}
    assert "layers.0.attn.kv_down.weight" in names and "layers.0.attn.kv_norm.weight" in names


def test_the_latent_norms_are_ones_at_init():
    model = GPTModel(mla_config())
    model.init_weights(3)
    attn = model.layers["1"].attn
    assert torch.equal(attn.kv_norm.weight, torch.ones(RKV)) and torch.equal(attn.q_norm.weight, torch.ones(RQ))
    assert not getattr(attn.kv_down.weight, "sequence_parallel", False)  # TP 1: nothing to sum


@pytest.mark.parametrize("change, parallel, message", [
    (dict(qk_pos_emb_head_dim=5), {}, "--qk-pos-emb-head-dim"),
    (dict(position_embedding_type="learned_absolute"), {}, "rope"),
    (dict(kv_lora_rank=0), {}, "--kv-lora-rank"),
    (dict(q_lora_rank=0), {}, "--q-lora-rank"),
    (dict(attention_backend="flash"), {}, "value head size"),
    (dict(attention_backend="triton", qk_head_dim=260), {}, "--qk-head-dim \\+ --qk-pos-emb-head-dim = 264"),
    (dict(num_query_groups=2), {}, "no key/value groups"),
    (dict(transformer_impl="transformer_engine"), {}, "transformer-engine"),
    (dict(num_attention_heads=3), dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size"),
])
def test_bad_settings_are_one_message(change, parallel, message):
    cfg = mla_config(**change)
    with pytest.raises(ConfigError, match=message):
        validate(Config(model=cfg, parallel=ParallelConfig(**parallel)), world_size=2 if parallel else 1)


def test_the_heads_need_not_divide_the_hidden_size():
    """MLA's heads have their own sizes: hidden 32 with 3 heads (and an odd hidden/heads) is valid."""
    for cfg in (mla_config(num_attention_heads=3), mla_config(hidden_size=36)):  # hidden/heads 9: odd
        validate(Config(model=cfg, data=DataConfig(mock_data=True)))


MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "64",
             "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm"]


def test_planner_weights_match_the_meta_dry_run():
    """TP 2 + SP x PP 2 x DP 2 (ZeRO-1) on meta: the weights the planner counts from MLAShape
    (split heads, replicated down-projections and latent norms) are the model's to the byte on
    every stage; the activations it plans are within 10% of the dry run's (measured: 6% over on
    stage 0, 2% under on stage 1)."""
    from tests.test_seam_attention import DRY, _planned_and_measured

    for role in _planned_and_measured(DRY + MLA_FLAGS, "self")[1]:
        assert role["categories"]["parameters"] == role["planned_categories"]["weights"], role["role"]
        measured, planned = role["categories"]["activations"], role["planned_categories"]["activations"]
        assert abs(measured - planned) / planned < 0.1, (role["role"], measured, planned)


def test_printed_flags_keep_the_latent_attention():
    from megalite.arguments import build_parser, config_from_args
    from megalite.planner import Layout
    from megalite.planner.flags import pretrain_flags

    m = mla_config(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1000, seq_length=256,
                   q_lora_rank=None)
    flags = pretrain_flags(m, Layout(tp=2, dp=4), 16, 1)
    got = config_from_args(build_parser().parse_args(flags + ["--mock-data"]), m.vocab_size).model
    fields = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim")
    assert [getattr(got, k) for k in fields] == [getattr(m, k) for k in fields]


def test_a_latent_attention_model_is_not_exported_as_llama():
    """An MLA model passes the Llama architecture check (rope, RMSNorm, SwiGLU) but has no q/k/v
    matrices: the export refuses it in one message before writing anything."""
    from megalite.checkpoint.hf_llama import UnsupportedModel, hf_config_from_llama

    with pytest.raises(UnsupportedModel, match="Multi-head Latent Attention or YaRN"):
        hf_config_from_llama(mla_config(), "llama", torch.float32, {})


def test_the_triton_limit_reads_the_latent_attention_sizes():
    """hidden / heads above the Triton limit means nothing under MLA (its heads have their own
    sizes): a model of 2 heads of hidden 640 validates with MLA's 12 + 4 / 6 head sizes."""
    from megalite.config import Config, DataConfig, ParallelConfig, TrainConfig, validate

    model = mla_config(hidden_size=640, num_attention_heads=2, attention_backend="triton")
    assert validate(Config(model, ParallelConfig(), TrainConfig(), DataConfig(mock_data=True)), 1) == []
