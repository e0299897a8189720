"""tools/step_time_sweep.py's arithmetic and cases, without training (the sweep itself is a
benchmark command: docs/BENCHMARKS.md): Spearman's correlation against hand-ranked lists, the
issue's three figures from hand-made rows, and every case a layout megalite accepts on two ranks
whose flags are the planner's own."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import step_time_sweep as sweep  # noqa: E402


def test_spearman_by_hand():
    assert sweep.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert sweep.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # ranks (0,1,2,3) against (1,0,2,3): d^2 sum 2, 1 - 6*2/(4*15) = 0.8
    assert sweep.spearman([1, 2, 3, 4], [2, 1, 3, 4]) == pytest.approx(0.8)


def test_summary_by_hand():
    rows = [{"label": "a", "predicted_s": 1.0, "measured_s": 1.25, "error": 1.0 / 1.25 - 1},
            {"label": "b", "predicted_s": 0.9, "measured_s": 1.5, "error": 0.9 / 1.5 - 1},
            {"label": "c", "predicted_s": 2.2, "measured_s": 2.0, "error": 0.1}]
    facts = sweep.summary(rows)
    assert facts["median_abs_error"] == pytest.approx(0.2)  # |errors| 0.2, 0.4, 0.1
    assert facts["predicted_best"] == "b" and facts["measured_best"] == "a"
    assert facts["predicted_best_gap"] == pytest.approx(1.5 / 1.25 - 1)
    assert facts["spearman"] == pytest.approx(0.5)  # predicted ranks (1,0,2), measured (0,1,2)


def test_every_case_fits_two_ranks_and_trains_with_the_planners_flags():
    assert len(sweep.CASES) >= 20 and set(sweep.QUICK) <= {c.label for c in sweep.CASES}
    for case in sweep.CASES:
        assert case.world <= 2, case.label  # two cores: no rank shares one
        flags = sweep.flags_of(case)
        assert "--mock-data" in flags and "--bf16" not in flags, case.label
        if case.update.optimizer == "muon":
            assert "--optimizer=muon" in flags, case.label


TINY = ("--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--vocab-size", "256", "--hidden-dropout", "0", "--attention-dropout", "0")


@pytest.mark.slow
def test_a_small_sweep_predicts_within_a_generous_bound():
    """The sweep's small version, measured here (the full one is a benchmark: docs/BENCHMARKS.md):
    a tiny GPT on one rank and on DP 2 ZeRO-1, this machine's achieved rate calibrated on that GPT
    (tools/calibrate_hardware.measure_training) and the links of the committed two-rank profile:
    each prediction within 2x of its measurement, and both rank the two layouts alike."""
    import dataclasses

    import torch

    from megalite.planner.hardware import hardware_from_profile
    from tools import calibrate_hardware

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank is one single-threaded process
    try:
        rate = calibrate_hardware.measure_training((128, 128, 1, 4), 2, 256, torch.device("cpu"), False, 3, 2)
    finally:
        torch.set_num_threads(threads)
    hw = dataclasses.replace(hardware_from_profile(os.path.join(os.path.dirname(sweep.__file__), "..", "docs",
                                                                "profiles", "cpu-2core-2ranks.json"),
                                                   gpus_per_node=2), achieved_tflops=rate["tflops"])
    cases = [c for c in sweep.CASES if c.label in ("1 rank", "DP 2 ZeRO-1")]
    predicted = [sweep.predict(c, hw, TINY)[0] for c in cases]
    measured = [sweep.measure(c, 8, 3, TINY) for c in cases]
    for case, p, m in zip(cases, predicted, measured):
        assert 0.5 < p / m < 2.0, (case.label, p, m)  # the goal is 15% (the benchmark); a test machine is noisy
    assert (predicted[0] > predicted[1]) == (measured[0] > measured[1]), (predicted, measured)
