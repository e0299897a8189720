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

from tests.layouts_vs_serial import LAYOUTS, TP2, assert_layouts_equal_serial

MLA = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
       "--num-attention-heads", "4", "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
       "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0"]
ZB_H1 = {"tp2+sp x pp2 zb-h1, selective recompute": TP2 + ["--pipeline-model-parallel-size", "2",
                                                             "--pipeline-schedule", "zb-h1",
                                                             "--recompute-granularity", "selective"]}


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_every_layout_equals_serial():
    assert_layouts_equal_serial(MLA, {**LAYOUTS, **ZB_H1})
