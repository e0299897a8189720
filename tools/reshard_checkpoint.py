#!/usr/bin/env python
"""Convert a checkpoint to another layout, offline: no GPU, no process group.

    python tools/reshard_checkpoint.py --load SRC --save DST \\
        [--target-tensor-model-parallel-size T] [--target-pipeline-model-parallel-size P] \\
        [--target-num-layers-per-virtual-pipeline-stage K] \\
        [--target-data-parallel-size D] [--target-zero-stage Z] [--target-expert-model-parallel-size E] \\
        [--to-format {megalite,torch_dcp}]

A size not given is the source's. SRC is a --save root (its 'latest' iteration) or one
iteration directory (SRC/iter_0000010). The target layout is checked first, by the same rules
training applies (megalite.config.validate and the layers' own checks): a layout training would
refuse is refused here, naming the rule and the numbers, before anything is written. The result
is DST/iter_N (N: the source's iteration), written as a training save is (into iter_N.tmp,
renamed when complete), then DST/latest. DST must lie outside the source's checkpoint root (SRC,
or the root of the iteration SRC names) and not hold it; an existing iteration is never replaced.

For every rank of the target layout, one after another, it builds that rank's model shard
on the meta device (shapes only), assembles each of its parameters' full tensors from the
source pieces (master weights and the optimizer state of the update rule the source's
metadata.json records, e.g. AdamW's two moments; a state it keeps for some parameters only, as
Muon's ``exp_avg_sq``, for those), cuts the rank's tensor-parallel shard and,
with ZeRO (Z >= 1), the rank's 1/D of it, and writes the rank's file. Memory stays near one
full tensor plus one rank's file. The result loads under the target layout (or any other:
loading re-slices pieces whatever their layout). RNG states are not carried over (training
reseeds and says so); transformer-engine's FP8 scales and amax histories (replicated) are
copied into rank 0's file. Experts are stored one global tensor per expert
(``layers.3.mlp.experts.7.fc1.weight``): each expert-parallel rank writes its own experts
(expert-data-parallel rank 0, or its 1/EDP with ZeRO).

Formats: SRC is either format (megalite's or torch_dcp, told apart by its metadata.json);
``--to-format`` picks the result's (default: the source's). A torch_dcp result holds every
full tensor once, under megalite's names (``weight/<name>``, ``exp_avg/<name>``, ...), written
by DCP in this one process: it loads under any layout, so the target sizes only set the
layout recorded in its metadata.json, and the tool holds the whole state in memory while
DCP writes it. DCP's ``.metadata`` is a pickle: convert only checkpoints you trust.
"""
import argparse
import copy
import dataclasses
import os
import shutil
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpoint.dcp_offline import CKPT_FORMAT, DcpReader, is_dcp_checkpoint, write_full_checkpoint  # noqa: E402
from megalite.checkpoint.names import global_pieces  # noqa: E402
from megalite.checkpoint.format import (FORMAT_VERSION, TOKENIZER_DIR, VOCAB_PARAMS, CheckpointError,  # noqa: E402
                                        PieceReader, fsync_path, iteration_dir, resolve_checkpoint,
                                        write_json_atomic, write_rank_files)
from megalite.checkpoint.rule_record import RULE_KEY, partial_states, saved_kinds, saved_rule_record  # noqa: E402
from megalite.checkpoint.expert_bias import KIND as BIAS_KIND  # noqa: E402
from megalite.checkpoint.serial import model_config_from  # noqa: E402
from megalite.checkpoint.settings import CARRIED  # noqa: E402
from megalite.data_parallel.update_rule import MASTER_KIND  # noqa: E402
from megalite.config import Config, ConfigError, DataConfig, ParallelConfig, TrainConfig, validate  # noqa: E402
from megalite.parallel.comm import OfflineGroup  # noqa: E402
from megalite.parallel.grid import GridLayout  # noqa: E402
from megalite.parallel.sharding import shard_tensor  # noqa: E402
from megalite.pipeline.partition import build_model_chunks  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402

SOURCE = "source"  # --target-num-layers-per-virtual-pipeline-stage not given


def rank_chunks(config, layout: GridLayout, tp: int, pp: int, ep: int = 0):
    grid = types.SimpleNamespace(layout=layout, pp_rank=pp, tp_group=OfflineGroup(tp, layout.tp),
                                 ep_group=OfflineGroup(ep, layout.ep) if layout.ep > 1 else None)
    return build_model_chunks(config, grid, device=torch.device("meta"))


