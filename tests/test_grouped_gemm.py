"""The Triton grouped GEMM (kernels/grouped_gemm.py) against the torch loop of matmuls, under
TRITON_INTERPRET=1 (set in conftest.py): forward, dx and dw, and an expert MLP built from two
grouped_linear calls against megalite.moe.experts.grouped_mlp (dx, dw1, dw2).

Error measure as in test_kernels.py: max |a - ref| / max(0.1, max |ref|) against float64.
Targets: fp32 1e-5, fp16 2e-3. The interpreter tiles are 32 x 32 x 32: K = 40 and Nout = 72
give ragged column tiles and a ragged reduction, a group of 37 rows spans two row tiles.
The last test runs the compiled kernels in bf16 and fp16 on a GPU (its ``cuda`` cases, marked
gpu) and, here, the same checks in the interpreter in fp16 on small ragged groups (``cpu``).
"""
import pytest
import torch

from megalite.kernels.grouped_gemm import (group_offsets, grouped_linear, grouped_linear_reference,
                                           grouped_matmul, grouped_weight_grad)
from tests.device_twins import device_cases, kernel_device

FP32, FP16 = 1e-5, 2e-3


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if a.numel() == 0:
        return 0.0
    return (a - ref).abs().max().item() / max(0.1, ref.abs().max().item())


def inputs(counts, k, n_out, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, k, generator=gen)
    w = torch.randn(len(counts), n_out, k, generator=gen) / k ** 0.5
    dy = torch.randn(n, n_out, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (x, w, dy))


def run(fn, x, w, dy, groups):
    """(y, dx, dw) of fn(x, w, groups) with autograd; float64 leaves for the reference."""
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(xl, wl, groups)
    y.backward(dy)
    return y.detach(), xl.grad, wl.grad


def reference(x, w, dy, counts):
    return run(grouped_linear_reference, x.double(), w.double(), dy.double(), counts)


# (counts, K, Nout)
CASES = [
    ([0, 37, 5, 0, 20], 40, 72),    # empty groups, a group over two row tiles, ragged K and Nout
    ([0, 0, 45, 0], 40, 72),        # every row in one group
    ([1, 2, 3], 16, 24),            # tiny groups, one tile
    ([33, 31, 64], 72, 40),         # exact and ragged row tiles, K > Nout
]


@pytest.mark.parametrize("counts,k,n_out", CASES, ids=lambda c: str(c))
def test_fp32_forward_and_gradients_match_the_loop(counts, k, n_out):
    x, w, dy = inputs(counts, k, n_out)
    y, dx, dw = run(grouped_linear, x, w, dy, counts)
    ry, rdx, rdw = reference(x, w, dy, counts)
    assert y.shape == (sum(counts), n_out) and y.dtype == torch.float32
    assert err(y, ry) < FP32 and err(dx, rdx) < FP32 and err(dw, rdw) < FP32
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), "an empty group's dw must be 0"


def test_fp16_forward_and_gradients():
    counts = [0, 37, 5, 0, 20]
    x, w, dy = inputs(counts, 40, 72, torch.float16)
    y, dx, dw = run(grouped_linear, x, w, dy, counts)
    ry, rdx, rdw = reference(x, w, dy, counts)
    assert y.dtype == dx.dtype == dw.dtype == torch.float16
    assert err(y, ry) < FP16 and err(dx, rdx) < FP16 and err(dw, rdw) < FP16


def test_bfloat16_runs_in_the_interpreter():
    counts = [5, 0, 11]
    x, w, dy = inputs(counts, 24, 40, torch.bfloat16)
    y, dx, dw = run(grouped_linear, x, w, dy, counts)
    ry, rdx, rdw = reference(x, w, dy, counts)
    assert y.dtype == dw.dtype == torch.bfloat16
    assert err(y, ry) < 2e-2 and err(dx, rdx) < 2e-2 and err(dw, rdw) < 2e-2  # truncating stores


def test_no_rows_at_all():
    x, w, dy = inputs([0, 0, 0], 40, 72)
    y, dx, dw = run(grouped_linear, x, w, dy, [0, 0, 0])
    assert y.shape == (0, 72) and dx.shape == (0, 40)
    assert dw is not None and torch.equal(dw, torch.zeros(3, 72, 40)), "dw must be zeros, not None"


