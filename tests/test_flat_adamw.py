"""The flat AdamW's device-side skip (megalite/data_parallel/adamw.py)."""
import pytest
import torch

from megalite.data_parallel.adamw import FlatAdamW


def _one_step(found_inf):
    masters, moments, squares = [torch.ones(8)], [torch.zeros(8)], [torch.zeros(8)]
    opt = FlatAdamW(masters, moments, squares, [[(0, 5)]], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.step([torch.ones(8)], 1e-2, None, found_inf)
    return masters[0], moments[0], squares[0], float(opt.steps)


@pytest.mark.parametrize("found_inf", [torch.tensor(True), torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5),
                                       torch.tensor(3, dtype=torch.int64)], ids=str)
def test_any_nonzero_found_inf_skips_the_whole_update_and_the_count(found_inf):
    """torch's fused kernel skips only on exactly 1.0; the docstring's promise (any nonzero
    value skips) is kept by making the flag 0/1 on the device first."""
    master, moment, square, steps = _one_step(found_inf)
    assert torch.equal(master, torch.ones(8)) and not moment.any() and not square.any() and steps == 0.0


@pytest.mark.parametrize("found_inf", [None, torch.tensor(False), torch.tensor(0.0)], ids=str)
def test_a_zero_or_absent_found_inf_updates_and_counts(found_inf):
    master, moment, square, steps = _one_step(found_inf)
    assert (master < 1).all() and moment.gt(0).all() and square.gt(0).all() and steps == 1.0
    assert master[0] < master[7]  # the decayed range [0, 5) moved further
