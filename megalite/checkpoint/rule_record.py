"""The update rule a checkpoint was written with: its record in metadata.json, read back.

A save writes ``"update_rule": rule.record()`` (:meth:`megalite.data_parallel.update_rule.
UpdateRule.record`): the rule's name and its state tensors (name, dtype, bytes per
parameter), in order. Readers take the optimizer-state kinds a checkpoint holds from that
record, never from a constant: a checkpoint written with another rule is resharded, converted
and loaded with *its* state. A checkpoint older than the record was written by AdamW, the only
rule there was, and reads as AdamW's record.

A state the rule keeps for its non-matrix parameters only (Muon's ``exp_avg_sq``) is marked
``"held_by": "non-matrix"`` in the record, and the checkpoint holds no piece of it for a matrix
(:func:`partial_states`: the tools copy what is there). A load reads, per parameter, only the
state the run's rule keeps for it, so a Muon checkpoint written before that split (an
``exp_avg_sq`` piece for every parameter, zero and unused on the matrices, and no mark) loads
unchanged: its matrices' ``exp_avg_sq`` pieces are not read.

Loading the optimizer state of a checkpoint into a run whose rule differs (another name or other
state tensors) is refused before any tensor is read (:func:`check_update_rule`); a run that
loads the weights only (``--finetune``, ``--no-load-optim``, a weights-only checkpoint) starts
its own rule's state fresh and is not refused.
"""
from __future__ import annotations

import os

from megalite.checkpoint.format import CheckpointError
from megalite.data_parallel.update_rule import ADAMW, MASTER_KIND

RULE_KEY = "update_rule"  # metadata.json's key for the record
BEFORE_THE_RECORD = ADAMW  # what a checkpoint without the record was written with


def saved_rule_record(meta: dict, directory: str = "") -> dict:
    """The checkpoint's rule record (AdamW's for a checkpoint that predates it), checked for shape."""
    record = meta.get(RULE_KEY)
    if record is None:
        return BEFORE_THE_RECORD.record()
    ok = (isinstance(record, dict) and isinstance(record.get("name"), str) and isinstance(record.get("state"), list)
          and all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in record["state"]))
    if not ok:
        where = os.path.join(directory, "metadata.json") if directory else "metadata.json"
        raise CheckpointError(f"{where}: the {RULE_KEY!r} record is corrupt ({record!r:.80}).")
    return record


def saved_state_names(meta: dict, directory: str = "") -> tuple[str, ...]:
    """The optimizer-state tensors the checkpoint holds per parameter, in its rule's order."""
    return tuple(s["name"] for s in saved_rule_record(meta, directory)["state"])


def saved_kinds(meta: dict, directory: str = "") -> tuple[str, ...]:
    """What the checkpoint stores per parameter: the master weights, then its rule's state tensors."""
    return (MASTER_KIND, *saved_state_names(meta, directory))


def partial_states(meta: dict, directory: str = "") -> frozenset[str]:
    """The state tensors the checkpoint holds for some parameters only (``"held_by"`` in its record)."""
    return frozenset(s["name"] for s in saved_rule_record(meta, directory)["state"] if s.get("held_by"))


def _describe(record: dict) -> str:
    names = [s["name"] for s in record["state"]]
    return f"{record['name']!r} (state: {', '.join(names) if names else 'none'})"


def check_update_rule(meta: dict, rule, with_optim: bool, directory: str = "") -> None:
    """Refuse to load optimizer state written by another update rule than the run's ``rule``
    (another name, or other state tensors); nothing to check when only weights are loaded."""
    if not with_optim:
        return
    saved = saved_rule_record(meta, directory)
    if saved["name"] == rule.name and saved_state_names(meta, directory) == tuple(rule.state_names):
        return
    where = f"checkpoint {directory!r}" if directory else "the checkpoint"
    raise CheckpointError(f"{where} holds the optimizer state of update rule {_describe(saved)}, but this run "
                          f"steps with {_describe(rule.record())}: one rule's state cannot continue the other. "
                          f"Fix: --finetune or --no-load-optim to load the weights only and start a fresh "
                          f"optimizer, or run with the checkpoint's update rule.")
