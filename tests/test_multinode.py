"""Beyond one node, for real on one machine: two torchrun agents forming a 2-node job over
loopback (c10d rendezvous), SLURM-launched processes without torchrun, and elastic restarts
(the same size by torchrun --max-restarts, and on fewer ranks, re-cutting the checkpoint)."""
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


def _losses(path):
    """iteration -> loss; a restarted job appends, so the last record of an iteration wins."""
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path))}


def _serial(tmp_path, argv, name="serial"):
    log = tmp_path / f"{name}.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--log-json", str(log)],
                   check=True, capture_output=True, env=ENV, timeout=120)
    return _losses(log)


def _two_nodes(tmp_path, argv, name):
    """Two torchrun agents on this machine, 2 processes each, --nnodes 2 over c10d."""
    port, log = free_port(), tmp_path / f"{name}.jsonl"
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name, os.path.join(ROOT, "pretrain_gpt.py"),
           *argv, "--log-json", str(log)]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=180) for agent in agents]
    assert all(a.returncode == 0 for a in agents), outputs
    return _losses(log), "".join(out + err for out, err in outputs)


@pytest.mark.parametrize("layout,name", [(["--tensor-model-parallel-size", "4"], "tp4"),
                                         (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                                          "tp2pp2")])
@pytest.mark.slow
def test_two_torchrun_agents_reproduce_the_single_process_losses(tmp_path, layout, name):
    """TP2 x PP2 (TP inside a node, the pipeline across), and TP4 across both nodes, which
    trains the same and warns once, with the cost, that its group spans nodes."""
    argv = BASE + ["--train-iters", "4"]
    serial = _serial(tmp_path, argv)
    losses, text = _two_nodes(tmp_path, argv + layout, name)
    assert losses.keys() == serial.keys()
    assert max(abs(losses[i] - serial[i]) / serial[i] for i in serial) < 1e-5, (losses, serial)
    # The grid table from the real node facts: 2 per node, 2 nodes, ranks 2 and 3 on node 1.
    assert "(2 per node, 2 node(s))" in text and "launch: torchrun; rank 0 of 4, local rank 0 of 2 on node 0" in text
    table = [line.split() for line in text.splitlines() if line.strip().split()[:1] in (["2"], ["3"])
             and len(line.split()) == 7]
    assert table and all(row[1] == "1" for row in table), table
    if name == "tp4":
        assert "tensor-parallel group of 4 ranks spans nodes (2 GPUs per node)" in text and "InfiniBand" in text
        assert text.count("spans nodes") == 1  # once (rank 0), not once per rank
    else:
        assert "spans nodes" not in text


def _slurm_env(rank, ntasks, port, **overrides):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                     "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.slow
def test_slurm_tasks_without_torchrun_train_like_one_process(tmp_path):
    argv = BASE + ["--train-iters", "3"]
    serial = _serial(tmp_path, argv)
    port, log = free_port(), tmp_path / "slurm.jsonl"
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--log-json", str(log)],
                              env=_slurm_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert "launch: slurm; rank 0 of 2, local rank 0 of 2 on node 0" in outputs[0][0]
    losses = _losses(log)
    assert max(abs(losses[i] - serial[i]) / serial[i] for i in serial) < 1e-5


