"""A Qwen3-shaped model (QK-norm, head size 16 with hidden 32 and 4 heads: attention width 64)
trains under every layout as serially: losses and grad norms within 1e-5 (fp32).

Two worlds: the serial run, and one world of 4 ranks running each layout in turn:
TP 2 + SP x PP 2 (the q/k norm weights' gradients summed over the TP heads), CP 2 ring (p2p) x
DP 2 ZeRO-1, and CP 2 all-to-all (a2a) x TP 2 + SP.
"""
from __future__ import annotations

import pytest

from megalite.testing import run_world

QWEN3 = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
         "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"tp2+sp x pp2": TP2 + ["--pipeline-model-parallel-size", "2"],
           "cp2 p2p x dp2 zero-1": ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                    "--use-distributed-optimizer"],
           "cp2 a2a x tp2+sp": TP2 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}


def _runs(rank, world, runs):
    from megalite.train.pretrain import pretrain
    return [[(r["loss"], r["grad_norm"]) for r in pretrain(argv)] for argv in runs]


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_every_layout_equals_serial():
    serial = run_world(_runs, 1, [QWEN3])[0][0]
    assert len(serial) == 4
    results = run_world(_runs, 4, [QWEN3 + flags for flags in LAYOUTS.values()])[0]
    for name, got in zip(LAYOUTS, results):
        worst = max(abs(a - b) / abs(b) for pair, ref in zip(got, serial) for a, b in zip(pair, ref))
        print(f"{name}: worst relative difference {worst:.1e}")
        assert worst < 1e-5, (name, got, serial)
