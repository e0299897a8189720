"""GPU acceptance tests: their ``cuda`` cases are marked ``gpu``, skipped without CUDA (tests/conftest.py).

    TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/        (scripts/gpu_check.sh runs this)

1. The Triton kernels compiled for the GPU, in bf16 and fp16, against float64 torch
   references computed on the GPU: flash attention forward and backward (non-powers of two,
   GQA/MQA, offsets, rows without keys; a value head size of its own, 192/128), the fused LayerNorm/RMSNorm forward and backward,
   and the cross-entropy (per-slice statistics combined as TP ranks do, and the autograd
   loss with padding and ignored targets).
   Error measure: max |a - ref| / max(1, max |ref|) (floor 1, where test_kernels.py's fp32 CPU
   checks use the reference's own scale with floor 0.1: to tighten once measured on a GPU). The bounds are
   about 4x the rounding of a 16-bit output (half an ulp: bf16 2^-9, fp16 2^-11 relative),
   which dominates: a kernel that feeds 16-bit P and dS to the tensor cores and accumulates
   in fp32 lands at bf16 ~4e-3, fp16 ~5e-4 (emulated in torch at these shapes).
2. CUDA dropout streams of ``megalite.parallel.random``: the tensor-parallel stream differs
   from the default one and leaves it undisturbed, re-seeding reproduces both, and
   ``state_dict``/``load_state_dict`` restore both bit-exactly.
3. A serial fp32 run on CUDA with TF32 off matches the CPU run's losses within 1e-4 for 10
   iterations (each run in its own process: device flags and TF32 are process-wide); a GPU run
   killed and resumed repeats the uninterrupted one bit for bit.

Each test takes its device as a parameter (tests/device_twins.py): the ``cuda`` case is
marked ``gpu`` (skipped without CUDA) and is what the list above describes; the ``cpu`` case
runs the same test body here, so a slip in the test's own logic fails on the CPU first:
1. the kernels in the Triton interpreter, fp16 only (the interpreter stores bf16 as raw
   uint16), on small shapes with the same features (partial tiles, GQA/MQA, offsets, rows
   without keys, wide and padded vocabularies), same error bounds;
2. the dropout streams on the CPU generator (the tracker's CUDA state is the GPU case's);
3. (slow tier) the same subprocess runs with ``--device cpu``: a CPU run against the CPU
   reference run, and the kill/resume on the CPU.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.device_twins import CUDA, DEVICES, cpu, device_cases, kernel_device, synchronize

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OUT_TOL = {"bf16": 1.6e-2, "fp16": 2e-3}   # 16-bit outputs and gradients
LSE_TOL = 5e-4                             # fp32 statistics from 16-bit inputs
CE_GRAD_TOL = {"bf16": 8e-3, "fp16": 2e-3}


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if a.numel() == 0:
        return 0.0
    return (a - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def compiled(device: str) -> torch.device:
    """cuda: the kernels compiled for the GPU (not the CPU interpreter, which conftest.py selects
    by default: it would run them on host copies of the CUDA tensors); cpu: the interpreter."""
    dev = kernel_device(device)
    torch.manual_seed(0)
    return dev


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


# -- 1. kernels ------------------------------------------------------------------------------------

# (batch, heads, groups, s_q, s_k, head_dim, causal, q_offset, k_offset)
ATTENTION_SHAPES = [
    (2, 4, 4, 128, 128, 64, True, 0, 0),        # exact tiles
    (1, 4, 4, 197, 197, 64, True, 0, 0),        # partial tiles
    (2, 8, 2, 300, 300, 128, True, 0, 0),       # GQA, head dim 128
    (1, 4, 1, 333, 333, 32, False, 0, 0),       # multi-query, no mask, s_k not a tile multiple
    (1, 6, 3, 61, 97, 80, True, 50, 10),        # GQA, head dim 80 (padded to 128), offsets, s_q != s_k
    (1, 2, 2, 40, 30, 64, True, 0, 25),         # the first 25 queries see no key
    (1, 8, 8, 1024, 1024, 128, True, 0, 0),     # many tiles per program
]
# the CPU case (interpreter tiles of 32 x 32): fp16
CPU_ATTENTION_SHAPES = [
    (1, 4, 2, 45, 45, 24, True, 0, 0),          # GQA, partial tiles, head dim 24 (padded to 32)
    (1, 2, 1, 37, 50, 16, False, 0, 0),         # multi-query, no mask, s_q != s_k
    (1, 3, 3, 21, 40, 16, True, 12, 5),         # offsets
    (1, 2, 2, 40, 30, 16, True, 0, 25),         # the first 25 queries see no key
]


@pytest.mark.parametrize("device,dtype,shape",
                         device_cases([("fp16", s) for s in CPU_ATTENTION_SHAPES],
                                      [(dt, s) for s in ATTENTION_SHAPES for dt in DTYPES],
                                      ids=lambda c: f"{c[0]}-{shape_id(c[1])}"))
def test_flash_attention_16bit_forward_backward_on_cuda(device, dtype, shape):
    from megalite.kernels.attention_reference import attention_reference
    from megalite.kernels.flash_attention import flash_attention

    b, h, g, sq, sk, d, causal, q_off, k_off = shape
    dev, dt = compiled(device), DTYPES[dtype]
    q, dout = (torch.randn(b, h, sq, d, device=dev).to(dt) for _ in range(2))
    k, v = (torch.randn(b, g, sk, d, device=dev).to(dt) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attention(*leaves, causal, q_off, k_off, return_lse=True)
    out.backward(dout)
    synchronize(dev)
    ref64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref64, causal, q_off, k_off)
    ref_out.backward(dout.double())

    assert out.dtype == dt and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert all(x.grad.dtype == dt for x in leaves)
    assert not any(torch.isnan(t).any() for t in (out, lse, *(x.grad for x in leaves)))
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without a visible key must have lse = -inf"
    assert err(out, ref_out) < OUT_TOL[dtype]
    assert err(lse[~empty], ref_lse[~empty]) < LSE_TOL
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref64):
        assert err(x.grad, r.grad) < OUT_TOL[dtype], (name, err(x.grad, r.grad))


# a value head size of its own (issue 38, DeepSeek-V3's MLA): (batch, heads, groups, s, d, d_v, causal)
VALUE_HEAD_SHAPES = [(2, 16, 16, 1024, 192, 128, True), (1, 6, 2, 197, 80, 48, False)]
CPU_VALUE_HEAD_SHAPES = [(1, 2, 1, 37, 40, 24, True)]  # fp16, tile widths 64 and 32


@pytest.mark.parametrize("device,dtype,shape",
                         device_cases([("fp16", s) for s in CPU_VALUE_HEAD_SHAPES],
                                      [(dt, s) for s in VALUE_HEAD_SHAPES for dt in DTYPES],
                                      ids=lambda c: f"{c[0]}-{shape_id(c[1])}"))
def test_flash_attention_value_head_size_of_its_own_on_cuda(device, dtype, shape):
    """v of head size d_v != d (q/k): out and dv of size d_v, dq and dk of d, lse unchanged."""
    from megalite.kernels.attention_reference import attention_reference
    from megalite.kernels.flash_attention import flash_attention

    b, h, g, s, d, d_v, causal = shape
    dev, dt = compiled(device), DTYPES[dtype]
    q, k = torch.randn(b, h, s, d, device=dev).to(dt), torch.randn(b, g, s, d, device=dev).to(dt)
    v, dout = torch.randn(b, g, s, d_v, device=dev).to(dt), torch.randn(b, h, s, d_v, device=dev).to(dt)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attention(*leaves, causal, return_lse=True)
    out.backward(dout)
    synchronize(dev)
    ref64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref64, causal)
    ref_out.backward(dout.double())
    assert out.shape == (b, h, s, d_v) and [x.grad.shape[-1] for x in leaves] == [d, d, d_v]
    assert err(out, ref_out) < OUT_TOL[dtype] and err(lse, ref_lse) < LSE_TOL
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref64):
        assert err(x.grad, r.grad) < OUT_TOL[dtype], (name, err(x.grad, r.grad))


NORM_SHAPES = [(4096, 1024), (3, 77, 1000), (17, 5120), (8, 8192)]
CPU_NORM_SHAPES = [(3, 7, 100), (37, 64)]  # the CPU case, fp16: a padded row, several row tiles


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("device,dtype,shape",
                         device_cases([("fp16", s) for s in CPU_NORM_SHAPES],
                                      [(dt, s) for s in NORM_SHAPES for dt in DTYPES],
                                      ids=lambda c: f"{c[0]}-{c[1]}"))
def test_fused_norms_16bit_on_cuda(device, dtype, kind, shape):
    from megalite.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

    dev, dt, n = compiled(device), DTYPES[dtype], shape[-1]
    x = (torch.randn(*shape, device=dev) * 2 + 0.5).to(dt)
    w = (1 + 0.1 * torch.randn(n, device=dev)).to(dt)
    bias = torch.randn(n, device=dev).to(dt) if kind == "layer" else None
    dy = torch.randn(*shape, device=dev).to(dt)
    params = [x, w] + ([bias] if bias is not None else [])
    leaves = [p.clone().requires_grad_() for p in params]
    y = layer_norm(*leaves, 1e-5) if kind == "layer" else rms_norm(*leaves, 1e-5)
    y.backward(dy)
    synchronize(dev)
    ref64 = [p.double().requires_grad_() for p in params]
    ref = (layer_norm_reference(*ref64, 1e-5) if kind == "layer" else rms_norm_reference(*ref64, 1e-5))
    ref.backward(dy.double())
    assert y.dtype == dt and y.shape == x.shape
    assert err(y, ref) < OUT_TOL[dtype]
    for name, leaf, r in zip(("dx", "dw", "db"), leaves, ref64):
        assert leaf.grad.dtype == dt and err(leaf.grad, r.grad) < OUT_TOL[dtype], (name, err(leaf.grad, r.grad))


CE_SHAPES = [(1000, 50304, 50257), (64, 128256, None), (7, 1000, 999)]
CPU_CE_SHAPES = [(9, 200, 190), (5, 130, None)]  # the CPU case, fp16: 4 slices with padding; 1 slice


@pytest.mark.parametrize("device,dtype,rows,vocab,vocab_size",
                         device_cases([("fp16", *s) for s in CPU_CE_SHAPES],
                                      [(dt, *s) for s in CE_SHAPES for dt in DTYPES],
                                      ids=lambda c: f"{c[0]}-{c[1:]}"))
def test_cross_entropy_16bit_on_cuda(device, dtype, rows, vocab, vocab_size):
    """The autograd loss with padding columns and an ignored target, and the per-slice
    statistics of 4 vocabulary slices combined as tensor-parallel ranks combine them."""
    from megalite.kernels.cross_entropy import (cross_entropy, cross_entropy_grad, cross_entropy_reference,
                                                cross_entropy_stats)

    dev, dt = compiled(device), DTYPES[dtype]
    real = vocab_size or vocab
    logits = (torch.randn(rows, vocab, device=dev) * 3).to(dt)
    target = torch.randint(0, real, (rows,), device=dev)
    target[0] = -100
    grad = torch.randn(rows, device=dev)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf, target, vocab_size=vocab_size)
    loss.backward(grad)
    ref64 = logits.double().requires_grad_()
    ref = cross_entropy_reference(ref64, target, vocab_size=vocab_size)
    ref.backward(grad.double())
    synchronize(dev)
    assert loss.dtype == torch.float32 and loss[0] == 0 and (leaf.grad[0] == 0).all()
    assert err(loss, ref) < 1e-4
    assert leaf.grad.dtype == dt and err(leaf.grad, ref64.grad) < CE_GRAD_TOL[dtype]
    if vocab_size:
        assert (leaf.grad[:, vocab_size:] == 0).all()

    slices = 4 if vocab % 4 == 0 else 1
    local = vocab // slices
    parts = [cross_entropy_stats(logits[:, r * local:(r + 1) * local], target, r * local, real)
             for r in range(slices)]
    big = torch.stack([p[0] for p in parts]).max(0).values
    lse = big + torch.log(sum(p[1] * torch.exp(p[0] - big) for p in parts))
    combined = (lse - sum(p[2] for p in parts)).masked_fill(target == -100, 0.0)
    assert err(combined, ref) < 1e-4
    dz = torch.cat([cross_entropy_grad(logits[:, r * local:(r + 1) * local], target, lse, grad, r * local, real)
                    for r in range(slices)], -1)
    assert err(dz, ref64.grad) < CE_GRAD_TOL[dtype]


# -- 2. CUDA dropout streams -----------------------------------------------------------------------

def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _seed(seed: int, dev: torch.device):
    """model_parallel_seed for a serial run on ``dev``: on a GPU every stream gets a CUDA state."""
    from megalite.parallel.random import model_parallel_seed

    return model_parallel_seed(seed, None, device=dev)


def _mask(dev: torch.device, n: int = 1 << 16) -> torch.Tensor:
    return F.dropout(torch.ones(n, device=dev), p=0.5, training=True) != 0


def _manual_seed(dev: torch.device, seed: int) -> None:
    """Re-seed the generator the masks on ``dev`` draw from (only that one)."""
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_dropout_streams_differ_and_reseeding_reproduces_them(device):
    dev = _device(device)
    tracker = _seed(1234, dev)
    d1 = _mask(dev)
    with tracker.fork("tensor-parallel"):
        t1 = _mask(dev)
    with tracker.fork("tensor-parallel"):
        t2 = _mask(dev)
    d2 = _mask(dev)
    assert d1.device.type == dev.type and 0.45 < d1.float().mean().item() < 0.55
    assert not torch.equal(d1, t1), "the tensor-parallel stream must differ from the default stream"
    assert not torch.equal(t1, t2) and not torch.equal(d1, d2), "each stream must advance"

    tracker = _seed(1234, dev)
    assert torch.equal(_mask(dev), d1)
    assert torch.equal(_mask(dev), d2), "fork() must leave the default stream where it was"
    with tracker.fork("tensor-parallel"):
        assert torch.equal(_mask(dev), t1) and torch.equal(_mask(dev), t2)
    tracker = _seed(4321, dev)
    assert not torch.equal(_mask(dev), d1), "another seed, other masks"


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_rng_state_dict_round_trip_is_bit_exact(device):
    dev = _device(device)
    tracker = _seed(99, dev)
    _mask(dev)
    with tracker.fork("tensor-parallel"):
        _mask(dev)
    state = copy.deepcopy(tracker.state_dict())
    assert ("default.cuda" in state) == (dev.type == "cuda")
    want_default = _mask(dev)
    with tracker.fork("tensor-parallel"):
        want_tp = _mask(dev)
    _manual_seed(dev, 12345)  # scramble both streams on the device (and go on drawing)
    with tracker.fork("tensor-parallel"):
        _manual_seed(dev, 54321)
        _mask(dev)
    _mask(dev)
    tracker.load_state_dict(state)
    assert torch.equal(_mask(dev), want_default), "load_state_dict must restore the default stream"
    with tracker.fork("tensor-parallel"):
        assert torch.equal(_mask(dev), want_tp), "load_state_dict must restore the tensor-parallel stream"


# -- 3. CUDA fp32 run = CPU run --------------------------------------------------------------------

SERIAL = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
          "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4", "--train-iters", "10",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1"]


def _losses(tmp_path: Path, name: str, flags: list[str], interpret: str) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, TRITON_INTERPRET=interpret,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *SERIAL, *flags, "--log-json", str(log)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name} run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 10 and all(x is not None and math.isfinite(x) for x in losses), (name, losses)
    return losses


@pytest.fixture(scope="module")
def cpu_losses(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("cpu"), "cpu", ["--device", "cpu"], interpret="1")


# auto: the Triton attention in fp32 ("ieee" dots). The CPU case: a second CPU run with the same
# flags against the first (one backend: on a CPU auto resolves to torch)
@pytest.mark.parametrize("device,backend", device_cases([pytest.param("torch", marks=pytest.mark.slow)],
                                                       [("torch",), ("auto",)], ids=lambda c: c[0]))
def test_fp32_cuda_run_matches_cpu_losses(cpu_losses, tmp_path, backend, device):
    interpret = "0" if device == "cuda" else "1"
    cuda = _losses(tmp_path, f"{device}-{backend}", ["--device", device, "--disable-tf32", "--attention-backend",
                                                    backend], interpret=interpret)
    print(f"cpu  losses: {cpu_losses}\n{device} losses ({backend}): {cuda}")
    diffs = [abs(a - b) for a, b in zip(cpu_losses, cuda)]
    assert max(diffs) < 1e-4, [f"iter {i + 1}: cpu {a:.6f} {device} {b:.6f}" for i, (a, b) in enumerate(zip(cpu_losses, cuda))]


# -- 4. A GPU resume is bit-exact (CUDA dropout streams saved and restored) --------------------------

@pytest.mark.parametrize("device", [cpu(pytest.mark.slow), CUDA])
def test_cuda_resume_after_kill_is_bit_identical(tmp_path, device):
    """Dropout on (so the CUDA generator states matter), killed after iteration 5 with a
    checkpoint at 4, resumed: iterations 5-8 repeat the uninterrupted run bit for bit. (The CPU
    case: the same runs with --device cpu, the CPU generator's states.)"""
    flags = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4", "--seed", "1234",
             "--device", device, "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
             "--attention-backend", "torch", "--train-iters", "8", "--save-interval", "4"]
    interpret = "0" if device == "cuda" else "1"

    def run(name, extra, env=None):
        log = tmp_path / f"{name}.jsonl"
        run_env = dict(os.environ, TRITON_INTERPRET=interpret, **(env or {}),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        argv = [*flags, *extra, "--log-json", str(log)]
        if device == "cuda":  # a new interpreter: CUDA is never initialised in a fork
            returncode = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], cwd=REPO, env=run_env,
                                        capture_output=True, text=True, timeout=300).returncode
        else:  # the script as __main__ in a fork of this process: no interpreter importing torch again
            from tests.forked_commands import start_script, wait
            returncode = wait(start_script(str(REPO / "pretrain_gpt.py"), argv, REPO, run_env,
                                           str(tmp_path / f"{name}.out")), 300)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return returncode, [(r["iteration"], r["loss"], r["grad_norm"]) for r in records]

    code, full = run("full", ["--save", str(tmp_path / "a")])
    assert code == 0 and len(full) == 8
    code, _ = run("killed", ["--save", str(tmp_path / "b"), "--inject-fault", "kill@5"])
    assert code != 0 and (tmp_path / "b" / "latest").read_text() == "4"
    code, resumed = run("resumed", ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])
    assert code == 0 and [r[0] for r in resumed] == [5, 6, 7, 8]
    assert resumed == full[4:]
