"""Every ``gpu`` test's own logic runs on the CPU too (issue 36): a mistake in a gpu test (an
attribute read after ``close()`` set it to None) fails here, not on the GPU machine on its first run.

The rule, checked over the whole suite's collection: a test function with a ``gpu``-marked case
either has a case without the mark (its device a parameter: tests/device_twins.py), or its
docstring names the CPU test that runs its logic (``CPU twin: test_name``, in the same file) or
says why none can (``Not on the CPU: ...``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_COLLECT = r"""
import json, sys
import pytest

class Collect:
    def __init__(self):
        self.items = []
    def pytest_collection_modifyitems(self, items):
        for item in items:
            function = getattr(item, "function", None)
            self.items.append({
                "file": item.nodeid.split("::")[0],
                "function": item.originalname if hasattr(item, "originalname") else item.name,
                "gpu": item.get_closest_marker("gpu") is not None,
                "doc": (function.__doc__ or "") if function is not None else "",
            })

plugin = Collect()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]], plugins=[plugin])
print("COLLECTED" + json.dumps(plugin.items))
sys.exit(int(code))
"""


def collected(tests_dir: Path) -> list[dict]:
    """Every test case of ``tests_dir`` as pytest collects it: file, function, gpu mark, docstring."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _COLLECT, str(tests_dir)], capture_output=True, text=True,
                         cwd=tests_dir.parent, env=env, timeout=300)
    line = next((line for line in run.stdout.splitlines() if line.startswith("COLLECTED")), None)
    assert run.returncode == 0 and line is not None, f"collection failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(line[len("COLLECTED"):])


def gpu_tests_without_a_cpu_twin(items: list[dict]) -> list[str]:
    """The gpu test functions that break the rule of the module docstring, as ``file::function``."""
    cases: dict[tuple[str, str], list[dict]] = {}
    for item in items:
        cases.setdefault((item["file"], item["function"]), []).append(item)
    missing = []
    for (file, function), its_cases in sorted(cases.items()):
        if not any(case["gpu"] for case in its_cases) or any(not case["gpu"] for case in its_cases):
            continue
        doc = its_cases[0]["doc"]
        if "Not on the CPU:" in doc:
            continue
        twin = re.search(r"CPU twin: (test_\w+)", doc)
        if twin and any(not case["gpu"] for case in cases.get((file, twin.group(1)), [])):
            continue
        missing.append(f"{file}::{function}")
    return missing


def this_sessions_collection() -> list[dict] | None:
    """The suite's cases as this session collected them (tests/conftest.py), before -m or -k
    took any away, when it was given the whole tests/ folder; else None."""
    from tests import conftest

    return conftest.COLLECTED["items"] if conftest.COLLECTED["whole"] else None


@pytest.mark.slow
def test_every_gpu_test_runs_its_logic_on_the_cpu_too():
    """Over the whole suite: this session's own collection when it ran tests/ (the suite, either
    tier), else a collection of tests/ in a new interpreter (a file or -k run)."""
    items = this_sessions_collection()
    missing = gpu_tests_without_a_cpu_twin(items if items is not None else collected(TESTS))
    assert not missing, (
        f"gpu tests whose logic never runs on a CPU: {missing}. Give the test a device parameter "
        f"(tests/device_twins.py: DEVICES, device_cases), or name its CPU test in its docstring "
        f"('CPU twin: test_...'), or say why it cannot run there ('Not on the CPU: ...').")


def test_the_rule_catches_a_gpu_only_test_and_accepts_each_kind_of_twin():
    def case(function, gpu, doc="", file="tests/test_x.py"):
        return {"file": file, "function": function, "gpu": gpu, "doc": doc}

    items = [
        case("test_device_parameter", True), case("test_device_parameter", False),
        case("test_named_twin", True, "CPU twin: test_the_twin"), case("test_the_twin", False),
        case("test_named_twin_missing", True, "CPU twin: test_nowhere"),
        case("test_gpu_only", True, "checks the GPU"),
        case("test_says_why", True, "Not on the CPU: needs the driver's clock"),
        case("test_cpu_only", False),
    ]
    assert gpu_tests_without_a_cpu_twin(items) == ["tests/test_x.py::test_gpu_only",
                                                  "tests/test_x.py::test_named_twin_missing"]
