"""What tools/calibrate_hardware.py measures of a device's compute (its module docstring, items 1, 3
and 4): the matmul rate at one layer's GEMM shapes, a training step's achieved rate, the memory copy
bandwidth and a context-parallel rank's attention blocks against the fused attention. Each timed
after a warm-up: CUDA events on a GPU, ``perf_counter`` on a CPU (:func:`seconds_per_call`)."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.context_parallel.ring_attention import block_ops, local_chunk_ids
from megalite.model.counting import flops_per_token
from megalite.model.gpt import GPTModel


def seconds_per_call(fn, device: torch.device, repeats: int) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` calls (after the caller's warm-up)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def layer_gemms(hidden: int, seq: int, micro_batch: int, heads: int, tp: int) -> list[tuple[str, int, int, int, int]]:
    """``(name, batch, m, k, n)`` of one layer's forward GEMMs on a rank of tensor-parallel size ``tp``."""
    tokens, d = micro_batch * seq, hidden // heads
    return [("qkv", 1, tokens, hidden, 3 * hidden // tp), ("proj", 1, tokens, hidden // tp, hidden),
            ("fc1", 1, tokens, hidden, 4 * hidden // tp), ("fc2", 1, tokens, 4 * hidden // tp, hidden),
            ("scores", micro_batch * heads // tp, seq, d, seq), ("context", micro_batch * heads // tp, seq, seq, d)]


def measure_matmuls(shapes, device: torch.device, dtype, min_seconds: float, trials: int = 1) -> list[dict]:
    """TFLOP/s of each ``(name, batch, m, k, n)``: repeats until ``min_seconds`` of work, after a warm-up;
    the best of ``trials`` such timings (a shared machine's other work only ever slows a trial)."""
    rows = []
    for name, batch, m, k, n in shapes:
        a = torch.randn(batch, m, k, device=device, dtype=dtype)
        b = torch.randn(batch, k, n, device=device, dtype=dtype)
        call = (lambda: torch.bmm(a, b)) if batch > 1 else (lambda: torch.mm(a[0], b[0]))
        call()
        once = seconds_per_call(call, device, 1)
        repeats = max(1, min(1000, int(min_seconds / max(once, 1e-7))))
        seconds = min(seconds_per_call(call, device, repeats) for _ in range(trials))
        flops = 2.0 * batch * m * k * n
        rows.append({"name": name, "shape": [batch, m, k, n], "flops": flops, "seconds": seconds,
                     "tflops": flops / seconds / 1e12})
    return rows


def measure_training(model: tuple, layers: int, vocab: int, device: torch.device, gpu: bool, repeats: int,
                     trials: int) -> dict:
    """One rank's forward and backward of a ``layers``-layer GPT of ``model`` = (h, s, b, heads)
    (bf16 autocast on a GPU, fp32 on a CPU; dropout off): model FLOPs per step over the best trial's
    mean time (module docstring, 1)."""
    h, s, b, heads = model
    cfg = ModelConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, seq_length=s,
                      max_position_embeddings=s, vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(cfg).to(device)
    gpt.init_weights(0)
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = gpt(tokens, labels=tokens).float().mean()
        loss.backward()

    step()  # warm-up
    seconds = min(seconds_per_call(step, device, repeats) for _ in range(trials))
    flops = flops_per_token(cfg) * b * s
    return {"layers": layers, "vocab_size": vocab, "tokens": b * s, "seconds": seconds, "flops": flops,
            "tflops": flops / seconds / 1e12}


def cp_block_pairs(rank: int, size: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, diagonal?) of the blocks a rank of a causal, load-balanced CP group of
    ``size`` attends: its chunks r and 2 size - 1 - r against every rank's, keys not after queries."""
    mine = local_chunk_ids(rank, size, True)
    return [(qa, ka, qa == ka) for src in range(size) for qa in mine
            for ka in local_chunk_ids(src, size, True) if ka <= qa]


def measure_cp_blocks(model: tuple, device: torch.device, dtype, repeats: int, trials: int, size: int = 2) -> dict:
    """Seconds of the fused causal attention's forward + backward over the whole sequence (SDPA on
    b x heads x s x d of ``model`` = (h, s, b, heads)) and of a CP rank's blocks (:func:`cp_block_pairs`,
    each block forward, then backward with its delta), the mean over the ``size`` ranks, each the
    best of ``trials``; ``tflops``: the planner's attention FLOPs of a rank over the blocks' time
    (module docstring, 4)."""
    h, s, b, heads = model
    d, c = h // heads, s // (2 * size)
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def fused():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    qc, kc, vc, dout = (torch.randn(b, heads, c, d, device=device, dtype=dtype) for _ in range(4))
    ops = block_ops("auto", qc)

    def blocks(rank):
        for _, _, diag in cp_block_pairs(rank, size):
            out, lse = ops.forward(qc, kc, vc, causal=diag)
            ops.backward(qc, kc, vc, out, dout, lse, causal=diag, delta=ops.delta(out, dout))

    def best(fn):
        fn()  # warm-up
        return min(seconds_per_call(fn, device, repeats) for _ in range(trials))
    fused_s = best(fused)
    blocks_s = sum(best(lambda: blocks(r)) for r in range(size)) / size
    flops = 3 * 4 * b * heads * d * s * s / size  # forward + backward, the planner's (non-causal) count
    return {"backend": ops.name, "shape": [b, heads, s, d], "cp": size, "fused_s": fused_s, "blocks_s": blocks_s,
            "flops": flops, "tflops": flops / blocks_s / 1e12}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes``."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2.0 * nbytes / seconds_per_call(lambda: dst.copy_(src), device, repeats)