def _piece(name, kind, local, tp, tp_size, split, lo, hi):
    """(key, values, description) of elements [lo, hi) of this TP rank's shard ``local``."""
    key = f"{kind}/{name}/tp{tp}/{lo}"
    piece = {"key": key, "name": name, "kind": kind, "tp_rank": tp, "tp_size": tp_size,
             "split": [split.dim, split.sections] if split is not None else None,
             "local_shape": list(local.shape), "range": [lo, hi]}
    return key, local.reshape(-1)[lo:hi].clone(), piece


def _target_config(meta: dict, tp: int, pp: int, vp_layers, dp: int, zero: int, ep: int) -> Config:
    """The config the target layout trains under, checked by training's own rules. Settings a
    checkpoint does not fix (kernels, recomputation, offload, the batch) are the trainer's choice at
    load: they take neutral values here, so only what the layout itself rules out is refused."""
    saved = meta["config"]
    model = dataclasses.replace(model_config_from(saved["model"]), attention_backend="auto", fused_kernels=False,
                                recompute_granularity=None, tp_comm_overlap=False, moe_grouped_gemm=False)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers_per_virtual_pipeline_stage=vp_layers,
                              sequence_parallel=tp > 1 and bool(model.num_experts),  # MoE with TP needs it
                              expert_model_parallel_size=ep)
    train = TrainConfig(**{k: v for k, v in saved["train"].items() if k in TrainConfig.__dataclass_fields__})
    train.zero_stage, train.offload_optimizer = zero, False
    train.micro_batch_size, train.global_batch_size = 1, dp * pp  # any batch the trainer picks must fit
    config = Config(model, parallel, train, DataConfig(mock_data=True))
    try:
        validate(config, tp * pp * dp)
        for c in {(layout_coord.tp, layout_coord.pp, ep_rank) for layout_coord, ep_rank in _rank_coords(config, dp)}:
            rank_chunks(config, _layout(config, dp), *c)  # the layers' own checks (shapes on meta)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"the target layout {_describe(tp, pp, vp_layers, dp, zero, ep)} is one training "
                          f"refuses: {e}") from None
    train.micro_batch_size = saved["train"].get("micro_batch_size", 1)
    train.global_batch_size = saved["train"].get("global_batch_size")
    return config


def _layout(config: Config, dp: int) -> GridLayout:
    p = config.parallel
    return GridLayout(tp=p.tensor_model_parallel_size, cp=1, dp=dp, pp=p.pipeline_model_parallel_size,
                      ep=p.expert_model_parallel_size, experts=bool(config.model.num_experts))


def _rank_coords(config: Config, dp: int):
    layout = _layout(config, dp)
    return [(layout.coord(r), layout.expert_coord(r)[0]) for r in range(layout.world_size)]


def _describe(tp, pp, vp_layers, dp, zero, ep) -> str:
    return (f"TP{tp} PP{pp}" + (f" (VP {vp_layers} layers/stage)" if vp_layers else "") + f" DP{dp} ZeRO-{zero}"
            + (f" EP{ep}" if ep > 1 else ""))


def _inside(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent


def _source_root(load: str, src_dir: str) -> str:
    """The checkpoint root --load belongs to: the parent of an iteration directory it names
    (``ckpt/iter_0000010`` -> ``ckpt``), else --load itself."""
    name = os.path.basename(src_dir.rstrip(os.sep))
    named_iteration = os.path.realpath(load) == os.path.realpath(src_dir) and name.startswith("iter_")
    return os.path.dirname(src_dir.rstrip(os.sep)) if named_iteration else load


def _check_apart(load: str, dst: str, root: str) -> None:
    """Refuse a --save that is the source checkpoint's root, lies inside it or holds it: the result's
    iter_N and 'latest' would land among (or around) the source run's own checkpoints."""
    root_real, dst_real = os.path.realpath(root), os.path.realpath(dst)
    if _inside(dst_real, root_real):
        relation = "is" if dst_real == root_real else "lies inside"
    elif _inside(root_real, dst_real):
        relation = "holds"
    else:
        return
    beside = os.path.join(os.path.dirname(root_real), os.path.basename(root_real) + "_resharded")
    raise CheckpointError(f"--save {dst} {relation} the checkpoint root {root} of --load {load}: the result must "
                          f"lie outside the source checkpoint's root and not hold it (the source is never "
                          f"modified). Fix: --save a directory beside it, e.g. --save {beside}.")


def _check_destination(dst: str, out_dir: str) -> None:
    """Refuse a --save that would replace an existing iteration or is a file."""
    if os.path.exists(out_dir):
        raise CheckpointError(f"{out_dir} already exists; reshard_checkpoint never replaces a checkpoint. "
                              f"Fix: --save another directory, or remove that one first.")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"--save {dst} is a file, not a directory.")


FORMATS = ("megalite", CKPT_FORMAT)


