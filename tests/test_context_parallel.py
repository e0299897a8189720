"""Context parallelism: ring attention against full attention, load balance, overlap, GPT."""
import os

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.kernels.attention_reference import attention_reference
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _ring_worker(rank, world, causal, heads, groups, seq, d):
    from megalite.context_parallel import ring_attention as ra
    grid = build_grid(ParallelConfig(context_parallel_size=world), world, rank)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, d, generator=g)
    k = torch.randn(2, groups, seq, d, generator=g)
    v = torch.randn(2, groups, seq, d, generator=g)
    dout = torch.randn(2, heads, seq, d, generator=g)
    # Reference on the whole sequence, float64.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=causal)
    ref.backward(dout.double())

    def mine(t):  # this rank's slice along the sequence (dim 2)
        return context_parallel_slice({"x": t.flatten(0, 1)}, rank, world, causal)["x"].view(
            t.shape[0], t.shape[1], -1, t.shape[3])

    ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
    ra.WORK_LOG.clear()
    exchange = ra.RingExchange(grid.cp_group)
    out = ra.ring_attention(ql, kl, vl, grid.cp_group, causal=causal, exchange=exchange)
    out.backward(mine(dout))
    errs = {"out": rel(out, mine(ref.detach())), "dq": rel(ql.grad, mine(q64.grad)),
            "dk": rel(kl.grad, mine(k64.grad)), "dv": rel(vl.grad, mine(v64.grad))}
    return errs, list(ra.WORK_LOG), exchange.events


CASES = [(2, True, 4, 4, 16, 16), (2, False, 4, 2, 16, 16), (4, True, 4, 2, 32, 16), (4, False, 2, 2, 32, 32),
         (2, True, 2, 1, 24, 32)]


@pytest.mark.parametrize("world,causal,heads,groups,seq,d", CASES)
def test_ring_attention_matches_full_attention(world, causal, heads, groups, seq, d):
    for errs, _, _ in run_world(_ring_worker, world, causal, heads, groups, seq, d):
        assert all(v < TOL for v in errs.values()), errs


def _flops(work, chunk):
    """Attention FLOPs of the logged kernel calls: a full chunk pair costs chunk^2, the causal
    diagonal about half (the kernel skips masked blocks)."""
    return sum(chunk * chunk * (0.5 if diag else 1.0) for _, _, diag in work)


def naive_contiguous_flops(seq, world):
    """Rank r holding positions [r*S/C, (r+1)*S/C) does its diagonal block plus r full blocks."""
    c = seq // world
    return [c * c * (r + 0.5) for r in range(world)]


