"""The ``pretrain_gpt.py --help`` contract as data: every option string of the parser with its
destination, default, type or action, choices and nargs (help text and groups left out, as they
may improve). ``tests/fixtures/pretrain_flags.json`` holds it as recorded before issue 37 rebuilt
the parser from the settings' dataclasses; ``test_flag_contract.py`` compares the two. A new flag
is added to it on purpose: ``python -m tests.flag_contract`` (from the repository root) rewrites it."""
from __future__ import annotations

import argparse
import json
import os

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pretrain_flags.json")


def _plain(value):
    """A JSON-comparable form of a default or choice (tuples as lists, types and callables by name)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value == int(value) and abs(value) < 2**53:
        return {"float": value}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": value}
    return getattr(value, "__name__", repr(value))


def contract(parser: argparse.ArgumentParser) -> dict:
    """``{option string: {dest, default, kind, choices, nargs, const}}`` of every option."""
    out = {}
    for action in parser._actions:
        for option in action.option_strings:
            out[option] = {"dest": action.dest, "default": _plain(action.default),
                           "kind": type(action).__name__, "type": _plain(action.type),
                           "choices": _plain(list(action.choices)) if action.choices is not None else None,
                           "nargs": action.nargs, "const": _plain(action.const),
                           "required": action.required, "metavar": _plain(action.metavar)}
    return out


def write_fixture(parser: argparse.ArgumentParser, path: str = FIXTURE) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(contract(parser), f, indent=1, sort_keys=True)
        f.write("\n")


def read_fixture(path: str = FIXTURE) -> dict:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    from megalite.arguments import build_parser

    write_fixture(build_parser())
