"""The pretraining driver behind ``pretrain_gpt.py``: flags -> settings -> grid -> model -> loop.

Runs under torchrun (one process per rank; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the
environment) or plainly as one process. Every setting is validated before any process
group or model is built.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
import time
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm

from megalite.arguments import build_parser, parse_settings
from megalite.checkpoint import CheckpointError, load_checkpoint
from megalite.checkpoint.format import complete_iterations, is_hugging_face_folder, resolve_checkpoint
from megalite.checkpoint.settings import adopt_checkpoint_model, checkpoint_config, describe_layout_change
from megalite.config import ConfigError, DataConfig, validate
from megalite.data import build_data_iterators_from
from megalite.data.batch_stream import BatchStream, batches_in, merge_windows
from megalite.data.blended import describe_data, parse_data_path
from megalite.data.indexed_dataset import DatasetError
from megalite.data.tokenizer import build_tokenizer
from megalite.layers.transformer_engine import tp_comm_overlap
from megalite.model.counting import total_matrix_parameters
from megalite.model.gpt import count_parameters
from megalite.parallel import comm
from megalite.model.summary import moe_summary
from megalite.parallel.grid import build_grid, gpus_per_node_from_env
from megalite.parallel.random import model_parallel_seed
from megalite.pipeline.partition import build_model_chunks, virtual_stages
from megalite.pipeline.schedule_kinds import schedule as schedule_kind
from megalite.data_parallel.accounting import describe_memory
from megalite.data_parallel.update_rule import rule_named
from megalite.flag_spec import set_flagless
from megalite.device import (cuda_allocator_environment, host_barrier, init_distributed, meta_stand_ins,
                             resolve_device)
from megalite.launch import detect_launch, leave_world
from megalite.resilience.faults import CollectiveTimeout, HangWatchdog, TrainingDiverged, report_failure
from megalite.observe.memory_tracker import training_tracker
from megalite.observe.monitor import Monitor, mock_data_note
from megalite.train.preflight import check_datasets, check_output_paths, check_save_location
from megalite.observe.profiling import Profiler
from megalite.resilience.fault_injection import FaultInjector, check_fault_ranks
from megalite.resilience.fault_injection import set_active as set_active_faults
from megalite.resilience.flags import check_resilience
from megalite.run_settings import RunPlan, check_logging
from megalite.observe.step_log import StepLog
from megalite.train.loop import Run, TrainLoop, checkpoint_saver, checkpoint_writer, straggler_monitor
from megalite.train.step import LossScaler, build_data_parallel_optimizer


def _tokenizer_for(data: DataConfig, vocab_size: int | None):
    """The run's tokenizer; ``data.tokenizer_type`` left unset becomes NullTokenizer with
    --mock-data, else SentencePieceTokenizer. ``vocab_size``: --vocab-size (NullTokenizer's range)."""
    if data.tokenizer_type is None:
        data.tokenizer_type = "NullTokenizer" if data.mock_data else "SentencePieceTokenizer"
    if data.tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--vocab-size is required with --mock-data / NullTokenizer "
                              "(the range of the random token ids). Fix: add --vocab-size N.")
        return build_tokenizer("NullTokenizer", vocab_size=vocab_size)
    if not data.tokenizer_model:
        what = ("a local folder holding tokenizer.json" if data.tokenizer_type == "HuggingFaceTokenizer"
                else "a sentencepiece .model from tools/train_tokenizer.py")
        raise ConfigError(f"--tokenizer-type {data.tokenizer_type} needs --tokenizer-model PATH ({what}).")
    return build_tokenizer(data.tokenizer_type, data.tokenizer_model)


def restart_note(finetune: bool) -> str:
    """Why a run that loaded iteration N counts from 1: what ``--finetune`` (or a weights-only
    checkpoint, e.g. one imported from Hugging Face) starts afresh."""
    why = "--finetune takes the weights only" if finetune else "the checkpoint holds weights only"
    return (f"; {why}: the iteration count (from 1), the optimizer state (moments and step), the loss "
            f"scale, the LR schedule (warmup from iteration 1) and the data position (the first batch) "
            f"start afresh")