def test_load_balanced_causal_split_is_equal_across_ranks():
    seq, world = 32, 4
    results = run_world(_ring_worker, world, True, 2, 2, seq, 16)
    flops = [_flops(work, seq // (2 * world)) for _, work, _ in results]
    assert max(flops) / min(flops) - 1 < 0.05, flops
    naive = naive_contiguous_flops(seq, world)
    assert sum(flops) == pytest.approx(sum(naive))  # the same total work...
    assert max(naive) / min(naive) > 5  # ...which the contiguous split spreads 7:1
    # Fully masked pairs do no work: of the 4C chunk pairs a rank meets, 2C + 1 are visible
    # (its two diagonals, then two per visiting block).
    assert all(len(work) == 2 * world + 1 for _, work, _ in results)
    print("causal attention work per rank (chunk-pair units): balanced", flops, "contiguous", naive)


def test_next_kv_transfer_is_in_flight_while_computing():
    results = run_world(_ring_worker, 2, True, 2, 2, 16, 16)
    for _, _, events in results:
        kinds = [e[0] for e in events]
        # forward: the transfer of the next block is posted before its compute starts,
        # and waited for only after the compute of the current block is done.
        first = kinds.index("posted")
        assert kinds[first: first + 4] == ["posted", "compute", "computed", "arrived"]
        t = {k: v for k, v in events[first: first + 4]}
        assert t["posted"] <= t["compute"] < t["computed"] <= t["arrived"]


def test_context_parallel_slice_keeps_true_positions():
    batch = {"position_ids": torch.arange(16).expand(2, -1)}
    assert context_parallel_slice(batch, 0, 2)["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel_slice(batch, 1, 2)["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert context_parallel_slice(batch, 1, 2, causal=False)["position_ids"][0].tolist() == list(range(8, 16))


def _gpt_worker(rank, world, tp, variant):
    from megalite.model.gpt import GPTModel
    from megalite.parallel import comm
    from megalite.parallel.sharding import gather_full
    from megalite.training import sequence_parallel_allreduce_gradients
    extra = {} if variant == "gpt2" else dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=2, add_bias_linear=False)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, **extra)
    cp = world // tp
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     sequence_parallel=tp > 1), world, rank)
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "position_ids": torch.arange(16).expand(2, -1)}
    ref = GPTModel(cfg)
    ref.init_weights(5)
    ref_loss = ref(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
    ref_loss.backward()
    cfg.attention_backend = "triton"
    model = GPTModel(cfg, tp_group=grid.tp_group, sequence_parallel=tp > 1, cp_group=grid.cp_group)
    model.init_weights(5)
    mine = context_parallel_slice(batch, grid.cp_rank, cp)
    loss = model(mine["tokens"], mine["position_ids"], labels=mine["labels"]).mean()
    loss.backward()
    sequence_parallel_allreduce_gradients(list(model.parameters()), grid.tp_group)
    total = comm.all_reduce(loss.detach().clone(), grid.cp_group) / cp  # equal tokens per CP rank
    errs = {"loss": abs(total.item() - ref_loss.item()) / ref_loss.item()}
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = comm.all_reduce(p.grad.clone(), grid.cp_group) / cp  # the DP x CP mean
        full = gather_full(g, getattr(p, "tp_split", None), grid.tp_group)[: refs[name].shape[0]]
        errs[name] = ((full - refs[name].grad).abs().max() / max(refs[name].grad.abs().max().item(), 1e-3 * gmax)).item()
    return errs


@pytest.mark.parametrize("world,tp,variant", [(2, 1, "gpt2"), (2, 1, "llama"), (4, 2, "gpt2")])
def test_gpt_context_parallel_matches_serial(world, tp, variant):
    for errs in run_world(_gpt_worker, world, tp, variant):
        assert all(v < TOL for v in errs.values()), {k: v for k, v in errs.items() if v >= TOL}


PRETRAIN = ["--mock-data", "--vocab-size", "300", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
# The Triton interpreter makes every attention call slow on a CPU (~0.3 s a launch here); the
# 20 iterations of the issue take ~8 minutes (both layouts matched one process to 1.7e-7), so
# CI runs 3 iterations at CP=2 and 2 on 8 ranks; MEGALITE_FULL_CP_TEST=1 runs all 20.
FULL = bool(os.environ.get("MEGALITE_FULL_CP_TEST"))
ITERS, ITERS_8 = ("20", "20") if FULL else ("3", "2")


def _pretrain_worker(rank, world, extra):
    from megalite.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + extra)]


def test_pretrain_context_parallel_matches_single_process():
    from megalite.pretrain import pretrain
    serial = [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + ["--train-iters", ITERS])]
    cp = ["--train-iters", ITERS, "--attention-backend", "triton", "--context-parallel-size", "2"]
    layouts = {"CP=2": (2, cp),
               "TP=2 x CP=2 x DP=2": (8, cp + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--train-iters", ITERS_8])}
    worst = {}
    for name, (world, extra) in layouts.items():
        for log in run_world(_pretrain_worker, world, extra, timeout=600):
            for got, ref in zip(log, serial):
                worst[name] = max([worst.get(name, 0.0)] + [abs(a - b) / b for a, b in zip(got, ref)])
    print(f"largest relative loss / grad-norm difference vs 1 process, {ITERS} iterations:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst
