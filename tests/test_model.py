"""The serial GPT: determinism, accumulation, variants, init independent of padding."""
import pytest
import torch

from megalite.config import ModelConfig, TrainConfig
from megalite.model.gpt import GPTModel, count_parameters
from megalite.parallel.random import model_parallel_seed
from megalite.train.step import LossScaler, forward_backward, lr_at
from megalite.testing.reference_step import build_optimizer, train_step


def tiny(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def batch(cfg, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    return {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(b, cfg.seq_length),
            "position_ids": torch.arange(cfg.seq_length).expand(b, -1)}


def build(cfg, seed=1):
    model = GPTModel(cfg)
    model.init_weights(seed)
    return model


def split(batch_, n):
    return [{k: v.chunk(n)[i] for k, v in batch_.items()} for i in range(n)]


VARIANTS = {
    "gpt2": {},
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  num_query_groups=2, untie_embeddings_and_output_weights=True,
                  add_bias_linear=False),
    "gqa1": dict(num_query_groups=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_accumulation_of_4_micro_batches_equals_one_big_batch(variant):
    cfg = tiny(**VARIANTS[variant])
    t = TrainConfig()
    data = batch(cfg, 8)
    m1, m2 = build(cfg), build(cfg)
    loss_big = forward_backward(m1, [data], t)
    loss_acc = forward_backward(m2, split(data, 4), t)
    assert torch.allclose(loss_big, loss_acc, rtol=1e-6, atol=0)
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        err = (p1.grad - p2.grad).abs().max() / p1.grad.abs().max().clamp_min(1e-12)
        assert err < 1e-6, (name, err.item())


def _run(cfg, steps=3, seed=7):
    torch.manual_seed(0)
    model_parallel_seed(seed)
    model = build(cfg, seed)
    t = TrainConfig(train_iters=steps, lr=1e-3, seed=seed)
    opt = build_optimizer(model, t)
    losses = [train_step(model, opt, split(batch(cfg, 4, s), 2), t, s, LossScaler(False)).loss
              for s in range(steps)]
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_bit_identical_runs_with_dropout():
    cfg = tiny(hidden_dropout=0.1, attention_dropout=0.1)
    l1, s1 = _run(cfg)
    l2, s2 = _run(cfg)
    assert l1 == l2
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    l3, _ = _run(cfg, seed=8)
    assert l3 != l1


def test_init_is_gpt2_style_and_independent_of_vocab_padding():
    cfg = tiny(num_layers=4, hidden_size=64)
    a = GPTModel(cfg, padded_vocab_size=128)
    b = GPTModel(cfg, padded_vocab_size=256)
    a.init_weights(3)
    b.init_weights(3)
    assert torch.equal(a.word_embeddings.weight[:97], b.word_embeddings.weight[:97])
    assert a.word_embeddings.weight[97:].abs().sum() == 0
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        if "word_embeddings" not in k:
            assert torch.equal(sa[k], sb[k]), k
    std = a.layers["0"].mlp.fc1.weight.std().item()
    assert 0.018 < std < 0.022
    out_std = a.layers["0"].mlp.fc2.weight.std().item()
    assert abs(out_std - 0.02 / (2 * 4) ** 0.5) < 0.002
    assert torch.equal(a.layers["1"].attn_norm.weight, torch.ones(64))
    assert a.layers["1"].attn.qkv.bias.abs().sum() == 0


def test_padding_columns_never_predicted_and_loss_matches_reference():
    cfg = tiny()
    model = build(cfg)
    data = batch(cfg, 2)
    logits = model(data["tokens"], data["position_ids"])
    assert logits.shape == (2, 16, 97)  # real vocabulary only, padding 128 sliced off
    losses = model(data["tokens"], data["position_ids"], labels=data["labels"])
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(),
                                            reduction="none").view(2, 16)
    assert torch.allclose(losses, ref)


def test_gqa_matches_explicit_repeat():
    """Grouped-query attention equals multi-head attention with K/V heads repeated."""
    from megalite.layers.attention import attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 8, generator=g)
    k = torch.randn(2, 2, 10, 8, generator=g)
    v = torch.randn(2, 2, 10, 8, generator=g)
    out = attention(q, k, v, causal=True)
    ref = attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal=True)
    assert torch.allclose(out, ref, atol=1e-6)


