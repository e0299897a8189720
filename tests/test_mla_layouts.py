"""A DeepSeek-V3-shaped MLA model (query latent 12, key/value latent 10, heads of 8 + 4 RoPE and
values of 6: d_v != d_qk) trains under every layout as serially: losses and grad norms within
1e-5 (fp32).

Two worlds: the serial run, and one world of 4 ranks running each layout in turn: TP 2 + SP x
PP 2 (the replicated down-projections and latent norms: gradients summed over TP; the
down-projections see the gathered sequence), CP 2 ring (p2p) x DP 2 ZeRO-1, and CP 2
all-to-all (a2a) x TP 2 + SP, and TP 2 + SP x PP 2 under the zero-bubble schedule zb-h1 (the
up-projections' weight gradients deferred, the replicated ones not) with selective recomputation.
"""
from __future__ import annotations

import pytest

from megalite.testing import run_world

MLA = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
       "--num-attention-heads", "4", "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
       "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"tp2+sp x pp2": TP2 + ["--pipeline-model-parallel-size", "2"],
           "cp2 p2p x dp2 zero-1": ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                    "--use-distributed-optimizer"],
           "cp2 a2a x tp2+sp": TP2 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
           "tp2+sp x pp2 zb-h1, selective recompute": TP2 + ["--pipeline-model-parallel-size", "2",
                                                            "--pipeline-schedule", "zb-h1",
                                                            "--recompute-granularity", "selective"]}


def _runs(rank, world, runs):
    from megalite.train.pretrain import pretrain
    return [[(r["loss"], r["grad_norm"]) for r in pretrain(argv)] for argv in runs]


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_every_layout_equals_serial():
    serial = run_world(_runs, 1, [MLA])[0][0]
    assert len(serial) == 4
    results = run_world(_runs, 4, [MLA + flags for flags in LAYOUTS.values()])[0]
    for name, got in zip(LAYOUTS, results):
        worst = max(abs(a - b) / abs(b) for pair, ref in zip(got, serial) for a, b in zip(pair, ref))
        print(f"{name}: worst relative difference {worst:.1e}")
        assert worst < 1e-5, (name, got, serial)
