"""Test settings: Triton kernels run in the CPU interpreter; one thread per process.

Tests marked ``gpu`` (tests/test_gpu.py) need a CUDA GPU and are skipped without one. On a
GPU machine run them with the kernels compiled (``TRITON_INTERPRET=0``, which the setdefault
below leaves alone): ``TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/``, or
``scripts/gpu_check.sh``.
"""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; scripts/gpu_check.sh "
                                       "runs them)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
