"""``pretrain_gpt.py``'s flags are a contract (issue 37): the parser built from the settings'
dataclasses has exactly the option strings recorded before (tests/fixtures/pretrain_flags.json),
each with the same destination, default, type or action, choices and nargs. Help text may differ."""
from __future__ import annotations

from megalite.arguments import build_parser
from tests.flag_contract import contract, read_fixture


def test_the_parser_keeps_every_recorded_flag():
    recorded, now = read_fixture(), contract(build_parser())
    assert sorted(now) == sorted(recorded), (sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded)))
    for option, spec in recorded.items():
        assert now[option] == spec, option


def test_no_flags_gives_the_recorded_defaults():
    """Parsing nothing gives each destination its recorded default."""
    parsed = vars(build_parser().parse_args([]))
    defaults = {spec["dest"]: spec["default"] for spec in read_fixture().values() if spec["dest"] != "help"}
    assert set(parsed) == set(defaults)
    for dest, default in defaults.items():
        value = parsed[dest]
        plain = {"float": value} if isinstance(value, float) else (list(value) if isinstance(value, tuple) else value)
        assert plain == default, dest
