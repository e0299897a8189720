"""A test that flips process-wide torch state (TF32 through pretrain's own switch, the default
dtype, the RNG) does not change the next test: the autouse fixture of tests/conftest.py restores
it. The two tests run in file order; the second checks what the first changed."""
import torch

from megalite.train.pretrain import set_tf32

_BEFORE = {}


def test_a_flips_tf32_dtype_and_rng():
    _BEFORE.update(tf32=torch.backends.cuda.matmul.allow_tf32, cudnn=torch.backends.cudnn.allow_tf32,
                   precision=torch.get_float32_matmul_precision(), dtype=torch.get_default_dtype(),
                   draw=torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state())))
    set_tf32(not _BEFORE["tf32"])  # what pretrain.setup does, on a GPU machine too
    torch.backends.cudnn.allow_tf32 = not _BEFORE["cudnn"]
    torch.backends.cudnn.benchmark = True
    torch.set_default_dtype(torch.float64)
    torch.rand(1000)
    assert torch.backends.cuda.matmul.allow_tf32 != _BEFORE["tf32"]


def test_b_sees_the_state_from_before_a():
    assert _BEFORE, "runs after test_a_flips_tf32_dtype_and_rng"
    assert torch.backends.cuda.matmul.allow_tf32 == _BEFORE["tf32"]
    assert torch.backends.cudnn.allow_tf32 == _BEFORE["cudnn"]
    assert torch.get_float32_matmul_precision() == _BEFORE["precision"]
    assert torch.backends.cudnn.benchmark is False
    assert torch.get_default_dtype() == _BEFORE["dtype"]
    assert torch.equal(torch.rand(3), _BEFORE["draw"])  # the RNG where it was before test a
