"""Triton kernels under TRITON_INTERPRET=1 (set in conftest.py) against their torch references,
the backend dispatch and its errors, and the GPT trained with the kernels against torch.

Error measure: max |a - ref| / max(0.1, max |ref|): relative to the reference's own scale,
with a floor of 0.1 for near-zero references (it was max(1, max |ref|), which gave the
cross-entropy gradients, of scale 0.25, a 4x looser bound). The floor is needed where the
reference vanishes by cancellation while the inputs are of order one: the single-token dq is
exactly 0 in float64 (kernel: 5.8e-7 absolute, rounding of order-one terms), and a norm's
parameter gradient summed over rows measured 5e-5 with 2.2e-7 absolute error; scaled by their
own size these would read 0.57 and 4e-3. Measured with this measure (fp32): attention <= 5.3e-7,
norms <= 2.2e-6, cross-entropy <= 2.2e-7; fp16 attention <= 6.1e-4; bf16 <= 6.6e-3.
Targets: fp32 1e-5 (attention), 5e-6 (norms, cross-entropy); fp16 2e-3.
The interpreter is slow (milliseconds per tile operation): shapes are small but cover
primes, partial tiles, several tiles, GQA and every masking case.
"""
import sys

import pytest
import torch

from megalite.kernels.attention_reference import attention_reference, merge_attention
from megalite.kernels.cross_entropy import (cross_entropy, cross_entropy_grad, cross_entropy_reference,
                                            cross_entropy_stats)
from megalite.kernels.flash_attention import (flash_attention, flash_attention_backward,
                                              flash_attention_forward)
from megalite.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

FP32_ATTN, FP32, FP16 = 1e-5, 5e-6, 2e-3
ERR_FLOOR = 0.1  # below this a reference is 'near zero' (see the module docstring)


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if a.numel() == 0:
        return 0.0
    return (a - ref).abs().max().item() / max(ERR_FLOOR, ref.abs().max().item())


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no visible key must have lse = -inf"
    return err(lse[~empty], ref[~empty])


def qkv(b, h, g, sq, sk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return make(b, h, sq, d), make(b, g, sk, d), make(b, g, sk, d), make(b, h, sq, d)


def reference_with_grads(q, k, v, dout, causal, q_off, k_off):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = attention_reference(q64, k64, v64, causal, q_off, k_off)
    out.backward(dout.double())
    return out, lse, q64.grad, k64.grad, v64.grad


# (batch, heads, groups, s_q, s_k, head_dim, causal, q_offset, k_offset)
SHAPES = [
    (1, 1, 1, 1, 1, 32, True, 0, 0),        # a single token
    (1, 2, 2, 7, 7, 32, True, 0, 0),
    (3, 2, 2, 5, 5, 16, True, 0, 0),        # batch 3, head dim 16
    (2, 2, 2, 16, 16, 64, True, 0, 0),
    (1, 2, 2, 61, 61, 64, True, 0, 0),      # prime: partial tiles
    (1, 2, 2, 61, 61, 64, False, 0, 0),
    (1, 2, 2, 64, 64, 32, True, 0, 0),      # exact tiles
    (1, 4, 1, 33, 33, 32, True, 0, 0),      # multi-query (4 heads, 1 group)
    (2, 4, 2, 17, 17, 128, True, 0, 0),     # GQA, head dim 128
    (1, 6, 3, 29, 29, 64, True, 0, 0),      # GQA with 3 groups
    (1, 2, 2, 127, 127, 32, True, 0, 0),
    (1, 1, 1, 257, 257, 32, True, 0, 0),
    (1, 1, 1, 300, 300, 16, False, 0, 0),
    (1, 2, 2, 7, 130, 32, False, 0, 0),     # s_q < s_k
    (1, 2, 2, 130, 7, 32, False, 0, 0),     # s_q > s_k
    (1, 2, 2, 40, 30, 32, True, 20, 0),     # ring: queries after the keys, partly visible
    (1, 2, 2, 40, 30, 32, True, 0, 25),     # first 25 queries see no key (lse = -inf)
    (1, 2, 1, 61, 97, 64, True, 50, 10),    # GQA with offsets, s_q != s_k
    (1, 2, 1, 127, 257, 128, True, 200, 0),
    (1, 2, 2, 16, 16, 64, True, 0, 100),    # no query sees any key
    (2, 4, 4, 16, 16, 8, True, 0, 0),       # the test GPT's heads (head dim 8, padded)
    (1, 2, 2, 19, 23, 48, True, 3, 0),      # head dim not a power of two
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_attention_fp32_matches_float64_reference(shape):
    b, h, g, sq, sk, d, causal, q_off, k_off = shape
    q, k, v, dout = qkv(b, h, g, sq, sk, d)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = flash_attention(q, k, v, causal, q_off, k_off, return_lse=True)
    out.backward(dout)
    ref_out, ref_lse, dq, dk, dv = reference_with_grads(q, k, v, dout, causal, q_off, k_off)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert not any(torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad))
    assert err(out, ref_out) < FP32_ATTN
    assert lse_err(lse, ref_lse) < FP32_ATTN
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert err(got, want) < FP32_ATTN, name


@pytest.mark.parametrize("shape", [SHAPES[i] for i in (1, 4, 8, 15, 16, 17)],
                         ids=lambda s: "x".join(map(str, s)))
def test_flash_attention_fp16_matches_float64_reference(shape):
    b, h, g, sq, sk, d, causal, q_off, k_off = shape
    q, k, v, dout = qkv(b, h, g, sq, sk, d, torch.float16, seed=1)
    out, lse = flash_attention_forward(q, k, v, causal, q_off, k_off)
    dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, causal, q_off, k_off)
    ref_out, ref_lse, rdq, rdk, rdv = reference_with_grads(q, k, v, dout, causal, q_off, k_off)
    assert out.dtype == dq.dtype == dk.dtype == torch.float16
    assert err(out, ref_out) < FP16 and lse_err(lse, ref_lse) < FP16
    assert err(dq, rdq) < FP16 and err(dk, rdk) < FP16 and err(dv, rdv) < FP16


