"""Context parallelism in training: the GPT's loss and gradients, and pretrain_gpt.py's losses and
gradient norms, under CP (with TP and DP) against one process (the blocks and ring attention
themselves: tests/test_context_parallel.py)."""
import functools
import os

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.parallel.grid import build_grid
from megalite.testing import run_world
from tests.test_context_parallel import TOL


def _gpt_worker(rank, world, tp, variant, backends):
    from megalite.model.gpt import GPTModel
    from megalite.parallel import comm
    from megalite.parallel.sharding import gather_full
    from megalite.testing.reference_step import sequence_parallel_allreduce_gradients
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
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    refs = dict(ref.named_parameters())
    errs = {}
    for backend in backends:
        cfg.attention_backend = backend
        model = GPTModel(cfg, tp_group=grid.tp_group, sequence_parallel=tp > 1, cp_group=grid.cp_group)
        model.init_weights(5)
        mine = context_parallel_slice(batch, grid.cp_rank, cp)
        loss = model(mine["tokens"], mine["position_ids"], labels=mine["labels"]).mean()
        loss.backward()
        sequence_parallel_allreduce_gradients(list(model.parameters()), grid.tp_group)
        total = comm.all_reduce(loss.detach().clone(), grid.cp_group) / cp  # equal tokens per CP rank
        errs[backend, "loss"] = abs(total.item() - ref_loss.item()) / ref_loss.item()
        for name, p in model.named_parameters():
            g = comm.all_reduce(p.grad.clone(), grid.cp_group) / cp  # the DP x CP mean
            full = gather_full(g, getattr(p, "tp_split", None), grid.tp_group)[: refs[name].shape[0]]
            errs[backend, name] = ((full - refs[name].grad).abs().max()
                                   / max(refs[name].grad.abs().max().item(), 1e-3 * gmax)).item()
    return errs


@pytest.mark.parametrize("world,tp,variant,backends", [(2, 1, "gpt2", ["auto"]), pytest.param(2, 1, "llama", ["auto", "triton"], marks=pytest.mark.slow),
                                                       (4, 2, "gpt2", ["torch"])])
def test_gpt_context_parallel_matches_serial(world, tp, variant, backends):
    """The default backend (auto: the torch math blocks on a CPU), and once the Triton kernels."""
    ranks = run_world(_gpt_worker, world, tp, variant, backends)
    assert len(ranks) == world
    for errs in ranks:
        assert {b for b, _ in errs} == set(backends), sorted(errs)  # every backend ran and was compared
        assert all((b, "loss") in errs for b in backends)
        assert all(v < TOL for v in errs.values()), {k: v for k, v in errs.items() if v >= TOL}


PRETRAIN = ["--mock-data", "--vocab-size", "300", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
# With the default backend ring attention runs on the torch math blocks (fast on a CPU), so
# CI runs the 20 iterations of the issue on both layouts; the Triton kernels, in the slow
# interpreter (~0.3 s a launch here), get a short CP=2 run (MEGALITE_FULL_CP_TEST=1: 20): two
# iterations, so the second one's loss and gradient norm come from weights the first updated
# (a wrong gradient shows there), of one micro-batch of 2 sequences (the interpreter's time goes
# with the sequences; accumulating micro-batches is the same code on every backend, which the
# other layouts check).
FULL = bool(os.environ.get("MEGALITE_FULL_CP_TEST"))
ITERS, TRITON_ITERS = "20", ("20" if FULL else "2")
ONE_MICRO_BATCH = ["--global-batch-size", "2"]


def _pretrain_worker(rank, world, extra):
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + extra)]


@functools.lru_cache
def _serial_log(iters, batch=()):
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(PRETRAIN + list(batch) + ["--train-iters", iters])]


CP2 = ["--context-parallel-size", "2"]
PRETRAIN_LAYOUTS = {  # name: (world, flags, iterations, batch flags); no --attention-backend: the default
    "CP=2": (2, CP2, ITERS, ()),
    "TP=2 x CP=2 x DP=2": (8, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ITERS, ()),
    "CP=2 on the Triton kernels": (2, CP2 + ["--attention-backend", "triton"], TRITON_ITERS,
                                   () if FULL else tuple(ONE_MICRO_BATCH)),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "CP=2" else pytest.mark.slow)
                                  for n in PRETRAIN_LAYOUTS])
def test_pretrain_context_parallel_matches_single_process(name):
    world, extra, iters, batch = PRETRAIN_LAYOUTS[name]
    serial = _serial_log(iters, batch)
    worst = 0.0
    for log in run_world(_pretrain_worker, world, extra + list(batch) + ["--train-iters", iters], timeout=600):
        assert len(log) == len(serial) == int(iters)
        for got, ref in zip(log, serial):
            worst = max([worst] + [abs(a - b) / b for a, b in zip(got, ref)])
    print(f"{name}: largest relative loss / grad-norm difference vs 1 process, {iters} iterations:", worst)
    assert worst < 1e-5, worst
