"""The second oracle: one rank of a 16-rank layout, alone, on meta tensors and the fake
process group (``--fake-process-group --device meta``).

A whole training iteration (forward, backward, pipeline schedule, DP/ZeRO reductions,
optimizer step, recomputation) runs on meta tensors; any tensor the framework creates on
the CPU meets a meta tensor and raises, so a passing run proves placement. The last test
proves the oracle can fail: one buffer put back on the CPU is caught, with the device named.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megalite.config import ConfigError
from megalite.train.pretrain import pretrain
from tests.side_by_side import SideBySide, selected_cases

# 4 layers (2 per stage at PP 2, 1 per virtual chunk) and a global batch of 16: at DP 4 that is
# 2 micro-batches per step, the pipeline's depth, so 1F1B and the interleaved schedule reach
# their steady state; a meta op costs Python time, so the time of a rank's dry run is about
# layers x micro-batches.
MODEL = ["--mock-data", "--vocab-size", "500", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
         "--log-interval", "1"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]

# Layouts of 16 ranks, rank = tp + TP*(cp + CP*(dp + DP*pp)), and one rank of every role:
# first / middle / last pipeline stage, TP and CP positions, DP position.
LAYOUTS = {
    "tp2-pp2-dp4-zero1-virtual": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--zero-stage", "1", "--num-layers-per-virtual-pipeline-stage", "1",
                                   "--overlap-grad-reduce"], [0, 1, 6, 8, 15]),
    "tp2-cp2-pp2-dp2-sp": (["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                            "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                            "--attention-dropout", "0"], [0, 3, 5, 10, 15]),
    "tp4-dp4-zero3": (["--tensor-model-parallel-size", "4", "--zero-stage", "3"], [0, 3, 13]),
    "tp2-pp2-dp4-zero2-offload-recompute": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                             "--zero-stage", "2", "--offload-optimizer",
                                             "--recompute-granularity", "full"], [0, 5, 9, 15]),
    "llama-tp2-pp2-dp4-bf16": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--bf16", *LLAMA], [0, 7, 8, 15]),
}


def dry_run(monkeypatch, world: int, rank: int, flags: list[str]) -> list[dict]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank % 8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    try:
        return pretrain(["--fake-process-group", "--device", "meta", *MODEL, *flags])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def one_role(layout: str, rank: int) -> list[dict]:
    """``dry_run`` of one rank of the layout, run in a fork of the test process
    (tests/side_by_side.py): the launch environment set here, and put back after."""
    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(WORLD_SIZE="16", RANK=str(rank), LOCAL_RANK=str(rank % 8), LOCAL_WORLD_SIZE="8")
    try:
        return pretrain(["--fake-process-group", "--device", "meta", *MODEL, *LAYOUTS[layout][0]])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def every_role_runs(request):
    """Each chosen rank of the layouts this session selected, two at a time (a rank's dry run is
    one process's work)."""
    layouts = selected_cases(request, "test_meta_dry_run_every_role", ("layout",))
    runs = SideBySide(one_role, [(layout, rank) for (layout,) in layouts for rank in LAYOUTS[layout][1]])
    yield runs
    runs.close()


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k == "llama-tp2-pp2-dp4-bf16" else pytest.mark.slow)
                                    for k in sorted(LAYOUTS)])
def test_meta_dry_run_every_role(every_role_runs, layout):
    flags, ranks = LAYOUTS[layout]
    for rank in ranks:
        log = every_role_runs.result(layout, rank)
        assert [r["iteration"] for r in log] == [1, 2], (layout, rank)
        # No values on meta (n/a), but the accounting and the traffic are real.
        assert all(r["loss"] is None and r["grad_norm"] is None for r in log)
        memory = log[-1]["memory_bytes"]
        assert memory["weights"] > 0 and memory["master_weights"] > 0, (layout, rank, memory)
        assert log[-1]["comm_bytes"], (layout, rank)  # every layout here communicates on every rank
        assert "valid_loss" in log[-1]  # evaluation ran too


