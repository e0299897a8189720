"""What a training run reports: throughput, TFLOP/s and MFU, memory, time split, progress.

Model FLOPs per token for training (forward + backward), the usual estimate:
    6 N + 12 L h s
N parameters (each does a multiply-add forward and two backward: 6 FLOPs per token), plus
the attention scores and weighted values that N does not count: 2 matmuls of s x h per
token per layer, x2 FLOPs, x3 for backward = 12 L h s. MFU = achieved model FLOP/s per GPU
divided by the GPU's peak (dense bf16), from ``--peak-tflops`` or the detected GPU.
"""
from __future__ import annotations

import sys
import time

import torch

from megalite.config import ModelConfig
from megalite.model.gpt import count_parameters

# Dense bf16 peak TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0, "V100": 125.0, "MI300X": 1307.0}


def flops_per_token(cfg: ModelConfig) -> float:
    return 6.0 * count_parameters(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


def detect_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def memory_line(optimizer) -> tuple[str, dict]:
    """GPU: allocated / reserved / peak; CPU: the optimizer's accounting of tensor bytes."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                 "peak": torch.cuda.max_memory_allocated()}
        return (f"mem {stats['allocated'] / 2**30:.2f}/{stats['reserved'] / 2**30:.2f}/"
                f"{stats['peak'] / 2**30:.2f} GiB (alloc/reserved/peak)"), stats
    stats = optimizer.memory_bytes()
    return f"mem {sum(stats.values()) / 2**20:.1f} MiB (weights+grads+optimizer)", stats


class Monitor:
    """Formats each logged step, keeps a progress bar with ETA on a terminal, and writes
    TensorBoard scalars when asked."""

    def __init__(self, cfg: ModelConfig, world_size: int, tokens_per_step: int, train_iters: int,
                 peak_tflops: float | None = None, tensorboard_dir: str | None = None, enabled: bool = True,
                 stream=None):
        self.flops_per_step = flops_per_token(cfg) * tokens_per_step
        self.world_size, self.tokens_per_step, self.train_iters = world_size, tokens_per_step, train_iters
        self.peak = peak_tflops if peak_tflops is not None else detect_peak_tflops()
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.writer = None
        if tensorboard_dir and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional package
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install "
                                   "tensorboard (or drop the flag)") from e
            self.writer = SummaryWriter(tensorboard_dir)

    def metrics(self, elapsed_s: float) -> dict:
        tflops = self.flops_per_step / elapsed_s / self.world_size / 1e12
        out = {"tokens_per_sec": self.tokens_per_step / elapsed_s, "tflops_per_gpu": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out

    def line(self, record: dict, memory: str) -> str:
        times = record.get("times_ms", {})
        parts = [f"iter {record['iteration']:>5}/{self.train_iters}", f"loss {record['loss']:.4f}",
                 f"lr {record['lr']:.3e}", f"grad norm {record['grad_norm']:.3f}",
                 f"scale {record['loss_scale']:g}", f"skipped {record['skipped_total']}",
                 f"{record['tokens_per_sec']:,.0f} tok/s", f"{record['tflops_per_gpu']:.3g} TFLOP/s/GPU"]
        if "mfu" in record:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts.append(memory)
        parts.append(" ".join(f"{k} {v:.0f}" for k, v in times.items()) + " ms")
        return " | ".join(parts)

    def log(self, record: dict, memory: str, print_line: bool) -> None:
        if not self.enabled:
            return
        if print_line:
            if self.tty:
                self.stream.write("\r\033[K")
            self.stream.write(self.line(record, memory) + "\n")
        if self.tty:
            self.stream.write(self.progress(record["iteration"]))
        self.stream.flush()
        if self.writer is not None:
            step = record["iteration"]
            for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_gpu", "mfu",
                        "valid_loss"):
                if key in record:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
            for key, value in record.get("times_ms", {}).items():
                self.writer.add_scalar(f"time_ms/{key}", value, step)
            for key, value in record.get("memory_bytes", {}).items():
                self.writer.add_scalar(f"memory_bytes/{key}", value, step)
            self.writer.flush()

    def progress(self, iteration: int) -> str:
        done = iteration / self.train_iters
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1e-9) * (1 - done)
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        return f"\r[{bar}] {100 * done:5.1f}% ETA {int(eta // 60)}:{int(eta % 60):02d}"

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        if self.writer is not None:
            self.writer.close()
