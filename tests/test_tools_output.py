"""What the planner and the dry run print: one unit and one measure for communication, and
tables whose columns hold whatever they are given.

The planner counts communication as wire bytes per rank (ring collectives); the dry run measures
the bytes handed to each group's collectives. Both now print GiB, the dry run prints the handed
bytes, the same bytes as wire bytes and the planner's wire bytes side by side, and the planner's
--verify prints its figure beside the dry run's. Where the planner's model is exact (the gradient
reduction over DP: the reduce-scatter and all-gather of ZeRO-1, the all-reduce of ZeRO-0) the
printed figures are equal; the planner's TP figure leaves out collectives it does not model (the
embedding's and the loss's, the norms' gradients) and its PP figure is a middle stage's (both
directions), so those are not compared.
"""
from __future__ import annotations

import json
import re

from megalite.planner import GiB
from tools import dry_run, plan_parallel

# One layout of 8 ranks with two roles (PP 2), TP 2 with SP and DP 2 under ZeRO-1, big enough
# that every figure shows in GiB with two decimals; a dry run on meta computes nothing. Untied: the
# tied embedding's gradient all-reduce would share the pp group (its ranks), which the planner does not count.
LAYOUT = ["--world-size", "8", "--gpus-per-node", "8", "--num-layers", "2", "--hidden-size", "2048",
          "--num-attention-heads", "16", "--seq-length", "2048", "--vocab-size", "32000", "--micro-batch-size", "1",
          "--global-batch-size", "4", "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--untie-embeddings-and-output-weights"]
LONG = " and a role name far longer than the old 34-character column"


def _long_role_names(monkeypatch):
    real = dry_run.roles

    def longer(layout):
        out = real(layout)
        out[0]["role"] += LONG
        return out

    monkeypatch.setattr(dry_run, "roles", longer)


def _right_edges(line: str, start: int) -> list[int]:
    """Where each token from ``start`` on ends."""
    return [m.end() for m in re.finditer(r"\S+", line[start:])]


def test_dry_run_tables_fit_a_long_role_name_and_print_the_planners_measure(monkeypatch, capsys, tmp_path):
    """A role name longer than any fixed column: every figure of the memory table still ends
    under its heading. The communication table prints, per role and group, the handed bytes,
    the same as wire bytes (a p2p send: the same) and the planner's wire bytes in GiB, the DP
    figures equal, and a line saying what each counts."""
    _long_role_names(monkeypatch)
    out = tmp_path / "dry.json"
    assert dry_run.main(LAYOUT + ["--json", str(out)]) == 0
    text = capsys.readouterr().out.splitlines()
    roles = json.loads(out.read_text())["roles"]
    assert roles[0]["role"].endswith(LONG)

    header = next(i for i, line in enumerate(text) if line.startswith("role ") and "weights" in line)
    head, rows = text[header], text[header + 1: header + 1 + len(roles)]
    numbers = head.index("ranks")  # the figures start after the ranks column
    heading_edges = _right_edges(head, numbers)[1:9]  # weights ... planned, diff
    for row, role in zip(rows, roles):
        assert row.startswith(role["role"]), row
        assert _right_edges(row, numbers)[1:9] == heading_edges, (head, row)

    comm = next(i for i, line in enumerate(text) if line.startswith("communication bytes per step per rank (GiB)"))
    columns = text[comm + 1].split()
    assert columns == ["role", "group", "handed", "wire", "planned", "diff"], text[comm + 1]
    printed = {}
    role = None
    for line in text[comm + 2:]:
        if line.startswith("handed:"):
            break
        cells = line.split()
        if not line.startswith(" "):
            role = next(r for r in roles if line.startswith(r["role"]))
            cells = line[len(role["role"]):].split()
        printed[role["stage"], cells[0]] = cells[1:]
    else:
        raise AssertionError(f"no line saying what the columns count:\n{text[comm:]}")
    assert "wire: what one rank sends over its links, the planner's measure" in line
    for role in roles:
        handed, wire, planned = (role[k] for k in ("comm_bytes", "comm_wire_bytes", "planned_comm_wire_bytes"))
        assert wire["dp"] == handed["dp"] / 2  # ZeRO-1 over 2 ranks: half of each tensor crosses
        dp = printed[role["stage"], "dp"]
        assert dp[:3] == [f"{handed['dp'] / GiB:.2f}", f"{wire['dp'] / GiB:.2f}", f"{planned['dp'] / GiB:.2f}"]
        assert float(dp[1]) > 0.05 and dp[1] == dp[2], dp  # the planner's figure, in the same unit and measure
        pp = printed[role["stage"], "pp"]
        assert pp[0] == pp[1] and float(pp[1]) > 0, pp  # p2p sends: every byte handed crosses
        assert printed[role["stage"], "tp"][2] != "-" and pp[2] != "-"  # the planner counts these too


def test_planner_verify_prints_its_communication_beside_the_dry_runs(capsys):
    """plan_parallel.py --verify prints, for each verified layout, its wire GiB per kind beside
    the dry run's on the same pipeline stage: equal for the gradient reduction (ZeRO-0, an
    all-reduce over 4 ranks)."""
    argv = ["--num-layers", "2", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--global-batch-size", "4", "--micro-batch-size", "1", "--gpu-memory-gb", "8",
            "--gpus-per-node", "4", "--nodes", "1", "--verify", "1", "--top", "1",
            "--nvlink-gbps", "45000"]  # a link so fast every layout ties: the practitioners' DDP (issue 40)
    assert plan_parallel.main(argv) == 0
    text = capsys.readouterr().out
    assert "communication in wire bytes per rank per step" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("communication (wire GiB per step per rank"))
    planned, measured = re.search(r"DP ([\d.]+) / ([\d.]+)", line).groups()
    assert float(planned) > 0.5 and planned == measured, line


def test_the_planners_recommendation_and_cp_lines_print_wire_gib():
    """The recommendation's 'Communication per step per GPU' line and the CP type line give wire
    bytes in GiB (the dry run's 'wire' column), not GB: the same number formatted one way."""
    from megalite.config import ModelConfig
    from megalite.planner.search import explain, plan
    from megalite.planner import Hardware, format_communication

    m = ModelConfig(num_layers=4, hidden_size=3072, num_attention_heads=24, num_query_groups=24,
                    ffn_hidden_size=4 * 3072, seq_length=131072, vocab_size=32000)
    p = plan(m, Hardware(8, 8, 2), 16, 1)
    lines = explain(p)
    comm = [line for line in lines if line.startswith("Communication per step per GPU")]
    assert comm == [f"Communication per step per GPU (no overlap): {format_communication(p.choice.comm)}."]
    cp = [line for line in lines if line.startswith("CP type")]
    assert cp and " GiB on InfiniBand + " in cp[0]
    assert not any(re.search(r"\d GB\b", line) for line in comm + cp), comm + cp