@pytest.mark.slow
def test_counts_offsets_and_tensor_forms_agree():
    counts = [0, 37, 5, 0, 20]
    x, w, dy = inputs(counts, 40, 72, seed=1)
    y = grouped_linear(x, w, counts)
    offsets = [0, 0, 37, 42, 42, 62]
    assert torch.equal(grouped_linear(x, w, offsets), y)
    assert torch.equal(grouped_linear(x, w, torch.tensor(counts)), y)
    assert torch.equal(grouped_linear(x, w, torch.tensor(offsets, dtype=torch.int64)), y)
    # without host counts (a GPU tensor): the grid is a bound, extra programs return at once
    off, _ = group_offsets(counts, 5, 62, "cpu")
    assert torch.equal(grouped_matmul(x, w, off, None), y)
    assert torch.equal(grouped_weight_grad(dy, x, off), run(grouped_linear, x, w, dy, counts)[2])


def test_expert_mlp_from_two_grouped_linears_matches_grouped_mlp():
    from megalite.moe.experts import _activation, grouped_mlp

    counts, h, ffn = [9, 0, 40, 3], 24, 20
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), h, generator=gen)
    w1 = torch.randn(len(counts), 2 * ffn, h, generator=gen) / h ** 0.5
    w2 = torch.randn(len(counts), h, ffn, generator=gen) / ffn ** 0.5
    dy = torch.randn(sum(counts), h, generator=gen)

    def triton_mlp(x, w1, w2):
        return grouped_linear(_activation(grouped_linear(x, w1, counts), True), w2, counts)

    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    triton_mlp(*leaves).backward(dy)
    refs = [t.double().requires_grad_() for t in (x, w1, w2)]
    out = grouped_mlp(refs[0], counts, refs[1], refs[2], swiglu=True)
    out.backward(dy.double())
    assert err(triton_mlp(x, w1, w2), out) < FP32
    for got, ref in zip(leaves, refs):
        assert err(got.grad, ref.grad) < FP32


@pytest.mark.parametrize("groups,fragment", [([3, 4], "sum to the 8 rows"), ([8], "1 group counts for 2"),
                                             ([-1, 9], "must be >= 0"), ([1, 3, 8], "offsets starting at 0")])
def test_bad_counts_name_the_problem(groups, fragment):
    x, w, _ = inputs([4, 4], 16, 16)
    with pytest.raises(ValueError, match=fragment):
        grouped_linear(x, w, groups)


def test_dtype_mismatch_is_an_error():
    x, w, _ = inputs([4, 4], 16, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        grouped_linear(x, w.half(), [4, 4])


GPU_GROUPS = [([0, 300, 17, 0, 1000, 129], 264, 520), ([0, 0, 777, 0], 128, 256), ([0, 0], 64, 64)]
CPU_GROUPS = [([0, 35, 3, 0], 24, 40), ([0, 0], 16, 16)]  # the CPU case: tiles of 32, ragged


@pytest.mark.parametrize("device,dtype,tol", device_cases([(torch.float16, 2e-3)],
                                                          [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)],
                                                          ids=lambda c: str(c[0]).split(".")[-1]))
def test_compiled_kernels_on_the_gpu(device, dtype, tol):
    """cuda: the compiled kernels in bf16 and fp16, host and device group counts; cpu: the
    interpreter in fp16 on smaller groups (a CPU tensor of counts takes the same path)."""
    dev = kernel_device(device)
    for counts, k, n_out in (GPU_GROUPS if dev.type == "cuda" else CPU_GROUPS):
        x, w, dy = inputs(counts, k, n_out, dtype, dev)
        ry, rdx, rdw = reference(x, w, dy, counts)
        for groups in (counts, torch.tensor(counts, device=dev)):  # host and device counts
            y, dx, dw = run(grouped_linear, x, w, dy, groups)
            assert y.dtype == dtype and err(y, ry) < tol
            assert err(dx, rdx) < tol and err(dw, rdw) < tol
