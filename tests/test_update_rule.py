"""The update rule is the one definition of the optimizer's state (issue 37, item 5).

:mod:`megalite.data_parallel.update_rule` names AdamW's state tensors and sizes them; the
distributed optimizer, the checkpoint formats, the reshard tool, the memory accounting, the
planners and the preflight disk check read both from it. Two checks keep it that way:

- no module outside the rule (and FlatAdamW, which *is* the step) writes a state name as a
  string or the 12-bytes-per-parameter figure as a number: a second definition would drift
  from the rule when a new rule (Muon, sign-SGD) arrives;
- a rule with other state (one tensor, 8 bytes per parameter) is followed: the optimizer
  allocates and reports exactly that state, its checkpoint kinds are the rule's, and the ZeRO
  arithmetic, the planner and the MoE planner count the rule's bytes.
"""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from megalite.config import TrainConfig
from megalite.data_parallel.accounting import zero_theory_bytes
from megalite.data_parallel.update_rule import ADAMW, MASTER_KIND, UpdateRule
from megalite.data_parallel.zero import DistributedOptimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULE_HOMES = {"megalite/data_parallel/update_rule.py", "megalite/data_parallel/rule_types.py",  # the registry, AdamW's rule
              "megalite/data_parallel/adamw.py"}
# A state name written as a string, or the AdamW bytes-per-parameter figure as code:
# ``= 12``, ``12 *``, ``* 12``, ``/ 12`` and ``x 12 bytes`` in a message.
STATE_LITERAL = re.compile(r"""["'](exp_avg|exp_avg_sq)["']""")
BYTES_LITERAL = re.compile(r"(=\s*12\b(?!\.)|\b12\s*\*\s*(psi|psi_|num_param)|[*/]\s*12\b(?!\.)|x 12 bytes)")


def _code_lines(path: pathlib.Path):
    """(number, line) of the file's code, docstrings and comments left out (they may explain the figure)."""
    in_doc = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc or stripped.startswith('"""') or stripped.startswith('r"""'):
            if quotes == 1:
                in_doc = not in_doc
            continue
        yield number, line.split("#", 1)[0]


def test_no_second_definition_of_the_optimizer_state():
    """Every file that counts or names optimizer state (the checkpoint code, the reshard tool,
    accounting, planners, preflight, the memory tracker, the optimizer) gets names and bytes
    from the rule."""
    files = [*ROOT.glob("megalite/checkpoint/*.py"), ROOT / "tools/reshard_checkpoint.py",
             *ROOT.glob("megalite/data_parallel/*.py"), *(ROOT / "megalite/planner" / f for f in ("types.py", "estimate.py", "search.py")),
             ROOT / "megalite/moe/planning.py",
             ROOT / "megalite/train/preflight.py", ROOT / "megalite/observe/memory_tracker.py"]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             if str(path.relative_to(ROOT)) not in RULE_HOMES for n, line in _code_lines(path)
             if STATE_LITERAL.search(line) or BYTES_LITERAL.search(line)]
    where = "optimizer state named or sized outside megalite/data_parallel/update_rule.py:\n"
    assert found == [], where + "\n".join(found)


class _HalfStep:
    """A stand-in step with one state tensor: the optimizer only builds it and reads step_count."""

    def __init__(self, masters, states, decay_ranges, t):
        self.masters, self.states, self.step_count = masters, states, 0


MOMENTUM_ONLY = UpdateRule("momentum", ("momentum_buffer",), _HalfStep, state_label="momentum buffers")


