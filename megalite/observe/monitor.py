"""What a training run reports: throughput, TFLOP/s and MFU, memory, time split, progress.

Model FLOPs per token for training (forward + backward): :func:`megalite.model.counting.flops_per_token`,
from the model's parts (``6 N + 12 L h s`` for GPT: 6 per parameter a token meets, plus the
attention scores and weighted values that N does not count). MFU = achieved model FLOP/s per GPU
divided by the GPU's peak (dense bf16), from ``--peak-tflops`` or the detected GPU.
"""
from __future__ import annotations

import math
import os
import sys

import torch

from megalite.arguments import WANDB_MISSING
from megalite.config import ModelConfig
from megalite.model.counting import flops_per_token  # noqa: F401  (the one definition; MFU reads it)
from megalite.observe.progress import is_terminal, progress_bar

# Dense 16-bit tensor-core peak TFLOP/s (bf16, fp32 accumulate; no 2:4 sparsity), keyed by the
# exact ``torch.cuda.get_device_name()``: variants of one chip differ (an H100 PCIe is 756, an
# SXM 989) and a substring match confuses them ("A10" is in "A100", "H100" in "H100 PCIe").
# Vendor datasheets quote the sparse figure: these are half of it. A name missing here gives
# no MFU and a one-time message; --peak-tflops sets the figure for any GPU.
PEAK_TFLOPS: dict[str, float] = {
    # Blackwell
    "NVIDIA B200": 2250.0,
    # Hopper
    "NVIDIA H100 80GB HBM3": 989.4,     # H100 SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.4,               # H200 SXM (our test machine; measured 769-798 on 8192^3)
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.4,
    "NVIDIA H800": 989.4,               # H800 SXM5
    "NVIDIA H800 PCIe": 756.0,
    "NVIDIA H20": 148.0,
    # Ampere
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM-80GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A800-SXM4-80GB": 312.0,
    "NVIDIA A800-SXM4-40GB": 312.0,
    "NVIDIA A800 80GB PCIe": 312.0,
    "NVIDIA A10": 125.0,
    "NVIDIA RTX A6000": 154.8,
    "NVIDIA GeForce RTX 3090": 71.0,    # GeForce: bf16 with fp32 accumulate runs at half rate
    # Ada Lovelace
    "NVIDIA L40S": 362.05,
    "NVIDIA L40": 181.05,
    "NVIDIA L4": 121.0,
    "NVIDIA GeForce RTX 4090": 165.2,   # fp32 accumulate (330.3 is fp16 accumulate)
    # Volta has no bf16: its fp16 tensor-core peak (for --fp16 runs)
    "Tesla V100-SXM2-16GB": 125.0,
    "Tesla V100-SXM2-32GB": 125.0,
    "Tesla V100-PCIE-16GB": 112.0,
    "Tesla V100-PCIE-32GB": 112.0,
    # AMD (ROCm torch reports through torch.cuda)
    "AMD Instinct MI300X": 1307.4,
}

_unknown_reported: set[str] = set()


def attended_length(micro_batches: list[dict]) -> float | None:
    """The mean over the tokens of host micro-batches of their document's length (the batch's
    ``doc_end - doc_start``; sum_i L_doc(i) = sum_d L_d^2), or None without documents. On the
    host tensors the data pipeline made, before they go to the device: no GPU sync. A rank sees
    its own data-parallel share, so the step's figure is estimated from it."""
    spans = [b["doc_end"].long() - b["doc_start"].long() for b in micro_batches if "doc_start" in b]
    if not spans:
        return None
    return float(sum(int(x.sum()) for x in spans)) / sum(x.numel() for x in spans)


def detect_peak_tflops(report_unknown: bool = True, stream=None,
                       device: torch.device | None = None) -> float | None:
    """The GPU's dense bf16 peak from ``PEAK_TFLOPS`` (exact name), or None without a GPU or
    for a name not in the table (then, once per name, a message naming the device and
    ``--peak-tflops``). ``device``: the run's device; None means the current CUDA device, a
    non-CUDA one (a CPU or meta run on a GPU machine) has no peak."""
    if device is not None and device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    peak = PEAK_TFLOPS.get(name.strip())
    if peak is None and report_unknown and name not in _unknown_reported:
        _unknown_reported.add(name)
        print(f"megalite: no peak TFLOP/s known for the GPU {name!r}: MFU is not reported. Fix: pass "
              f"--peak-tflops N (its dense bf16 tensor-core TFLOP/s, without sparsity).",
              file=stream or sys.stderr, flush=True)
    return peak


