"""What the planner assumes about a training run, and the run as ``pretrain_gpt.py`` flags.

One source of truth: every default the planner models (gradient accumulation dtype, dropout,
micro batch, ZeRO stage, recomputation, sequence parallelism, the DDP bucket size) is read from
``megalite.arguments.build_parser()``, the parser of ``pretrain_gpt.py``, never copied here, and
every flag printed is named by the setting's own mark (``megalite.arguments.flag_for``).
:func:`pretrain_flags` writes a planned layout as the exact flags that train it, so that
``tools/dry_run.py`` with those flags measures what the planner estimated, and
``tools/plan_parallel.py --verify`` dry-runs nothing else.

Beyond the parser's defaults the planner assumes, and prints in the flags:
``--sequence-parallel`` with TP > 1 (Megatron practice); ``--overlap-grad-reduce`` with DP x CP > 1
(the step-time model hides the buckets behind backward; without it megalite's ZeRO-2/3 stage every bucket's gradients until the end of the step, a full
gradient more than the one bucket the planner counts); ``--attention-dropout 0`` under CP (no
CP type has attention dropout); the CP type (``--cp-comm-type``, and for a2a+p2p
``--hierarchical-context-parallel-sizes A B``) when CP > 1 and it is not the default p2p; the
precision flag (``--bf16`` by default); Megatron's packed-document flags ``--reset-position-ids``
and ``--reset-attention-mask`` when the planner was asked with them (the batch then carries the
documents' arrays, which the estimate counts: :mod:`megalite.planner_documents`); the pipeline
schedule (``--pipeline-schedule zb-h1`` or ``zbv``, :mod:`megalite.planner_pipeline`) when PP > 1
and it is not the parser's default, and an interleaved 1F1B's
``--num-layers-per-virtual-pipeline-stage L/(P V)``.

**The model's flags** (:func:`model_flags`), derived from the settings' marks, never a list of
names: a ModelConfig setting is printed when its value differs from what ``pretrain_gpt.py``
makes of the flag's absence, so that parsing the printed flags gives back an equal ModelConfig
(the round trip ``tests/test_planner_model_flags.py`` holds):

- the model's shape (:data:`ALWAYS`: layers, hidden, heads, sequence, vocabulary) always: a
  command line names its model, and the vocabulary's flag defaults to the tokenizer's;
- a setting whose default is None and that ``ModelConfig.__post_init__`` derives from others
  (``ffn_hidden_size``, ``num_query_groups``, ``max_position_embeddings``,
  ``moe_ffn_hidden_size``): when it differs from what it derives to from the model's other
  settings (found by building the model with it unset, not by a list here);
- every other setting: when it differs from the field's default.

Not printed there: the settings the layout decides (:data:`LAYOUT_SETTINGS`, printed by
:func:`pretrain_flags` from the Layout), and a setting no flag sets (``attention_kind``: a
checkpoint or a config built in code sets it; a value other than its default is refused, since
no command line could train that model). How a value is written follows its marks
(:mod:`megalite.flag_spec`): a ``store_true`` switch alone; a ``BooleanOptionalAction`` as the
flag or its ``--no-`` form; ``nargs`` as separate values; a 0/1 list per layer
(``--moe-layer-freq``) as Megatron's run-length pattern, e.g. ``([0]*3+[1]*58)``; anything else
``--flag=value``. A setting set by flags of another shape (``flags=`` and ``read=`` in its
marks: ``--disable-bias-linear``; ``rope_scaling`` from ``--use-rope-scaling`` or ``--rope-type
yarn`` and its flags) is written by its writer in :data:`WRITERS`, the inverse of its ``read``;
a new setting of that shape without one is refused by name (:func:`unwritable_settings`, which
the tests check is empty). So a new model flag of the ordinary shape is printed with no edit
here. The planner's command line (``tools/plan_parallel.py``) takes the same model flags from
the same marks (:func:`add_model_flags`, :func:`model_from_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools

from megalite.arguments import build_parser, flag_for
from megalite.config import ModelConfig, TrainConfig, llama3_rope_scaling
from megalite.config_types import yarn_rope_scaling
from megalite.flag_spec import Flag, flags_of_field, read_field, settings_of
from megalite.moe.settings import parse_layer_freq
from megalite.planner.types import UpdatePlan


@functools.lru_cache(maxsize=1)
def _defaults() -> tuple:
    return tuple(sorted(vars(build_parser().parse_args([])).items()))


def training_defaults() -> dict:
    """``pretrain_gpt.py``'s defaults (its parser with no flags), by destination name."""
    return dict(_defaults())


