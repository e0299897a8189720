"""What the planner counts per layer for the new models' attention equals what a layer keeps.

The per-layer activations of the planner (the parts' shapes, megalite/layers/part_shape.py) against
a meta dry run (tools/dry_run.py): the layer's share is the difference between a 4-layer and a
2-layer model of the same shape, so the embedding, the output layer and the loss cancel. Qwen3's
attention (--kv-channels, --qk-layernorm) under grouped-query attention, where the query heads of a
group are gathered into a copy that the query norm keeps (the Qwen3-30B-A3B recipe's 48 layers keep
1.6 GB more than planned: an expected failure until the shape counts it, below), and with one head
per group, where the query stays a view. Single process, meta tensors: about a second each (slow).
"""
from __future__ import annotations

import json

import pytest

SHAPE = ["--world-size", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--hidden-size", "1024",
         "--num-attention-heads", "16", "--ffn-hidden-size", "2048", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--seq-length", "1024", "--vocab-size", "512",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16"]


def _activations(argv: list[str], tmp_path, capsys) -> tuple[float, float]:
    from tools import dry_run

    out = tmp_path / "dry.json"
    assert dry_run.main(argv + ["--json", str(out)]) == 0
    capsys.readouterr()
    role = json.loads(out.read_text())["roles"][0]
    return role["planned_categories"]["activations"], role["categories"]["activations"]


# The GQA case fails today: SelfAttentionShape.activation_bytes counts the query norm's input as a
# view of the qkv output, but under GQA megalite's attention gathers a group's query heads into a
# copy (q = qkv[:, :, :hpg].reshape(...)), which the norm keeps: s b a d bytes per layer more. The
# fix, ``split += B * width * (1 + 2 * kv + (g < a)) + ...`` in megalite/layers/part_shape.py, changes
# what tests/test_qwen3_attention.py::test_the_shape_is_the_built_model asserts (the old formula),
# a test this change may not edit: left to the merge (strict: this fails once the shape is fixed).
GQA_GAP = pytest.mark.xfail(strict=True, reason="the query norm's GQA copy is not in the shape yet (see above)")


@pytest.mark.slow
@pytest.mark.parametrize("attention", [pytest.param(["--num-query-groups", "4", "--kv-channels", "128",
                                                     "--qk-layernorm"], marks=GQA_GAP),
                                       ["--num-query-groups", "16", "--kv-channels", "128", "--qk-layernorm"]],
                         ids=["gqa", "one-head-per-group"])
def test_qk_norm_layer_activations_equal_the_dry_run(attention, tmp_path, capsys):
    (p2, m2), (p4, m4) = (_activations(SHAPE + attention + ["--num-layers", str(n)], tmp_path, capsys)
                          for n in (2, 4))
    planned, measured = (p4 - p2) / 2, (m4 - m2) / 2
    assert abs(planned - measured) <= 0.01 * measured, (planned, measured)