def memory_line(optimizer, reset_peak: bool = False, device: torch.device | None = None) -> tuple[str, dict]:
    """This rank's memory: on a GPU allocated / reserved / peak allocated of the current CUDA
    device, the peak since the last reset; on the CPU (or meta) the optimizer's accounting of
    tensor bytes. ``reset_peak``: reset the GPU peak afterwards (pass True for a step whose
    line is printed, so each printed peak covers the steps since the previous one).
    ``device``: where the model lives; None means the current CUDA device once CUDA is
    initialized, else the CPU."""
    on_gpu = device.type == "cuda" if device is not None else (torch.cuda.is_available()
                                                               and torch.cuda.is_initialized())
    if on_gpu:
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        stats = {"allocated": torch.cuda.memory_allocated(index), "reserved": torch.cuda.memory_reserved(index),
                 "peak": torch.cuda.max_memory_allocated(index)}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(index)
        return (f"mem {stats['allocated'] / 2**30:.2f}/{stats['reserved'] / 2**30:.2f}/"
                f"{stats['peak'] / 2**30:.2f} GiB (alloc/reserved/peak)"), stats
    stats = optimizer.memory_bytes()
    return f"mem {sum(stats.values()) / 2**20:.1f} MiB (weights+grads+optimizer)", stats


def per_device_unit(device: torch.device | None) -> str:
    """The name of the log line's TFLOP/s per rank: per GPU on CUDA, per CPU process on the CPU
    (a rank is a process there, sharing the machine's cores), per device elsewhere (meta).
    ``device`` None: a GPU when CUDA is available, else the CPU."""
    kind = device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return {"cuda": "TFLOP/s/GPU", "cpu": "TFLOP/s/CPU process"}.get(kind, "TFLOP/s/device")


def mock_data_note(vocab_size: int) -> str:
    """The one-time startup note of a ``--mock-data`` run: its tokens are uniform random ids,
    which no model can predict, so the loss stays near ln(vocab), the loss of a uniform guess."""
    return (f"mock data: random tokens, nothing to learn: the loss stays near ln(vocab) = "
            f"ln({vocab_size}) = {math.log(vocab_size):.2f} (train on real data to see it fall: docs/data.md)")


def clock_time(seconds: float | None) -> str:
    """``seconds`` as h:mm:ss (hours not wrapped at a day), n/a for None."""
    if seconds is None:
        return "n/a"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _value(x, spec: str) -> str:
    """A logged value, or n/a where there is none (a meta dry run computes nothing)."""
    return "n/a" if x is None else format(x, spec)


def scalars(record: dict) -> dict[str, float]:
    """The scalars of one logged step under their TensorBoard / W&B names (train/loss,
    time_ms/forward, memory_bytes/weights, ...); values that are None (a meta dry run) are left
    out."""
    out = {f"train/{key}": record[key] for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec",
                                                    "tflops_per_gpu", "mfu", "valid_loss", "moe_aux_loss",
                                                    "moe_z_loss", "moe_load_min", "moe_load_max", "mtp_loss",
                                                    "max_attention_logit")
           if record.get(key) is not None}
    for field, group in (("times_ms", "time_ms"), ("memory_bytes", "memory_bytes")):
        out.update({f"{group}/{key}": value for key, value in record.get(field, {}).items() if value is not None})
    return out


