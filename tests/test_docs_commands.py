"""The CPU commands of README.md and docs/*.md run as written.

A command block runs when the line just before its ```bash fence is a marker:

    <!-- cpu-test -->                  run it (fast tier)
    <!-- cpu-test slow -->             run it, marked slow
    <!-- cpu-test slow as-written -->  run it without shortening --train-iters
    <!-- cpu-test slow batch=128 -->    also run it with --global-batch-size 128 (a dry run of
                                       a large layout: fewer micro-batches, same roles and peak)
    <!-- cpu-test slow equality -->            a parallel run the guide says gives one process's
    <!-- cpu-test slow equality-reference -->  losses, and that one process: both run as written,
                                               in pairs, by tests/test_docs_equality.py, not here

Each block runs as a bash script would (stopping at the first failing command) in its own
temporary directory, with the virtual environment's `python` and `torchrun` first on PATH, the
repository on PYTHONPATH, TRITON_INTERPRET=1 and OMP_NUM_THREADS=1; its `python pretrain_gpt.py`,
`python tools/X.py` and `torchrun --standalone --nproc_per_node N pretrain_gpt.py` commands run the
script as `__main__` in forks of the test process (N forked ranks for torchrun) instead of new
interpreters, which would each import torch first (tests/forked_commands.py); the rest runs in bash. The repository's scripts and tools are
named by their absolute paths (`pretrain_gpt.py`, `tools/`, `scripts/`), and every
`--train-iters N` becomes `--train-iters 2` unless the block says `as-written`. Blocks that need
a GPU, a download or several machines carry no marker.
"""
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.forked_commands import run_block
from tests.side_by_side import SideBySide, selected_cases

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*cpu-test((?:\s+[\w=-]+)*)\s*-->\s*$")
REPO_PATHS = re.compile(r"(?<![\w/.-])(\./)?(pretrain_gpt\.py|tools/|scripts/|examples/)")
TIMEOUT_S = 600
EQUALITY = {"equality", "equality-reference"}