def grads_in_fp32(precision: str, accumulate: bool | None = None) -> bool:
    """Whether gradients are accumulated and reduced in fp32: ``--accumulate-allreduce-grads-in-fp32``
    (default from the parser: None, which ``megalite.config.validate`` turns on under --bf16/--fp16)."""
    if accumulate is None:
        accumulate = training_defaults()["accumulate_allreduce_grads_in_fp32"]
    if accumulate is None:
        return precision in ("bf16", "fp16")
    return bool(accumulate) or precision == "fp32"


def _flag(name: str) -> str:
    """The flag of setting ``name``, from the settings' own marks (megalite.flag_spec), never a copy."""
    return flag_for(name)


# The model's shape: printed even at a default value (a command line names its model).
ALWAYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")

# ModelConfig settings the planned layout decides (Layout.recompute, Layout.cp_comm_type):
# pretrain_flags prints them from the layout, the planner's command line searches them.
LAYOUT_SETTINGS = ("recompute_granularity", "cp_comm_type")


def _options(name: str) -> dict[str, Flag]:
    """The setting's flags by argparse destination."""
    return {one.dest: one for one in flags_of_field(_FIELDS[name])}


def _write_bias(value: bool) -> list[str]:
    """add_bias_linear = not --disable-bias-linear."""
    return [] if value else [_options("add_bias_linear")["disable_bias_linear"].option]


# YaRN's rope_scaling keys (Hugging Face's) -> the destination of the flag that sets each.
YARN_KEYS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings":
             "yarn_original_max_position_embeddings", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
             "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "yarn_correction_range_round_to_int"}


def _write_rope_scaling(value: dict | None) -> list[str]:
    """rope_scaling: None; Llama 3.1's (--use-rope-scaling [--rope-scaling-factor F]); YaRN's
    (--rope-type=yarn and each parameter that differs from the flags' defaults)."""
    if value is None:
        return []
    flags, kind = _options("rope_scaling"), value.get("rope_type")
    if kind == "llama3" and value == llama3_rope_scaling(value["factor"]):
        out = [flags["use_rope_scaling"].option]
        default = dict(flags["rope_scaling_factor"].kwargs)["default"]
        return out + ([f"{flags['rope_scaling_factor'].option}={value['factor']}"] if value["factor"] != default else [])
    if kind == "yarn" and set(value) == set(yarn_rope_scaling()) | {"rope_type"}:
        out = [f"{flags['rope_type'].option}=yarn"]
        for key, dest in YARN_KEYS.items():
            one = flags[dest]
            if value[key] == dict(one.kwargs)["default"]:
                continue
            if isinstance(value[key], bool):  # --[no-]yarn-correction-range-round-to-int
                out.append(one.option if value[key] else "--no-" + one.option[2:])
            else:
                out.append(f"{one.option}={value[key]}")
        return out
    raise ValueError(f"rope_scaling {value!r} has no pretrain_gpt.py flags (Llama 3.1's schedule with the "
                     f"original context 8192 and frequency factors 1/4, or YaRN's keys). Fix: train it from a "
                     f"checkpoint that holds it, or use one of those two.")


# Settings set by flags of another shape: value -> the flags that make pretrain_gpt.py read it back.
def _write_split_qkv(value: bool) -> list[str]:
    """muon_split_qkv = not --muon-no-split-qkv."""
    return [] if value else [one.option for one in flags_of_field(_TRAIN_FIELDS["muon_split_qkv"])]


WRITERS = {"add_bias_linear": _write_bias, "rope_scaling": _write_rope_scaling, "muon_split_qkv": _write_split_qkv}

_FIELDS = {f.name: f for f, _ in settings_of(ModelConfig)}


def unwritable_settings() -> list[str]:
    """ModelConfig settings set by flags of another shape that have no writer in :data:`WRITERS`."""
    return [f.name for f, marks in settings_of(ModelConfig)
            if marks.flags and marks.read is not None and f.name not in WRITERS]


def pattern_text(freq: list) -> str:
    """A 0/1 list per layer as Megatron's run-length pattern: [0,0,0,1,1] -> ``([0]*3+[1]*2)``."""
    runs: list[list] = []
    for v in freq:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs) + ")"


