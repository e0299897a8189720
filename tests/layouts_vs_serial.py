"""Shared by the model-family layout tests: train a tiny model through ``pretrain`` in one process
and under several layouts in one 4-rank world, and hold every layout's losses and grad norms to
the serial run's (fp32, 1e-5 relative)."""
from __future__ import annotations

from megalite.testing import run_world

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"tp2+sp x pp2": TP2 + ["--pipeline-model-parallel-size", "2"],
           "cp2 p2p x dp2 zero-1": ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                                    "--use-distributed-optimizer"],
           "cp2 a2a x tp2+sp": TP2 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}


def _runs(rank, world, runs):
    from megalite.train.pretrain import pretrain
    return [[(r["loss"], r["grad_norm"]) for r in pretrain(argv)] for argv in runs]


def assert_layouts_equal_serial(model_flags: list[str], layouts: dict[str, list[str]], steps: int = 4) -> None:
    """``model_flags`` (a whole pretrain command line of ``steps`` iterations) serially, then with
    each layout's flags added, all layouts side by side in one 4-rank world."""
    serial = run_world(_runs, 1, [model_flags])[0][0]
    assert len(serial) == steps
    results = run_world(_runs, 4, [model_flags + flags for flags in layouts.values()])[0]
    for name, got in zip(layouts, results):
        worst = max(abs(a - b) / abs(b) for pair, ref in zip(got, serial) for a, b in zip(pair, ref))
        print(f"{name}: worst relative difference {worst:.1e}")
        assert worst < 1e-5, (name, got, serial)
