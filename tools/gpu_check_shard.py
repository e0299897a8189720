"""A pytest plugin that keeps one shard of the collected tests: ``GPU_CHECK_SHARD=i/K``.

    GPU_CHECK_SHARD=0/4 python -m pytest -p tools.gpu_check_shard -m gpu tests/

scripts/gpu_check.sh starts K such pytest processes side by side, so the Triton kernels the GPU
tests compile (one process compiles one kernel at a time) and the training runs some tests
start spread over the machine's cores. Every process collects the same tests in the same order
and computes the same split, so the K shards together hold each test exactly once:

- tests that share a fixture wider than a function (a module-scoped CPU reference run, say)
  stay together, so it is computed once;
- a test that takes ``tmp_path`` usually writes files or runs processes: it weighs HEAVY, others 1;
- groups are dealt heaviest first, each to the lightest shard (ties: the lower index).

Without ``GPU_CHECK_SHARD`` the plugin does nothing.
"""
from __future__ import annotations

import os

import pytest

HEAVY = 12  # ~a training process or two (10-25 s) against ~2 s of kernel compiles per test


def shard_spec(value: str | None) -> tuple[int, int] | None:
    """(i, K) from "i/K", or None when unset; a malformed value is an error that names the form."""
    if not value:
        return None
    try:
        i, k = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"GPU_CHECK_SHARD={value!r}: expected i/K, e.g. 0/4") from None
    if not 0 <= i < k:
        raise ValueError(f"GPU_CHECK_SHARD={value!r}: need 0 <= i < K")
    return i, k


def _group_key(item, index: int):
    """Items sharing a non-function-scoped fixture of the project (not pytest's own) share a key."""
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in sorted(getattr(info, "name2fixturedefs", {}).items()):
        for d in defs:
            if getattr(d, "scope", "function") != "function" and getattr(d, "baseid", ""):
                return ("fixture", d.baseid, name)
    return ("item", index)


def split(keys: list, weights: list, shards: int) -> list[int]:
    """The shard of each item: groups of equal keys, heaviest first, to the lightest shard."""
    groups: dict = {}
    for index, (key, weight) in enumerate(zip(keys, weights)):
        g = groups.setdefault(key, [0, index, []])
        g[0] += weight
        g[2].append(index)
    load = [0] * shards
    where = [0] * len(keys)
    for weight, first, members in sorted(groups.values(), key=lambda g: (-g[0], g[1])):
        target = min(range(shards), key=lambda s: (load[s], s))
        load[target] += weight
        for index in members:
            where[index] = target
    return where


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: split only the tests that will run
def pytest_collection_modifyitems(config, items):
    spec = shard_spec(os.environ.get("GPU_CHECK_SHARD"))
    if spec is None:
        return
    mine, shards = spec
    keys = [_group_key(item, i) for i, item in enumerate(items)]
    weights = [HEAVY if "tmp_path" in getattr(item, "fixturenames", ()) else 1 for item in items]
    where = split(keys, weights, shards)
    keep = [item for item, s in zip(items, where) if s == mine]
    drop = [item for item, s in zip(items, where) if s != mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_report_header(config):
    value = os.environ.get("GPU_CHECK_SHARD")
    return f"gpu_check shard {value}" if value else None