def test_optimizer_and_checkpoint_kinds_follow_the_rule():
    """The optimizer allocates one fp32 shard per bucket for each of the rule's state names
    (reachable by name, as ``exp_avg`` is for AdamW), reports their bytes as optimizer state,
    and a checkpoint stores the master weights and the rule's state kinds."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict()
    model.proj = torch.nn.Linear(6, 5)
    opt = DistributedOptimizer([model], TrainConfig(), None, rule=MOMENTUM_ONLY)
    psi = sum(p.numel() for p in model.parameters())
    assert list(opt.state) == ["momentum_buffer"] and opt.momentum_buffer is opt.state["momentum_buffer"]
    assert not hasattr(opt, "exp_avg")
    assert opt.memory_bytes()["optimizer_state"] == MOMENTUM_ONLY.state_bytes * psi == 4 * psi
    assert list(opt.shards_by_kind()) == [MASTER_KIND, "momentum_buffer"] == list(MOMENTUM_ONLY.checkpoint_kinds)
    assert opt.update.states is opt.state

    adam = DistributedOptimizer([model], TrainConfig(), None)
    assert adam.rule is ADAMW and adam.memory_bytes()["optimizer_state"] == ADAMW.state_bytes * psi


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_reach_accounting_and_the_planners(stage):
    """The ZeRO arithmetic, the planner and the MoE planner count the rule's master + state
    bytes: 12 for AdamW, 8 for a one-state rule (its optimizer column is 8/12 of AdamW's)."""
    from megalite.moe import planning
    from megalite.planner import Precision, model_state_bytes

    psi, n = 1_200, 4
    adam = zero_theory_bytes(psi, n, stage, 2, 2)
    one = zero_theory_bytes(psi, n, stage, 2, 2, MOMENTUM_ONLY.bytes_per_parameter)
    assert ADAMW.bytes_per_parameter == Precision().optimizer_bytes
    assert one["master_and_optimizer"] == pytest.approx(adam["master_and_optimizer"] * 8 / ADAMW.bytes_per_parameter)
    prec = Precision(optimizer_bytes=MOMENTUM_ONLY.bytes_per_parameter)
    assert model_state_bytes(psi, n, stage, prec) == one
    moe = planning.model_state_bytes(psi, 0, n, 1, stage, 2, 2, MOMENTUM_ONLY.bytes_per_parameter)
    assert moe == pytest.approx(one)
    assert planning.model_state_bytes(psi, 0, n, 1, stage, 2, 2) == pytest.approx(adam)



def test_zero_report_names_the_rule_it_measures():
    """tools/zero_report.py's header takes the rule's name, state and bytes from the rule (no
    fixed "Adam" text): AdamW's by default, a one-state rule's when given one."""
    from tools import zero_report

    assert zero_report.RULE is ADAMW
    adam = zero_report.header(ADAMW, 4, False)
    assert "adamw (fp32 master + two Adam moments: 12 bytes per parameter)" in adam
    one = zero_report.header(MOMENTUM_ONLY, 2, True).splitlines()
    assert "momentum (fp32 master + one momentum buffers: 8 bytes per parameter)" in one[0]
    assert "Adam" not in one[0] and "adam" not in one[1] and "momentum" in one[1]

STEP_COUNT_HOME = "megalite/data_parallel/step_counter.py"
# The steppers' count as code: the device tensor made, or the property defined (the optimizer's
# ``step_count``, in zero.py, only hands through to its stepper's).
COUNTER_LITERAL = re.compile(r"(self\.steps\s*=\s*torch\.|def step_count\b)")


def test_one_device_step_counter():
    """Every rule's stepper takes its step count from DeviceStepCount: no stepper in megalite/ or
    the seam test makes its own ``steps`` tensor or ``step_count`` property; the count is a
    device scalar, settable, and reads 0 on meta tensors (a dry run)."""
    from megalite.data_parallel.adamw import FlatAdamW
    from megalite.data_parallel.step_counter import DeviceStepCount

    files = [*ROOT.glob("megalite/data_parallel/*.py"), ROOT / "tests/test_seams_proof.py"]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             if str(path.relative_to(ROOT)) not in {STEP_COUNT_HOME, "megalite/data_parallel/zero.py"}
             for n, line in _code_lines(path) if COUNTER_LITERAL.search(line)]
    assert found == [], f"a step count defined outside {STEP_COUNT_HOME}:\n" + "\n".join(found)
    assert issubclass(FlatAdamW, DeviceStepCount)
    counter = DeviceStepCount([torch.zeros(4)])
    counter.step_count = 7
    counter.steps += 1
    assert counter.step_count == 8 and counter.steps.dtype == torch.float32 and counter.steps.dim() == 0
    assert DeviceStepCount([torch.zeros(4, device="meta")]).step_count == 0
    assert DeviceStepCount([]).steps.device.type == "cpu"