def _value(x, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


class RankZeroPrinter:
    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, *parts, **kw):
        if self.rank == 0:
            with tqdm.external_write_mode(file=kw.get("file"), nolock=True):  # above a progress bar
                print(*parts, **kw, flush=True)


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on Ampere and later (10-bit
    mantissa inputs, fp32 accumulation): the usual choice for training speed. Off for exact
    comparisons (``--disable-tf32``). No effect on a CPU."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _flag_error(message: str):
    raise ConfigError(f"{message}. (python pretrain_gpt.py --help lists the flags.)")


def setup(argv=None, flagless: dict | None = None):
    """Parse and validate (before any group or model), then, in this order: the device
    (``LOCAL_RANK`` -> ``set_device``), the default process group, the grid's groups.
    ``flagless``: ``{section: {field: value}}`` for the settings no flag sets (``model``'s
    ``attention_kind``, ``train``'s ``optimizer``), as a caller holding a config hands them on."""
    parser = build_parser()
    parser.error = _flag_error  # one configuration-error line (rank 0's), not a usage text per rank
    settings = parse_settings(argv, parser)
    config, run = settings.config, settings.run
    for section, values in (flagless or {}).items():
        set_flagless(getattr(config, section), values)
    here, ckpt = run.launch, run.checkpoint
    if here.device in ("auto", "cuda"):
        cuda_allocator_environment()  # before any torch.cuda call: the allocator reads it once
    # (world size, rank) from torchrun's variables, else SLURM's, or those a fake process group is given
    plan = RunPlan(run, detect_launch(fake_process_group=here.fake_process_group))
    world_size, rank = plan.launch.world_size, plan.launch.rank
    resilience = check_resilience(run.resilience, ckpt.save, ckpt.async_save, here.fake_process_group)
    plan.faults, plan.skip_windows = resilience.faults, resilience.skip_windows
    check_fault_ranks(plan.faults, world_size)
    # Elastic jobs pass --load D --save D from the first start: nothing to load yet is fine there.
    if ckpt.ckpt_step is not None and not ckpt.load:
        raise ConfigError(f"--ckpt-step {ckpt.ckpt_step} needs --load DIR (the checkpoint root to take it from).")
    plan.fresh_start = bool(ckpt.load and ckpt.save and os.path.abspath(ckpt.load) == os.path.abspath(ckpt.save)
                            and ckpt.ckpt_step is None and not os.path.exists(os.path.join(ckpt.load, "latest"))
                            and not is_hugging_face_folder(ckpt.load))  # that one is refused: convert it first
    done = complete_iterations(ckpt.load) if plan.fresh_start and os.path.isdir(ckpt.load) else []
    if done:  # no 'latest', but complete iterations: a fresh start's saves would overwrite them
        raise ConfigError(f"--load {ckpt.load} --save {ckpt.save}: there is no 'latest' file, but complete "
                          f"iterations are ({', '.join(map(str, done))}); starting fresh would overwrite them. "
                          f"Fix: --ckpt-step {done[-1]} to resume the newest, or --save to another directory.")
    # The iteration directory, resolved once: the config read here and the weights loaded later
    # come from the same iteration even if 'latest' moves in between.
    load_dir = resolve_checkpoint(ckpt.load, ckpt.ckpt_step) if ckpt.load and not plan.fresh_start else None
    plan.load_dir = load_dir
    saved_config = checkpoint_config(load_dir) if load_dir else None
    saved = saved_config["model"] if saved_config else None
    vocab_size = run.vocab_size
    if saved and config.data.mock_data and vocab_size is None and config.data.tokenizer_type in (None, "NullTokenizer"):
        vocab_size = saved["vocab_size"]  # mock data over the checkpoint's vocabulary
    tokenizer = _tokenizer_for(config.data, vocab_size)
    check_logging(run.logging)
    config.model.vocab_size, config.data.eod_token = tokenizer.vocab_size, tokenizer.eod
    if saved:  # the model is the checkpoint's; contradicting flags are refused
        adopt_checkpoint_model(config.model, saved, run.given, tokenizer.vocab_size, load_dir)
        batch = saved_config["train"].get("global_batch_size")
        if batch and not ckpt.finetune and "global_batch_size" not in run.given:
            config.train.global_batch_size = batch  # a resumed run keeps its global batch under any DP
    if here.device == "meta":  # nothing computes: GPU-only kernels give way to the torch paths
        swapped = meta_stand_ins(config.model)
        if swapped and (rank == 0 or here.fake_process_group):  # a fake rank is the only process
            print(f"meta device: megalite's torch layers and kernels stand in for {', '.join(swapped)} "
                  f"(same parameters and communication)")
    for warning in validate(config, world_size, gpus_per_node_from_env(world_size)):
        if rank == 0:
            warnings.warn(warning)
    # Fail before the work: bad data or an unusable --save stop here, before any group or step.
    if config.data.data_path and not config.data.mock_data:
        check_datasets(parse_data_path(config.data.data_path)[0], config.model.vocab_size)
    if ckpt.save:
        check_save_location(ckpt.save, count_parameters(config.model), rule_named(config.train.optimizer),
                            total_matrix_parameters(config.model))  # the rule's bytes per class
    check_output_paths(run.logging)  # --log-json, --tensorboard-dir, ...: folders created now, or refused by flag
    device = resolve_device(here.device, here.fake_process_group)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_tf32(not here.disable_tf32)
    timeout = timedelta(minutes=here.distributed_timeout_minutes)
    init_distributed(device, world_size, rank, timeout, fake=here.fake_process_group)
    comm.expect_device(device if here.fake_process_group else None)  # the dry run's collective check
    grid = build_grid(config.parallel, world_size, rank, timeout=timeout, experts=bool(config.model.num_experts))
    return plan, config, tokenizer, grid, device


