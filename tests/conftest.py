"""Test settings: Triton kernels run in the CPU interpreter; one thread per process."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