def reshard(src: str, dst: str, tp=None, pp=None, vp_layers=SOURCE, dp=None, zero=None, ep=None,
            to_format: str | None = None) -> str:
    """Write ``src``'s checkpoint under ``dst`` for the target layout; sizes left None are the
    source's (``vp_layers``: the source's when PP is unchanged; None or 0: no interleaving).
    ``to_format``: megalite or torch_dcp (None: the source's)."""
    src_dir = resolve_checkpoint(src)
    _check_apart(src, dst, _source_root(src, src_dir))
    dcp_source = is_dcp_checkpoint(src_dir)
    reader = DcpReader(src_dir) if dcp_source else PieceReader(src_dir)
    to_format = to_format or (CKPT_FORMAT if dcp_source else "megalite")
    if to_format not in FORMATS:
        raise ConfigError(f"--to-format {to_format!r}: the formats are {', '.join(FORMATS)}.")
    meta = reader.metadata
    try:  # the fields read below, present and of the right kind
        then, saved = meta["layout"], meta["config"]
        source = {d: int(then.get(d, 1)) for d in ("tp", "pp", "dp", "ep")}
        source_vp = saved.get("parallel", {}).get("num_layers_per_virtual_pipeline_stage")
        dict(saved["model"]), dict(saved["train"]), int(meta.get("zero_stage", 0))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(src_dir, 'metadata.json')}: unexpected content ({e!r}): the "
                              f"checkpoint's metadata is corrupt.") from None
    tp, pp, dp, ep = tp or source["tp"], pp or source["pp"], dp or source["dp"], ep or source["ep"]
    zero = int(meta.get("zero_stage", 0)) if zero is None else zero
    if vp_layers == SOURCE:
        vp_layers = source_vp if pp == source["pp"] else None
    config = _target_config(meta, tp, pp, vp_layers or None, dp, zero, ep)
    model = config.model
    layout = _layout(config, dp)
    out_dir = iteration_dir(dst, meta["iteration"])
    _check_destination(dst, out_dir)
    batch = config.train.global_batch_size
    if batch and batch % (config.train.micro_batch_size * dp):
        print(f"reshard_checkpoint: note: the checkpoint's global batch {batch} is not a multiple of its micro "
              f"batch {config.train.micro_batch_size} x DP {dp}; train it with a --micro-batch-size that fits "
              f"(or a new --global-batch-size).", file=sys.stderr)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # The master weights and the state of the rule that wrote the source (its own record).
        kinds = saved_kinds(meta, src_dir) if not meta.get("weights_only") else (MASTER_KIND,)
        partial = partial_states(meta, src_dir)  # held for some parameters only (Muon's exp_avg_sq)
        if to_format == CKPT_FORMAT:
            files = _write_dcp(reader, tmp, model, kinds, partial)
        else:
            files = _write_ranks(reader, config, layout, tmp, zero, model, kinds, partial)
        # The folders the metadata refers to: an HF import's tokenizer and generation config,
        # and the tokenizer the run trained with (its record stays in the metadata).
        for folder in (CARRIED, TOKENIZER_DIR):
            if os.path.isdir(os.path.join(src_dir, folder)):
                shutil.copytree(os.path.join(src_dir, folder), os.path.join(tmp, folder))
        new_meta = copy.deepcopy(meta)
        new_meta.update({"format_version": FORMAT_VERSION, "config": config.to_dict(),
                         "layout": layout.record(), "zero_stage": zero, "files": files,
                         "resharded_from": os.path.abspath(src_dir)})
        if not meta.get("weights_only"):
            new_meta[RULE_KEY] = saved_rule_record(meta, src_dir)  # a source older than the record: AdamW
        new_meta.pop("ckpt_format", None)
        if to_format == CKPT_FORMAT:
            new_meta["ckpt_format"] = CKPT_FORMAT
        write_json_atomic(os.path.join(tmp, "metadata.json"), new_meta)
        fsync_path(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(dst)
    _write_text_atomic(os.path.join(dst, "latest"), str(meta["iteration"]))
    return out_dir


def _write_text_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _write_ranks(reader, config, layout: GridLayout, out_dir: str, zero: int, model, kinds,
                 partial=frozenset()) -> list:
    files, dp = [], layout.dp
    for rank in range(layout.world_size):
        c = layout.coord(rank)
        ep_rank, edp_rank = layout.expert_coord(rank)
        tensors, pieces = {}, []
        for chunk in rank_chunks(config, layout, c.tp, c.pp, ep_rank):
            for name, p in chunk.named_parameters():
                split = getattr(p, "tp_split", None)
                if getattr(p, "expert_parallel", False):  # one global tensor per expert
                    if zero == 0 and edp_rank:
                        continue  # expert-data-parallel copies: EDP rank 0 writes
                    parts, share = global_pieces(name, p), (edp_rank, layout.edp)
                else:
                    if zero == 0 and c.dp:
                        continue  # DDP replicas: DP rank 0 writes everything
                    if getattr(p, "embedding_copy", False) or (split is None and c.tp):
                        continue  # the first stage writes the tied embedding; TP rank 0 replicated ones
                    parts, share = [(name, 0, p.numel(), None)], (c.dp, dp)
                for global_name, _, n, _ in parts:
                    lo, hi = (share[0] * n // share[1], (share[0] + 1) * n // share[1]) if zero >= 1 else (0, n)
                    for kind in kinds:
                        if kind in partial and not reader.has(global_name, kind):
                            continue  # a state the source's rule keeps not for this parameter
                        full = reader.full_tensor(global_name, kind, model.vocab_size)
                        if global_name in VOCAB_PARAMS:
                            full = torch.cat([full, torch.zeros(p.full_shape[0] - full.shape[0], *full.shape[1:])])
                        local = shard_tensor(full, split, c.tp, layout.tp) if split is not None else full
                        key, values, piece = _piece(global_name, kind, local, c.tp, layout.tp, split, lo, hi)
                        tensors[key] = values
                        pieces.append(piece)
        if rank == 0:  # FP8 scaling state and the routers' expert biases: replicated, layout-free
            for kind in ("fp8", BIAS_KIND):
                for name in reader.names(kind):
                    full = reader.full_tensor(name, kind)
                    key, tensors[key], piece = _piece(name, kind, full, 0, 1, None, 0, full.numel())
                    pieces.append(piece)
        if pieces:
            write_rank_files(out_dir, rank, tensors, pieces)
            files.append(f"rank{rank:05d}.safetensors")
    return files


def _write_dcp(reader, out_dir: str, model, kinds, partial=frozenset()) -> list:
    """DCP's files holding every full tensor of the source (vocabulary rows unpadded): of each
    of ``kinds`` (the weights, and the update rule's state unless weights-only; of a state in
    ``partial``, the parameters the source holds it for), and the FP8 scaling state. No rank files."""
    tensors = {}
    for kind in kinds:
        for name in reader.names(MASTER_KIND):
            if kind in partial and not reader.has(name, kind):
                continue
            tensors[f"{kind}/{name}"] = reader.full_tensor(name, kind, model.vocab_size)
    for kind in ("fp8", BIAS_KIND):
        for name in reader.names(kind):
            tensors[f"{kind}/{name}"] = reader.full_tensor(name, kind)
    write_full_checkpoint(out_dir, tensors)
    return []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reshard_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the source: a --save root (its 'latest') or an iter_N directory")
    p.add_argument("--save", required=True,
                   help="the destination root (gets iter_N and 'latest'): outside the source checkpoint's root, "
                        "not holding it")
    src = " (default: the source's)"
    p.add_argument("--target-tensor-model-parallel-size", type=int, default=None, help="TP" + src)
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=None, help="PP" + src)
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual stage, 0 for none (default: the source's when PP is unchanged, else none)")
    p.add_argument("--target-data-parallel-size", type=int, default=None, help="DP" + src)
    p.add_argument("--target-zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage" + src)
    p.add_argument("--target-expert-model-parallel-size", type=int, default=None, help="EP" + src)
    p.add_argument("--to-format", choices=FORMATS, default=None,
                   help="the result's format: megalite (safetensors pieces) or torch_dcp "
                        "(torch.distributed.checkpoint)" + src)
    return p


def main(argv=None) -> int:
    a = one_line_errors(build_parser()).parse_args(argv)
    sizes = {"tensor-model-parallel-size": a.target_tensor_model_parallel_size,
             "pipeline-model-parallel-size": a.target_pipeline_model_parallel_size,
             "data-parallel-size": a.target_data_parallel_size,
             "expert-model-parallel-size": a.target_expert_model_parallel_size}
    try:
        for flag, value in sizes.items():
            if value is not None and value < 1:
                raise ConfigError(f"--target-{flag} must be a positive integer, got {value}.")
        out = reshard(a.load, a.save, a.target_tensor_model_parallel_size, a.target_pipeline_model_parallel_size,
                      SOURCE if a.target_num_layers_per_virtual_pipeline_stage is None
                      else a.target_num_layers_per_virtual_pipeline_stage, a.target_data_parallel_size,
                      a.target_zero_stage, a.target_expert_model_parallel_size, a.to_format)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"reshard_checkpoint: {e}", file=sys.stderr)
        raise SystemExit(2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
