"""``--ckpt-format torch_dcp``: checkpoints through ``torch.distributed.checkpoint`` (DCP).

The state dict uses megalite's global names: ``weight/<name>`` (fp32 master weights),
then one key per state tensor of the update rule (AdamW: ``exp_avg/<name>``, ``exp_avg_sq/<name>``,
the Adam moments; metadata.json's ``update_rule`` record names them; a state the rule keeps for
some parameters only, Muon's ``exp_avg_sq``, has keys for those only), ``fp8/<module>.<state>``
(transformer-engine's scaling state, if any), ``expert_bias/<module>`` (the routers' expert
biases, :mod:`megalite.checkpoint.expert_bias`) and ``rng/rankXXXXX/<stream>`` (each rank's
random streams). Parameter tensors have their *global* shape, vocabulary rows unpadded, so
the files do not depend on the layout that wrote them: each rank contributes the pieces it
owns (the same ones it writes in megalite's format, :func:`megalite.checkpoint.core._owns`)
as boxes of the global tensor (:mod:`megalite.checkpoint.dcp_boxes`), several per tensor, in
a ``ShardedTensor``. Loading asks DCP for the boxes of the *reader's* layout: DCP reads the
overlapping parts of the stored chunks, so any layout loads any other, and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns the directory into one
``torch.save`` file of full tensors under those names.

The directory layout is megalite's: ``iter_N`` written as ``iter_N.tmp`` (DCP's
``__R_0.distcp`` files and its ``.metadata``), committed by rank 0 after every rank's files
and DCP's ``.metadata`` are on disk: ``metadata.json`` (megalite's, with
``"ckpt_format": "torch_dcp"``: config, layout, optimizer step, loss scaler, data position),
rename to ``iter_N``, ``latest``, ``keep_last``. ``resolve_checkpoint``, ``--ckpt-step`` and
``checkpoint_config`` work unchanged. DCP's ``.metadata`` is a *pickle*: load DCP
checkpoints only from trusted sources (megalite's own format pickles nothing).

Why ``ShardedTensor`` and not ``DTensor``: a ZeRO rank's piece is a flat range, which is
several boxes of the global tensor, and a DTensor holds one box per rank. The ShardedTensor
is built without its cross-rank checks (they need every rank's boxes, and at load replicas
overlap); DCP itself checks at save that the chunks of each tensor cover it exactly once.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalite.checkpoint.core import (_barrier, _coords, _param_ranges, check_config, finish_optimizer_load,
                                      rng_note)
from megalite.checkpoint.dcp_async import AsyncDcpSaver
from megalite.checkpoint.dcp_offline import read_dcp_index, read_errors
from megalite.checkpoint.dcp_state import (_rank_boxes, checkpoint_metadata, commit, dcp_group, dcp_state_dict,
                                           prepare_tmp, sharded)
from megalite.checkpoint.rule_record import check_update_rule
from megalite.checkpoint.format import (VOCAB_PARAMS, CheckpointError, iteration_dir, resolve_checkpoint,
                                        same_layout)
from megalite.data_parallel.update_rule import MASTER_KIND
from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import expert_biases, load_expert_biases
from megalite.layers.fp8 import load_fp8_state
from megalite.parallel.random import get_rng_tracker

__all__ = ["AsyncDcpSaver", "load_dcp_checkpoint", "save_dcp_checkpoint"]


def save_dcp_checkpoint(root: str, iteration: int, optimizer, scaler, config, grid, consumed_samples: int,
                        keep_last: int | None = None, tokenizer=None, extra_meta: dict | None = None) -> str:
    """Write iteration ``iteration``'s checkpoint under ``root`` through DCP; returns its
    directory (the arguments are :func:`megalite.checkpoint.core.save_checkpoint`'s)."""
    from megalite.resilience.fault_injection import active

    c = _coords(grid)
    final = iteration_dir(root, iteration)
    tmp = prepare_tmp(final, c["rank"], grid)
    group = dcp_group(grid)
    state = dcp_state_dict(optimizer, c, config.model.vocab_size, group)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group, no_dist=group is None)
    active().during_save(iteration)
    _barrier(grid)
    if c["rank"] == 0:
        commit(root, tmp, final, checkpoint_metadata(iteration, optimizer, scaler, config, c, consumed_samples,
                                                     extra_meta), config, tokenizer, keep_last)
    _barrier(grid)
    return final


