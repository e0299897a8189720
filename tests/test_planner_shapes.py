"""What the planner counts per layer for the new models' attention equals what a layer keeps.

The per-layer activations of the planner (the parts' shapes, megalite/layers/part_shape.py) against
a meta dry run (tools/dry_run.py): the layer's share is the difference between a 4-layer and a
2-layer model of the same shape, so the embedding, the output layer and the loss cancel. Qwen3's
attention (--kv-channels, --qk-layernorm) under grouped-query attention, where the query heads of a
group are gathered into a copy that the query norm keeps (s b a d per layer: 1.6 GB over the
Qwen3-30B-A3B recipe's 48 layers), and with one head per group, where the query stays a view. Single process, meta tensors: about a second each (slow).
"""
from __future__ import annotations

import json

import pytest

SHAPE = ["--world-size", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--hidden-size", "1024",
         "--num-attention-heads", "16", "--ffn-hidden-size", "2048", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--seq-length", "1024", "--vocab-size", "512",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16"]


def _activations(argv: list[str], tmp_path, capsys, with_gathered: bool = False) -> tuple[float, float]:
    """(planned, measured) activation bytes of the dry run's first role; ``with_gathered``: the
    measured side with what the dry run files under "communication" (an all-gathered tensor kept
    for backward), which the planner counts with the activations."""
    from tools import dry_run

    out = tmp_path / "dry.json"
    assert dry_run.main(argv + ["--json", str(out)]) == 0
    capsys.readouterr()
    role = json.loads(out.read_text())["roles"][0]
    gathered = role["categories"].get("communication", 0) if with_gathered else 0
    return role["planned_categories"]["activations"], role["categories"]["activations"] + gathered


@pytest.mark.slow
@pytest.mark.parametrize("attention", [["--num-query-groups", "4", "--kv-channels", "128",
                                        "--qk-layernorm"],
                                       ["--num-query-groups", "16", "--kv-channels", "128", "--qk-layernorm"]],
                         ids=["gqa", "one-head-per-group"])
def test_qk_norm_layer_activations_equal_the_dry_run(attention, tmp_path, capsys):
    (p2, m2), (p4, m4) = (_activations(SHAPE + attention + ["--num-layers", str(n)], tmp_path, capsys)
                          for n in (2, 4))
    planned, measured = (p4 - p2) / 2, (m4 - m2) / 2
    assert abs(planned - measured) <= 0.01 * measured, (planned, measured)


@pytest.mark.slow
def test_mla_layer_activations_under_sequence_parallelism_equal_the_dry_run(tmp_path, capsys):
    """MLA at TP2 + SP: the down-projections keep the gathered input (the whole sequence on each
    rank), which the shape counts whole (PartShape.sequence_gathered_bytes), the rest a shard."""
    mla = ["--multi-latent-attention", "--q-lora-rank", "192", "--kv-lora-rank", "128", "--qk-head-dim", "64",
           "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--world-size", "2",
           "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    (p2, m2), (p4, m4) = (_activations(SHAPE + mla + ["--num-layers", str(n)], tmp_path, capsys, with_gathered=True)
                          for n in (2, 4))
    planned, measured = (p4 - p2) / 2, (m4 - m2) / 2
    assert abs(planned - measured) <= 0.01 * measured, (planned, measured)