class Monitor:
    """Formats each logged step, keeps a progress bar with ETA (tqdm) under the log lines on a
    terminal, and writes the scalars to TensorBoard and to Weights & Biases when asked.

    ``wandb_project`` (``--wandb-project``) starts a W&B run named ``wandb_exp_name`` in
    ``wandb_save_dir`` (default: wandb's, ``./wandb``) with ``config`` (the run's Config as a
    dict) as its config; ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it
    later). Only an enabled Monitor (the rank that logs) writes anything."""

    def __init__(self, cfg: ModelConfig, world_size: int, tokens_per_step: int, train_iters: int,
                 peak_tflops: float | None = None, tensorboard_dir: str | None = None, enabled: bool = True,
                 stream=None, device: torch.device | None = None, wandb_project: str | None = None,
                 wandb_exp_name: str | None = None, wandb_save_dir: str | None = None,
                 config: dict | None = None):
        self.cfg = cfg
        self.flops_per_step = flops_per_token(cfg) * tokens_per_step
        self.world_size, self.tokens_per_step, self.train_iters = world_size, tokens_per_step, train_iters
        if peak_tflops is None:
            peak_tflops = detect_peak_tflops(report_unknown=enabled, device=device)
        self.peak = peak_tflops
        self.flops_unit = per_device_unit(device)
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tty = enabled and is_terminal(self.stream)
        self.bar = None  # the tqdm bar, made at the first logged step (it knows where a resumed run starts)
        self.writer = None
        self.wandb_run = None
        if tensorboard_dir and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional package
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install "
                                   "tensorboard (or drop the flag)") from e
            self.writer = SummaryWriter(tensorboard_dir)
        if wandb_project and enabled:
            try:
                import wandb
            except ImportError as e:  # wandb is an optional package
                raise RuntimeError(WANDB_MISSING) from e
            if wandb_save_dir:
                os.makedirs(wandb_save_dir, exist_ok=True)
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_exp_name, dir=wandb_save_dir,
                                        config=config)

    def metrics(self, elapsed_s: float, attended: float | None = None) -> dict:
        """Throughput of a step that took ``elapsed_s``; ``attended``: its mean attended length
        with packed documents (:func:`attended_length`), else the whole sequence."""
        flops = self.flops_per_step if attended is None else flops_per_token(self.cfg, attended) * self.tokens_per_step
        tflops = flops / elapsed_s / self.world_size / 1e12
        out = {"tokens_per_sec": self.tokens_per_step / elapsed_s, "tflops_per_gpu": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out

    def line(self, record: dict, memory: str) -> str:
        times = record.get("times_ms", {})
        parts = [f"iter {record['iteration']:>5}/{self.train_iters}",
                 f"elapsed {clock_time(record.get('run_elapsed_s'))} ETA {clock_time(record.get('eta_s'))}",
                 f"loss {_value(record['loss'], '.4f')}"
                 + (f" mtp {_value(record['mtp_loss'], '.4f')}" if "mtp_loss" in record else ""),
                 f"lr {record['lr']:.3e}", f"grad norm {_value(record['grad_norm'], '.3f')}"
                 + (f" max logit {_value(record['max_attention_logit'], '.2f')}"
                    if "max_attention_logit" in record else ""),
                 f"scale {record['loss_scale']:g}", f"skipped {record['skipped_total']}",
                 f"{_value(record['tokens_per_sec'], ',.0f')} tok/s",
                 f"{_value(record['tflops_per_gpu'], '.3g')} {self.flops_unit}"]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if record.get("moe_aux_loss") is not None:  # expert load: min / max tokens per expert over the mean
            parts.append(f"moe aux {_value(record['moe_aux_loss'], '.4f')} load "
                         f"{_value(record['moe_load_min'], '.2f')}/{_value(record['moe_load_max'], '.2f')}")
        parts.append(memory)
        parts.append(" ".join(f"{k} {v:.0f}" for k, v in times.items()) + " ms")
        return " | ".join(parts)

    def log(self, record: dict, memory: str, print_line: bool) -> None:
        if not self.enabled:
            return
        step = record["iteration"]
        if self.tty:
            if self.bar is None:
                self.bar = progress_bar(stream=self.stream, total=self.train_iters, initial=step - 1,
                                        desc="training", unit="it")
            self.bar.update(step - self.bar.n)
        if print_line:
            if self.bar is not None:
                self.bar.write(self.line(record, memory), file=self.stream, nolock=True)  # above the bar
            else:
                self.stream.write(self.line(record, memory) + "\n")
        self.stream.flush()
        values = scalars(record) if self.writer is not None or self.wandb_run is not None else {}
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