def test_bfloat16_runs_in_the_interpreter():
    """bf16 loads are upcast at once (the interpreter mishandles bf16 otherwise); its stores
    truncate instead of rounding, so the bound is a few bf16 ulps (2^-8 = 3.9e-3)."""
    q, k, v, dout = qkv(1, 2, 1, 37, 45, 32, torch.bfloat16, seed=2)
    out, lse = flash_attention_forward(q, k, v, True, 8, 0)
    grads = flash_attention_backward(q, k, v, out, dout, lse, True, 8, 0)
    ref_out, ref_lse, *ref_grads = reference_with_grads(q, k, v, dout, True, 8, 0)
    assert out.dtype == torch.bfloat16 and err(out, ref_out) < 1e-2 and lse_err(lse, ref_lse) < 1e-5
    assert max(err(g, r) for g, r in zip(grads, ref_grads)) < 1e-2
    x, w, b = torch.randn(7, 100).bfloat16(), torch.rand(100).bfloat16(), torch.randn(100).bfloat16()
    assert err(layer_norm(x, w, b), layer_norm_reference(x.double(), w.double(), b.double())) < 1e-2
    z, t = torch.randn(5, 300).bfloat16(), torch.randint(0, 300, (5,))
    assert err(cross_entropy(z, t), cross_entropy_reference(z.double(), t)) < 1e-5


def test_small_tiles_and_rows_without_keys():
    """16x16 tiles (many tiles, partial ones at both edges) on a causal offset case where the
    first rows see no key: zeros out, lse -inf, zero gradients, no NaN."""
    q, k, v, dout = qkv(1, 2, 1, 45, 37, 32)
    out, lse = flash_attention_forward(q, k, v, True, 0, 9, block_m=16, block_n=16)
    dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, True, 0, 9, block_m=16, block_n=16)
    ref_out, ref_lse, rdq, rdk, rdv = reference_with_grads(q, k, v, dout, True, 0, 9)
    assert torch.isneginf(lse[:, :, :9]).all() and (out[:, :, :9] == 0).all()
    assert (dq[:, :, :9] == 0).all()
    assert err(out, ref_out) < FP32_ATTN and lse_err(lse, ref_lse) < FP32_ATTN
    assert max(err(dq, rdq), err(dk, rdk), err(dv, rdv)) < FP32_ATTN


