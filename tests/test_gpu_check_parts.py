"""gpu_check's parts added by issue 36, on a CPU: (e) the fake-group dry runs of the zero-bubble
schedules and the CP a2a / allgather types, (f) the checkpoint bench.

Why: no command of the GPU check should run for the first time on the GPU (15 minutes of device
time hold one rerun). Each (e) command is run here exactly as built, with only ``--device cuda``
swapped for ``--device meta`` (tools/dry_run.py's placement dry run: same flags, same parsers,
same validation, every role; the kernels are stood in by torch on meta), and its JSON goes
through the part's judge. The (f) command runs here on the CPU with a tiny model.
"""
import json
import math
import types

import pytest
import torch.distributed as dist

from tools import gpu_check
from tools import gpu_check_results as results
from tools.gpu_check_runner import Command


def part(key: str, out):
    stages = gpu_check.build_stages("python3", ["--quick"])
    found = next(p for stage in stages for p in stage if p.key == key)
    return found, found.commands(out)


def on_meta(argv: list) -> list:
    """The command's own arguments with the device swapped (cuda -> meta)."""
    args = [str(a) for a in argv[2:]]
    i = args.index("--device")
    assert args[i + 1] == "cuda"
    return args[:i + 1] + ["meta"] + args[i + 2:]


def test_e_covers_both_zero_bubble_schedules_and_both_cp_types(tmp_path):
    from megalite.arguments import build_parser

    _, cmds = part("e", tmp_path)
    seen = set()
    for cmd in cmds:
        assert cmd.argv[1] == "tools/dry_run.py" and "--world-size" in cmd.argv
        flags = on_meta(cmd.argv)
        flags = flags[2:]  # --world-size N
        args, _ = build_parser().parse_known_args([a for a in flags if a not in ("--device", "meta")])
        seen.add(args.pipeline_schedule if args.pipeline_model_parallel_size > 1 else f"cp-{args.cp_comm_type}")
    assert seen == {"zb-h1", "zbv", "cp-a2a", "cp-allgather"}


@pytest.mark.parametrize("layout", sorted(gpu_check.DRY_LAYOUTS))
def test_e_commands_run_on_meta_and_pass_the_judge(tmp_path, layout, monkeypatch):
    from tools import dry_run

    _, cmds = part("e", tmp_path)
    cmd = next(c for c in cmds if c.log == f"e_{layout}.log")
    for key, value in cmd.env.items():
        monkeypatch.setenv(key, value)
    try:
        rc = dry_run.main(on_meta(cmd.argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert rc == 0
    data = json.loads((tmp_path / f"e_{layout}.json").read_text())
    pp = 2 if "pp2" in layout else 1
    assert [r["stage"] for r in data["roles"]] == list(range(pp)) and data["world_size"] == gpu_check.DRY_WORLD
    log = tmp_path / cmd.log
    log.write_text("")
    ok, fig, line = results.judge_dry_runs(tmp_path, [types.SimpleNamespace(command=cmd, rc=0, seconds=1.0,
                                                                            log=log)])
    assert ok and fig["roles"] == pp and "1/1 layouts" in line, line
    role = fig["layouts"][layout]["roles"][0]
    assert role["tracked_peak_gib"] > 0 and role["planned_gib"] > 0 and role["cuda_max_allocated_gib"] is None


def test_e_judge_names_a_failed_or_silent_layout(tmp_path):
    good = tmp_path / "e_good.json"
    good.write_text(json.dumps({"roles": [dict(role="stage 0", ranks=[0], measured_bytes=2**30, planned_bytes=2**30,
                                               cuda_max_memory_allocated=2**31, fits=True)]}))

    def outcome(name, rc):
        argv = ["python3", "tools/dry_run.py", "--json", str(tmp_path / f"e_{name}.json")]
        return types.SimpleNamespace(command=Command(argv, f"e_{name}.log"), rc=rc, seconds=1.0)
    ok, fig, line = results.judge_dry_runs(tmp_path, [outcome("good", 0)])
    assert ok and fig["layouts"]["good"]["roles"][0]["cuda_max_allocated_gib"] == 2.0
    ok, fig, line = results.judge_dry_runs(tmp_path, [outcome("good", 0), outcome("crashed", -9),
                                                      outcome("good", 1)])
    assert not ok and fig["failed"] == ["crashed", "good"] and "1/3 layouts" in line


def test_f_judge_reports_the_goal_and_fails_without_figures(tmp_path):
    cmd = Command(["python3", "tools/bench_checkpoint.py", "--json", str(tmp_path / "f.json")], "f.txt")
    res = dict(blocked_s_sync=0.8, blocked_s_async=0.2, blocked_ratio=0.25, step_s_no_save=0.02, async_write_s=0.9,
               step_slowdown_during_write=0.05, checkpoint_bytes=481 * 2**20, device="cuda:0")
    (tmp_path / "f.json").write_text(json.dumps(res))
    ok, fig, line = results.judge_checkpoint_bench(tmp_path, [types.SimpleNamespace(command=cmd, rc=0)])
    assert ok and not fig["blocked_goal_met"] and "async/sync 0.250, goal <= 0.1 MISSED" in line and "+5.0%" in line
    (tmp_path / "f.json").write_text(json.dumps(dict(res, blocked_s_async=math.nan)))
    ok, _, line = results.judge_checkpoint_bench(tmp_path, [types.SimpleNamespace(command=cmd, rc=0)])
    assert not ok and "not finite" in line
    (tmp_path / "f.json").unlink()
    ok, _, line = results.judge_checkpoint_bench(tmp_path, [types.SimpleNamespace(command=cmd, rc=-9)])
    assert not ok and "no results" in line


def test_f_command_runs_on_the_cpu(tmp_path):
    """The (f) command as built, on the CPU with a tiny model (the flags added at the end win),
    in a forked one-rank world (the bench's setup() starts a process group)."""
    from megalite.testing import run_world
    from tools.bench_checkpoint import main

    _, cmds = part("f", tmp_path)
    argv = [str(a) for a in cmds[0].argv[2:]]
    argv[argv.index("--device") + 1] = "cpu"
    tiny = ["--hidden", "32", "--layers", "1", "--vocab", "64", "--seq", "8", "--rounds", "1"]
    run_world(lambda rank, world: main(argv + tiny), 1)
    ok, fig, line = results.judge_checkpoint_bench(tmp_path, [types.SimpleNamespace(command=cmds[0], rc=0)])
    assert ok and fig["device"] == "cpu" and fig["rounds"] == 1, line