def test_incomplete_launch_environment_names_the_missing_variable(tmp_path):
    from megalite.config import ConfigError
    from megalite.launch import detect_launch, first_host

    with pytest.raises(ConfigError, match="SLURM_PROCID missing"):
        detect_launch(_slurm_env(0, 2, 1234, SLURM_PROCID=None))
    with pytest.raises(ConfigError, match="LOCAL_RANK missing .* RANK, WORLD_SIZE are set"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2"})
    assert detect_launch({}).source == "single"
    assert first_host("gpu[03-05,9],cpu1") == "gpu03" and first_host("node7") == "node7"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--train-iters", "1"],
                         env=_slurm_env(0, 2, 1234, SLURM_JOB_NODELIST=None), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "megalite: configuration error: SLURM_JOB_NODELIST missing" in run.stderr


# -- elastic continuation -----------------------------------------------------------------------------

def _run(rank, world, argv):
    from megalite.pretrain import pretrain
    return [(r["iteration"], r["loss"]) for r in pretrain(argv)]


@pytest.mark.parametrize("zero", ["0", "2"])
@pytest.mark.slow
def test_dp4_killed_and_restarted_as_dp2_continues_the_same_run(tmp_path, zero):
    argv = BASE + ["--train-iters", "20", "--zero-stage", zero, "--save-interval", "10"]
    full = dict(run_world(_run, 4, argv + ["--save", str(tmp_path / "a")])[0])
    with pytest.raises(WorldError, match="died|failed"):  # the killed rank, or a peer that lost it
        run_world(_run, 4, argv + ["--save", str(tmp_path / "b")],
                  env={"MEGALITE_TEST_KILL_AT_ITERATION": "13", "MEGALITE_TEST_KILL_RANK": "1"}, timeout=60)
    assert (tmp_path / "b" / "latest").read_text() == "10"
    resumed = dict(run_world(_run, 2, argv + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")])[0])
    assert sorted(resumed) == list(range(11, 21))
    assert max(abs(resumed[i] - full[i]) / full[i] for i in resumed) < 1e-5, (resumed, full)


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_and_finishes_bit_identically(tmp_path):
    argv = BASE + ["--train-iters", "16", "--save-interval", "8", "--zero-stage", "1"]
    launch = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
              os.path.join(ROOT, "pretrain_gpt.py")]
    full_log = tmp_path / "full.jsonl"
    subprocess.run([*launch, *argv, "--save", str(tmp_path / "a"), "--log-json", str(full_log)],
                   check=True, capture_output=True, env=ENV, cwd=tmp_path, timeout=180)
    log = tmp_path / "elastic.jsonl"
    run = subprocess.run([*launch, *argv, "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"),
                          "--log-json", str(log)], capture_output=True, text=True, cwd=tmp_path, timeout=180,
                         env=dict(ENV, MEGALITE_TEST_KILL_AT_ITERATION="11", MEGALITE_TEST_KILL_RANK="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no checkpoint there yet, starting from iteration 0" in run.stdout
    assert "loaded" in run.stdout and "at iteration 8" in run.stdout  # the restart resumed from iteration 8
    assert _losses(log) == _losses(full_log)  # bit for bit


# -- the SLURM examples, run through a local stand-in for srun and scontrol ---------------------------

STANDIN = os.path.join(ROOT, "tests", "slurm_standin")
TINY = {"DATA_ARGS": "--mock-data --vocab-size 300",
        "MODEL_ARGS": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                      "--hidden-dropout 0 --attention-dropout 0",
        "TRAIN_ARGS": "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 100 "
                      "--adam-eps 1e-5 --train-iters 3"}


@pytest.fixture(scope="module")
def tiny_serial(tmp_path_factory):
    return _serial(tmp_path_factory.mktemp("serial"), " ".join(TINY.values()).split())


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
    assert (tmp_path / "ckpt" / "latest").read_text() == "3"  # --save ckpt --load ckpt: a fresh start, then saved
    calls = [json.loads(line) for line in open(tmp_path / "srun.jsonl")]
    return _losses(tmp_path / "logs" / "train.jsonl"), run.stdout + run.stderr, calls


@pytest.mark.slow
def test_slurm_example_srun_per_gpu_runs_and_trains_like_one_process(tmp_path, tiny_serial):
    losses, text, calls = _sbatch(tmp_path, "srun_per_gpu.sbatch", 1, 1,
                                  PARALLEL_ARGS="--pipeline-model-parallel-size 2")
    assert losses.keys() == tiny_serial.keys()
    assert max(abs(losses[i] - tiny_serial[i]) / tiny_serial[i] for i in tiny_serial) < 1e-5, (losses, tiny_serial)
    assert "launch: slurm; rank 0 of 2, local rank 0 of 1 on node 0" in text
    assert [c["options"].get("cpus_per_task") for c in calls] == ["1"]  # passed on to srun explicitly


@pytest.mark.slow
def test_slurm_example_torchrun_per_node_runs_and_trains_like_one_process(tmp_path, tiny_serial):
    losses, text, calls = _sbatch(tmp_path, "torchrun_per_node.sbatch", 1, 2, GPUS_PER_NODE="2",
                                  PARALLEL_ARGS="--tensor-model-parallel-size 2")
    assert losses.keys() == tiny_serial.keys()
    assert max(abs(losses[i] - tiny_serial[i]) / tiny_serial[i] for i in tiny_serial) < 1e-5, (losses, tiny_serial)
    assert "(2 per node, 2 node(s))" in text and "launch: torchrun; rank 0 of 4, local rank 0 of 2 on node 0" in text
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
