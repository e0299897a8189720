"""Command-line flags (Megatron-LM's names wherever Megatron has the flag), built from the settings.

Every flag is a marked field of the dataclass that owns it (:mod:`megalite.flag_spec`): the
model, layout, training and data settings in :mod:`megalite.config_types`, the run's own in
:mod:`megalite.run_settings` and :mod:`megalite.resilience.flags`. :func:`build_parser` adds
them in the order of :data:`OWNERS`; :func:`parse_settings` turns the parsed namespace into the
typed :class:`Settings` at once, so nothing after parsing reads the namespace.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megalite.config_types import (MOE, Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig,
                                   llama3_rope_scaling)  # noqa: F401 - llama3_rope_scaling re-exported
from megalite.flag_spec import add_flags, flag_of, from_namespace, read_field, settings_of
from megalite.pipeline.schedule_kinds import SCHEDULES
from megalite.resilience.flags import GROUP as LONG_RUNS, ResilienceSettings
from megalite.run_settings import (WANDB_MISSING, CheckpointSettings, LaunchSettings,  # noqa: F401
                                   LoggingSettings, RunSettings, check_logging)

# (owner, its --help group), in the order --help lists them; a setting may name another group.
OWNERS = ((ModelConfig, "model"), (ParallelConfig, "parallelism"), (LaunchSettings, "device"),
          (TrainConfig, "training"), (DataConfig, "data"), (LoggingSettings, "logging and outputs"),
          (CheckpointSettings, "checkpoints"), (ResilienceSettings, LONG_RUNS))

# The --help groups in the order they are listed (a setting may name a group other than its owner's).
GROUPS = ("model", MOE, "parallelism", "device", "training", "data", "logging and outputs", "checkpoints", LONG_RUNS)

# Choices a floor above the settings knows: the pipeline schedules of the schedule table.
CHOICES = {"pipeline_schedule": list(SCHEDULES)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a GPT with megalite.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    for owner, group in OWNERS:
        add_flags(p, owner, group, groups, CHOICES)
    return p


@dataclass
class Settings:
    """A parsed command line: the run's :class:`Config` (its model's vocabulary still the
    flag's, until the tokenizer is known) and its :class:`RunSettings`."""
    config: Config
    run: RunSettings = field(default_factory=RunSettings)


def explicit_args(argv=None) -> set[str]:
    """The destinations of the flags given on the command line (not left at their defaults)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def config_from_args(args: argparse.Namespace, vocab_size: int, eod_token: int | None = None) -> Config:
    """The :class:`Config` of a parsed command line, its W&B flags checked (as pretrain checks
    them). ``vocab_size``: the tokenizer's; ``eod_token``: its end-of-document id (None: it has
    none), which the packed-document flags need."""
    check_logging(from_namespace(LoggingSettings, args))
    return _config_of(args, vocab_size, eod_token)


def _config_of(args: argparse.Namespace, vocab_size: int, eod_token: int | None = None) -> Config:
    return Config(model=from_namespace(ModelConfig, args, vocab_size=vocab_size),
                  parallel=from_namespace(ParallelConfig, args), train=from_namespace(TrainConfig, args),
                  data=from_namespace(DataConfig, args, eod_token=eod_token))


def _requested_vocab_size(args: argparse.Namespace) -> int | None:
    vocab = next(f for f, _ in settings_of(ModelConfig) if f.name == "vocab_size")
    return read_field(vocab, args)


def settings_from_args(args: argparse.Namespace, given: frozenset = frozenset()) -> Settings:
    """Typed settings of a parsed namespace; the model's vocabulary is the flag's (or the
    default) until :func:`megalite.train.pretrain.setup` sets the tokenizer's, and the logging flags
    are checked there (:func:`megalite.run_settings.check_logging`), in their turn."""
    requested = _requested_vocab_size(args)
    config = _config_of(args, requested if requested is not None else ModelConfig.vocab_size)
    run = RunSettings(launch=from_namespace(LaunchSettings, args), logging=from_namespace(LoggingSettings, args),
                      checkpoint=from_namespace(CheckpointSettings, args),
                      resilience=from_namespace(ResilienceSettings, args), vocab_size=requested, given=given)
    return Settings(config, run)


def parse_settings(argv=None, parser: argparse.ArgumentParser | None = None) -> Settings:
    """``pretrain_gpt.py``'s command line as typed settings (``parser``: one whose ``error`` was replaced)."""
    args = (parser or build_parser()).parse_args(argv)
    return settings_from_args(args, frozenset(explicit_args(argv)))



def flag_for(name: str) -> str:
    """The option that sets setting ``name`` (a field of one of :data:`OWNERS`), e.g. ``swiglu`` ->
    ``--swiglu``, ``add_bias_linear`` -> ``--disable-bias-linear``: what the planner prints."""
    for owner, _ in OWNERS:
        if any(f.name == name for f, _ in settings_of(owner)):
            return flag_of(owner, name)
    raise KeyError(f"no setting named {name!r}")
