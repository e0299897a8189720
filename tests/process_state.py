"""What one test may change for the whole process, saved before it and restored after it.

``torch.backends`` switches (TF32 for matmuls and cuDNN, cuDNN's deterministic and benchmark
modes, deterministic algorithms, the fp32 matmul precision), the default dtype and the RNG
streams (CPU, and every CUDA device's when there is one) are process-wide. ``pretrain.setup``
turns TF32 on (``set_tf32``), so without a restore a test that calls it changes the tolerance of
every fp32 CUDA comparison after it, in whatever order a shard runs them (issue 36). The
autouse fixture in ``tests/conftest.py`` calls :func:`save` and :func:`restore` around each test.
"""
from __future__ import annotations

import torch


def save() -> dict:
    state = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    # The precision first: setting matmul.allow_tf32 rewrites it, and the saved pair agrees.
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = state["matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_allow_tf32"]
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.use_deterministic_algorithms(state["deterministic_algorithms"], warn_only=state["deterministic_warn_only"])
    torch.set_default_dtype(state["default_dtype"])
    torch.set_rng_state(state["cpu_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