def test_rope_relative_positions():
    """Rotary attention scores depend only on the distance between positions."""
    from megalite.layers.rotary import apply_rotary, rotary_angles
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    def score(pq, pk):
        cq, sq = rotary_angles(torch.tensor([[pq]]), 8, 10000.0)
        ck, sk = rotary_angles(torch.tensor([[pk]]), 8, 10000.0)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()
    assert torch.allclose(score(3, 1), score(10, 8), atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)


def test_count_parameters_gpt2_small():
    cfg = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                      seq_length=1024)
    assert count_parameters(cfg) == 124_439_808  # Hugging Face GPT-2 small


def test_lr_schedule():
    t = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, train_iters=110, lr_decay_iters=110)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.55)
    assert lr_at(110, t) == pytest.approx(0.1)
    t.lr_decay_style = "linear"
    assert lr_at(35, t) == pytest.approx(1.0 - 0.9 * 0.25)


def test_fp16_dynamic_loss_scale_skips_overflow():
    s = LossScaler(True, initial_scale=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 4.0
    s.update(False); s.update(False)
    assert s.scale == 8.0


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_mixed_precision_step_runs_and_is_close_to_fp32(flag):
    cfg = tiny()
    data = split(batch(cfg, 4), 2)
    losses = {}
    for mode in ("fp32", flag):
        model = build(cfg)
        t = TrainConfig(**({flag: True} if mode != "fp32" else {}))
        r = train_step(model, build_optimizer(model, t), data, t, 0, LossScaler(mode == "fp16"))
        assert not r.skipped
        losses[mode] = r.loss
    assert abs(losses[flag] - losses["fp32"]) / losses["fp32"] < 2e-2


@pytest.mark.parametrize("rope", [True, False])
def test_attention_keeps_no_more_than_q_k_v_for_backward(rope):
    """What the graph keeps for backward holds q, k, v and the attention output once. The Triton
    kernel (as flash-attn and SDPA's GPU kernels) saves its inputs as given: with RoPE, q and k
    are new tensors and v is copied out of the fused qkv, so no view keeps the qkv projection's
    output alive (heads + groups head dims per token more than needed); without RoPE q, k, v are
    views of it, and qkv is exactly them, kept once. The kernel's output, which it keeps, is
    proj's input (no copy between them)."""
    from megalite.layers.backends import triton_missing
    if triton_missing("cpu"):
        pytest.skip(triton_missing("cpu"))
    extra = dict(position_embedding_type="rope", num_query_groups=2) if rope else {}
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=32,
                      hidden_dropout=0.0, attention_dropout=0.0, attention_backend="triton", **extra)
    model = GPTModel(cfg)
    model.init_weights(0)
    attn = model.layers["0"].attn
    qkv = {}  # between the qkv projection and proj: its output is alive, no address is reused
    saved = set()  # storages saved for backward inside attention
    attn.qkv.register_forward_hook(lambda m, i, o: qkv.update(ptr=o.untyped_storage().data_ptr(), saved=False))
    # proj's input is the kernel's output itself (it writes the (s, b, heads, d) order proj reads)
    attn.proj.register_forward_pre_hook(lambda m, i: qkv.update(ptr=None, out_once=i[0].untyped_storage().data_ptr()
                                                                in saved))

    def pack(t):
        if qkv.get("ptr") is not None:
            saved.add(t.untyped_storage().data_ptr())
            qkv["saved"] |= t.untyped_storage().data_ptr() == qkv["ptr"]
        return t
    x = torch.randint(0, 97, (2, 33))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x[:, :-1], labels=x[:, 1:]).sum().backward()
    assert qkv["saved"] == (not rope) and qkv["out_once"]