def build_training_state(config, grid, device):
    """This rank's pipeline chunks (one without PP), seeded and initialized as every layout
    initializes them, their data-parallel optimizer and the loss scaler."""
    t = config.train
    model_parallel_seed(t.seed, grid, device)
    model = build_model_chunks(config, grid, device)
    for chunk in model:
        chunk.init_weights(t.seed)
    optimizer = build_data_parallel_optimizer(model, t, grid, rule=rule_named(t.optimizer))
    return model, optimizer, LossScaler(t.fp16, t.initial_loss_scale, t.loss_scale)


def pretrain(argv=None, flagless: dict | None = None) -> list[dict]:
    """Train as the command line ``argv`` (and the settings without a flag, :func:`setup`) say;
    returns the log records."""
    plan, config, tokenizer, grid, device = setup(argv, flagless)
    m, t = config.model, config.train
    ckpt, log, resilience = plan.checkpoint, plan.logging, plan.resilience
    fake = plan.launch_settings.fake_process_group
    reporter = grid.rank == 0 or fake  # a fake rank is the only process: it reports
    say = RankZeroPrinter(0 if reporter else grid.rank)
    dp = grid.layout.dp
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    say(grid.describe())
    if plan.launch.source != "single":
        say(plan.launch.describe())
    say(f"model: {count_parameters(m) / 1e6:.2f}M parameters, {m.num_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_attention_heads} heads, vocab {m.vocab_size} (padded "
        f"{m.padded_vocab_size(grid.layout.tp)}), seq {m.seq_length}")
    if m.num_experts:
        say(moe_summary(m, grid.layout))
    if grid.layout.pp > 1:
        v = virtual_stages(config)
        schedule, kind = t.pipeline_schedule, schedule_kind(t.pipeline_schedule)
        if kind.v_shape:
            schedule = "zbv, 2 chunks per rank in a V (rank p: chunks p and 2P-1-p), B and W apart"
        elif kind.one_chunk_split:
            schedule = "zb-h1 (1F1B with B and W apart)"
        elif v > 1:
            schedule = f"interleaved 1F1B, {v} chunks per rank"
        say(f"pipeline: {grid.layout.pp} stages x {v} chunk(s) of {m.num_layers // (grid.layout.pp * v)} "
            f"layer(s); schedule {schedule}")
    say(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + (f"; fake process group: this process is rank {grid.rank} of {grid.layout.world_size}"
           if fake else ""))
    say(f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x DP {dp} x "
        f"{num_micro} accumulation steps; {t.train_iters} iterations")

    release_tp_comm_buffers = tp_comm_overlap(config)  # TE userbuffers (only with --tp-comm-overlap)
    model, optimizer, scaler = build_training_state(config, grid, device)
    start_iteration, consumed, windows = 0, 0, list(plan.skip_windows)
    if ckpt.load and not plan.fresh_start:
        meta = load_checkpoint(plan.load_dir, optimizer, scaler, config, grid, load_optimizer=not ckpt.no_load_optim,
                               load_rng=not ckpt.no_load_rng, finetune=ckpt.finetune)
        start_iteration, consumed = meta["iteration"], meta["consumed_samples"]
        windows += [tuple(w) for w in meta.get("skipped_batches", [])]  # a resume does not replay them
        if ckpt.finetune or meta.get("weights_only"):
            start_iteration, consumed, windows = 0, 0, list(plan.skip_windows)
        say(f"loaded {meta['directory']} at iteration {meta['iteration']} (layout then {meta['layout']}; "
            f"{meta['rng_note']})" + (restart_note(ckpt.finetune) if ckpt.finetune or meta.get("weights_only") else ""))
        if not (ckpt.finetune or meta.get("weights_only")):
            change = describe_layout_change(meta, grid, t)
            if change:
                say(change)
    elif plan.fresh_start:
        say(f"--load {ckpt.load}: no checkpoint there yet, starting from iteration 0 (with --save to the same "
            f"directory, a restarted job resumes from what this run saves)")
    say(describe_memory(optimizer, dp))
    if start_iteration >= t.train_iters:
        say(f"the checkpoint is at iteration {start_iteration}, --train-iters is {t.train_iters}: nothing "
            f"left to train (raise --train-iters to continue)")
        optimizer.sync.remove_hooks()  # held by autograd, they would keep the model and its groups alive
        return []

    global_batch = t.global_batch_size
    windows = merge_windows(windows)
    # batches read, not trained
    reserve = batches_in(windows) + resilience.max_rollbacks * resilience.rollback_skip_batches
    num_evals = t.train_iters // t.eval_interval + 1
    train_iter, valid_iter, _ = build_data_iterators_from(  # config.data.eod_token is tokenizer.eod (setup)
        config, dp_rank=grid.dp_rank, dp_size=dp, train_samples=(t.train_iters + reserve) * global_batch,
        valid_samples=num_evals * t.eval_iters * global_batch, test_samples=t.eval_iters * global_batch,
        consumed_train_samples=consumed)
    stream = BatchStream(train_iter, num_micro, global_batch, consumed // global_batch, windows)
    for line in describe_data(getattr(train_iter, "dataset", None)):
        say(line)
    if config.data.mock_data:
        say(mock_data_note(m.vocab_size))  # before the flat loss it explains
    if valid_iter is not None:  # continue validation where the interrupted run was
        for _ in range((start_iteration // t.eval_interval) * t.eval_iters * num_micro):
            next(valid_iter)

    log_file = open(log.log_json, "a" if ckpt.load else "w") if log.log_json and reporter else None
    tokens_per_step = global_batch * m.seq_length
    monitor = Monitor(m, grid.layout.world_size, tokens_per_step, t.train_iters, log.peak_tflops,
                      log.tensorboard_dir, enabled=reporter, device=device, wandb_project=log.wandb_project,
                      wandb_exp_name=log.wandb_exp_name, wandb_save_dir=log.wandb_save_dir, config=config.to_dict())
    faults = FaultInjector(plan.faults, grid.rank)
    set_active_faults(faults)  # the checkpoint writer's kill-during-save reaches it there
    steps = StepLog(monitor, grid, check=device.type != "meta" and not fake and not resilience.checked,
                    fp16=t.fp16, meta=device.type == "meta")
    watchdog = None
    if device.type == "cuda" and dist.is_initialized() and not fake:
        watchdog = HangWatchdog(grid, 0.9 * plan.launch_settings.distributed_timeout_minutes * 60)
    run = Run(plan=plan, config=config, tokenizer=tokenizer, grid=grid, device=device, model=model,
              optimizer=optimizer, scaler=scaler, stream=stream, valid_iter=valid_iter,
              start_iteration=start_iteration, say=say, monitor=monitor, steps=steps, faults=faults,
              saver=checkpoint_saver(plan, grid), save_fn=checkpoint_writer(ckpt),
              straggler=straggler_monitor(resilience, grid, device),
              profiler=Profiler(log, grid.rank) if log.profile else None,
              tracker=training_tracker(model, optimizer) if log.track_memory else None,
              watchdog=watchdog, log_file=log_file)
    start = time.perf_counter()
    try:
        log_lines = TrainLoop(run).run()
    finally:
        monitor.close()
        if run.straggler is not None:
            run.straggler.close()  # its timer of blocked time is process-wide
        if watchdog is not None:
            watchdog.stop()
        if run.profiler:
            run.profiler.finish()
        if log_file:
            log_file.close()
        optimizer.sync.remove_hooks()  # held by autograd, they would keep the model and its groups alive
    total = time.perf_counter() - start
    if log_lines:
        rate = "" if device.type == "meta" else f", {len(log_lines) * tokens_per_step / total:.0f} tokens/s overall"
        say(f"done: {len(log_lines)} iterations in {total:.1f} s{rate}; "
            f"loss {_value(log_lines[0]['loss'])} -> {_value(log_lines[-1]['loss'])}")
    if log_file:
        say(f"log: {os.path.abspath(log.log_json)}")
    if log.pipeline_trace:
        say(f"pipeline trace: {os.path.abspath(log.pipeline_trace)} (draw it with tools/pipeline_timeline.py)")
    release_tp_comm_buffers()
    host_barrier(grid)
    return log_lines


def main(argv=None) -> int:
    """Run, and turn every expected failure into ONE ``megalite:`` message and an exit code
    (:func:`megalite.resilience.faults.report_failure`): printed by rank 0, as every rank meets the same
    configuration, input or checkpoint error, and under torchrun recorded as the root cause of
    its failure summary; the other ranks add nothing. A timeout is reported by each waiting
    rank (each names who it waited for). Any other exception propagates with its traceback."""
    argv_list = sys.argv[1:] if argv is None else argv
    slurm_rank = os.environ.get("SLURM_PROCID", "0") if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 else "0"
    rank = os.environ.get("RANK", slurm_rank)  # torchrun's, else SLURM's tasks without torchrun
    printer = (int(rank) if rank.isdigit() else 0) == 0 or "--fake-process-group" in argv_list
    try:
        pretrain(argv)
    except ConfigError as e:
        return report_failure("configuration error", e, 2, printer)
    except (DatasetError, FileNotFoundError, CheckpointError) as e:
        return report_failure("input error", e, 2, printer)
    except TrainingDiverged as e:
        return report_failure("training stopped", e, 3, printer)
    except CollectiveTimeout as e:
        return report_failure("distributed timeout", e, 4, True)
    finally:  # every group destroyed and its threads joined now, not in interpreter teardown
        leave_world(release=sys.exc_info()[0] is None)  # not under an unexpected exception: a peer may be gone
    return 0