@pytest.mark.parametrize("causal,q_off,split", [(False, 0, 23), (True, 30, 17), (True, 0, 30)])
def test_merge_of_two_key_halves_equals_full_attention(causal, q_off, split):
    """Ring attention's pieces: attention of the queries over two halves of K/V (the second
    with k_offset = split), merged, equals attention over all keys, forward and backward
    (gradients flow through merge_attention into the lse of each half)."""
    q, k, v, dout = qkv(1, 4, 2, 31, 47, 32, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o1, l1 = flash_attention(q, k[:, :, :split], v[:, :, :split], causal, q_off, 0, return_lse=True)
    o2, l2 = flash_attention(q, k[:, :, split:], v[:, :, split:], causal, q_off, split,
                             return_lse=True)
    out, lse = merge_attention(o1, l1, o2, l2)
    out.backward(dout)
    ref_out, ref_lse, dq, dk, dv = reference_with_grads(q, k, v, dout, causal, q_off, 0)
    assert err(out, ref_out) < FP32_ATTN and lse_err(lse, ref_lse) < FP32_ATTN
    assert max(err(q.grad, dq), err(k.grad, dk), err(v.grad, dv)) < FP32_ATTN


def test_backward_per_key_block_with_global_lse_sums_to_full_gradient():
    """flash_attention_backward on (q, one K/V block) with the global out/lse gives that
    block's exact share: dq sums over blocks, dk/dv are the block's rows of the full ones. One
    sequence of 2 heads sharing a K/V group (GQA: dk/dv sum over the group's heads); each Triton
    program costs ~0.1 s in the interpreter."""
    q, k, v, dout = qkv(1, 2, 1, 24, 40, 32, seed=4)
    out, lse = flash_attention_forward(q, k, v, True, 16, 0)
    ref_out, ref_lse, rdq, rdk, rdv = reference_with_grads(q, k, v, dout, True, 16, 0)
    dq_sum, dks, dvs = torch.zeros_like(q), [], []
    for start in (0, 13, 29):
        stop = {0: 13, 13: 29, 29: 40}[start]
        dq, dk, dv = flash_attention_backward(q, k[:, :, start:stop], v[:, :, start:stop], out,
                                              dout, lse, True, 16, start)
        dq_sum += dq
        dks.append(dk)
        dvs.append(dv)
    assert err(dq_sum, rdq) < FP32_ATTN
    assert err(torch.cat(dks, 2), rdk) < FP32_ATTN and err(torch.cat(dvs, 2), rdv) < FP32_ATTN


def test_merge_handles_rows_without_keys():
    out1, out2 = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    lse1 = torch.tensor([[0.5, float("-inf"), float("-inf")]] * 2)
    lse2 = torch.tensor([[float("-inf"), 1.0, float("-inf")]] * 2)
    out, lse = merge_attention(out1, lse1, out2, lse2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.allclose(out[:, 0], out1[:, 0]) and torch.allclose(out[:, 1], out2[:, 1])
    assert (out[:, 2] == 0).all() and torch.isneginf(lse[:, 2]).all()


NORM_SHAPES = [(3, 5, 37), (17, 100), (1, 1), (2, 70, 130), (4, 1000)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norms_match_torch(shape, kind):
    gen = torch.Generator().manual_seed(5)
    n = shape[-1]
    x = (torch.randn(*shape, generator=gen) * 2 + 0.5).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, generator=gen)).requires_grad_()
    bias = torch.randn(n, generator=gen).requires_grad_() if kind == "layer" else None
    dy = torch.randn(*shape, generator=gen)
    params = [x, w] + ([bias] if bias is not None else [])
    fused = layer_norm(x, w, bias, 1e-5) if kind == "layer" else rms_norm(x, w, 1e-5)
    got = torch.autograd.grad(fused, params, dy)
    params64 = [p.detach().double().requires_grad_() for p in params]
    x64, w64 = params64[:2]
    ref = (layer_norm_reference(x64, w64, params64[2], 1e-5) if kind == "layer"
           else rms_norm_reference(x64, w64, 1e-5))
    want = torch.autograd.grad(ref, params64, dy.double())
    assert fused.shape == x.shape and err(fused, ref) < FP32
    for a, r in zip(got, want):
        assert err(a, r) < FP32


def test_norms_fp16_in_fp16_out():
    x, w, b = torch.randn(9, 77).half(), torch.rand(77).half() + 0.5, torch.randn(77).half()
    y = layer_norm(x, w, b)
    assert y.dtype == torch.float16 and err(y, layer_norm_reference(x, w, b)) < FP16
    assert err(rms_norm(x, w), rms_norm_reference(x, w)) < FP16


CE_CASES = [((7,), 1000, None), ((5,), 300, 290), ((3,), 3, None), ((2, 3), 517, 500)]


@pytest.mark.parametrize("rows,vocab,vocab_size", CE_CASES, ids=str)
def test_cross_entropy_matches_torch(rows, vocab, vocab_size):
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(*rows, vocab, generator=gen) * 3).requires_grad_()
    target = torch.randint(0, vocab_size or vocab, rows, generator=gen)
    target.view(-1)[0] = -100  # an ignored token
    grad = torch.randn(*rows, generator=gen)
    loss = cross_entropy(logits, target, vocab_size=vocab_size)
    (got,) = torch.autograd.grad(loss, logits, grad)
    logits64 = logits.detach().double().requires_grad_()
    ref = cross_entropy_reference(logits64, target, vocab_size=vocab_size)
    (want,) = torch.autograd.grad(ref, logits64, grad.double())
    if vocab_size:  # padding columns: no probability, zero gradient
        assert (got[..., vocab_size:] == 0).all()
    assert loss.view(-1)[0] == 0 and (got.view(-1, vocab)[0] == 0).all()
    assert err(loss, ref) < FP32 and err(got, want) < FP32


