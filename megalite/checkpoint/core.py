"""Save and load training checkpoints (see :mod:`megalite.checkpoint.format`).

Save, atomically: every rank writes its files into ``iter_N.tmp``; after a barrier rank 0
writes ``metadata.json``, fsyncs, renames the directory to ``iter_N``, then rewrites the
``latest`` pointer (write + rename) and deletes checkpoints beyond ``keep_last``. A crash at
any point leaves ``latest`` on the previous complete checkpoint. Given the run's tokenizer,
rank 0 also copies its files into ``iter_N.tmp/tokenizer`` and records it in metadata.json
(:func:`megalite.checkpoint.format.write_tokenizer`), so the checkpoint generates text alone.
A save is staging (:func:`rank_state`, :func:`checkpoint_metadata`) then writing
(:func:`~megalite.checkpoint.format.write_rank_files`) and committing (:func:`commit_checkpoint`);
:func:`save_checkpoint` runs them in turn, :mod:`megalite.checkpoint.async_save` runs the
writing and committing on a background thread (``--async-save``), with the same bytes.

Load (``--load DIR``: its 'latest'; ``--load DIR --ckpt-step N`` or ``--load DIR/iter_N``:
that iteration, see :func:`megalite.checkpoint.format.resolve_checkpoint`): every rank fills
its optimizer shards (fp32 master weights, the update rule's state: per parameter the state
tensors the rule keeps for it, :meth:`megalite.data_parallel.zero.DistributedOptimizer.state_piece`)
from the full tensors of the checkpoint, cut for *its* layout, then publishes the weights to the model; optimizer state
written by another rule is refused first (:mod:`megalite.checkpoint.rule_record`). With the same layout it also restores its RNG streams, so a resumed run repeats the
uninterrupted one bit for bit.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from megalite import __version__
from megalite.checkpoint.format import (FORMAT_VERSION, VOCAB_PARAMS, CheckpointError, PieceReader,
                                        fsync_path, iteration_dir, resolve_checkpoint, same_layout,
                                        write_json_atomic, write_rank_files, write_tokenizer)
from megalite.config import ModelConfig
from megalite.data_parallel.update_rule import MASTER_KIND
from megalite.device import host_barrier
from megalite.checkpoint.expert_bias import KIND as BIAS_KIND
from megalite.checkpoint.expert_bias import expert_biases, load_expert_biases
from megalite.checkpoint.names import global_pieces
from megalite.checkpoint.rule_record import RULE_KEY, check_update_rule
from megalite.checkpoint.settings import SHAPE_FIELDS, carry_forward
from megalite.layers.fp8 import fp8_state, load_fp8_state
from megalite.parallel.random import get_rng_tracker
from megalite.parallel.sharding import is_expert, is_tensor_parallel, shard_tensor
from megalite.resilience.fault_injection import active as active_faults

def _barrier(grid=None):
    host_barrier(grid)  # a host-side wait: the gloo control group under NCCL


def _coords(grid):
    if grid is None:
        return dict(rank=0, tp_rank=0, tp_size=1, dp_rank=0, cp_rank=0, edp_rank=0, world=1,
                    layout=dict(tp=1, cp=1, dp=1, pp=1))
    return dict(rank=grid.rank, tp_rank=grid.tp_rank, tp_size=grid.layout.tp, dp_rank=grid.dp_rank,
                cp_rank=grid.cp_rank, edp_rank=grid.edp_rank, world=grid.layout.world_size,
                layout=grid.layout.record())


def _param_ranges(optimizer):
    """(bucket index, param, global name, global shape, [a, z) within that global tensor's
    flat (TP-local) values, offset in the bucket shard): one entry per global tensor a
    parameter holds in this rank's shard (a stacked expert parameter holds several)."""
    names = {p: n for c in optimizer.chunks for n, p in c.named_parameters()}
    for i, b in enumerate(optimizer.sync.buckets):
        lo, hi = b.shard
        for p, (start, numel) in zip(b.params, b.offsets):
            for name, g0, gn, shape in global_pieces(names[p], p):
                a, z = max(start + g0, lo), min(start + g0 + gn, hi)
                if a < z:
                    yield i, p, name, shape, (a - start - g0, z - start - g0), a - lo


