"""Test settings: Triton kernels run in the CPU interpreter; one thread per process.

Tests marked ``gpu`` (tests/test_gpu.py) need a CUDA GPU and are skipped without one. On a
GPU machine run them with the kernels compiled (``TRITON_INTERPRET=0``, which the setdefault
below leaves alone): ``TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/``, or
``scripts/gpu_check.sh``.

Tests marked ``slow`` are left out by ``pytest -m "not slow" tests/``, the fast tier (a few
minutes on two CPU cores) that still holds a test of every feature; the whole suite runs them all.
"""
import os

import pytest

# Under CI=true a skip that is not the machine's fails the run, a whole module's skip at
# collection included: the hooks live in tests/skip_policy.py, and naming them here is what makes
# pytest call them (tests/test_skip_policy.py checks that they are these).
from tests.skip_policy import (pytest_collectreport, pytest_runtest_logreport,  # noqa: F401
                               pytest_sessionfinish)

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Imported once here, before any test forks a world: building a model on meta (every pretrain
# does, for its parameter count) runs nn.init.normal_ through torch's reference ops, whose
# dynamo-disabled wrapper imports torch._dynamo (about 1.3 s of one core, sympy included) on
# first use. A forked rank of megalite.testing.run_world inherits the parent's modules, so
# without this line each rank of each world paid that import whenever no earlier test in the
# session had made the parent import it (a file or -k selection run on its own).
import torch._dynamo  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; scripts/gpu_check.sh "
                                       "runs them)")
    config.addinivalue_line("markers", "slow: left out of the fast tier (pytest -m \"not slow\"): worlds of "
                                       "4-8 processes, torchrun, long runs, second cases of a feature the fast "
                                       "tier already covers")


@pytest.fixture(autouse=True)
def _leave_the_process_as_found():
    """torch.backends flags, the default dtype and the RNG streams are restored after every
    test (tests/process_state.py): no test's TF32 or seed changes the next one's numbers."""
    from tests import process_state

    saved = process_state.save()
    yield
    process_state.restore(saved)


def pytest_report_header(config):
    """Every dependency's resolved version, in the header of any pytest run (CI logs included)."""
    from tests.dependency_versions import line

    return line()


# Every case this session collected, before -m / -k / --deselect take any away: what
# tests/test_gpu_twins.py checks, without collecting the suite again in a new interpreter, when
# the session was given the whole tests/ folder (pytest tests/, the fast and the slow tier alike).
COLLECTED: dict = {"whole": False, "items": []}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    given = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    ignored = any(config.getoption(name, None) for name in ("ignore", "ignore_glob"))
    COLLECTED["whole"] = given == [here] and not ignored and not config.getoption("collectonly", False)
    COLLECTED["items"] = [{
        "file": item.nodeid.split("::")[0],
        "function": getattr(item, "originalname", None) or item.name,
        "gpu": item.get_closest_marker("gpu") is not None,
        "doc": (getattr(item, "function", None).__doc__ or "") if getattr(item, "function", None) else "",
    } for item in items]
    _skip_gpu_items_without_a_gpu(items)


def _skip_gpu_items_without_a_gpu(items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
