"""Who this process is: rank, world size, local rank and ranks per node, from torchrun or SLURM.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
(the node) and ``MASTER_ADDR``/``MASTER_PORT``. Under SLURM with one task per GPU and no
torchrun (``srun python pretrain_gpt.py ...``) the same facts come from ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NODEID`` and the first
host of ``SLURM_JOB_NODELIST`` (the rendezvous address); megalite then sets torch's variables
itself, so ``init_process_group`` reads them as under torchrun. A plain ``python
pretrain_gpt.py`` (neither) is one process. Half of either set is an error naming what is missing.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megalite.errors import ConfigError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")
DEFAULT_PORT = "29500"


@dataclass(frozen=True)
class Launch:
    source: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int

    def describe(self) -> str:
        return (f"launch: {self.source}; rank {self.rank} of {self.world_size}, local rank {self.local_rank} of "
                f"{self.local_world_size} on node {self.node}")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu7`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a node list. Fix: run under srun/sbatch, or set "
                          f"MASTER_ADDR.")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _tasks_per_node(env) -> int:
    """SLURM_NTASKS_PER_NODE (``8``), else the first count of SLURM_TASKS_PER_NODE (``8(x4),6``)."""
    for key in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            return int(re.match(r"\d+", env[key]).group())
    raise ConfigError("SLURM_NTASKS_PER_NODE (and SLURM_TASKS_PER_NODE) are missing: megalite needs the tasks per "
                      "node to place TP groups inside nodes. Fix: sbatch --ntasks-per-node N.")


def detect_launch(env=None, fake_process_group: bool = False) -> Launch:
    """Rank, world and node facts from torchrun's variables, else SLURM's (exported for torch)."""
    env = os.environ if env is None else env
    if fake_process_group and not ("WORLD_SIZE" in env and "RANK" in env):
        raise ConfigError("--fake-process-group plays one rank of a world: set WORLD_SIZE and RANK in "
                          "the environment, e.g. WORLD_SIZE=16 RANK=5 python pretrain_gpt.py "
                          "--fake-process-group --device meta ...")
    if fake_process_group or any(k in env for k in TORCHRUN):
        missing = [k for k in TORCHRUN if k not in env] if not fake_process_group else []
        if missing:
            raise ConfigError(f"{', '.join(missing)} missing from the environment while "
                              f"{', '.join(k for k in TORCHRUN if k in env) or 'others'} are set: start with torchrun "
                              f"(which sets all of RANK, WORLD_SIZE, LOCAL_RANK), or under SLURM with srun.")
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        launch = Launch("torchrun", rank, world, int(env.get("LOCAL_RANK", "0")), local_world,
                        int(env.get("GROUP_RANK", rank // max(local_world, 1))))
    elif any(k in env for k in SLURM) and int(env.get("SLURM_NTASKS", "1")) > 1:
        missing = [k for k in SLURM if k not in env]
        if missing:
            raise ConfigError(f"{', '.join(missing)} missing from the environment: megalite reads rank, world size, "
                              f"local rank and the rendezvous host from SLURM when torchrun's variables are absent. "
                              f"Fix: start each task with srun (not plain ssh), or launch with torchrun.")
        per_node = _tasks_per_node(env)
        rank = int(env["SLURM_PROCID"])
        launch = Launch("slurm", rank, int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"]), per_node,
                        int(env.get("SLURM_NODEID", rank // per_node)))
        env.setdefault("MASTER_ADDR", first_host(env["SLURM_JOB_NODELIST"]))
        env.setdefault("MASTER_PORT", DEFAULT_PORT)
        env.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                   LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(launch.node))
    else:
        return Launch("single", 0, 1, 0, 1, 0)
    if not 0 <= launch.rank < launch.world_size:
        raise ConfigError(f"rank {launch.rank} is outside the world of {launch.world_size} ({launch.source}). "
                          f"Fix: 0 <= rank < world size.")
    if launch.world_size % launch.local_world_size == 0 and launch.rank // launch.local_world_size != launch.node:
        raise ConfigError(f"rank {launch.rank} is on node {launch.node} but ranks are expected node by node "
                          f"({launch.local_world_size} per node), so tensor-parallel groups of consecutive ranks "
                          f"could span nodes. Fix: launch the same number of processes on every node "
                          f"(torchrun --nproc-per-node / sbatch --ntasks-per-node).")
    return launch


def leave_world(release: bool = True) -> None:
    """End this rank's part in the distributed world, in a fixed order, before the interpreter
    shuts down: (1) destroy every process group (torch's ``destroy_process_group``: the default
    group and the grid's subgroups); (2) with ``release``, drop megalite's own references to the
    groups (the grid's group cache, the last collective kept for hang reports) and collect, so
    each gloo group's C++ object is destroyed now, which joins its worker and socket threads;
    (3) flush stdout and stderr.

    Why (2): a group that is only shut down keeps its C++ threads until the object is freed, and
    an object still referenced at exit is freed (or not) during interpreter teardown, where a C++
    thread that then needs the GIL is ended by Python, and ending a C++ thread that way aborts the
    process (``terminate called without an active exception``): the likely cause of a finished
    run dying at exit, rarely (issue 42).
    Without ``release`` (an unexpected exception is on its way up, a peer may be gone) nothing is
    freed: freeing a group waits for its queued collectives, which a dead peer never completes.

    The caller stops its own threads first (monitor, watchdog, straggler timer, checkpoint writer)
    and waits for every rank where all ranks finish together (``host_barrier``)."""
    import gc
    import sys

    import torch.distributed as dist

    from megalite.parallel import comm, grid

    real_world = dist.is_initialized() and dist.get_backend() != "fake"  # a fake group has no threads
    if dist.is_initialized():
        dist.destroy_process_group()
    if release:
        grid.forget_groups()
        comm.LAST_COLLECTIVE = None
        if real_world:  # a full collection costs 0.1-0.3 s: only where gloo threads may wait for it
            gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):  # closed or detached
            pass