def _owns(p, c, stage) -> bool:
    """Whether this rank writes parameter p's pieces (each value written exactly once)."""
    if is_expert(p):  # each EP rank holds other experts; EDP ranks hold copies (or ZeRO shards)
        return stage >= 1 or c["edp_rank"] == 0
    if getattr(p, "embedding_copy", False):
        return False  # the first stage writes the tied embedding
    if not is_tensor_parallel(p) and c["tp_rank"] != 0:
        return False  # replicated over TP: TP rank 0 writes it
    if c["cp_rank"] != 0:
        return False
    return stage >= 1 or c["dp_rank"] == 0  # ZeRO shards differ per DP rank; DDP replicas do not


def _split_of(p):
    split = getattr(p, "tp_split", None)
    return [split.dim, split.sections] if split is not None else None


def rank_state(optimizer, grid) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's part of a checkpoint: ``{key: tensor}`` (views of the optimizer's fp32
    states, where they are fp32: nothing is copied here) and the pieces that describe them,
    plus its RNG streams. The staging step of a save (sync: written from these; async: first
    copied into host buffers, :mod:`megalite.checkpoint.async_save`)."""
    c = _coords(grid)
    tensors, pieces = {}, []
    for i, p, name, shape, (a, z), offset in _param_ranges(optimizer):
        if not _owns(p, c, optimizer.stage):
            continue
        for kind in optimizer.rule.checkpoint_kinds:
            values = optimizer.state_piece(kind, i, offset, z - a)
            if values is None:  # a state the rule keeps not for this parameter (a Muon matrix's exp_avg_sq)
                continue
            key = f"{kind}/{name}/tp{c['tp_rank']}/{a}"
            tensors[key] = values.float()
            pieces.append({"key": key, "name": name, "kind": kind, "tp_rank": c["tp_rank"],
                           "tp_size": c["tp_size"], "split": _split_of(p), "local_shape": list(shape),
                           "range": [a, z]})
    if c["tp_rank"] == c["cp_rank"] == c["dp_rank"] == 0:  # FP8 scaling state, expert biases: equal over the stage
        for chunk in optimizer.chunks:
            _add_fp8_pieces(chunk, tensors, pieces)
            _add_bias_pieces(chunk, tensors, pieces)
    for key, value in get_rng_tracker().state_dict().items():
        tensors[f"rng/{key}"] = value
    return tensors, pieces


def checkpoint_metadata(iteration: int, optimizer, scaler, config, grid, consumed_samples: int) -> dict:
    """metadata.json's values known at the save point (an asynchronous save takes them then, as
    training goes on during its write); :func:`commit_checkpoint` adds the rest."""
    return {"format_version": FORMAT_VERSION, "megalite_version": __version__, "iteration": iteration,
            "consumed_samples": consumed_samples, "config": config.to_dict(), "layout": _coords(grid)["layout"],
            "zero_stage": optimizer.stage, "optimizer_step": optimizer.step_count, RULE_KEY: optimizer.rule.record(),
            "loss_scaler": scaler.state_dict() if scaler is not None else None}


def prepare_save(root: str, iteration: int, grid) -> tuple[str, str]:
    """(final directory, its ``.tmp``): rank 0 empties the tmp directory (a crashed save's
    leftovers), then every rank waits for it (a host barrier, on the calling thread)."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if _coords(grid)["rank"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(grid)
    return final, tmp


