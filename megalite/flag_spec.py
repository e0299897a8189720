"""Each setting defined once: a dataclass field whose metadata names its command-line flag(s).

A setting is a field of the dataclass that owns it (``ModelConfig``, ``CheckpointSettings``,
...), written ``name: type = setting(default, "help", ...)``. Its flag is Megatron's name,
``--`` + the field name with ``-`` for ``_``; its argparse type follows the default (a bool
that defaults to False is a ``store_true`` switch) unless a type, an action or choices are
given. A setting with ``flags=()`` has no command-line flag (:data:`NO_FLAG`): a config built
in code, or a checkpoint, sets it; a parsed command line leaves its default. A few settings are set by
flags of another shape (``--disable-bias-linear`` sets ``add_bias_linear`` to its negation,
``--use-rope-scaling --rope-scaling-factor F`` build ``rope_scaling``): they list their
:class:`Flag` objects and a ``read`` function from the parsed namespace to the field's value.

From these marks are derived: the parser (:func:`add_flags`), the dataclass built from a parsed
namespace (:func:`from_namespace`), the flag of a field (:func:`flag_of`, which the planner
prints) and the settings a checkpoint fixes (:func:`fixed_settings`). No megalite imports:
this sits on the ground floor with the dataclasses that use it.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

KEY = "megalite_setting"  # the field metadata key
NO_FLAG = ()  # ``flags=NO_FLAG``: a setting no command-line flag sets
_UNSET = object()


@dataclass(frozen=True)
class Flag:
    """One command-line option: its string, its argparse destination and ``add_argument`` keywords."""
    option: str
    dest: str
    kwargs: tuple = ()  # sorted (keyword, value) pairs

    def add_to(self, group) -> None:
        group.add_argument(self.option, dest=self.dest, **dict(self.kwargs))


def flag(option: str, **kwargs) -> Flag:
    """A :class:`Flag`; its destination is the option without dashes (``--use-rope-scaling``: use_rope_scaling)."""
    return Flag(option, option.lstrip("-").replace("-", "_"), tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class Setting:
    """The marks of one field: how the command line sets it, and whether a checkpoint fixes it."""
    help: str = ""
    fixed: bool = False          # a checkpoint fixes it (``--load`` adopts it; a contradicting flag is refused)
    group: str | None = None     # the --help group (None: the owner's)
    flags: tuple | None = None   # the options that set it (None: one, named after the field; (): none)
    read: Callable | None = None  # parsed namespace -> the field's value (None: the namespace's field name)
    kwargs: tuple = ()           # add_argument keywords of the one flag named after the field


def setting(default: Any = _UNSET, help: str = "", *, fixed: bool = False, group: str | None = None,
            flags: tuple | list | None = None, read: Callable | None = None, default_factory: Any = _UNSET,
            **argparse_kwargs):
    """A dataclass field that is a setting. ``argparse_kwargs`` (type, choices, nargs, metavar,
    action, flag_default: the parser's default when it differs from the field's, e.g. None for
    "from the tokenizer") shape its one flag; ``flags`` and ``read`` replace it."""
    marks = Setting(help=help, fixed=fixed, group=group, flags=tuple(flags) if flags is not None else None,
                    read=read, kwargs=tuple(sorted(argparse_kwargs.items())))
    if default_factory is not _UNSET:
        return dataclasses.field(default_factory=default_factory, metadata={KEY: marks})
    return dataclasses.field(default=default, metadata={KEY: marks})


def settings_of(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of dataclass ``cls`` that are settings, in order, with their marks."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata]


def flag_of(cls, name: str) -> str:
    """The option that sets field ``name`` of ``cls`` (its first, e.g. ``--disable-bias-linear``);
    KeyError for a setting without a flag."""
    flags = flags_of_field(_field(cls, name))
    if not flags:
        raise KeyError(f"{cls.__name__}.{name} has no command-line flag")
    return flags[0].option


def _field(cls, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def flags_of_field(f: dataclasses.Field) -> tuple[Flag, ...]:
    """The options of setting ``f``: its own list, or one named after the field."""
    marks: Setting = f.metadata[KEY]
    if marks.flags is not None:
        return marks.flags
    kwargs = dict(marks.kwargs)
    default = kwargs.pop("flag_default", _default(f))
    if "action" not in kwargs and "type" not in kwargs and "choices" not in kwargs:
        if default is True:
            raise TypeError(f"setting {f.name} defaults to True: name the flag that turns it off (flags=, read=)")
        if isinstance(default, bool):
            kwargs["action"] = "store_true"
        elif default is not None and not isinstance(default, (list, tuple)):
            kwargs["type"] = type(default)
    if kwargs.get("action") not in ("store_true", "store_false") or default is not False:
        kwargs["default"] = default
    if marks.help:
        kwargs["help"] = marks.help
    return (flag("--" + f.name.replace("_", "-"), **kwargs),)


def add_flags(parser: argparse.ArgumentParser, cls, group: str, groups: dict | None = None,
              choices: dict | None = None) -> None:
    """Add the flags of ``cls``'s settings to ``parser`` under --help group ``group`` (or the
    setting's own). ``groups`` (title -> argparse group) is shared between calls so that two
    owners may fill one group; ``choices`` (field -> choices) supplies choices a floor above
    knows (the pipeline schedules)."""
    groups = {} if groups is None else groups
    for f, marks in settings_of(cls):
        title = marks.group or group
        if title not in groups and flags_of_field(f):
            groups[title] = parser.add_argument_group(title)
        for one in flags_of_field(f):
            if choices and f.name in choices and one.dest == f.name:
                kwargs = {**dict(one.kwargs), "choices": choices[f.name]}
                one = Flag(one.option, one.dest, tuple(sorted(kwargs.items())))
            one.add_to(groups[title])


def read_field(f: dataclasses.Field, namespace: argparse.Namespace):
    marks: Setting = f.metadata[KEY]
    return marks.read(namespace) if marks.read is not None else getattr(namespace, f.name)


def from_namespace(cls, namespace: argparse.Namespace, **overrides):
    """``cls`` built from a parsed namespace: each setting read from its flags; ``overrides``
    (values known only after parsing, such as the tokenizer's vocabulary) win."""
    values = {f.name: read_field(f, namespace) for f, marks in settings_of(cls)
              if flags_of_field(f) or marks.read is not None}  # a setting without a flag keeps its default
    values.update(overrides)
    return cls(**values)


def fixed_settings(cls) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{field: (the flag that sets it, the argparse destinations of its flags)}`` of the
    settings of ``cls`` that a checkpoint fixes; a setting without a flag: ``(None, ())``."""
    out = {}
    for f, marks in settings_of(cls):
        if marks.fixed:
            flags = flags_of_field(f)
            out[f.name] = (flags[0].option if flags else None, tuple(one.dest for one in flags))
    return out


def flagless(obj) -> dict:
    """``{field: value}`` of the settings of dataclass instance ``obj`` that no flag sets."""
    return {f.name: getattr(obj, f.name) for f, marks in settings_of(type(obj))
            if not flags_of_field(f) and marks.read is None}


def set_flagless(obj, values: dict) -> None:
    """Set settings of ``obj`` that no flag sets (a flag's setting is the command line's: KeyError)."""
    mine = flagless(obj)
    for name, value in values.items():
        if name not in mine:
            raise KeyError(f"{type(obj).__name__}.{name} is not a setting without a flag (pass its flag instead)")
        setattr(obj, name, value)
