"""Shared by the model-family layout tests: train a tiny model through ``pretrain`` in one process
and under several layouts in one 4-rank world, and hold every layout's losses and grad norms to
the serial run's (fp32, 1e-5 relative).

A layout is a list of flags added to the model's command line, or a pair (model flags, layout
flags): the model flags (e.g. packed documents) go into that layout's serial run too; the serial
runs of every distinct set share one 1-rank world. With ``expert_biases`` the aux-loss-free
expert biases after the last step are collected from every rank (each stage holds its own
layers') and must be bit-identical to the serial run's."""
from __future__ import annotations

import torch

from megalite.testing import run_world

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"tp2+sp x pp2": TP2 + ["--pipeline-model-parallel-size", "2"],
           "cp2 p2p x dp2 zero-1": ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                    "--use-distributed-optimizer"],
           "cp2 a2a x tp2+sp": TP2 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}


def _runs(rank, world, runs, expert_biases=False):
    import megalite.train.pretrain as driver
    if not expert_biases:
        return [[(r["loss"], r["grad_norm"]) for r in driver.pretrain(argv)] for argv in runs]
    built = []
    build = driver.build_training_state

    def keep(config, grid, device):  # the run's model chunks, to read their biases after training
        state = build(config, grid, device)
        built.append(state[0])
        return state

    driver.build_training_state = keep
    try:
        out = []
        for argv in runs:
            log = [(r["loss"], r["grad_norm"]) for r in driver.pretrain(argv)]
            chunks = built.pop()
            out.append((log, {n: b.detach().clone() for c in chunks for n, b in c.named_buffers()
                              if n.endswith("expert_bias")}))
        return out
    finally:
        driver.build_training_state = build


def _split(layout) -> tuple[list[str], list[str]]:
    return (list(layout[0]), list(layout[1])) if isinstance(layout, tuple) else ([], list(layout))


def assert_layouts_equal_serial(model_flags: list[str], layouts: dict, steps: int = 4, *,
                                expert_biases: bool = False, timeout: float = 120.0) -> None:
    """``model_flags`` (a whole pretrain command line of ``steps`` iterations) serially, then with
    each layout's flags added, all layouts side by side in one 4-rank world (module docstring)."""
    variants = {name: _split(layout) for name, layout in layouts.items()}
    extras = sorted({tuple(extra) for extra, _ in variants.values()})
    serial_runs = run_world(_runs, 1, [model_flags + list(e) for e in extras], expert_biases, timeout=timeout)[0]
    serial = {e: run for e, run in zip(extras, serial_runs)}
    per_rank = run_world(_runs, 4, [model_flags + extra + flags for extra, flags in variants.values()],
                         expert_biases, timeout=timeout)
    for i, (name, (extra, _)) in enumerate(variants.items()):
        ref, got = serial[tuple(extra)], per_rank[0][i]
        if expert_biases:
            (ref, ref_biases), got = ref, got[0]
        assert len(ref) == steps
        worst = max(abs(a - b) / abs(b) for pair, r in zip(got, ref) for a, b in zip(pair, r))
        print(f"{name}: worst relative difference {worst:.1e}")
        assert worst < 1e-5, (name, got, ref)
        if expert_biases:
            assert any(b.abs().sum() > 0 for b in ref_biases.values()), "the serial run moved no bias"
            seen = set()
            for rank_out in per_rank:
                for layer, bias in rank_out[i][1].items():
                    assert torch.equal(bias, ref_biases[layer]), (name, layer, bias, ref_biases[layer])
                    seen.add(layer)
            assert seen == set(ref_biases), (name, sorted(seen), sorted(ref_biases))