def _write_one(f: dataclasses.Field, value) -> list[str]:
    """A setting of one flag named after it (:func:`megalite.flag_spec.flags_of_field`)."""
    (one,) = flags_of_field(f)
    kwargs = dict(one.kwargs)
    action = kwargs.get("action")
    if action == "store_true":
        return [one.option] if value else []
    if action is argparse.BooleanOptionalAction:
        return [one.option if value else "--no-" + one.option[2:]]
    if kwargs.get("nargs") not in (None, "?"):
        return [one.option, *map(str, value)]
    if isinstance(value, (list, tuple)):  # --moe-layer-freq's 0/1 list per layer
        return [f"{one.option}={pattern_text(list(value))}"]
    return [f"{one.option}={value}"]


def _unset_value(m: ModelConfig, f: dataclasses.Field):
    """What ``pretrain_gpt.py`` makes of setting ``f`` without its flag, the model's others as given:
    for a derived default (None, filled in by ``__post_init__``) what it derives to, else the default."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if default is not None:
        return default
    values = {g.name: getattr(m, g.name) for g, _ in settings_of(ModelConfig)}
    return getattr(ModelConfig(**{**values, f.name: None}), f.name)


def model_flags(m: ModelConfig) -> list[str]:
    """The flags of every setting of ``m`` that differs from its absence (module docstring): the
    shape first, then the others in the order ModelConfig defines them."""
    missing = unwritable_settings()
    if missing:
        raise TypeError(f"ModelConfig settings {missing} are set by flags of their own shape (flags=, read=) "
                        f"and megalite.planner.flags.WRITERS has no writer for them: add one (the "
                        f"inverse of the setting's read function).")
    out = []
    for name in ALWAYS:
        out += _write_one(_FIELDS[name], getattr(m, name))
    for f, marks in settings_of(ModelConfig):
        if f.name in ALWAYS or f.name in LAYOUT_SETTINGS:
            continue
        value = getattr(m, f.name)
        if f.name == "moe_layer_freq":
            value = parse_layer_freq(value)  # its flag's text, or the int or list it stands for
        if value == _unset_value(m, f):
            continue
        if not flags_of_field(f):
            raise ValueError(f"ModelConfig.{f.name} = {value!r} has no command-line flag, so no pretrain_gpt.py "
                             f"command line trains this model. Fix: start it from a checkpoint that fixes it.")
        out += WRITERS[f.name](value) if f.name in WRITERS else _write_one(f, value)
    return out


# -- the planner's command line: the same model flags ------------------------------------------------

@functools.lru_cache(maxsize=1)
def planner_model_settings() -> tuple[str, ...]:
    """The ModelConfig settings ``tools/plan_parallel.py`` takes as flags: all with a flag but those
    the layout decides (the planner searches them)."""
    return tuple(f.name for f, _ in settings_of(ModelConfig) if flags_of_field(f) and f.name not in LAYOUT_SETTINGS)


def add_model_flags(group, required: tuple = ALWAYS) -> None:
    """Add ``pretrain_gpt.py``'s model flags (:func:`planner_model_settings`) to ``group`` (an
    argparse parser or group), with the same names, defaults and help; ``required``: settings
    that must be given."""
    for name in planner_model_settings():
        for one in flags_of_field(_FIELDS[name]):
            kwargs = dict(one.kwargs)
            if name in required:
                kwargs.pop("default", None)
                kwargs["required"] = True
            group.add_argument(one.option, dest=one.dest, **kwargs)


def model_from_args(a: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of a namespace parsed with :func:`add_model_flags`'s flags, each setting read
    from its flags as ``pretrain_gpt.py`` reads it (the layout's settings at their defaults;
    ``--moe-layer-freq``'s text as the int or list it stands for)."""
    model = ModelConfig(**{name: read_field(_FIELDS[name], a) for name in planner_model_settings()})
    model.moe_layer_freq = parse_layer_freq(model.moe_layer_freq)
    return model


# -- the update rule: --optimizer and Muon's settings that move data (megalite.planner.UpdatePlan) -------

UPDATE_SETTINGS = tuple(f.name for f in dataclasses.fields(UpdatePlan))
_TRAIN_FIELDS = {f.name: f for f, _ in settings_of(TrainConfig)}


