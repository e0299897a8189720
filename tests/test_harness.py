"""The multi-process harness itself: results, errors and hangs are reported, never hung."""
import time

import pytest
import torch
import torch.distributed as dist

from megalite.testing import WorldError, run_world


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


def test_results_in_rank_order():
    assert run_world(_sum_ranks, 4, 2.0) == [12.0] * 4


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_worker_exception_is_reported_with_rank_and_traceback():
    with pytest.raises(WorldError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_world(_fail_on_rank_1, 2, timeout=30)


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


@pytest.mark.slow
def test_hang_is_reported_not_hung():
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"rank\(s\) \[0\] of 2 did not finish"):
        run_world(_hang_on_rank_0, 2, timeout=3)
    assert time.monotonic() - start < 20


def test_an_unawaited_rank_is_killed_once_the_others_have_reported():
    """``unawaited=(0,)``: the world ends when rank 1 has returned, not after rank 0's sleep."""
    start = time.monotonic()
    assert run_world(_hang_on_rank_0, 2, timeout=30, unawaited=(0,)) == [None, 1]
    assert time.monotonic() - start < 20
