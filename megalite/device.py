"""Where a rank computes, and how its world starts: device choice, process group, batches.

Startup order on a GPU (as Megatron-LM and torchtitan do it)::

    LOCAL_RANK -> torch.cuda.set_device -> init_process_group(nccl, device_id=...) -> groups -> model

``set_device`` comes first so that NCCL binds every communicator to this rank's GPU, and
``device_id`` makes NCCL create the world communicator eagerly (a wrong GPU count or a
broken fabric fails at startup, not at the first collective).

``--device``: ``auto`` (cuda when a GPU is visible, else cpu), ``cuda``, ``cpu`` or ``meta``.
On ``meta`` every tensor has a shape and dtype but no storage: a whole training iteration
runs without computing anything. Together with ``--fake-process-group`` (torch's fake
backend: collectives return at once) one process plays any rank of any world, which proves
device placement on a laptop: a tensor that the framework creates on the CPU and that meets
a meta tensor raises ``Tensor on device cpu is not on the expected device meta``.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.errors import ConfigError

DEVICES = ("auto", "cuda", "cpu", "meta")


def local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when run plainly)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str = "auto", fake_process_group: bool = False) -> torch.device:
    """The device this rank computes on. ``cuda`` is this rank's GPU, ``cuda:LOCAL_RANK``
    (modulo the visible GPUs when several fake ranks share one GPU)."""
    if name not in DEVICES:
        raise ConfigError(f"--device {name!r} is unknown. Fix: use one of {', '.join(DEVICES)}.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but torch sees no CUDA GPU "
                              f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
                              "Fix: install a CUDA build of torch on a GPU machine, or use "
                              "--device cpu (or --device meta for a dry run).")
        count = torch.cuda.device_count()
        index = local_rank() % count if fake_process_group else local_rank()
        if index >= count:
            raise ConfigError(f"LOCAL_RANK {index} but only {count} GPU(s) are visible: launch at most "
                              f"{count} processes per node (torchrun --nproc-per-node {count}), or "
                              f"check CUDA_VISIBLE_DEVICES.")
        return torch.device("cuda", index)
    return torch.device(name)


def cuda_allocator_environment() -> None:
    """Expandable segments for CUDA's caching allocator, unless the user configured it: blocks
    grow in place instead of fragmenting into fixed segments (activations of varying sizes,
    pipeline micro-batches). The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA is
    first initialized (``set_device``, ``is_available`` may already probe), so this must run
    before any ``torch.cuda`` call of the process: the first thing of the startup, on every
    GPU run, one GPU included."""
    if "PYTORCH_ALLOC_CONF" not in os.environ:  # torch >= 2.9 also reads this newer name
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def nccl_environment() -> None:
    """The field's defaults for NCCL runs, unless the user set them: errors raise instead of
    hanging (async error handling), and on a timeout every rank dumps its flight recorder
    (the last collectives it issued, with sequence numbers) for ``torch.distributed``'s
    fr_trace analyzer."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                          os.path.join(os.getcwd(), "nccl_flight_recorder_rank_"))


def init_distributed(device: torch.device, world_size: int, rank: int, timeout: timedelta,
                     fake: bool = False) -> None:
    """Start this rank's default process group (nothing for a plain one-process run).

    ``fake``: torch's fake backend (any world size, no communication). Otherwise NCCL on a
    GPU, gloo on the CPU. ``device`` must already be the current CUDA device."""
    if dist.is_initialized():
        return
    if fake:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        register_meta(None)
        return
    if world_size == 1:
        return
    store = _attempt_store(world_size, timeout)
    if device.type == "cuda":
        nccl_environment()
        dist.init_process_group("nccl", timeout=timeout, device_id=device, **store)
    elif device.type == "cpu":
        dist.init_process_group("gloo", timeout=timeout, **store)
    else:
        raise ConfigError(f"--device {device.type} with {world_size} processes: a meta run has no real "
                          f"collectives. Fix: add --fake-process-group and run one process per rank "
                          f"you want to check (WORLD_SIZE={world_size} RANK=r).")


def _attempt_store(world_size: int, timeout: timedelta) -> dict:
    """Under torchrun the workers' rendezvous store is the agent's, and it outlives a restart:
    the keys a failed attempt left there (its ranks' addresses) would be read by the next
    attempt's ranks, which then connect to dead processes. Give every attempt
    (TORCHELASTIC_RESTART_COUNT) its own key prefix. Elsewhere: torch's env:// rendezvous."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"megalite/attempt_{attempt}", client),
            "rank": int(os.environ["RANK"]), "world_size": world_size}


def is_fake() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def register_meta(group) -> None:
    """Let a fake group serve meta tensors in ``batch_isend_irecv`` too (its backend is
    registered for cpu only; the other fake collectives accept meta tensors as they are)."""
    if not is_fake():
        return
    pg = group if group is not None else dist.group.WORLD
    meta = torch.device("meta")
    try:
        pg._get_backend(meta)
    except RuntimeError:
        pg._register_backend(meta, dist.ProcessGroup.BackendType.CUSTOM, pg._get_backend(torch.device("cpu")))


def to_device(batch: dict, device: torch.device) -> dict:
    """A micro-batch of (b, s) tensors on ``device``: through pinned memory, without blocking
    the host, on a GPU (the copy overlaps the previous step's kernels)."""
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    if device.type == "cpu":
        return batch
    return {k: v.to(device) for k, v in batch.items()}


def host_value(t: torch.Tensor) -> float:
    """A scalar tensor as a Python float; NaN on meta, where there is no value to read."""
    return float("nan") if t.device.type == "meta" else t.item()


def host_barrier(grid=None) -> None:
    """Wait for every rank, on the gloo control group (no GPU stream involved). Without a
    world, nothing to wait for."""
    if not dist.is_initialized():
        return
    group = getattr(grid, "control_group", None)
    if group is None and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])  # NCCL must know the GPU
    else:
        dist.barrier(group=group)


def meta_stand_ins(model) -> list[str]:
    """On the meta device nothing computes, so GPU-only kernels and libraries are not needed:
    swap them for megalite's torch paths (in place, on a ModelConfig) before validation, and
    return one line per swap. Parameters, names and the communication are the same; activation
    memory differs by the kernels' workspaces only (the torch attention path is counted)."""
    swaps = {
        "attention_backend": ("torch", lambda v: v in ("triton", "flash"), "--attention-backend {v}"),
        "fused_kernels": (False, bool, "--fused-kernels"),
        "moe_grouped_gemm": (False, bool, "--moe-grouped-gemm"),
        "transformer_impl": ("local", lambda v: v != "local", "--transformer-impl {v}"),
        "fp8_format": (None, lambda v: v is not None, "--fp8-format {v}"),
        "tp_comm_overlap": (False, bool, "--tp-comm-overlap"),
    }
    lines = []
    for field, (stand_in, applies, flag) in swaps.items():
        value = getattr(model, field)
        if applies(value):
            lines.append(flag.format(v=value))
            setattr(model, field, stand_in)
    return lines
