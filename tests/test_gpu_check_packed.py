"""Packed documents in the compiled Triton attention kernels: gpu_check part (a)'s packed case.

Why: the document-masked variants (``DOCS=True``: each query sees only keys of its own document)
are separate compilations of the forward, delta, dk/dv and dq kernels, with two more loads and a
compare per tile; tests/test_packed_kernels.py checks them in the CPU interpreter only, so the
compiled code for a GPU had no check (issue 36). One case per pass: the forward (output and LSE)
and the backward (dq, dk, dv) of one packed batch, against a float64 torch reference with the
same document mask.

The ``cuda`` case (``gpu``-marked, scripts/gpu_check.sh part (a)): bf16, GQA, head dim 128,
s = 1000 (not a tile multiple) with documents of length 1, across tile edges and filling the
row. The ``cpu`` case runs the same body in the Triton interpreter (tests/device_twins.py): fp16
(the interpreter stores bf16 as raw uint16), 32-wide tiles, the same kinds of documents.
Error measure and bounds as tests/test_gpu.py: max |a - ref| / max(1, max |ref|), about 4x the
rounding of a 16-bit output.
"""
from __future__ import annotations

import pytest
import torch

from tests.device_twins import device_cases, kernel_device, synchronize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OUT_TOL = {"bf16": 1.6e-2, "fp16": 2e-3}
LSE_TOL = 5e-4

# (document lengths per batch row, heads, groups, head dim)
CUDA_CASE = ([[1, 63, 64, 1, 300, 571], [500, 500]], 8, 2, 128)
CPU_CASE = ([[1, 1, 32, 1, 37], [5, 60, 7]], 4, 2, 16)


def documents(lengths_per_row: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_start, doc_end), (b, s) int32: each position's document's first and one-past-last."""
    starts, ends = [], []
    for lengths in lengths_per_row:
        row_start, row_end, at = [], [], 0
        for n in lengths:
            row_start += [at] * n
            row_end += [at + n] * n
            at += n
        starts.append(row_start)
        ends.append(row_end)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(starts), as_tensor(ends)


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return (a - ref).abs().max().item() / max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("device,dtype,case", device_cases([("fp16", CPU_CASE)], [("bf16", CUDA_CASE)],
                                                           ids=lambda c: c[0]))
def test_packed_documents_forward_and_backward_on_cuda(device, dtype, case):
    from megalite.kernels.attention_reference import attention_reference
    from megalite.kernels.flash_attention import flash_attention

    lengths, heads, groups, d = case
    dev, dt = kernel_device(device), DTYPES[dtype]
    torch.manual_seed(0)
    doc_start, doc_end = documents(lengths, dev)
    b, s = doc_start.shape
    q, dout = (torch.randn(b, heads, s, d, device=dev).to(dt) for _ in range(2))
    k, v = (torch.randn(b, groups, s, d, device=dev).to(dt) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attention(*leaves, return_lse=True, doc_start=doc_start, doc_end=doc_end)
    out.backward(dout)
    synchronize(dev)
    ref64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref64, doc_start=doc_start)
    ref_out.backward(dout.double())

    assert out.dtype == dt and lse.shape == (b, heads, s) and out.device.type == torch.device(device).type
    assert not any(torch.isnan(t).any() for t in (out, lse, *(x.grad for x in leaves)))
    assert err(out, ref_out) < OUT_TOL[dtype], err(out, ref_out)
    assert err(lse, ref_lse) < LSE_TOL, err(lse, ref_lse)
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref64):
        assert err(x.grad, r.grad) < OUT_TOL[dtype], (name, err(x.grad, r.grad))
    # A length-1 document past the row's start attends to itself alone: its output is its own value
    # row (GQA: its group's value head), which a causal kernel without the mask would not give.
    at = next(sum(lengths[0][:i]) for i, n in enumerate(lengths[0]) if n == 1 and i > 0)
    own = v[0].repeat_interleave(heads // groups, dim=0)[:, at].double()
    assert err(out[0, :, at].double(), own) < OUT_TOL[dtype]
