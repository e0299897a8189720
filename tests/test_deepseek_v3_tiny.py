"""DeepSeek-V3-tiny end to end: every DeepSeek-V3 piece in one model, trained 6 steps serially and
under every layout in one 4-rank world, through ``pretrain``'s command line.

The model (``DEEPSEEK_V3_TINY``, the command line docs/moe.md shows): Multi-head Latent Attention
with a query latent (12) and a key/value latent (10), heads of 8 no-RoPE + 4 RoPE dimensions
against values of 6 (d_qk 12 != d_v 6), YaRN RoPE (factor 4 over an original 8 positions, the
softmax-scale correction on); the first layer dense, the second MoE (``([0]*1+[1]*1)``) with 8
experts top-2 and a shared expert; sigmoid scores, 4 groups keeping 2, a routed scaling factor,
aux-loss-free expert bias (no aux loss).

Layouts (losses and grad norms within 1e-5 of serial, the expert biases after 6 steps
bit-identical to serial's): TP2+SP x EP2, CP2 a2a x EP2, CP2 p2p x DP2 ZeRO-1 on packed documents
(its serial run packs them too), PP2 (1F1B) x EP2 x DP2 ZeRO-1, PP2 zb-h1 x DP2, TP2+SP x PP2
with full recomputation, EP4 x DP4 ZeRO-1 (each group of 2 experts on a rank of its own) and CP2
all-gather x TP2+SP. docs/moe.md's "Train a DeepSeek-V3-style model" block is this command
line (its --train-iters aside) at TP2+SP x EP2.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.layouts_vs_serial import TP2, assert_layouts_equal_serial

STEPS = 6
DEEPSEEK_V3_TINY = [
    "--mock-data", "--vocab-size", "300", "--seq-length", "32", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "48",
    # Multi-head Latent Attention, YaRN RoPE
    "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--position-embedding-type", "rope",
    "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
    "--mscale", "1.0", "--mscale-all-dim", "1.0",
    # first layer dense, then MoE with a shared expert, DeepSeek-V3 routing, expert bias
    "--moe-layer-freq", "([0]*1+[1]*1)", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16",
    "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "none",
    # six steps
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "1",
    "--train-iters", str(STEPS), "--log-interval", "100", "--adam-eps", "1e-5", "--hidden-dropout", "0",
    "--attention-dropout", "0"]
EP2, PP2 = ["--expert-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
ZERO1 = ["--use-distributed-optimizer"]
LAYOUTS = {
    "tp2+sp x ep2": TP2 + EP2,
    "cp2 a2a x ep2": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"] + EP2,
    "cp2 p2p x dp2 zero-1, packed documents": (PACKED, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
                                               + ZERO1),
    "pp2 1f1b x ep2 x dp2 zero-1": PP2 + EP2 + ZERO1,
    "pp2 zb-h1 x dp2": PP2 + ["--pipeline-schedule", "zb-h1"],
    "tp2+sp x pp2, full recompute": TP2 + PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    "ep4 x dp4 zero-1": ["--expert-model-parallel-size", "4"] + ZERO1,
    "cp2 allgather x tp2+sp": TP2 + ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
}


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_deepseek_v3_tiny_every_layout_equals_serial_with_bit_identical_expert_biases():
    assert_layouts_equal_serial(DEEPSEEK_V3_TINY, LAYOUTS, steps=STEPS, expert_biases=True, timeout=300)


def test_docs_command_is_the_tested_one():
    text = (Path(__file__).resolve().parent.parent / "docs" / "moe.md").read_text()
    block = text.split("**Train a DeepSeek-V3-style model**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    argv = argv[argv.index("pretrain_gpt.py") + 1:]
    iters = argv.index("--train-iters")
    tested = list(DEEPSEEK_V3_TINY)
    tested[tested.index("--train-iters") + 1] = argv[iters + 1]
    assert argv == tested + LAYOUTS["tp2+sp x ep2"], argv
