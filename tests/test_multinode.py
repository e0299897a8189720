"""Beyond one node, for real on one machine: the SLURM examples on 2 "nodes" of loopback (srun
per GPU: SLURM-launched processes without torchrun; torchrun per node: two torchrun agents
forming one job over a c10d rendezvous), and elastic restarts (the same size by torchrun
--max-restarts, and on fewer ranks, re-cutting the checkpoint).

Every multi-process run here is compared with one reference: the same tiny model trained for 4
iterations by one process (a forked world of 1, made once per module: no interpreter to start).
The launchers themselves (torchrun, srun, the batch scripts) are what these tests are about;
everything else runs in forked worlds (megalite.testing.run_world)."""
import json
import os
import subprocess
import sys

import pytest

from megalite.testing import WorldError, free_port, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100", "--adam-eps", "1e-5",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="0")
ITERS = 4  # the reference run's length: every run compared with it trains this long


def _losses(path):
    """iteration -> loss; a restarted job appends, so the last record of an iteration wins."""
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path))}


def _run(rank, world, argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"]) for r in pretrain(argv)]


@pytest.fixture(scope="module")
def serial():
    """iteration -> loss of BASE trained for ITERS iterations by one process."""
    return dict(run_world(_run, 1, BASE + ["--train-iters", str(ITERS)])[0])


def _close(losses, reference):
    assert losses.keys() == reference.keys(), (losses, reference)
    assert max(abs(losses[i] - reference[i]) / reference[i] for i in reference) < 1e-5, (losses, reference)


def _slurm_env(rank, ntasks, port, **overrides):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                     "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_incomplete_launch_environment_names_the_missing_variable(monkeypatch, capsys):
    from megalite.config import ConfigError
    from megalite.launch import detect_launch, first_host

    with pytest.raises(ConfigError, match="SLURM_PROCID missing"):
        detect_launch(_slurm_env(0, 2, 1234, SLURM_PROCID=None))
    with pytest.raises(ConfigError, match="LOCAL_RANK missing .* RANK, WORLD_SIZE are set"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2"})
    assert detect_launch({}).source == "single"
    assert first_host("gpu[03-05,9],cpu1") == "gpu03" and first_host("node7") == "node7"
    # pretrain_gpt.py's main, in this process (the program's own exit status and one line:
    # tests/test_single_message.py::test_plain_python_prints_one_line).
    from megalite.train.pretrain import main
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    for key, value in _slurm_env(0, 2, 1234, SLURM_JOB_NODELIST=None).items():
        if key.startswith("SLURM_") or key == "MASTER_PORT":
            monkeypatch.setenv(key, value)
    assert main([*BASE, "--train-iters", "2"]) == 2
    assert "megalite: configuration error: SLURM_JOB_NODELIST missing" in capsys.readouterr().err


# -- elastic continuation -----------------------------------------------------------------------------

@pytest.mark.parametrize("zero", ["0", "2"])
@pytest.mark.slow
def test_dp4_killed_and_restarted_as_dp2_continues_the_same_run(tmp_path, zero):
    argv = BASE + ["--train-iters", "20", "--zero-stage", zero, "--save-interval", "10"]
    full = dict(run_world(_run, 4, argv + ["--save", str(tmp_path / "a")])[0])
    with pytest.raises(WorldError, match="died|failed"):  # the killed rank, or a peer that lost it
        run_world(_run, 4, argv + ["--save", str(tmp_path / "b"), "--inject-fault", "kill@13:1"], timeout=60)
    assert (tmp_path / "b" / "latest").read_text() == "10"
    resumed = dict(run_world(_run, 2, argv + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])[0])
    assert sorted(resumed) == list(range(11, 21))
    assert max(abs(resumed[i] - full[i]) / full[i] for i in resumed) < 1e-5, (resumed, full)


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_and_finishes_bit_identically(tmp_path):
    """The uninterrupted reference is the same 2 ranks in a forked world (same gloo collectives,
    same data; torchrun adds only the launch), so one torchrun job is started, not two."""
    argv = BASE + ["--train-iters", "16", "--save-interval", "8", "--zero-stage", "1"]
    full = dict(run_world(_run, 2, argv + ["--save", str(tmp_path / "a")])[0])
    launch = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
              os.path.join(ROOT, "pretrain_gpt.py")]
    log = tmp_path / "elastic.jsonl"
    run = subprocess.run([*launch, *argv, "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"),
                          "--log-json", str(log), "--inject-fault", "kill@11:1"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=180, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no checkpoint there yet, starting from iteration 0" in run.stdout
    assert "loaded" in run.stdout and "at iteration 8" in run.stdout  # the restart resumed from iteration 8
    assert _losses(log) == full  # bit for bit


# -- the SLURM examples, run through a local stand-in for srun and scontrol ---------------------------

STANDIN = os.path.join(ROOT, "tests", "slurm_standin")
TINY = {"DATA_ARGS": "--mock-data --vocab-size 300",
        "MODEL_ARGS": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                      "--hidden-dropout 0 --attention-dropout 0",
        "TRAIN_ARGS": "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 100 "
                      f"--adam-eps 1e-5 --train-iters {ITERS}"}


def test_the_scripts_model_is_the_reference_model():
    assert sorted(" ".join(TINY.values()).split()) == sorted(BASE + ["--train-iters", str(ITERS)])


def _job_id_with_free_port():
    """A job id whose port (the scripts' 20000 + id % 20000) is free now."""
    for _ in range(500):
        port = free_port()
        if 20000 <= port < 40000:
            return 1_000_000 + port - 20000  # 1_000_000 % 20000 == 0
    pytest.skip("no free port in 20000-39999")


def _sbatch(tmp_path, script, tasks_per_node, cpus, **variables):
    """Run an example batch script as sbatch would on a 2-node allocation (both "nodes" are this
    machine over loopback), with the stand-ins first on PATH. Returns (losses, output, srun calls)."""
    env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_") and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
        "OMP_NUM_THREADS")}  # the scripts derive OMP_NUM_THREADS from the CPUs per task
    venv = sys.prefix if os.path.exists(os.path.join(sys.prefix, "bin", "activate")) else ""
    env.update(TINY, **variables, PATH=os.pathsep.join([STANDIN, os.path.dirname(sys.executable), env["PATH"]]),
               MEGALITE_VENV=venv, MEGALITE_HOME=ROOT, SRUN_STANDIN_LOG=str(tmp_path / "srun.jsonl"),
               SLURM_JOB_ID=str(_job_id_with_free_port()), SLURM_JOB_NODELIST="localhost,127.0.0.1",
               SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE=str(tasks_per_node),
               SLURM_NTASKS=str(2 * tasks_per_node), SLURM_CPUS_PER_TASK=str(cpus), SLURM_SUBMIT_DIR=str(tmp_path))
    run = subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm", script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == str(ITERS)  # --save ckpt --load ckpt: fresh start, saved
    calls = [json.loads(line) for line in open(tmp_path / "srun.jsonl")]
    return _losses(tmp_path / "logs" / "train.jsonl"), run.stdout + run.stderr, calls


