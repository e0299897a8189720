"""Which layers each pipeline rank holds, and the model chunks it builds.

With P stages and V virtual stages (model chunks) per rank, the layers are cut into P*V
equal chunks of K = L / (P*V) layers. Chunk c of rank p is global chunk g = c*P + p and
holds layers [g*K, (g+1)*K): with V > 1 a rank holds every P-th chunk, so a micro-batch
visits every rank V times (the interleaved schedule). Global chunk 0 embeds (first stage),
global chunk P*V - 1 applies the final norm, output layer and loss (last stage).

``--pipeline-schedule zbv`` cuts the layers into 2P chunks placed in a V: rank p holds global
chunks p and 2P-1-p (see :func:`megalite.pipeline.op_lists.global_chunk`), so rank 0 holds both
the embedding and the loss, and rank P-1 the two middle chunks.
"""
from __future__ import annotations

import torch

from megalite.config import Config
from megalite.model.gpt import GPTModel, materialize
from megalite.pipeline.op_lists import global_chunk, num_chunks


def virtual_stages(config: Config) -> int:
    """V: model chunks per pipeline rank (1 unless --num-layers-per-virtual-pipeline-stage)."""
    k = config.parallel.num_layers_per_virtual_pipeline_stage
    if k is None:
        return num_chunks(config.train.pipeline_schedule)
    return config.model.num_layers // (config.parallel.pipeline_model_parallel_size * k)


def chunk_layers(num_layers: int, pp_size: int, vp_size: int, pp_rank: int, chunk: int,
                 schedule: str = "1f1b") -> range:
    per_chunk = num_layers // (pp_size * vp_size)
    g = global_chunk(schedule, pp_size, pp_rank, chunk)
    return range(g * per_chunk, (g + 1) * per_chunk)


def build_model_chunks(config: Config, grid, device=None) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage), parameters not yet initialized.

    Built on the meta device (no memory, no init work), then given storage on ``device``
    (default: the CPU), where ``init_weights`` fills them: the full model never exists in
    fp32 on the host."""
    P, V = grid.layout.pp, virtual_stages(config)
    schedule = config.train.pipeline_schedule
    chunks = []
    for c in range(V):
        g = global_chunk(schedule, P, grid.pp_rank, c)
        with torch.device("meta"):
            chunk = GPTModel(
                config.model, pre_process=g == 0, post_process=g == P * V - 1,
                layer_range=chunk_layers(config.model.num_layers, P, V, grid.pp_rank, c, schedule),
                tp_group=grid.tp_group, sequence_parallel=config.parallel.sequence_parallel,
                cp_group=getattr(grid, "cp_group", None), ep_group=getattr(grid, "ep_group", None),
                token_group=getattr(grid, "tp_cp_group", None), amax_group=getattr(grid, "stage_group", None),
                cp_hierarchy=getattr(grid, "cp_hierarchy", (None, None)))
        chunks.append(materialize(chunk, device if device is not None else torch.device("cpu")))
    return chunks
