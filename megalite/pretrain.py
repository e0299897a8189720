"""The pretraining driver behind ``pretrain_gpt.py``: args -> config -> grid -> model -> loop.

Runs under torchrun (one process per rank; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the
environment) or plainly as one process. Every setting is validated before any process
group or model is built.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from megalite.arguments import build_parser, config_from_args
from megalite.config import Config, ConfigError, validate
from megalite.data import build_data_iterators
from megalite.data.indexed_dataset import DatasetError, IndexedDataset
from megalite.data.tokenizer import build_tokenizer
from megalite.model.gpt import count_parameters
from megalite.parallel.comm import count_collectives
from megalite.parallel.grid import build_grid, gpus_per_node_from_env
from megalite.parallel.random import model_parallel_seed
from megalite.pipeline.partition import build_model_chunks, virtual_stages
from megalite.pipeline.schedules import Trace
from megalite.data_parallel.accounting import describe_memory
from megalite.training import LossScaler, build_data_parallel_optimizer, evaluate, train_step


def _tokenizer_for(args):
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else "SentencePieceTokenizer"
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ConfigError("--vocab-size is required with --mock-data / NullTokenizer "
                              "(the range of the random token ids). Fix: add --vocab-size N.")
        return build_tokenizer("NullTokenizer", vocab_size=args.vocab_size)
    if not args.tokenizer_model:
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model PATH "
                          f"(a sentencepiece .model from tools/train_tokenizer.py).")
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model)


class RankZeroPrinter:
    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, *parts, **kw):
        if self.rank == 0:
            print(*parts, **kw, flush=True)


def setup(argv=None):
    """Parse and validate (before any group or model), then init the world and the grid."""
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = _tokenizer_for(args)
    config = config_from_args(args, tokenizer.vocab_size)
    for warning in validate(config, world_size, gpus_per_node_from_env(world_size)):
        warnings.warn(warning)
    if config.data.data_path and not config.data.mock_data:
        IndexedDataset(config.data.data_path)  # missing or corrupt files fail here, before any group
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    grid = build_grid(config.parallel, world_size, rank)
    return args, config, tokenizer, grid


def save_outputs(save_dir: str, chunks, config: Config, grid, log_lines: list[dict]) -> str | None:
    """This rank's weights (safetensors, global parameter names, its TP shards) + the config
    (JSON), each written atomically. One file per (tp, pp) coordinate, written by DP rank 0;
    ``model.safetensors`` without model parallelism. (Full checkpoints: see the checkpoint issue.)"""
    from safetensors.torch import save_file

    if grid.dp_rank != 0 or grid.cp_rank != 0:
        return None
    os.makedirs(save_dir, exist_ok=True)
    layout = grid.layout
    name = "model.safetensors" if layout.tp == layout.pp == 1 else \
        f"model-tp{grid.tp_rank:02d}-pp{grid.pp_rank:02d}.safetensors"
    weights = os.path.join(save_dir, name)
    state = {k: v.detach().contiguous() for c in chunks for k, v in c.state_dict().items()}
    splits = {k: [p.tp_split.dim, p.tp_split.sections] for c in chunks for k, p in c.named_parameters()
              if getattr(p, "tp_split", None) is not None and layout.tp > 1}
    save_file(state, weights + ".tmp", metadata={"format": "megalite-weights-v1",
                                                 "tp_splits": json.dumps(splits)})
    os.replace(weights + ".tmp", weights)
    if grid.rank == 0:
        with open(os.path.join(save_dir, "config.json.tmp"), "w") as f:
            json.dump({"config": config.to_dict(), "layout": layout.__dict__,
                       "final": log_lines[-1] if log_lines else None}, f, indent=2)
        os.replace(os.path.join(save_dir, "config.json.tmp"), os.path.join(save_dir, "config.json"))
    return weights


def write_trace(trace_dir: str, trace, grid, num_micro: int, num_chunks: int) -> None:
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"trace_rank{grid.rank:03d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": grid.rank, "pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank,
                   "dp_rank": grid.dp_rank, "P": grid.layout.pp, "V": num_chunks, "M": num_micro,
                   "events": trace.events}, f)
    os.replace(path + ".tmp", path)


def pretrain(argv=None) -> list[dict]:
    args, config, tokenizer, grid = setup(argv)
    m, t = config.model, config.train
    say = RankZeroPrinter(grid.rank)
    dp = grid.layout.dp
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    say(grid.describe())
    say(f"model: {count_parameters(m) / 1e6:.2f}M parameters, {m.num_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_attention_heads} heads, vocab {m.vocab_size} (padded "
        f"{m.padded_vocab_size(grid.layout.tp)}), seq {m.seq_length}")
    if grid.layout.pp > 1:
        v = virtual_stages(config)
        schedule = f"interleaved 1F1B, {v} chunks per rank" if v > 1 else t.pipeline_schedule
        say(f"pipeline: {grid.layout.pp} stages x {v} chunk(s) of {m.num_layers // (grid.layout.pp * v)} "
            f"layer(s); schedule {schedule}")
    say(f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x DP {dp} x "
        f"{num_micro} accumulation steps; {t.train_iters} iterations")

    tracker_seed = t.seed
    model_parallel_seed(tracker_seed, grid)
    model = build_model_chunks(config, grid)  # this rank's pipeline chunks (one without PP)
    for chunk in model:
        chunk.init_weights(t.seed)
    optimizer = build_data_parallel_optimizer(model, t, grid)
    if grid.rank == 0:
        say(describe_memory(optimizer, dp))
    scaler = LossScaler(t.fp16, t.initial_loss_scale, t.loss_scale)

    global_batch = t.global_batch_size
    num_evals = t.train_iters // t.eval_interval + 1
    train_iter, valid_iter, _ = build_data_iterators(
        data_prefix=config.data.data_path, mock=config.data.mock_data, split=config.data.split,
        vocab_size=m.vocab_size, seq_length=m.seq_length, seed=t.seed,
        micro_batch_size=t.micro_batch_size, dp_rank=grid.dp_rank, dp_size=dp,
        train_samples=t.train_iters * global_batch,
        valid_samples=num_evals * t.eval_iters * global_batch,
        test_samples=t.eval_iters * global_batch)

    log_file = open(args.log_json, "w") if args.log_json and grid.rank == 0 else None
    log_lines: list[dict] = []
    tokens_per_step = global_batch * m.seq_length
    start = time.perf_counter()
    for iteration in range(t.train_iters):
        step_start = time.perf_counter()
        micro_batches = [next(train_iter) for _ in range(num_micro)]
        trace = Trace() if args.pipeline_trace and iteration == t.train_iters - 1 else None
        with count_collectives() as traffic:
            result = train_step(model, optimizer, micro_batches, t, iteration, scaler, grid, trace)
        if trace is not None:
            write_trace(args.pipeline_trace, trace, grid, num_micro, len(model))
        elapsed = time.perf_counter() - step_start
        record = {"iteration": iteration + 1, "loss": result.loss, "lr": result.lr,
                  "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                  "skipped": result.skipped, "elapsed_ms": elapsed * 1e3,
                  "tokens_per_sec": tokens_per_step / elapsed,
                  "comm_bytes": {k: v["bytes"] for k, v in traffic.items()},
                  "memory_bytes": optimizer.memory_bytes()}
        log_lines.append(record)
        if (iteration + 1) % t.log_interval == 0 or iteration == 0:
            say(f"iter {iteration + 1:>5}/{t.train_iters} | loss {result.loss:.4f} | lr {result.lr:.3e} "
                f"| grad norm {result.grad_norm:.3f} | {elapsed * 1e3:7.1f} ms | "
                f"{tokens_per_step / elapsed:8.0f} tokens/s" + (" | skipped (inf/nan)" if result.skipped else ""))
        if iteration == 0 and traffic:
            say("collectives/step (rank 0, bytes handed): " + ", ".join(
                f"{k} {v['calls']} calls {v['bytes'] / 2**20:.2f} MiB" for k, v in sorted(traffic.items())))
        if valid_iter is not None and (iteration + 1) % t.eval_interval == 0:
            with optimizer.full_weights():
                val = evaluate(model, [next(valid_iter) for _ in range(t.eval_iters * num_micro)], t, grid)
            say(f"validation at iter {iteration + 1}: loss {val:.4f} | ppl {min(1e9, 2.718281828 ** val):.2f}")
            record["valid_loss"] = val
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
    total = time.perf_counter() - start
    say(f"done: {t.train_iters} iterations in {total:.1f} s, "
        f"{t.train_iters * tokens_per_step / total:.0f} tokens/s overall; "
        f"loss {log_lines[0]['loss']:.4f} -> {log_lines[-1]['loss']:.4f}")
    if log_file:
        log_file.close()
        say(f"log: {os.path.abspath(args.log_json)}")
    if args.pipeline_trace:
        say(f"pipeline trace: {os.path.abspath(args.pipeline_trace)} (draw it with tools/pipeline_timeline.py)")
    if args.save:
        with optimizer.full_weights():
            path = save_outputs(args.save, model, config, grid, log_lines)
        if grid.rank == 0:
            others = " and the other model-parallel ranks' shards" if grid.layout.world_size > 1 else ""
            say(f"saved: {os.path.abspath(os.path.dirname(path))} ({os.path.basename(path)}{others}, "
                f"config.json)")
    if dist.is_initialized():
        dist.barrier()
    return log_lines


def main(argv=None) -> int:
    try:
        pretrain(argv)
    except ConfigError as e:
        print(f"megalite: configuration error: {e}", file=sys.stderr)
        return 2
    except (DatasetError, FileNotFoundError) as e:
        print(f"megalite: input error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
