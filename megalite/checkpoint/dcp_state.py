"""The save side of the torch_dcp format (see :mod:`megalite.checkpoint.dcp`): this rank's
state dict of ShardedTensors, megalite's metadata.json, the commit. Shared by the synchronous
save and :class:`megalite.checkpoint.dcp_async.AsyncDcpSaver`."""
from __future__ import annotations

import os
import shutil
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

from megalite import __version__
from megalite.checkpoint.core import _barrier, _owns, _param_ranges, _prune, _split_of
from megalite.checkpoint.dcp_boxes import global_shape, piece_boxes
from megalite.checkpoint.dcp_offline import CKPT_FORMAT
from megalite.checkpoint.format import FORMAT_VERSION, fsync_path, write_json_atomic, write_tokenizer
from megalite.checkpoint.rule_record import RULE_KEY
from megalite.host_memory import HostBuffer
from megalite.checkpoint.settings import carry_forward
from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import expert_biases
from megalite.layers.fp8 import fp8_state
from megalite.parallel.random import get_rng_tracker

warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)


def dcp_group(grid):
    """The process group DCP coordinates on: the grid's gloo control group (host values, so
    under NCCL too); None without a world (DCP then runs without collectives)."""
    if grid is None or not dist.is_initialized():
        return None
    return getattr(grid, "control_group", None) or dist.group.WORLD


def sharded(shape, boxes, rank: int, group) -> ShardedTensor:
    """A ShardedTensor of global ``shape`` whose local shards are ``boxes`` ([(offsets, cpu
    tensor)]), built without the cross-rank checks (see the module docstring)."""
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])  # unused by DCP: it reads the shards
    st = ShardedTensorBase.__new__(ShardedTensor, spec, *shape, dtype=torch.float32, layout=torch.strided,
                                   pin_memory=False, requires_grad=False)
    # What ShardedTensor._prepare_init sets, without its default-group lookup (no world: group None).
    st._init_rrefs, st._sharded_tensor_id, st._process_group, st._remote_shards = False, None, group, {}
    st._local_shards = [Shard(t, ShardMetadata(list(g), list(t.shape), f"rank:{rank}/cpu")) for g, t in boxes]
    return st


def _rank_boxes(optimizer, c, vocab: int, kinds, owned_only: bool):
    """{(kind, name): (global shape, [(offsets, view of the optimizer state)])} for this rank: each
    kind a parameter keeps (:meth:`~megalite.data_parallel.zero.DistributedOptimizer.state_piece`)."""
    out: dict = {}
    for i, p, name, shape, (a, z), offset in _param_ranges(optimizer):
        if owned_only and not _owns(p, c, optimizer.stage):
            continue
        split = _split_of(p)
        for kind in kinds:
            values = optimizer.state_piece(kind, i, offset, z - a)
            if values is None:  # not kept for this parameter (a Muon matrix's exp_avg_sq): no key
                continue
            gshape = global_shape(name, shape, split, c["tp_size"], vocab)
            entry = out.setdefault((kind, name), (gshape, []))
            entry[1].extend(piece_boxes(name, list(shape), split, c["tp_rank"], c["tp_size"], a, z, vocab, values))
    return out


def _box_views(boxes: dict):
    """((kind, name, offsets), view) for every box, in a fixed order."""
    for (kind, name), (_, pieces) in boxes.items():
        for g, view in pieces:
            yield (kind, name, tuple(g)), view


def dcp_state_dict(optimizer, c, vocab: int, group, buffers: HostBuffer | None = None) -> dict:
    """The state dict this rank saves: copies of its boxes (into ``buffers``, one host buffer
    reused across saves and page-locked on a GPU, when given), its FP8 state and expert biases
    (the stage's TP/CP/DP rank 0) and its RNG streams."""
    rank = c["rank"]
    boxes = _rank_boxes(optimizer, c, vocab, optimizer.rule.checkpoint_kinds, owned_only=True)
    if buffers is None:
        copies = {key: torch.empty(view.shape, dtype=torch.float32) for key, view in _box_views(boxes)}
    else:
        layout = [(key, tuple(view.shape), torch.float32) for key, view in _box_views(boxes)]
        copies = buffers.views(layout, pinned=optimizer.device.type == "cuda")
    state = {}
    for (kind, name), (gshape, pieces) in boxes.items():
        staged = []
        for g, view in pieces:
            buf = copies[(kind, name, tuple(g))]
            buf.copy_(view, non_blocking=False)
            staged.append((g, buf))
        if staged:
            state[f"{kind}/{name}"] = sharded(gshape, staged, dist.get_rank() if group else rank, group)
    if c["tp_rank"] == c["cp_rank"] == c["dp_rank"] == 0:
        for chunk in optimizer.chunks:
            for name, t in fp8_state(chunk).items():
                state[f"fp8/{name}"] = t.detach().float().cpu().clone()
            for name, t in expert_biases(chunk).items():  # megalite.checkpoint.expert_bias
                state[f"{BIAS_KIND}/{name}"] = t.detach().float().cpu().clone()
    for key, value in get_rng_tracker().state_dict().items():
        state[f"rng/rank{rank:05d}/{key}"] = value.detach().cpu().clone()
    return state


def checkpoint_metadata(iteration, optimizer, scaler, config, c, consumed_samples, extra_meta=None) -> dict:
    """megalite's metadata.json for a torch_dcp checkpoint (taken at the save, not at the commit)."""
    return {"format_version": FORMAT_VERSION, "ckpt_format": CKPT_FORMAT, "megalite_version": __version__,
            "iteration": iteration, "consumed_samples": consumed_samples, "config": config.to_dict(),
            "layout": c["layout"], "zero_stage": optimizer.stage, "optimizer_step": optimizer.step_count,
            RULE_KEY: optimizer.rule.record(),
            "loss_scaler": scaler.state_dict() if scaler is not None else None, "files": [],
            "weights_only": False, **(extra_meta or {})}


def commit(root: str, tmp: str, final: str, meta: dict, config, tokenizer=None, keep_last=None) -> None:
    """Rank 0, after every rank's files and DCP's .metadata: metadata.json, rename, latest, prune."""
    meta = dict(meta)
    if tokenizer is not None:
        meta["tokenizer"] = write_tokenizer(tmp, tokenizer)
    meta["source"] = carry_forward(config, tmp)
    write_json_atomic(os.path.join(tmp, "metadata.json"), meta)
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_path(root)
    write_latest(root, meta["iteration"])
    if keep_last:
        _prune(root, keep_last)


def write_latest(root: str, iteration: int) -> None:
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))


def prepare_tmp(final: str, rank: int, grid) -> str:
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(grid)
    return tmp