@pytest.mark.slow
def test_meta_dry_run_memory_matches_a_real_rank(monkeypatch):
    """The accounting of the meta rank equals a real single-process CPU run's of the same
    shard (same model, TP=1 PP=1, ZeRO-1 over DP 4: one quarter of the optimizer state)."""
    meta = dry_run(monkeypatch, 4, 2, ["--zero-stage", "1"])[-1]["memory_bytes"]
    flags = ["--fake-process-group", "--device", "cpu", *MODEL, "--zero-stage", "1"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    try:
        cpu = pretrain(flags)[-1]["memory_bytes"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert meta == cpu


def test_oracle_catches_a_cpu_buffer(monkeypatch):
    """Put one buffer back on the CPU (the gradient bucket of DDP, as it was before the
    placement work): the meta dry run must fail, naming the devices."""
    from megalite.data_parallel import ddp

    monkeypatch.setattr(ddp.GradSync, "_zeros", lambda self, n: torch.zeros(n, dtype=self.grad_dtype))
    with pytest.raises(RuntimeError, match="device cpu.*meta|meta.*cpu"):
        dry_run(monkeypatch, 16, 0, LAYOUTS["tp4-dp4-zero3"][0])


def test_oracle_catches_a_cpu_rotary_table(monkeypatch):
    """The same for a tensor made inside the model's forward (the rotary frequencies)."""
    from megalite.layers import rotary

    def on_cpu(position_ids, head_dim, base, scaling=None):
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = position_ids.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()

    monkeypatch.setattr("megalite.model.gpt.rotary_angles", on_cpu)
    assert rotary.rotary_angles is not on_cpu
    with pytest.raises(RuntimeError, match="device cpu.*meta|meta.*cpu"):
        dry_run(monkeypatch, 16, 0, LAYOUTS["llama-tp2-pp2-dp4-bf16"][0])


def test_fake_process_group_needs_world_and_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="set WORLD_SIZE and RANK"):
        pretrain(["--fake-process-group", "--device", "meta", *MODEL])


def test_meta_device_with_a_real_world_is_refused(monkeypatch):
    from megalite.device import init_distributed

    with pytest.raises(ConfigError, match="--fake-process-group"):
        init_distributed(torch.device("meta"), 4, 0, timeout=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused():
    from megalite.device import resolve_device

    with pytest.raises(ConfigError, match="--device cuda was asked for, but torch sees no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.slow
def test_gpu_only_kernels_and_libraries_give_way_to_torch_on_meta(monkeypatch, capsys):
    """A dry run of a GPU configuration (Triton kernels, transformer-engine with FP8 and TP comm
    overlap, grouped GEMM) needs none of them on meta: the torch paths stand in, said once, with
    the same memory and traffic as the run that asked for torch."""
    base = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
            "--bf16", "--attention-dropout", "0", "--num-experts", "4", "--expert-model-parallel-size", "2"]
    gpu_only = ["--attention-backend", "triton", "--fused-kernels", "--moe-grouped-gemm",
                "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"]
    plain = dry_run(monkeypatch, 16, 15, base)[-1]
    capsys.readouterr()
    swapped = dry_run(monkeypatch, 16, 15, base + gpu_only)[-1]
    out = capsys.readouterr().out
    assert ("torch layers and kernels stand in for --attention-backend triton, --fused-kernels, "
            "--moe-grouped-gemm, --transformer-impl transformer_engine, --fp8-format hybrid") in out
    assert swapped["memory_bytes"] == plain["memory_bytes"] and swapped["comm_bytes"] == plain["comm_bytes"]


@pytest.mark.slow
def test_oracle_catches_a_cpu_tensor_handed_to_a_collective(monkeypatch):
    """The fake process group accepts a tensor on any device, and torch lets a 0-dim CPU tensor
    meet a meta one: a CPU scalar all-reduced and added into the gradient norm would pass the
    placement oracle, unless every tensor handed to a collective is checked (comm.expect_device)."""
    from megalite.data_parallel import zero
    from megalite.parallel import comm

    original = zero.DistributedOptimizer.grad_norm

    def with_a_cpu_scalar(self, loss_scale=1.0):
        host = torch.zeros(())  # made without a device: on the CPU
        comm.all_reduce(host, self.group)
        return original(self, loss_scale) + host

    monkeypatch.setattr(zero.DistributedOptimizer, "grad_norm", with_a_cpu_scalar)
    with pytest.raises(RuntimeError, match="all_reduce handed a tensor on device cpu .*expected device meta"):
        dry_run(monkeypatch, 16, 0, LAYOUTS["tp4-dp4-zero3"][0])


def _cpu_tensors_meeting_meta(flags):
    """The ops of a meta dry run that take a CPU tensor next to a meta one (torch allows it for
    0-dim CPU tensors: a CPU scalar in device math, a host sync on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "meta" for t in tensors) and any(t.device.type == "cpu" for t in tensors):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return seen, Watch


@pytest.mark.parametrize("layout", ["tp2-pp2-dp4-zero1-virtual", "llama-tp2-pp2-dp4-bf16"])
@pytest.mark.slow
def test_no_cpu_tensor_meets_a_meta_one_in_the_step(monkeypatch, layout):
    from megalite.train import step as training

    seen, Watch = _cpu_tensors_meeting_meta(LAYOUTS[layout][0])
    step = training.train_step

    def watched(*args, **kwargs):
        with Watch():
            return step(*args, **kwargs)

    monkeypatch.setattr("megalite.train.loop.train_step", watched)
    dry_run(monkeypatch, 16, 15, LAYOUTS[layout][0])
    assert seen == [], sorted(set(seen))


@pytest.mark.slow
def test_the_cpu_tensor_watch_catches_a_cpu_scalar_in_device_math(monkeypatch):
    """The watch above can fail: a CPU 0-dim tensor added into the gradient norm is seen."""
    from megalite.train import step as training
    from megalite.data_parallel import zero

    original = zero.DistributedOptimizer.grad_norm
    monkeypatch.setattr(zero.DistributedOptimizer, "grad_norm",
                        lambda self, loss_scale=1.0: original(self, loss_scale) + torch.zeros(()))
    seen, Watch = _cpu_tensors_meeting_meta([])
    step = training.train_step

    def watched(*args, **kwargs):
        with Watch():
            return step(*args, **kwargs)

    monkeypatch.setattr("megalite.train.loop.train_step", watched)
    dry_run(monkeypatch, 16, 0, LAYOUTS["tp4-dp4-zero3"][0])
    assert "aten.add.Tensor" in seen, seen


# TP2 x CP4 x DP2 (16 ranks), 8 heads so a2a over 4 CP ranks gets whole heads of the 4 per TP rank.
CP_TYPES = {"p2p": [], "a2a": [], "allgather": [],
            "a2a+p2p": ["--hierarchical-context-parallel-sizes", "2", "2"]}
CP_LAYOUT = ["--num-layers", "1", "--num-attention-heads", "8", "--seq-length", "32", "--global-batch-size", "4",
             "--train-iters", "1", "--eval-interval", "1000", "--tensor-model-parallel-size", "2",
             "--context-parallel-size", "4", "--sequence-parallel", "--attention-dropout", "0"]


@pytest.mark.parametrize("comm_type", sorted(CP_TYPES))
def test_meta_dry_run_each_cp_comm_type(monkeypatch, comm_type):
    """Every --cp-comm-type runs alone on meta under the fake group (the all-to-alls too), on
    the one role of a PP=1 layout at three TP/CP/DP positions, and hands the attention groups
    exactly the bytes of context_parallel.traffic's formula (one layer, one micro-batch, fp32;
    a2a+p2p's inner and outer groups are named apart)."""
    from megalite.context_parallel.traffic import cp_attention_traffic

    theory = cp_attention_traffic(comm_type, batch=2, seq=32, heads=4, groups=4, head_dim=8, cp=4,
                                  element_size=4, inner=2)
    expected = ({"cp": theory.total} if comm_type != "a2a+p2p" else
                {"cp_inner": sum(v for p in theory.handed.values() for k, v in p.items() if k == "all_to_all"),
                 "cp_outer": sum(v for p in theory.handed.values() for k, v in p.items() if k == "send")})
    for rank in (0, 5, 15):  # (tp, cp, dp) = (0, 0, 0), (1, 2, 0), (1, 3, 1)
        log = dry_run(monkeypatch, 16, rank, CP_LAYOUT + ["--cp-comm-type", comm_type] + CP_TYPES[comm_type])
        assert [r["iteration"] for r in log] == [1] and log[-1]["loss"] is None
        by_group = log[-1]["comm_bytes_by_group"]
        assert {k: v for k, v in by_group.items() if k.startswith("cp")} == expected, (rank, by_group)


# Packed documents: what the dry run's --track-memory peak holds of the batch's doc_start/doc_end.
DOCUMENTS_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                   "--vocab-size", "500", "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16",
                   "--mock-data"]


@pytest.mark.parametrize("cp", [1, 2])
def test_dry_run_peak_with_documents_and_the_planned_data_entry(cp):
    """--reset-attention-mask adds the (b, s) int32 doc_start and doc_end to every micro-batch:
    M b s 8 bytes on the device: the planner's "data" entry and the dry run's measured peak (the
    tracker registers the step's device batches as "data") both grow by exactly that, with and
    without CP. Here M = 4 (8 / (2 x DP 1))."""
    from megalite.arguments import build_parser, config_from_args
    from megalite.parallel.grid import GridLayout
    from tools import dry_run as tool

    extra = ["--context-parallel-size", str(cp), "--attention-dropout", "0"] if cp > 1 else []
    peaks, planned = [], []
    for documents in ([], ["--reset-position-ids", "--reset-attention-mask"]):
        flags = DOCUMENTS_MODEL + extra + documents
        config = config_from_args(build_parser().parse_args(flags), 500, eod_token=tool.mock_eod(500))
        (role,) = tool.measure_layout(flags, config, GridLayout.from_config(config.parallel, cp), 8)
        peaks.append(role["measured_bytes"])
        planned.append(role["planned_categories"]["data"])
    doc_arrays = 4 * 2 * 64 * (4 + 4)  # M b s (doc_start + doc_end)
    assert planned[1] - planned[0] == doc_arrays
    assert peaks[1] - peaks[0] == doc_arrays, peaks


def test_dry_run_cuts_the_learning_rate_schedule_to_its_one_iteration(capsys):
    """A run planned with a long warm-up (and no --lr-decay-iters) dry-runs: the tool's single
    iteration takes the schedule with it instead of failing validation inside pretrain."""
    from tools import dry_run as tool
    code = tool.main(["--world-size", "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "64", "--vocab-size", "500", "--micro-batch-size", "1", "--global-batch-size", "2",
                      "--lr-warmup-iters", "10", "--tensor-model-parallel-size", "2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "fits within" in out.out and "Traceback" not in out.err