def doc_files():
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def find_blocks(path):
    """(line number, options, script text) of every marked ```bash block of one file."""
    lines = path.read_text().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m and "cpu-test" in line and line.strip().startswith("<!--"):
            raise AssertionError(f"{path.name}:{i + 1}: a cpu-test marker that does not parse: {line.strip()}")
        if not m:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
            raise AssertionError(f"{path.name}:{i + 1}: a cpu-test marker must come right before a ```bash fence")
        end = i + 2
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.name}:{i + 2}: the ```bash block is not closed")
        blocks.append((i + 2, set(m.group(1).split()), "\n".join(lines[i + 2:end])))
    return blocks


def adapt(script, as_written, batch=None):
    """The block's text as the test runs it: repository paths absolute, training shortened,
    the global batch replaced when the block says ``batch=N``."""
    script = REPO_PATHS.sub(lambda m: str(REPO) + "/" + m.group(2), script)
    if not as_written:
        script = re.sub(r"--train-iters[ =]\d+", "--train-iters 2", script)
    if batch is not None:
        script = re.sub(r"--global-batch-size[ =]\d+", f"--global-batch-size {batch}", script)
    return script


def collect():
    params = []
    for path in doc_files():
        for lineno, opts, script in find_blocks(path):
            batch = [int(o.split("=", 1)[1]) for o in opts if re.fullmatch(r"batch=\d+", o)]
            unknown = {o for o in opts if not re.fullmatch(r"batch=\d+", o)} - {"slow", "as-written", *EQUALITY}
            assert not unknown, f"{path.name}:{lineno}: unknown cpu-test option(s) {sorted(unknown)}"
            if opts & EQUALITY:
                continue  # tests/test_docs_equality.py runs these, as written, in pairs
            marks = [pytest.mark.slow] if "slow" in opts else []
            params.append(pytest.param(path, lineno, "as-written" in opts, script, batch[0] if batch else None,
                                       id=f"{path.relative_to(REPO)}:{lineno}", marks=marks))
    return params


BLOCKS = collect()


def test_marked_blocks_found():
    files = {p.values[0].name for p in BLOCKS}
    assert "README.md" in files, "the README's tour has no marked CPU command"
    assert len(BLOCKS) >= 10, f"only {len(BLOCKS)} marked CPU commands in README.md and docs/"


def test_adapt_rewrites_paths_and_iters():
    out = adapt("python tools/x.py --train-iters 200 && ./scripts/y.sh\n"
                "torchrun pretrain_gpt.py --train-iters=50 --save runs/tools/z", False)
    assert f"python {REPO}/tools/x.py --train-iters 2 && {REPO}/scripts/y.sh" in out
    assert f"torchrun {REPO}/pretrain_gpt.py --train-iters 2 --save runs/tools/z" in out
    assert "--train-iters 6" in adapt("--train-iters 6", True)
    assert "--global-batch-size 128 --bf16" in adapt("--global-batch-size 1024 --bf16", False, 128)


def run_script(script, cwd):
    """Run one adapted block (stopping at the first failing command) in ``cwd``, with the virtual
    environment first on PATH and the repository importable: (exit code, output). Its megalite
    commands run in forks of this process, the others in bash (tests/forked_commands.py)."""
    venv_bin = REPO / ".venv" / "bin"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(venv_bin if venv_bin.is_dir() else Path(sys.executable).parent),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_block(script, cwd, env, str(REPO), TIMEOUT_S)


# A block that launches no processes of several ranks (no torchrun, srun, sbatch or bash script) is
# one process's work at a time: those this session selected run two at a time, each in a fork of
# the test process with a folder of its own (tests/side_by_side.py); the others run in the test.
SEVERAL_RANKS = re.compile(r"\b(torchrun|srun|sbatch|bash)\b")
TEXT = {(p.values[0], p.values[1]): p.values[2:] for p in BLOCKS}


def runs_alone(path, lineno) -> bool:
    return not SEVERAL_RANKS.search(TEXT[(path, lineno)][1])


def run_in_a_folder_of_its_own(path, lineno):
    """``run_script`` of the block in a new temporary folder: (exit code, output, the folder),
    the folder removed when the block succeeded."""
    as_written, script, batch = TEXT[(path, lineno)]
    folder = tempfile.mkdtemp(prefix=f"{path.stem}-{lineno}-")
    code, output = run_script(adapt(script, as_written, batch), Path(folder))
    if code == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return code, output, folder


@pytest.fixture(scope="module")
def one_process_blocks(request):
    cases = [case for case in selected_cases(request, "test_doc_command", ("path", "lineno")) if runs_alone(*case)]
    runs = SideBySide(run_in_a_folder_of_its_own, cases)
    yield runs
    runs.close()


@pytest.mark.parametrize("path,lineno,as_written,script,batch", BLOCKS)
def test_doc_command(path, lineno, as_written, script, batch, one_process_blocks, tmp_path):
    if runs_alone(path, lineno):
        code, output, folder = one_process_blocks.result(path, lineno)
    else:
        (code, output), folder = run_script(adapt(script, as_written, batch), tmp_path), tmp_path
    assert code == 0, (
        f"{path.name}:{lineno} exited {code} in {folder}; command:\n{script}\n--- output (tail) ---\n"
        + output[-6000:])


def test_forked_commands_are_only_plain_megalite_launches():
    """What runs in a fork (python/torchrun of a repository script, env assignments first) and
    what stays with bash (shell syntax, other programs, a block that keeps shell state)."""
    from tests.forked_commands import commands, is_stateful, parse

    script = f"{REPO}/pretrain_gpt.py"
    block = (f"torchrun --standalone --nproc_per_node 2 {script} --a \\\n    '([0]*1+[1]*3)'\n"
             f"python - <<'EOF'\nprint(1)\nEOF\nX=1 python {script} --b # note\n"
             f"python -c 'import sys\nprint(sys.argv)' x\npython {script} | tee log\n")
    steps = commands(block)
    assert len(steps) == 5, steps
    assert parse(steps[0], str(REPO)) == ({}, 2, script, ["--a", "([0]*1+[1]*3)"])
    assert parse(steps[1], str(REPO)) is None and steps[1].endswith("EOF")  # a heredoc: bash
    assert parse(steps[2], str(REPO)) == ({"X": "1"}, None, script, ["--b"])
    assert parse(steps[3], str(REPO)) is None and parse(steps[4], str(REPO)) is None
    assert parse(f"python {script} --save $HOME/x", str(REPO)) is None  # an expansion: bash
    assert parse(f"torchrun --nnodes 2 {script}", str(REPO)) is None  # another launch: for real
    assert parse("python /elsewhere/x.py", str(REPO)) is None
    assert is_stateful("export A=1") and is_stateful("A=1") and not is_stateful(f"A=1 python {script}")
