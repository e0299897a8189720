"""Multi-token prediction (``--mtp-num-layers 2``) trains under every layout as serially: the main
loss, the MTP loss and the grad norm of each step within 1e-5 (fp32), untied and tied embeddings.

Two worlds: the serial runs (untied, tied), and one world of 4 ranks running each layout in turn:
PP 2 under 1F1B (the last stage's copy of the untied word embedding, summed with the first
stage's), PP 2 under zb-h1 (the MTP blocks' weight gradients deferred like the layers'), TP 2 + SP
(the gathered, re-split ``eh_proj`` output), CP 2 ring x DP 2 ZeRO-1 (targets shifted on the whole
sequence before the load-balanced split) and TP 2 + SP x PP 2 with full recomputation.
"""
from __future__ import annotations

import pytest

from megalite.testing import run_world

MODEL = ["--mock-data", "--vocab-size", "300", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1",
         "--train-iters", "3", "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
UNTIED = MODEL + ["--untie-embeddings-and-output-weights"]
TIED = MODEL
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {"untied pp2 1f1b": (UNTIED, PP2),
           "tied pp2 zb-h1": (TIED, PP2 + ["--pipeline-schedule", "zb-h1"]),
           "untied tp2+sp": (UNTIED, TP2),
           "tied cp2 p2p x dp2 zero-1": (TIED, ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                                "--use-distributed-optimizer"]),
           "untied tp2+sp x pp2 zb-h1, full recompute": (UNTIED, TP2 + PP2 + [
               "--pipeline-schedule", "zb-h1", "--recompute-granularity", "full"])}


def _runs(rank, world, runs):
    from megalite.train.pretrain import pretrain
    return [[(r["loss"], r["mtp_loss"], r["grad_norm"]) for r in pretrain(argv)] for argv in runs]


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_every_layout_equals_serial():
    untied, tied = run_world(_runs, 1, [UNTIED, TIED])[0]
    serial = {id(UNTIED): untied, id(TIED): tied}
    assert untied[0][1] > 0 and untied != tied
    results = run_world(_runs, 4, [model + flags for model, flags in LAYOUTS.values()])[0]
    for (name, (model, _)), got in zip(LAYOUTS.items(), results):
        ref = serial[id(model)]
        assert len(got) == len(ref) == 3
        worst = max(abs(a - b) / abs(b) for step, want in zip(got, ref) for a, b in zip(step, want))
        print(f"{name}: worst relative difference {worst:.1e}")
        assert worst < 1e-5, (name, got, ref)
