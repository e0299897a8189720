#!/usr/bin/env python
"""Convert a checkpoint to another layout, offline: no GPU, no process group.

    python tools/reshard_checkpoint.py --load SRC --save DST \\
        --target-tensor-model-parallel-size T --target-pipeline-model-parallel-size P \\
        [--target-num-layers-per-virtual-pipeline-stage K] \\
        [--target-data-parallel-size D --target-zero-stage Z] [--target-expert-model-parallel-size E]

For every rank of the target layout, one after another, it builds that rank's model shard
on the meta device (shapes only), assembles each of its parameters' full tensors from the
source pieces (master weights and Adam moments), cuts the rank's tensor-parallel shard and,
with ZeRO (Z >= 1), the rank's 1/D of it, and writes the rank's file. Memory stays near one
full tensor plus one rank's file. The result loads under the target layout (or any other:
loading re-slices pieces whatever their layout). RNG states are not carried over; transformer-
engine's FP8 scales and amax histories (replicated) are copied into rank 0's file. Experts are
stored one global tensor per expert (``layers.3.mlp.experts.7.fc1.weight``): each expert-parallel
rank writes its own experts (expert-data-parallel rank 0, or its 1/EDP with ZeRO).
"""
import argparse
import copy
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpoint.core import KINDS  # noqa: E402
from megalite.checkpoint.names import global_pieces  # noqa: E402
from megalite.checkpoint.format import (FORMAT_VERSION, VOCAB_PARAMS, PieceReader, iteration_dir,  # noqa: E402
                                        read_latest, write_json_atomic, write_rank_files)
from megalite.checkpoint.serial import model_config_from  # noqa: E402
from megalite.config import Config, DataConfig, ParallelConfig, TrainConfig, validate_layout  # noqa: E402
from megalite.parallel.comm import OfflineGroup  # noqa: E402
from megalite.parallel.grid import GridLayout  # noqa: E402
from megalite.parallel.sharding import shard_tensor  # noqa: E402
from megalite.pipeline.partition import build_model_chunks  # noqa: E402


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


def reshard(src: str, dst: str, tp: int, pp: int, vp_layers, dp: int, zero: int, ep: int = 1) -> str:
    src_dir = src if os.path.exists(os.path.join(src, "metadata.json")) else iteration_dir(src, read_latest(src))
    reader = PieceReader(src_dir)
    meta = reader.metadata
    model = model_config_from(meta["config"]["model"])
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers_per_virtual_pipeline_stage=vp_layers,
                              sequence_parallel=meta["config"]["parallel"].get("sequence_parallel", False) and tp > 1,
                              expert_model_parallel_size=ep)
    config = Config(model, parallel, TrainConfig(**{k: v for k, v in meta["config"]["train"].items()
                                                   if k in TrainConfig.__dataclass_fields__}),
                    DataConfig(**meta["config"]["data"]))
    config.train.zero_stage = zero
    validate_layout(parallel, tp * pp * dp)
    if model.num_experts and model.num_experts % ep:
        raise SystemExit(f"--target-expert-model-parallel-size {ep} must divide the {model.num_experts} experts.")
    if (tp * dp) % ep:
        raise SystemExit(f"--target-expert-model-parallel-size {ep} must divide TP*DP = {tp * dp}.")
    layout = GridLayout(tp=tp, cp=1, dp=dp, pp=pp, ep=ep, experts=bool(model.num_experts))
    out_dir = iteration_dir(dst, meta["iteration"])
    os.makedirs(out_dir, exist_ok=True)
    with_optim = not meta.get("weights_only")
    files = []
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
                    for kind in KINDS if with_optim else ("weight",):
                        full = reader.full_tensor(global_name, kind, model.vocab_size)
                        if global_name in VOCAB_PARAMS:
                            full = torch.cat([full, torch.zeros(p.full_shape[0] - full.shape[0], *full.shape[1:])])
                        local = shard_tensor(full, split, c.tp, tp) if split is not None else full
                        key, values, piece = _piece(global_name, kind, local, c.tp, tp, split, lo, hi)
                        tensors[key] = values
                        pieces.append(piece)
        if rank == 0:  # transformer-engine's FP8 scaling state: replicated, layout-free
            for name in reader.names("fp8"):
                full = reader.full_tensor(name, "fp8")
                key, tensors[key], piece = _piece(name, "fp8", full, 0, 1, None, 0, full.numel())
                pieces.append(piece)
        if pieces:
            write_rank_files(out_dir, rank, tensors, pieces)
            files.append(f"rank{rank:05d}.safetensors")
    new_meta = copy.deepcopy(meta)
    new_meta.update({"format_version": FORMAT_VERSION, "config": config.to_dict(), "layout": dict(layout.__dict__),
                     "zero_stage": zero, "files": files, "resharded_from": src_dir})
    write_json_atomic(os.path.join(out_dir, "metadata.json"), new_meta)
    with open(os.path.join(dst, "latest"), "w") as f:
        f.write(str(meta["iteration"]))
    return out_dir


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--target-data-parallel-size", type=int, default=1)
    p.add_argument("--target-zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1)
    a = p.parse_args()
    out = reshard(a.load, a.save, a.target_tensor_model_parallel_size, a.target_pipeline_model_parallel_size,
                  a.target_num_layers_per_virtual_pipeline_stage, a.target_data_parallel_size, a.target_zero_stage,
                  a.target_expert_model_parallel_size)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
