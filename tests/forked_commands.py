"""Run a guide's command block with its megalite commands in forks of the test process.

A guide's ``python pretrain_gpt.py ...``, ``python tools/NAME.py ...`` and ``torchrun --standalone
--nproc_per_node N pretrain_gpt.py ...`` lines are what the guide is about: their flags, sizes and
files. A new interpreter spends about 2.5 s of CPU importing torch and megalite before it does any
of that (five interpreters for a 4-rank torchrun line). Here a fork of the test process, which has
imported them already, runs the script itself as ``__main__`` (runpy: its own ``sys.exit``, its
exit status) with the same arguments, working directory and environment; torchrun's N ranks are a
forked gloo world (:func:`megalite.testing.run_world`), each rank running the script. The
launchers themselves run for real elsewhere: torchrun in tests/test_single_message.py,
test_multinode.py, test_clean_exit.py, test_corrupt_checkpoint.py and test_pretrain.py; a new
interpreter running pretrain_gpt.py in each torchrun rank and under the srun stand-in
(test_multinode.py); each tool the guides run in an interpreter of its own: see NEW_INTERPRETER.

Every other command of the block (a heredoc, ``python -c``, ``grep``, ``bash script``) runs in
bash as it always did, in order, stopping at the first failure. A block that keeps shell state
(``export``, ``cd``, a variable) runs whole in bash.
"""
from __future__ import annotations

import gc
import io
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
import traceback

from megalite.testing import run_world

ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)")
STATEFUL = {"export", "cd", "source", ".", "set", "unset", "pushd", "popd", "alias"}
# Tools that a guide runs and no other test starts in a new interpreter: bash runs them for real.
# (pretrain_gpt.py: tests/test_single_message.py under torchrun, test_multinode.py under srun;
# the other tools' own processes: tests/test_tools_reporting.py::test_tool_bad_input_own_process,
# plot_log.py and preprocess_data.py in test_tools_reporting.py and test_hf_tokenizer.py.)
NEW_INTERPRETER = {"generate.py", "build_default_corpus.py"}
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def commands(script: str) -> list[str]:
    """The block's commands: continued lines and multi-line quotes joined, a heredoc with its body."""
    out, pending, lines, i = [], [], script.split("\n"), 0
    while i < len(lines):
        pending.append(lines[i])
        i += 1
        heredoc = HEREDOC.search(pending[-1])
        while heredoc and i < len(lines):
            pending.append(lines[i])
            i += 1
            if pending[-1].strip() == heredoc.group(1):
                break
        text = "\n".join(pending)
        if text.rstrip().endswith("\\") and i < len(lines):
            continue
        try:
            shlex.split(text, comments=True)
        except ValueError:  # a quote still open: the command goes on
            if i < len(lines):
                continue
        if text.strip() and not text.strip().startswith("#"):
            out.append(text)
        pending = []
    return out


def parse(command: str, repo: str):
    """``(env, nproc, script, argv)`` of a megalite command this module runs in a fork (nproc
    None: plain python), or None when bash must run it (anything else, or shell syntax)."""
    if any(c in command for c in "$`") or HEREDOC.search(command):
        return None
    lexer = shlex.shlex(command.replace("\\\n", ""), posix=True, punctuation_chars=True)  # as bash joins lines
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        words = list(lexer)
    except ValueError:
        return None
    if any(w and set(w) <= set("();<>|&") for w in words):
        return None  # a pipe, a redirection, a list or a subshell
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if len(words) < 2:
        return None
    nproc = None
    if words[0] == "torchrun":
        rest = words[1:]
        if rest[:1] != ["--standalone"]:
            return None
        rest = rest[1:]
        if rest and rest[0] in ("--nproc_per_node", "--nproc-per-node") and len(rest) > 1 and rest[1].isdigit():
            nproc, rest = int(rest[1]), rest[2:]
        else:
            return None
        words = ["python", *rest]
    if words[0] != "python" or not words[1].endswith(".py"):
        return None
    script = words[1]
    if not os.path.isabs(script) or not script.startswith(repo + os.sep) or not os.path.isfile(script):
        return None
    if os.path.basename(script) in NEW_INTERPRETER:
        return None
    return env, nproc, script, words[2:]


def is_stateful(command: str) -> bool:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return False
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    return not words or words[0] in STATEFUL  # a bare assignment sets a shell variable


def _run_script_as_main(script: str, argv: list[str], cwd: str, env: dict, log: str, err_log: str | None = None) -> int:
    """In this (forked) process: the script as ``__main__`` with its output going to ``log``
    (its standard error to ``err_log`` when given)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd_number, path in ((1, log), (2, err_log or log)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, fd_number)
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        traceback.print_exc()
        code = 1
    gc.collect()  # close what the script left open (files it wrote), as interpreter exit would
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def start_script(script: str, argv: list[str], cwd, env: dict, log: str, err_log: str | None = None) -> int:
    """Fork a process that runs ``script`` as ``__main__`` (output to ``log``, standard error to
    ``err_log`` when given); its pid (reap it with :func:`wait`)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_script_as_main(script, argv, str(cwd), env, log, err_log)
        finally:
            os._exit(code)
    return pid


def wait(pid: int, timeout_s: float) -> int:
    """The exit status of a :func:`start_script` process (killed past ``timeout_s``: TimeoutExpired)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(str(pid), timeout_s)
        time.sleep(0.02)


def _fork_one(script, argv, cwd, env, log, timeout_s: float) -> int:
    pid = start_script(script, argv, cwd, env, log)
    return wait(pid, timeout_s)


def _rank(rank, world, script, argv, cwd, env, logs):
    env = {k: v for k, v in env.items() if k not in LAUNCH_KEYS}
    env.update({k: os.environ[k] for k in LAUNCH_KEYS if k in os.environ})  # run_world's, as torchrun's
    return _run_script_as_main(script, argv, cwd, env, os.path.join(logs, f"rank{rank}.log"))


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run_block(script: str, cwd, env: dict, repo: str, timeout_s: float) -> tuple[int, str]:
    """Run the block's commands in order in ``cwd`` (stopping at the first failure):
    (exit status, the output of every command in order)."""
    cwd = str(cwd)
    steps = commands(script)
    if any(is_stateful(step) for step in steps):
        steps = [None]  # shell state carries from line to line: bash runs the block whole
    output, logs = [], os.path.join(cwd, ".forked-logs")
    os.makedirs(logs, exist_ok=True)
    for number, step in enumerate(steps):
        parsed = None if step is None else parse(step, repo)
        if parsed is None:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script if step is None else step], cwd=cwd,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout_s)
            code, text = proc.returncode, proc.stdout
        else:
            extra, nproc, path, argv = parsed
            step_env = {**env, **extra}
            if nproc is None:
                log = os.path.join(logs, f"step{number}.log")
                code = _fork_one(path, argv, cwd, step_env, log, timeout_s)
                text = _read(log)
            else:
                folder = os.path.join(logs, f"step{number}")
                os.makedirs(folder, exist_ok=True)
                codes = run_world(_rank, nproc, path, argv, cwd, step_env, folder, timeout=timeout_s)
                code = next((c for c in codes if c != 0), 0)
                text = "".join(_read(os.path.join(folder, f"rank{r}.log")) for r in range(nproc))
        output.append(text)
        if code != 0:
            return code, "".join(output)
    return 0, "".join(output)
