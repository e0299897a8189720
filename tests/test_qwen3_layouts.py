"""A Qwen3-shaped model (QK-norm, head size 16 with hidden 32 and 4 heads: attention width 64)
trains under every layout as serially: losses and grad norms within 1e-5 (fp32).

Two worlds: the serial run, and one world of 4 ranks running each layout in turn:
TP 2 + SP x PP 2 (the q/k norm weights' gradients summed over the TP heads), CP 2 ring (p2p) x
DP 2 ZeRO-1, and CP 2 all-to-all (a2a) x TP 2 + SP.
"""
from __future__ import annotations

import pytest

from tests.layouts_vs_serial import LAYOUTS, TP2, assert_layouts_equal_serial

QWEN3 = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
         "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_every_layout_equals_serial():
    assert_layouts_equal_serial(QWEN3, LAYOUTS)