def test_cross_entropy_fp16_logits():
    logits, target = torch.randn(6, 333).half(), torch.randint(0, 333, (6,))
    assert err(cross_entropy(logits, target), cross_entropy_reference(logits, target)) < FP16


@pytest.mark.parametrize("slices,vocab_size", [(2, 200), (3, 290), (3, 190)])
def test_vocab_slice_stats_combine_to_full_cross_entropy(slices, vocab_size):
    """What TP ranks do: per-slice stats, M = max of maxima, S = sum of rescaled sums, the
    target logit summed; then each slice's gradient from lse = M + log S. (3, 190): the
    last slice is all padding (its max is -inf)."""
    gen = torch.Generator().manual_seed(7)
    rows, local = 9, 100
    logits = torch.randn(rows, slices * local, generator=gen) * 4
    target = torch.randint(0, vocab_size, (rows,), generator=gen)
    target[3] = -100
    parts = [cross_entropy_stats(logits[:, r * local:(r + 1) * local], target, r * local, vocab_size)
             for r in range(slices)]
    maxima = torch.stack([p[0] for p in parts])
    big = maxima.max(0).values
    total = sum(p[1] * torch.exp(p[0] - big) for p in parts)
    lse = big + torch.log(total)
    loss = (lse - sum(p[2] for p in parts)).masked_fill(target == -100, 0.0)
    full = logits[:, :vocab_size].double().requires_grad_()
    ref = cross_entropy_reference(full, target)
    assert err(loss, ref) < FP32
    grad = torch.randn(rows, generator=gen)
    got = torch.cat([cross_entropy_grad(logits[:, r * local:(r + 1) * local], target, lse, grad,
                                        r * local, vocab_size) for r in range(slices)], -1)
    (want,) = torch.autograd.grad(ref, full, grad)
    assert err(got[:, :vocab_size], want) < FP32 and (got[:, vocab_size:] == 0).all()


def _tp_cross_entropy(rank, world, logits, target, vocab_size):
    from megalite.layers.tensor_parallel import vocab_parallel_cross_entropy

    local = logits.shape[-1] // world
    results = []
    for fused in (False, True):
        z = logits[..., rank * local:(rank + 1) * local].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(z, target, vocab_size, None if world == 1 else
                                            torch.distributed.group.WORLD, fused=fused)
        loss.sum().backward()
        results.append((loss.detach(), z.grad))
    return results


def test_fused_vocab_parallel_cross_entropy_matches_unfused_at_tp2():
    from megalite.testing import run_world

    logits, target = torch.randn(4, 3, 256) * 3, torch.randint(0, 250, (4, 3))
    target[0, 0] = -100
    for rank, ((loss, grad), (floss, fgrad)) in enumerate(
            run_world(_tp_cross_entropy, 2, logits, target, 250)):
        assert err(floss, loss) < FP32 and err(fgrad, grad) < FP32, rank