def _read_metadata(directory: str) -> tuple[dict, dict]:
    """(megalite's metadata.json, DCP's {key: storage metadata})."""
    try:
        with open(os.path.join(directory, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}/metadata.json: unreadable ({e}): the checkpoint's metadata is "
                              f"corrupt.") from None
    return meta, read_dcp_index(directory)


def load_dcp_checkpoint(root: str, optimizer, scaler, config, grid, load_optimizer: bool = True,
                        load_rng: bool = True, iteration: int | None = None, finetune: bool = False) -> dict:
    """:func:`megalite.checkpoint.core.load_checkpoint` for a torch_dcp checkpoint: DCP reads
    the boxes of this rank's layout (any layout); same arguments, same returned metadata."""
    if finetune:
        load_optimizer = load_rng = False
    c = _coords(grid)
    directory = resolve_checkpoint(root, iteration)
    meta, stored = _read_metadata(directory)
    check_config(meta["config"]["model"], config.model)
    vocab = config.model.vocab_size
    with_optim = load_optimizer and not meta.get("weights_only")
    check_update_rule(meta, optimizer.rule, with_optim, directory)  # before DCP reads anything
    kinds = optimizer.rule.checkpoint_kinds if with_optim else (MASTER_KIND,)
    group = dcp_group(grid)
    rank = dist.get_rank() if group is not None else 0
    targets = _rank_boxes(optimizer, c, vocab, kinds, owned_only=False)
    state, fills = {}, []
    for (kind, name), (gshape, boxes) in targets.items():
        key = f"{kind}/{name}"
        md = stored.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {directory!r} has no {kind!r} for parameter {name!r}.")
        if list(md.size) != list(gshape):
            raise CheckpointError(f"parameter {name!r}: the checkpoint's {kind} has shape {tuple(md.size)}, "
                                  f"the model's is {tuple(gshape)}.")
        fresh = [(g, torch.empty(view.shape)) for g, view in boxes]  # DCP reads into these, then we copy
        fills += [(view, t) for (_, view), (_, t) in zip(boxes, fresh)]
        state[key] = sharded(gshape, fresh, rank, group)
    rng_keys = {}
    prefix = f"rng/rank{c['rank']:05d}/"
    if load_rng and same_layout(meta["layout"], c["layout"]):
        rng_keys = {k[len(prefix):]: k for k in stored if k.startswith(prefix)}
    fp8_keys = [k for k in stored if k.startswith("fp8/")] if config.model.fp8_format is not None else []
    bias_keys = ([k for k in stored if k.startswith(f"{BIAS_KIND}/")]
                 if any(expert_biases(chunk) for chunk in optimizer.chunks) else [])
    for k in list(rng_keys.values()) + fp8_keys + bias_keys:
        state[k] = torch.empty(list(stored[k].size), dtype=stored[k].properties.dtype)
    with read_errors(directory):
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), process_group=group, no_dist=group is None)
    for i, _, name, _, (a, z), offset in _param_ranges(optimizer):
        if name in VOCAB_PARAMS:  # the padding rows (in no box) are zero, as in core's load
            for kind in kinds:
                target = optimizer.state_piece(kind, i, offset, z - a)
                if target is not None:
                    target.zero_()
    for view, loaded in fills:
        view.copy_(loaded)
    if bias_keys:  # any layout: the stage's layers, whole (megalite.checkpoint.expert_bias)
        saved = {k[len(BIAS_KIND) + 1:]: state[k] for k in bias_keys}
        meta["expert_biases_restored"] = sum(load_expert_biases(chunk, saved) for chunk in optimizer.chunks)
    return _finish(meta, directory, state, rng_keys, fp8_keys, optimizer, scaler, config, c, with_optim,
                   load_rng, finetune)


def _finish(meta, directory, state, rng_keys, fp8_keys, optimizer, scaler, config, c, with_optim, load_rng,
            finetune) -> dict:
    finish_optimizer_load(meta, optimizer, scaler, with_optim)
    if fp8_keys:
        saved = {k[len("fp8/"):]: state[k] for k in fp8_keys}
        meta["fp8_modules_restored"] = sum(load_fp8_state(chunk, saved) for chunk in optimizer.chunks)
    rng = {stream: state[k] for stream, k in rng_keys.items()}
    if rng:
        get_rng_tracker().load_state_dict(rng)
    meta["rng_restored"] = bool(rng)
    meta["rng_note"] = rng_note(meta, c["layout"], load_rng, bool(rng), "--finetune" if finetune else "--no-load-rng")
    meta["directory"] = directory
    return meta
