"""The run's own settings (the device and launch, logging and outputs, checkpoints, long-run
resilience), typed like the model's: each a dataclass field marked with its Megatron flag
(:mod:`megalite.flag_spec`), from which ``pretrain_gpt.py``'s parser is built. Nothing reads the
argparse namespace after :func:`megalite.arguments.parse_settings` has turned it into these."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from megalite.errors import ConfigError
from megalite.flag_spec import setting
from megalite.launch import Launch
from megalite.resilience.flags import GROUP as LONG_RUNS
from megalite.resilience.flags import ResilienceSettings
from megalite.resilience.fault_injection import Fault

CKPT_FORMATS = ("megalite", "torch_dcp")  # --ckpt-format's choices (checkpoint/ writes both)

WANDB_MISSING = ("--wandb-project needs the wandb package, which is not installed. Fix: pip install wandb "
                 "(or pip install 'megalite[wandb]'), or drop --wandb-project.")


@dataclass
class LaunchSettings:
    device: str = setting("auto", "auto: this rank's GPU (LOCAL_RANK) when there is one, else the CPU; meta: "
                          "shapes only, nothing computed (a dry run)", choices=["auto", "cuda", "cpu", "meta"])
    fake_process_group: bool = setting(False, "play rank RANK of a world of WORLD_SIZE alone, on torch's fake "
                                       "backend (collectives return at once); with --device meta a placement "
                                       "and memory dry run")
    disable_tf32: bool = setting(False, "exact fp32 matmuls on Ampere and later (TF32 is on by default there)")
    distributed_timeout_minutes: float = setting(10.0, "a collective that does not complete in time raises a "
                                                 "clear error on every rank", group="logging and outputs")


@dataclass
class LoggingSettings:
    log_json: str | None = setting(None, "write one JSON object per iteration", type=str)
    tensorboard_dir: str | None = setting(None, "write TensorBoard scalars here", type=str)
    wandb_project: str | None = setting(None, "log the same scalars to this Weights & Biases project (pip "
                                        "install wandb; WANDB_MODE=offline keeps the run on disk)", type=str)
    wandb_exp_name: str | None = setting(None, "the W&B run name (None: wandb picks one)", type=str)
    wandb_save_dir: str | None = setting(None, "the W&B run files go to DIR/wandb/ (None: the working "
                                         "directory)", type=str)
    peak_tflops: float | None = setting(None, "peak TFLOP/s per GPU for MFU (default: detected GPU's dense "
                                        "bf16 peak)", type=float)
    profile: bool = setting(False, "torch.profiler trace per rank")
    profile_step_start: int = setting(2)
    profile_step_end: int = setting(3)
    profile_dir: str = setting("profile")
    track_memory: bool = setting(False, "count every tensor storage of each iteration by category, with the "
                                 "peak (memory_tracked in the JSON log; tools/dry_run.py uses it)")
    pipeline_trace: str | None = setting(None, "directory: each rank writes its schedule trace of the last "
                                         "iteration", type=str, group="checkpoints")


def check_logging(log: LoggingSettings) -> None:
    """W&B flags: the package is there (checked on every rank, before any group or model) and
    the run options come with a project."""
    if log.wandb_project:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(WANDB_MISSING)
    else:
        for name in ("wandb_exp_name", "wandb_save_dir"):
            if getattr(log, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} is set without --wandb-project. Fix: add --wandb-project NAME, or "
                                  f"drop {flag}.")


@dataclass
class CheckpointSettings:
    save: str | None = setting(None, "checkpoint directory (also saved at the end and on SIGTERM)", type=str)
    save_interval: int | None = setting(None, "iterations between checkpoints", type=int)
    keep_last: int | None = setting(None, "keep only the newest K checkpoints", type=int)
    load: str | None = setting(None, "resume from this directory's 'latest' checkpoint, or from an iteration "
                               "directory (DIR/iter_0000010)", type=str)
    ckpt_step: int | None = setting(None, "with --load DIR: load iteration N instead of 'latest'", type=int)
    no_load_optim: bool = setting(False, "load weights only; fresh optimizer")
    no_load_rng: bool = setting(False, "do not restore the RNG states")
    finetune: bool = setting(False, "load the weights only (no optimizer state, no RNG state, as Megatron), "
                             "restart at iteration 0")
    async_save: bool = setting(False, "save checkpoints in the background: the state is copied to reused host "
                               "buffers and a writer thread writes and commits it while training goes on (needs "
                               "--save)", group=LONG_RUNS)
    ckpt_format: str = setting("megalite", "megalite: safetensors + JSON; torch_dcp: torch.distributed.checkpoint "
                               "(readable by DCP's tools such as dcp_to_torch_save)", group=LONG_RUNS,
                               choices=CKPT_FORMATS)


@dataclass
class RunSettings:
    """Everything of a run beyond its :class:`~megalite.config.Config`."""
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)
    vocab_size: int | None = None  # --vocab-size as given (the model's is the tokenizer's; see arguments)
    given: frozenset = frozenset()  # the argparse destinations typed on the command line


@dataclass
class RunPlan:
    """What :func:`megalite.train.pretrain.setup` works out on the way from the settings to the run
    (none of it a flag): the launch found in the environment, the checkpoint to load and the
    resilience settings parsed."""
    settings: RunSettings
    launch: Launch                 # torchrun, SLURM or one process (megalite.launch)
    fresh_start: bool = False      # --load D --save D with nothing saved under D yet
    load_dir: str | None = None    # the iteration directory --load resolved to, once (None: nothing to load)
    faults: list[Fault] = field(default_factory=list)  # --inject-fault, parsed
    skip_windows: list[tuple[int, int]] = field(default_factory=list)  # --skip-batches, merged

    @property
    def checkpoint(self) -> CheckpointSettings:
        return self.settings.checkpoint

    @property
    def logging(self) -> LoggingSettings:
        return self.settings.logging

    @property
    def resilience(self) -> ResilienceSettings:
        return self.settings.resilience

    @property
    def launch_settings(self) -> LaunchSettings:
        return self.settings.launch
