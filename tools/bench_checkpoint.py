#!/usr/bin/env python
"""Checkpoint saves: training time blocked per save, synchronous vs asynchronous, and step
time while the background write runs vs without a save, side by side in one run.

One process trains a GPT (megalite's model, ZeRO optimizer and train step, mock data) and
measures, in rounds that alternate the variants:
- ``steps, no save``: the train step alone (in each round: steps before the saves, and right
  after the async write as many steps as ran during it, so both see the same machine load);
- ``sync save``: the time ``save_checkpoint`` blocks training (stage + write + commit);
- ``async save``: the time ``AsyncCheckpointSaver.save`` blocks training (wait for nothing,
  empty the tmp directory, copy the state into the reused host buffers), then the steps that
  run while its writer thread writes and commits (``steps during write``), until the commit.

The model should be big enough that a write takes several steps (the defaults: 42M parameters,
a 481 MiB checkpoint, short sequences so that a CPU step is short). Goals (issue 27): blocked
time of the async save at most a tenth of the sync save's; steps during the write within 10% of
steps without a save. Also printed: the training thread's CPU time per step, with and without a
write running (equal: what a write adds to a step's wall time is waiting for a core or the GIL).

    python tools/bench_checkpoint.py [--hidden 512] [--layers 12] [--seq 32] [--rounds 7] [--device cuda]
                                     [--dir DIR] [--json PATH]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tools.tool_errors import one_line_errors, positive, writable  # noqa: E402


def build(args, save_dir):
    from megalite.data import build_data_iterators
    from megalite.device import to_device
    from megalite.train.pretrain import build_training_state, setup
    argv = ["--mock-data", "--vocab-size", str(args.vocab), "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--num-attention-heads", "8", "--seq-length", str(args.seq), "--micro-batch-size",
            "1", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "100000", "--save", save_dir,
            "--device", args.device]
    _, config, _, grid, device = setup(argv)
    t = config.train
    model, optimizer, scaler = build_training_state(config, grid, device)
    train_iter, _, _ = build_data_iterators(
        data_prefix=None, mock=True, split="100,0,0", vocab_size=args.vocab, seq_length=args.seq, seed=t.seed,
        micro_batch_size=1, dp_rank=0, dp_size=1, train_samples=100000, valid_samples=0, test_samples=0)
    batch = [to_device(next(train_iter), device)]  # the same batch every step: the work is what counts
    return config, grid, device, model, optimizer, scaler, t, batch


def main(argv=None):
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7, help="saves of each kind")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training thread")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    positive(parser, "--rounds", args.rounds)
    writable(parser, "--json", args.json)
    torch.set_num_threads(args.threads)
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    from megalite.checkpoint.async_save import AsyncCheckpointSaver
    from megalite.checkpoint.core import save_checkpoint
    from megalite.testing.reference_step import train_step
    config, grid, device, model, optimizer, scaler, t, batch = build(args, root)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    iteration = [0]

    cpu = []  # the training thread's CPU time per step, and whether a write ran

    def step(writing: bool = False) -> float:
        start, start_cpu = time.perf_counter(), time.thread_time()
        iteration[0] += 1
        result = train_step(model, optimizer, batch, t, iteration[0], scaler, grid)
        float(result.loss)  # the loop reads the loss at its log points; here every step
        sync()
        cpu.append((writing, time.thread_time() - start_cpu))
        return time.perf_counter() - start

    saver = AsyncCheckpointSaver(grid)
    nbytes = sum(b.numel() * b.element_size() for b in optimizer.master) * 3
    plain, during, blocked_sync, blocked_async, writes, steps_per_write, ratios = [], [], [], [], [], [], []
    for _ in range(3):
        step()  # warm-up
    for r in range(args.rounds):
        plain += [step() for _ in range(4)]
        sync()
        start = time.perf_counter()
        save_checkpoint(os.path.join(root, "sync"), iteration[0], optimizer, scaler, config, grid, iteration[0], 1)
        blocked_sync.append(time.perf_counter() - start)
        plain += [step() for _ in range(2)]
        sync()
        start = time.perf_counter()
        saver.save(os.path.join(root, "async"), iteration[0], optimizer, scaler, config, grid, iteration[0], 1)
        blocked_async.append(time.perf_counter() - start)
        these = []
        while saver.in_flight:
            these.append(step(writing=True))
        saver.wait()
        writes.append(time.perf_counter() - start)
        steps_per_write.append(len(these))
        after = [step() for _ in these]  # as many without a save, right after: the same machine load
        during += these
        plain += after
        if these:
            ratios.append(statistics.median(these) / statistics.median(after))
    saver.close()
    params = sum(p.numel() for c in model for p in c.parameters())
    med = statistics.median
    res = {"parameters": params, "checkpoint_bytes": nbytes, "device": str(device), "threads": args.threads,
           "rounds": args.rounds, "step_s_no_save": med(plain), "step_s_during_write": med(during) if during else None,
           "blocked_s_sync": med(blocked_sync), "blocked_s_async": med(blocked_async),
           "async_write_s": med(writes), "steps_per_write": med(steps_per_write)}
    res["blocked_ratio"] = res["blocked_s_async"] / res["blocked_s_sync"]
    res["step_slowdown_during_write"] = (med(ratios) - 1) if ratios else None  # median over rounds of paired ratios
    res["cpu_s_no_save"] = med([c for w, c in cpu if not w])
    res["cpu_s_during_write"] = med([c for w, c in cpu if w]) if during else None
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {nbytes / 2**20:.0f} MiB; {device}, "
          f"{args.threads} training thread(s); medians of {args.rounds} saves each")
    print(f"{'':28s}{'sync':>10s}{'async':>10s}")
    print(f"{'blocked per save (s)':28s}{res['blocked_s_sync']:10.3f}{res['blocked_s_async']:10.3f}"
          f"   async/sync {res['blocked_ratio']:.3f} (goal <= 0.1)")
    print(f"{'step, no save (ms)':28s}{1e3 * res['step_s_no_save']:10.1f}")
    if during:
        print(f"{'step during write (ms)':28s}{'':10s}{1e3 * res['step_s_during_write']:10.1f}"
              f"   {100 * res['step_slowdown_during_write']:+.1f}% (goal within 10%; median of the rounds' "
              f"ratios to the steps right after)")
        print(f"{'training thread CPU/step (ms)':28s}{1e3 * res['cpu_s_no_save']:10.1f}"
              f"{1e3 * res['cpu_s_during_write']:10.1f}   (no save | during write)")
    print(f"{'write, save to commit (s)':28s}{'':10s}{res['async_write_s']:10.3f}"
          f"   {res['steps_per_write']:.0f} steps ran during it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