def commit_checkpoint(root: str, final: str, meta: dict, config, tokenizer=None, keep_last: int | None = None,
                      extra_meta: dict | None = None) -> None:
    """Rank 0, once every rank's files are in ``final``.tmp: metadata.json (``meta`` from
    :func:`checkpoint_metadata`, the files' list, the tokenizer and source records, then
    ``extra_meta``: the loop's data position), fsync, rename to ``final``, then the ``latest``
    pointer (write + rename) and pruning beyond ``keep_last``. Shared by the synchronous and the
    asynchronous save, so both write the same bytes."""
    tmp = final + ".tmp"
    files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
    recorded = {"tokenizer": write_tokenizer(tmp, tokenizer)} if tokenizer is not None else {}
    write_json_atomic(os.path.join(tmp, "metadata.json"), {
        **meta, "files": files, "weights_only": False, "source": carry_forward(config, tmp), **recorded,
        **(extra_meta or {})})
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_path(root)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(str(meta["iteration"]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    if keep_last:
        _prune(root, keep_last)


def save_checkpoint(root: str, iteration: int, optimizer, scaler, config, grid, consumed_samples: int,
                    keep_last: int | None = None, tokenizer=None, extra_meta: dict | None = None) -> str:
    """Write iteration ``iteration``'s checkpoint under ``root`` (synchronously: every rank
    returns once it is committed); returns its directory. ``tokenizer``: the run's, recorded
    with its files (none given: no tokenizer record); ``extra_meta``: merged into metadata.json."""
    final, tmp = prepare_save(root, iteration, grid)
    tensors, pieces = rank_state(optimizer, grid)
    write_rank_files(tmp, _coords(grid)["rank"], tensors, pieces)
    active_faults().during_save(iteration)  # kill-during-save: files written, nothing committed
    _barrier(grid)
    if _coords(grid)["rank"] == 0:
        meta = checkpoint_metadata(iteration, optimizer, scaler, config, grid, consumed_samples)
        commit_checkpoint(root, final, meta, config, tokenizer, keep_last, extra_meta)
    _barrier(grid)
    return final


def _add_fp8_pieces(chunk, tensors: dict, pieces: list) -> None:
    """transformer-engine's FP8 scales and amax histories (kind ``fp8``, replicated, named by
    module: ``layers.3.attn.qkv.fp8.scaling_fwd.amax_history``); none for local layers."""
    for name, t in fp8_state(chunk).items():
        key = f"fp8/{name}"
        tensors[key] = t.reshape(-1)
        pieces.append({"key": key, "name": name, "kind": "fp8", "tp_rank": 0, "tp_size": 1, "split": None,
                       "local_shape": list(t.shape), "range": [0, t.numel()]})


def _add_bias_pieces(chunk, tensors: dict, pieces: list) -> None:
    """The routers' expert biases (kind ``expert_bias``, replicated, :mod:`megalite.checkpoint.expert_bias`)."""
    for name, t in expert_biases(chunk).items():
        key = f"{BIAS_KIND}/{name}"
        tensors[key] = t.detach().float().reshape(-1).clone()
        pieces.append({"key": key, "name": name, "kind": BIAS_KIND, "tp_rank": 0, "tp_size": 1, "split": None,
                       "local_shape": list(t.shape), "range": [0, t.numel()]})


def _prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("iter_") and not d.endswith(".tmp"))
    for d in done[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def check_config(saved: dict, model_config) -> None:
    """Refuse a checkpoint whose model shape differs from the run's, listing every difference."""
    defaults = ModelConfig()  # a field a checkpoint predates has its default value
    fields = [f for f in SHAPE_FIELDS
              if not (f == "max_position_embeddings" and model_config.position_embedding_type == "rope")]
    diffs = [f"{f}: checkpoint {saved.get(f, getattr(defaults, f))!r}, run {getattr(model_config, f)!r}"
             for f in fields if saved.get(f, getattr(defaults, f)) != getattr(model_config, f)]
    if diffs:
        raise CheckpointError("the checkpoint's model does not match this run's config:\n  "
                              + "\n  ".join(diffs) + "\nFix: use the checkpoint's model flags.")


def _local_values(reader: PieceReader, p, name: str, shape, kind: str, vocab_size: int, c) -> torch.Tensor:
    """This rank's TP shard of global tensor ``name`` (flattened), for its own layout;
    ``shape``: that shard's shape (the parameter's, or one expert's)."""
    full = reader.full_tensor(name, kind, vocab_size)
    if name in VOCAB_PARAMS:
        padded_rows = getattr(p, "full_shape", p.shape)[0]
        full = torch.cat([full, torch.zeros(padded_rows - full.shape[0], *full.shape[1:])])
    split = getattr(p, "tp_split", None)
    local = shard_tensor(full, split, c["tp_rank"], c["tp_size"]) if split is not None else full
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(f"parameter {name!r}: checkpoint gives shape {tuple(local.shape)} for this "
                              f"rank, the model has {tuple(shape)}.")
    return local.reshape(-1)


def finish_optimizer_load(meta: dict, optimizer, scaler, with_optim: bool) -> None:
    """After the shards are filled (either format): the optimizer's step count and the loss
    scale, or, loading weights only, zero optimizer state (the update rule's) and step 0; then the weights go to the
    model (``publish``: fp32 masters cast into the model's dtype, ZeRO shards all-gathered)."""
    if with_optim:
        optimizer.step_count = meta["optimizer_step"]
        if scaler is not None and meta.get("loss_scaler"):
            scaler.load_state_dict(meta["loss_scaler"])
    else:
        for shards in optimizer.state.values():
            for shard in shards:
                shard.zero_()
        optimizer.step_count = 0
    optimizer.publish()


def files_to_read(reader: PieceReader, optimizer, kinds, fp8: bool, rng_file: str | None) -> list[str]:
    """The files of the checkpoint this rank reads: those holding pieces of its parameters
    (every TP rank's pieces of a split tensor: the full tensor is assembled, then cut), the
    FP8 state's, and its own RNG file."""
    files = {rng_file} if rng_file else set()
    for _, _, name, _, _, _ in _param_ranges(optimizer):
        for kind in kinds:
            files.update(f for f, _ in reader.index.get((name, kind), ()))
    for name in reader.names("fp8") if fp8 else ():
        files.update(f for f, _ in reader.index[(name, "fp8")])
    if any(expert_biases(chunk) for chunk in optimizer.chunks):
        for name in reader.names(BIAS_KIND):
            files.update(f for f, _ in reader.index[(name, BIAS_KIND)])
    return sorted(files)


def verify_files(reader: PieceReader, files: list[str]) -> str | None:
    """The first fault of ``files`` (checksum, safetensors header), or None: each is checked
    once, before any tensor is read."""
    for name in files:
        try:
            reader._file(name)
        except CheckpointError as e:
            return str(e)
    return None


def agree_on_fault(fault: str | None, grid) -> None:
    """One collective (an all-gather of each rank's fault, on the gloo control group): when any
    rank found one, every rank raises the lowest rank's, so rank 0 reports it at once, and no
    rank reports "loaded" while another cannot load. Without a world (or in a dry run's fake
    one, where this process is the only rank), this rank's own."""
    found = [fault]
    if grid is not None and dist.is_initialized() and grid.layout.world_size > 1 and dist.get_backend() != "fake":
        found = [None] * grid.layout.world_size
        dist.all_gather_object(found, fault, group=grid.control_group)
    faulty = [(rank, text) for rank, text in enumerate(found) if text]
    if faulty:
        rank, text = faulty[0]
        raise CheckpointError(text + (f" (found by rank {rank})" if len(found) > 1 else ""))


def load_checkpoint(root: str, optimizer, scaler, config, grid, load_optimizer: bool = True,
                    load_rng: bool = True, iteration: int | None = None, finetune: bool = False) -> dict:
    """Fill the optimizer (and through it the model) from a checkpoint; return its metadata.
    ``finetune`` (Megatron's ``--finetune``): the weights only, no optimizer state, no RNG."""
    if finetune:
        load_optimizer = load_rng = False
    c = _coords(grid)
    reader = PieceReader(resolve_checkpoint(root, iteration))  # root, root + iteration, or an iter_N directory
    meta = reader.metadata
    check_config(meta["config"]["model"], config.model)
    vocab = config.model.vocab_size
    with_optim = load_optimizer and not meta.get("weights_only")
    check_update_rule(meta, optimizer.rule, with_optim, reader.directory)  # before any file is read
    kinds = optimizer.rule.checkpoint_kinds if with_optim else (MASTER_KIND,)
    rng_file = f"rank{c['rank']:05d}.safetensors"
    read_rng = load_rng and same_layout(meta["layout"], c["layout"]) and rng_file in reader.descriptions
    fp8 = config.model.fp8_format is not None
    agree_on_fault(verify_files(reader, files_to_read(reader, optimizer, kinds, fp8, rng_file if read_rng else None)),
                   grid)  # every rank's files are sound, or every rank stops with the first fault found
    for i, p, name, shape, (a, z), offset in _param_ranges(optimizer):
        for kind in kinds:
            target = optimizer.state_piece(kind, i, offset, z - a)
            if target is None:  # not kept for this parameter (a checkpoint may hold it: read only what the run keeps)
                continue
            target.copy_(_local_values(reader, p, name, shape, kind, vocab, c)[a:z])
    finish_optimizer_load(meta, optimizer, scaler, with_optim)
    fp8_names = reader.names("fp8")
    if fp8_names and fp8:  # any layout: the state is the stage's
        saved = {n: reader.full_tensor(n, "fp8") for n in fp8_names}
        meta["fp8_modules_restored"] = sum(load_fp8_state(chunk, saved) for chunk in optimizer.chunks)
    if any(expert_biases(chunk) for chunk in optimizer.chunks):  # any layout: the stage's layers, whole
        saved = {n: reader.full_tensor(n, BIAS_KIND) for n in reader.names(BIAS_KIND)}
        meta["expert_biases_restored"] = sum(load_expert_biases(chunk, saved) for chunk in optimizer.chunks)
    rng = {}
    if read_rng:
        handle = reader._file(rng_file)
        rng = {k[len("rng/"):]: handle.get_tensor(k) for k in handle.keys() if k.startswith("rng/")}
    if rng:  # same layout: every rank continues its own random streams
        get_rng_tracker().load_state_dict(rng)
    meta["rng_restored"] = bool(rng)
    meta["rng_note"] = rng_note(meta, c["layout"], load_rng, bool(rng), "--finetune" if finetune else "--no-load-rng")
    meta["directory"] = reader.directory
    return meta


def _layout_text(layout: dict) -> str:
    dims = [d for d in ("tp", "cp", "dp", "pp") if d != "cp" or layout.get("cp", 1) > 1]
    return " ".join([f"{d.upper()}{layout.get(d, 1)}" for d in dims]
                    + ([f"EP{layout['ep']}"] if layout.get("ep", 1) > 1 else []))


def rng_note(meta: dict, current: dict, load_rng: bool, restored: bool, not_loaded_by: str = "--no-load-rng") -> str:
    """What happened to the random streams at load, and why, for the log."""
    if restored:
        return "RNG: restored"
    if not load_rng:
        return f"RNG: reseeded ({not_loaded_by})"
    hf = (meta.get("source") or {}).get("format") == "huggingface"
    writer = ("reshard_checkpoint" if meta.get("resharded_from") else None if not meta.get("weights_only") else
              "tools/convert_hf.py (imported from Hugging Face, weights only)" if hf
              else "save_weights_checkpoint (weights only)")
    if writer:
        return f"RNG: reseeded (the checkpoint carries no RNG state: written by {writer})"
    if not same_layout(meta["layout"], current):
        return f"RNG: reseeded: layout changed from {_layout_text(meta['layout'])} to {_layout_text(current)}"
    return "RNG: reseeded (the checkpoint carries no RNG state for this rank)"