@pytest.mark.slow
def test_slurm_example_srun_per_gpu_runs_and_trains_like_one_process(tmp_path, serial):
    """srun starts the tasks, no torchrun: megalite reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
    and the rendezvous host from SLURM_JOB_NODELIST; the pipeline's two stages on two nodes."""
    losses, text, calls = _sbatch(tmp_path, "srun_per_gpu.sbatch", 1, 1,
                                  PARALLEL_ARGS="--pipeline-model-parallel-size 2")
    _close(losses, serial)
    assert "launch: slurm; rank 0 of 2, local rank 0 of 1 on node 0" in text
    assert [c["options"].get("cpus_per_task") for c in calls] == ["1"]  # passed on to srun explicitly


@pytest.mark.slow
def test_slurm_example_torchrun_per_node_runs_and_trains_like_one_process(tmp_path, serial):
    """Two torchrun agents (one per "node", 2 processes each) form one job over c10d. TP 4 spans
    both nodes: it trains the same, and rank 0 alone warns, with the cost, that its group spans
    nodes (a TP group inside a node does not warn: tests/test_grid.py)."""
    losses, text, calls = _sbatch(tmp_path, "torchrun_per_node.sbatch", 1, 2, GPUS_PER_NODE="2",
                                  PARALLEL_ARGS="--tensor-model-parallel-size 4")
    _close(losses, serial)
    assert "(2 per node, 2 node(s))" in text and "launch: torchrun; rank 0 of 4, local rank 0 of 2 on node 0" in text
    # The grid table from the real node facts: ranks 2 and 3 on node 1.
    table = [line.split() for line in text.splitlines() if line.strip().split()[:1] in (["2"], ["3"])
             and len(line.split()) == 7]
    assert table and all(row[1] == "1" for row in table), table
    assert "tensor-parallel group of 4 ranks spans nodes (2 GPUs per node)" in text and "InfiniBand" in text
    assert text.count("spans nodes") == 1  # once (rank 0), not once per rank
    (call,) = calls
    assert call["options"].get("cpus_per_task") == "2" and call["options"].get("no_kill") is True
    assert call["command"][0] == "torchrun" and "1:2" in call["command"]


def test_slurm_example_finds_its_head_node_in_a_large_allocation(tmp_path):
    """The head node comes from all of ``scontrol show hostnames`` without ``| head``: under
    pipefail, head closing the pipe early ends scontrol with SIGPIPE, and with it the job (this
    once failed CI, with two nodes, when the pipe closed before scontrol had written)."""
    script = open(os.path.join(ROOT, "examples", "slurm", "torchrun_per_node.sbatch")).read()
    for name in os.listdir(os.path.join(ROOT, "examples", "slurm")):
        text = open(os.path.join(ROOT, "examples", "slurm", name)).read()
        assert "| head" not in text.replace("no \"| head\"", ""), name
    lines = [line for line in script.splitlines() if line.startswith(("HOSTS=", "HEAD="))]
    assert len(lines) == 2, lines
    env = dict(ENV, PATH=os.pathsep.join([STANDIN, ENV["PATH"]]), SLURM_JOB_NODELIST="gpu[00001-30000],cpu7")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines + ['echo "$HEAD"'])], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "gpu00001\n", (run.returncode, run.stdout[-200:], run.stderr[-500:])