def add_update_flags(group) -> None:
    """Add ``pretrain_gpt.py``'s flags of the :class:`UpdatePlan` settings (``--optimizer``,
    ``--muon-tp-mode``, ``--muon-num-ns-steps``, ``--muon-no-split-qkv``) to ``group``, from their marks."""
    for name in UPDATE_SETTINGS:
        for one in flags_of_field(_TRAIN_FIELDS[name]):
            group.add_argument(one.option, dest=one.dest, **dict(one.kwargs))


def update_from_args(a: argparse.Namespace) -> UpdatePlan:
    """The :class:`UpdatePlan` of a namespace parsed with :func:`add_update_flags`'s flags."""
    return UpdatePlan(**{name: read_field(_TRAIN_FIELDS[name], a) for name in UPDATE_SETTINGS})


def update_flags(update: UpdatePlan) -> list[str]:
    """The flags that make ``pretrain_gpt.py`` train with ``update`` (those at their defaults left out)."""
    out = []
    for name in UPDATE_SETTINGS:
        f, value = _TRAIN_FIELDS[name], getattr(update, name)
        if value != f.default:
            out += WRITERS[name](value) if name in WRITERS else _write_one(f, value)
    return out


def pretrain_flags(m: ModelConfig, layout, global_batch: int, micro: int, precision: str = "bf16",
                   accumulate: bool | None = None, reset_position_ids: bool = False,
                   reset_attention_mask: bool = False, update: UpdatePlan = UpdatePlan()) -> list[str]:
    """The ``pretrain_gpt.py`` flags of a planned layout (``megalite.planner.Layout``): the model,
    the batch, the layout and every assumption the planner made (module docstring); flags left
    at the parser's defaults are left out. Data flags are the user's (``--mock-data`` for a try)."""
    d = training_defaults()
    flags = model_flags(m)
    flags += [f"{_flag('global_batch_size')}={global_batch}", f"{_flag('micro_batch_size')}={micro}"]
    flags += [f"{_flag(k)}={v}" for k, v in (("tensor_model_parallel_size", layout.tp),
                                             ("pipeline_model_parallel_size", layout.pp),
                                             ("context_parallel_size", layout.cp), ("zero_stage", layout.zero),
                                             ("expert_model_parallel_size", layout.ep)) if v != d[k]]
    if layout.pp > 1 and layout.schedule != d["pipeline_schedule"]:
        flags.append(f"{_flag('pipeline_schedule')}={layout.schedule}")
    if layout.pp > 1 and layout.virtual > 1:  # the interleaved 1F1B: V chunks of L / (P V) layers per rank
        flags.append(f"{_flag('num_layers_per_virtual_pipeline_stage')}={layout.layers_per_virtual_stage(m.num_layers)}")
    if layout.sp and not d["sequence_parallel"]:
        flags.append(_flag("sequence_parallel"))
    if layout.recompute != (d["recompute_granularity"] or "none"):
        flags.append(f"{_flag('recompute_granularity')}={layout.recompute}")
    if (layout.zero >= 2 or layout.dp * layout.cp > 1) and not d["overlap_grad_reduce"]:  # step_time's overlap
        flags.append(_flag("overlap_grad_reduce"))
    if layout.cp > 1 and m.attention_dropout > 0:
        flags.append(f"{_flag('attention_dropout')}=0")
    kind = layout.cp_comm_type
    if layout.cp > 1 and kind != d["cp_comm_type"]:
        flags.append(f"{_flag('cp_comm_type')}={kind}")
        if layout.cp_sizes:  # a hierarchical type: A inner (all-to-all) ranks, B = CP/A outer (ring) ranks
            flags += [_flag("hierarchical_context_parallel_sizes"), *map(str, layout.cp_sizes)]
    if precision != "fp32":
        flags.append(_flag(precision))  # --bf16 or --fp16
    if accumulate is not None and grads_in_fp32(precision, accumulate) != grads_in_fp32(precision, None):
        option = _flag("accumulate_allreduce_grads_in_fp32")  # a BooleanOptionalAction: --no-... turns it off
        flags.append(option if accumulate else "--no-" + option[2:])
    flags += [_flag(k) for k, on in (("reset_position_ids", reset_position_ids),
                                     ("reset_attention_mask", reset_attention_mask)) if on]
    return flags + update_flags(update)

