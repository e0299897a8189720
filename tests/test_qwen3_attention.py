"""Qwen3's attention: QK-norm (``--qk-layernorm``) and a head size apart from hidden/heads
(``--kv-channels``).

The layer is checked against a float64 reference written from the equations (Qwen3 report /
the RoFormer paper), not from megalite's code: separate W_q (a d x h), W_k, W_v (g d x h) and
W_o (h x a d);

    q_i = RMSNorm(W_q x)_i = w_q * q_i / sqrt(mean_j q_ij^2 + eps)   per head i, over its d
    k_j likewise with w_k;  then RoPE: x -> x cos(t theta) + rotate_half(x) sin(t theta),
    theta_m = base^(-2m/d);  o_i = softmax(q_i k_{g(i)}^T / sqrt(d) + causal) v_{g(i)};
    y = W_o [o_0 ... o_{a-1}]

and the parts' shapes (parameters, FLOPs, activations) are the built model's. Every parallel
layout equals serial: tests/test_qwen3_layouts.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from megalite.config import ConfigError, ModelConfig
from megalite.layers.part_shape import SelfAttentionShape
from megalite.model.attention import SelfAttention
from megalite.model.counting import flops_per_token, total_parameters
from megalite.model.gpt import GPTModel, count_parameters

H, A, G, D, EPS, BASE = 32, 4, 2, 16, 1e-6, 10000.0  # width a d = 64 != h = 32


def qwen3_config(**kw) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=A, num_query_groups=G, kv_channels=D,
                  qk_layernorm=True, normalization="RMSNorm", norm_epsilon=EPS, position_embedding_type="rope",
                  swiglu=True, add_bias_linear=False, vocab_size=100, seq_length=16, hidden_dropout=0.0,
                  attention_dropout=0.0)
    return ModelConfig(**{**fields, **kw})


def rope_angles(positions):
    """cos and sin (s, d) of t theta_m, each repeated for the two halves, float64."""
    theta = BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = positions[:, None].double() * theta[None]  # (s, d/2)
    return torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)


def reference_attention(x, wq, wk, wv, wo, norm_q, norm_k, positions):
    """x (s, h) float64 -> (s, h), from the equations in the module docstring."""
    s = x.shape[0]

    def rms(t, w):  # over the last (head) dim
        return w * t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS)

    def rope(t):  # t (heads, s, d): rotate the pairs (m, m + d/2) by angle t * theta_m
        cos, sin = rope_angles(positions)
        half = torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)
        return t * cos + half * sin

    q = rope(rms((x @ wq.T).view(s, A, D).transpose(0, 1), norm_q))
    k = rope(rms((x @ wk.T).view(s, G, D).transpose(0, 1), norm_k))
    v = (x @ wv.T).view(s, G, D).transpose(0, 1)
    out = []
    for i in range(A):
        g = i // (A // G)  # query heads 0..a/g-1 share key/value group 0, and so on
        scores = q[i] @ k[g].T / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out.append(scores.softmax(-1) @ v[g])
    return torch.cat(out, -1) @ wo.T


def test_attention_equals_the_float64_reference():
    torch.manual_seed(0)
    cfg = qwen3_config()
    attn = SelfAttention(cfg).double()
    wq, wk, wv = (torch.randn(n * D, H, dtype=torch.float64) * 0.3 for n in (A, G, G))
    wo = torch.randn(H, A * D, dtype=torch.float64) * 0.3
    norm_q, norm_k = 1 + 0.5 * torch.randn(D, dtype=torch.float64), 1 + 0.5 * torch.randn(D, dtype=torch.float64)
    # megalite's fused qkv rows, per key/value group: its query heads, its key head, its value head
    per = A // G
    fused = torch.cat([torch.cat([wq.view(G, per * D, H)[g], wk.view(G, D, H)[g], wv.view(G, D, H)[g]])
                       for g in range(G)])
    with torch.no_grad():
        attn.qkv.weight.copy_(fused)
        attn.proj.weight.copy_(wo)
        attn.q_norm.weight.copy_(norm_q)
        attn.k_norm.weight.copy_(norm_k)
    s = 12
    x = torch.randn(s, 1, H, dtype=torch.float64)
    positions = torch.arange(s)
    cos, sin = rope_angles(positions)
    got = attn(x, (cos[None, None], sin[None, None]))[:, 0]
    want = reference_attention(x[:, 0], wq, wk, wv, wo, norm_q, norm_k, positions)
    # the core attention's softmax runs in fp32 (measured 7e-8 of the largest output): 1e-6
    assert (got - want).abs().max().item() < 1e-6 * want.abs().max().item()
    # the norm weights get a gradient (each rank's heads' share of it under TP: the layouts test)
    got.sum().backward()
    assert attn.q_norm.weight.grad.abs().sum() > 0 and attn.k_norm.weight.grad.abs().sum() > 0


def test_the_shape_is_the_built_model():
    """Parameters (the q/k norms replicated, the linears heads x kv-channels wide), the per-tensor
    list, FLOPs (attention 4 a d per attended position) from the parts' shapes equal the model's."""
    for kw in (dict(), dict(qk_layernorm=False), dict(kv_channels=None, qk_layernorm=True),
               dict(normalization="LayerNorm")):
        cfg = qwen3_config(**kw)
        assert total_parameters(cfg) == count_parameters(cfg), kw
        attn = SelfAttention(cfg)
        assert SelfAttentionShape.parameter_list(cfg, 1) == [p.numel() for p in attn.parameters()], kw
        L, s, n = cfg.num_layers, cfg.seq_length, count_parameters(cfg)
        assert flops_per_token(cfg) == 6 * n + 12 * L * A * cfg.head_dim * s, kw
    cfg = qwen3_config()
    names = {n for n, _ in GPTModel(cfg).named_parameters()}
    assert {"layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight"} <= names
    assert GPTModel(cfg).layers["0"].attn.qkv.weight.shape == ((A + 2 * G) * D, H)
    _, split, _ = SelfAttentionShape.activation_bytes(cfg, 16, 2, 2)
    # q k v out, the qkv output the norms' inputs keep, the query heads' GQA copy, their 1/rms per
    # head and token
    assert split == 2 * 16 * 2 * A * D * (2 + 2 * G / A + 1 + 2 * G / A + (G < A)) + 4 * 16 * 2 * (A + G)


def test_the_norm_weights_are_ones_at_init_and_marked_for_the_tp_sum():
    cfg = qwen3_config()
    model = GPTModel(cfg)
    model.init_weights(3)
    attn = model.layers["1"].attn
    assert torch.equal(attn.q_norm.weight, torch.ones(D)) and torch.equal(attn.k_norm.weight, torch.ones(D))
    assert not getattr(attn.q_norm.weight, "sequence_parallel", False)  # TP 1: nothing to sum


@pytest.mark.parametrize("change, message", [
    (dict(kv_channels=0), "--kv-channels"),
    (dict(kv_channels=15), "even head dim"),
    (dict(hidden_size=30, kv_channels=None, qk_layernorm=False), "--kv-channels"),
])
def test_bad_head_sizes_are_one_message(change, message):
    from megalite.config import Config, validate
    cfg = qwen3_config(**change)
    with pytest.raises(ConfigError, match=message):
        validate(Config(model=cfg))


def test_a_hidden_size_not_divisible_by_the_heads_is_fine_with_kv_channels():
    from megalite.config import Config, validate
    cfg = qwen3_config(hidden_size=30, kv_channels=16)
    config = Config(model=cfg)
    config.data.mock_data = True
    validate(config)
    model = GPTModel(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, 100, (2, 16))
    assert torch.isfinite(model(tokens, labels=tokens)).all()


def test_planner_memory_matches_the_dry_run():
    """TP 2 + SP x PP 2 x DP 2 on meta, RoPE attention with a head size of twice hidden/heads,
    without and with QK-norm: the weights the planner counts from the shapes are the model's to
    the byte; the activations QK-norm's shape adds are what the dry run measures it adding (3%),
    and the planner's total is as close to the measured peak as for hidden/heads heads."""
    from tests.test_seam_attention import DRY, _planned_and_measured

    rope = ["--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    plain = _planned_and_measured(DRY + rope, "self")[1]
    wide = _planned_and_measured(DRY + rope + ["--kv-channels", "128"], "self")[1]
    qwen = _planned_and_measured(DRY + rope + ["--kv-channels", "128", "--qk-layernorm"], "self")[1]
    for base, mid, role in zip(plain, wide, qwen):
        for run in (mid, role):
            assert run["categories"]["parameters"] == run["planned_categories"]["weights"], run["role"]
        measured = role["categories"]["activations"] - mid["categories"]["activations"]
        planned = role["planned_categories"]["activations"] - mid["planned_categories"]["activations"]
        print(role["role"], measured, planned)
        # the peak may fall inside a q/k norm's backward, whose fp32 temporaries (x, dy, x^) the
        # planner does not hold per layer: measured 16% over on the 2-layer stage 0, 0% on stage 1
        assert planned > 0 and abs(measured - planned) / planned < 0.2, (role["role"], measured, planned)
        assert abs(role["difference"]) <= abs(base["difference"]) + 0.01, (role["difference"], base["difference"])


def test_transformer_engine_layers_take_qk_norm_and_kv_channels(monkeypatch):
    """QK-norm is megalite's own norm between TE's LayerNormLinear qkv and TE's attention core,
    so --transformer-impl transformer_engine takes it (here TE's stand-in, tests/te_standin.py):
    the same parameter names, loss and gradients as the local layers."""
    import dataclasses

    from tests import te_standin
    from tests.test_transformer_engine import _loss_and_grads

    te_standin.install(monkeypatch)
    cfg = qwen3_config(seq_length=16, vocab_size=97)
    local_loss, local_grads, _ = _loss_and_grads(cfg)
    te_loss, te_grads, model = _loss_and_grads(dataclasses.replace(cfg, transformer_impl="transformer_engine"))
    assert type(model.layers["0"].attn.qkv).__name__ == "LayerNormLinear"
    assert list(te_grads) == list(local_grads)
    assert abs(te_loss - local_loss) <= 1e-6 * local_loss
    for name, grad in local_grads.items():
        assert torch.allclose(te_grads[name], grad, rtol=1e-5, atol=1e-7), name


def test_fused_kernels_normalize_the_heads_the_same():
    """--fused-kernels: the q/k norms run the Triton RMSNorm over each head's row (a
    non-contiguous view of qkv): the same loss and norm-weight gradients as torch's."""
    results = []
    for fused in (False, True):
        model = GPTModel(qwen3_config(fused_kernels=fused))
        model.init_weights(0)
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attn.q_norm.weight.normal_(1, 0.3, generator=torch.Generator().manual_seed(1))
        tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        attn = model.layers["0"].attn
        results.append((loss.item(), attn.q_norm.weight.grad, attn.k_norm.weight.grad, type(attn.q_norm).__name__))
    (torch_loss, *torch_grads, _), (fused_loss, *fused_grads, kind) = results
    assert kind == "FusedRMSNorm" and abs(fused_loss - torch_loss) <= 1e-6 * torch_loss
    for a, b in zip(torch_grads, fused_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_triton_head_size_too_large_names_kv_channels():
    """The Triton backend's head-size limit names the flag that set the size: --kv-channels."""
    from megalite.config import Config, DataConfig, ParallelConfig, TrainConfig, validate

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=2, kv_channels=288, vocab_size=100,
                        seq_length=32, attention_backend="triton", attention_dropout=0.0)
    with pytest.raises(ConfigError, match="got --kv-channels = 288. Fix: a smaller --kv-channels"):
        validate(Config(model, ParallelConfig(), TrainConfig(), DataConfig(mock_data=True)), 1)