# -- backends in megalite ------------------------------------------------------------------------

def _model_config(**overrides):
    from megalite.config import ModelConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200,
                  seq_length=16, attention_dropout=0.0)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize("overrides,env,fragments", [
    (dict(attention_backend="xformers"), {}, ["'xformers' is unknown", "auto, triton, flash, torch"]),
    (dict(attention_backend="triton", attention_dropout=0.1), {},
     ["no attention dropout", "--attention-dropout 0", "torch or flash"]),
    (dict(attention_backend="flash"), {}, ["flash-attn is not installed", "pip install megalite[flash]"]),
    (dict(attention_backend="triton"), {"TRITON_INTERPRET": "0"},
     ["no CUDA GPU", "TRITON_INTERPRET=1", "--attention-backend torch"]),
    (dict(fused_kernels=True), {"TRITON_INTERPRET": "0"}, ["--fused-kernels", "TRITON_INTERPRET=1"]),
])
def test_backend_config_errors_name_the_fix(overrides, env, fragments, monkeypatch):
    from megalite.config import ConfigError
    from megalite.layers.attention import check_attention_backend

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        check_attention_backend(_model_config(**overrides))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_runtime_dispatch_errors_and_auto():
    from megalite.layers.attention import BackendUnavailable, attention, resolve_backend
    from megalite.layers.norms import build_norm

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(BackendUnavailable, match=r"pip install megalite\[flash\]"):
        attention(q, q, q, backend="flash")
    with pytest.raises(BackendUnavailable, match="has no dropout"):
        attention(q, q, q, dropout_p=0.1, backend="triton")
    with pytest.raises(RuntimeError, match=r"pip install megalite\[te\]"):
        build_norm("LayerNorm", 8, 1e-5, fused="te")
    assert resolve_backend("auto", q) == "torch"  # CPU: the interpreter is never "fastest"
    assert "flash_attn" not in sys.modules and "transformer_engine" not in sys.modules


@pytest.mark.parametrize("groups", [4, 2])
def test_triton_backend_equals_torch_backend(groups):
    from megalite.layers.attention import attention

    q, k, v, dout = qkv(2, 4, groups, 24, 24, 16, seed=8)
    outs = []
    for backend in ("torch", "triton"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, causal=True, backend=backend)
        out.backward(dout)
        outs.append([out] + [x.grad for x in leaves])
    for a, b in zip(*outs):
        assert err(b, a) < FP32_ATTN


def test_fused_norm_modules_keep_parameter_names():
    from megalite.layers.norms import FusedLayerNorm, FusedRMSNorm, build_norm

    fused, plain = build_norm("LayerNorm", 24, 1e-5, fused=True), build_norm("LayerNorm", 24, 1e-5)
    assert isinstance(fused, FusedLayerNorm) and isinstance(build_norm("RMSNorm", 24, 1e-5, True), FusedRMSNorm)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        plain.weight.uniform_()
        plain.bias.uniform_()
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 24)
    assert err(fused(x), plain(x)) < FP32


def test_bad_backend_flag_exits_with_clear_message(capsys):
    from megalite.train.pretrain import main

    assert main(["--mock-data", "--vocab-size", "200", "--attention-backend", "triton",
                 "--attention-dropout", "0.1"]) == 2
    assert "--attention-dropout 0" in capsys.readouterr().err


@pytest.mark.slow
def test_gpt_trains_with_triton_kernels_like_torch():
    """4 iterations, fp32, no dropout: --attention-backend triton --fused-kernels (Triton
    attention, LayerNorm, cross-entropy) gives the torch backend's loss at every step (a wrong
    gradient shows from the second step on; each kernel against its reference: the tests above)."""
    from megalite.train.pretrain import pretrain

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2",
            "--mock-data", "--vocab-size", "200", "--train-iters", "4", "--log-interval", "100"]
    torch_log = pretrain(argv + ["--attention-backend", "torch"])
    triton_log = pretrain(argv + ["--attention-backend", "triton", "--fused-kernels"])
    assert len(triton_log) == 4
    for a, b in zip(torch_log, triton_log):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (a["iteration"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] < 1e-4
    assert "flash_attn" not in sys.modules and "transformer_engine" not in sys.modules
