"""Each --cp-comm-type trains exactly like one process: the GPT's loss and every gradient, and
pretrain's losses and gradient norms, against the serial run (fp32, 1e-5 relative).

Worlds are expensive on two cores, so each world runs many checks in sequence (pretrain leaves
the process group up; the grid's groups are reused by rank list) and module fixtures share
the results between the test functions:

- CP=2 (2 ranks): a2a, allgather, a2a+p2p as 2x1 and 1x2, a2a with selective recompute,
  allgather with full recompute, a checkpoint saved under p2p resumed under a2a, and the GPT
  (GQA + RoPE) under a2a and allgather.
- CP=4 (4 ranks), Llama-style (RoPE, GQA with 2 key/value groups, RMSNorm, SwiGLU): all four
  types, a2a+p2p as 2x2; a2a over 4 ranks replicates the 2 groups to lcm(2, 4) = 4. And the GPT
  (loss and every gradient) under all four.
- Also at 4 ranks: PP2 x CP2 under allgather with ZeRO-2, and CP2 x DP2 under a2a with MoE (EP2).
- 8 ranks: TP2 x CP4 (a2a+p2p 2x2) x DP1 and TP2 x CP2 (a2a) x DP2, both with sequence
  parallelism.
"""
import functools

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.context_parallel.data import context_parallel_slice
from megalite.parallel.grid import build_grid
from megalite.testing import run_world

TOL = 1e-5
ITERS = "4"
BASE = ["--mock-data", "--vocab-size", "300", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
LLAMA = ["--position-embedding-type", "rope", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear"]


def cp_flags(cp: int, comm_type: str, sizes=None) -> list[str]:
    flags = ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]
    return flags + (["--hierarchical-context-parallel-sizes", *map(str, sizes)] if sizes else [])


def worst_rel(log, ref) -> float:
    assert len(log) == len(ref)
    return max(abs(a - b) / abs(b) for got, want in zip(log, ref) for a, b in zip(got, want))


@functools.lru_cache
def serial_log(extra: tuple = ()) -> list:
    from megalite.train.pretrain import pretrain
    return [(r["loss"], r["grad_norm"]) for r in pretrain(BASE + list(extra) + ["--train-iters", ITERS])]


def _pretrain(argv) -> list:
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in pretrain(argv)]


def gpt_errors(rank, world, comm_types, sizes=None) -> dict:
    """Loss and every gradient of the Llama-style GPT (GQA, RoPE) with CP = world under each
    type, against the same model in this one process; relative to the largest gradient. Also
    the collective kinds each type's forward and backward used."""
    from megalite.model.gpt import GPTModel
    from megalite.parallel import comm
    from megalite.parallel.sharding import gather_full
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=97, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      add_bias_linear=False)
    grid = build_grid(ParallelConfig(context_parallel_size=world, hierarchical_context_parallel_sizes=sizes),
                      world, rank)
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "position_ids": torch.arange(16).expand(2, -1)}
    ref = GPTModel(cfg)
    ref.init_weights(5)
    ref_loss = ref(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
    ref_loss.backward()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    refs = dict(ref.named_parameters())
    errs, kinds = {}, {}
    mine = context_parallel_slice(batch, grid.cp_rank, world)
    for comm_type in comm_types:
        cfg.cp_comm_type = comm_type
        model = GPTModel(cfg, cp_group=grid.cp_group, cp_hierarchy=grid.cp_hierarchy)
        model.init_weights(5)
        with comm.count_collectives() as traffic:
            loss = model(mine["tokens"], mine["position_ids"], labels=mine["labels"]).mean()
            loss.backward()
        kinds[comm_type] = set(traffic)
        total = comm.all_reduce(loss.detach().clone(), grid.cp_group) / world  # equal tokens per rank
        errs[comm_type, "loss"] = abs(total.item() - ref_loss.item()) / ref_loss.item()
        for name, p in model.named_parameters():
            g = comm.all_reduce(p.grad.clone(), grid.cp_group) / world
            full = gather_full(g, getattr(p, "tp_split", None), None)[: refs[name].shape[0]]
            errs[comm_type, name] = ((full - refs[name].grad).abs().max()
                                     / max(refs[name].grad.abs().max().item(), 1e-3 * gmax)).item()
    return errs, kinds


def _world_worker(rank, world, runs, gpt=None):
    """Each run: (name, argv) for pretrain; ``gpt``: (types, sizes) for :func:`gpt_errors`."""
    out = {name: _pretrain(argv) for name, argv in runs}
    if gpt is not None:
        out["gpt"] = gpt_errors(rank, world, *gpt)
    return out


# What each type hands to the collectives (the ring's blocks travel by send/recv).
KINDS = {"p2p": {"send"}, "a2a": {"all_to_all"}, "allgather": {"all_gather"}, "a2a+p2p": {"all_to_all", "send"}}


def _check_gpt(ranks, types):
    worst = 0.0
    for out in ranks:
        errs, kinds = out["gpt"]
        assert {t for t, _ in errs} == set(types) and all((t, "loss") in errs for t in types)
        assert {t: kinds[t] & {"send", "all_to_all", "all_gather"} for t in types} == {t: KINDS[t] for t in types}
        worst = max([worst] + list(errs.values()))
        assert worst < TOL, {k: v for k, v in errs.items() if v >= TOL}
    return worst


# -- CP = 2 ------------------------------------------------------------------------------------
CP2_RUNS = {
    "a2a": cp_flags(2, "a2a"),
    "allgather": cp_flags(2, "allgather"),
    "a2a+p2p 2x1": cp_flags(2, "a2a+p2p", (2, 1)),
    "a2a+p2p 1x2": cp_flags(2, "a2a+p2p", (1, 2)),
    "a2a, selective recompute": cp_flags(2, "a2a") + ["--recompute-granularity", "selective"],
    "allgather, full recompute": cp_flags(2, "allgather") + ["--recompute-granularity", "full"],
}


@pytest.fixture(scope="module")
def cp2_world(tmp_path_factory):
    """One world of 2 ranks for every CP=2 check; the resume pair last (it needs the save)."""
    ckpt = str(tmp_path_factory.mktemp("cp_resume"))
    iters = ["--train-iters", ITERS]
    runs = [(name, BASE + flags + iters) for name, flags in CP2_RUNS.items()]
    dropout = ["--hidden-dropout", "0.1"]  # the resume must restore the random streams too
    runs += [("p2p, saved", BASE + dropout + cp_flags(2, "p2p") + iters + ["--save", ckpt, "--save-interval", "2"]),
             ("a2a, resumed", BASE + dropout + cp_flags(2, "a2a") + iters + ["--load", ckpt, "--ckpt-step", "2"])]
    return run_world(_world_worker, 2, runs, (["a2a", "allgather"], None), timeout=300)


@pytest.mark.parametrize("name", CP2_RUNS)
def test_pretrain_cp2_each_type_matches_single_process(cp2_world, name):
    serial, worst = serial_log(), 0.0
    for out in cp2_world:
        worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
        assert worst < TOL, (name, worst)
    print(f"CP=2 {name}: largest relative loss / grad-norm difference vs 1 process:", worst)


def test_checkpoint_saved_under_p2p_resumes_under_a2a(cp2_world):
    """The type changes no weight and no layout: a p2p checkpoint of iteration 2 continues under
    a2a with the losses of the uninterrupted p2p run, hidden dropout included (so the random
    streams were restored: the layout record is the same)."""
    worst = 0.0
    for out in cp2_world:
        full, resumed = out["p2p, saved"], out["a2a, resumed"]
        assert [r[0] for r in resumed] == [3, 4]
        worst = max(worst, worst_rel([r[1:] for r in resumed], [r[1:] for r in full[2:]]))
        assert worst < TOL, worst
    print("p2p checkpoint resumed under a2a: largest relative difference vs uninterrupted:", worst)


def test_gpt_cp2_a2a_and_allgather_match_serial(cp2_world):
    print("GPT (GQA, RoPE) CP=2 a2a/allgather, largest relative error:",
          _check_gpt(cp2_world, ["a2a", "allgather"]))


# -- CP = 4, Llama-style -------------------------------------------------------------------------
CP4_RUNS = {"p2p": cp_flags(4, "p2p"), "a2a": cp_flags(4, "a2a"), "allgather": cp_flags(4, "allgather"),
            "a2a+p2p 2x2": cp_flags(4, "a2a+p2p", (2, 2))}
CP4_TYPES = ["p2p", "a2a", "allgather", "a2a+p2p"]


# In the same 4-rank world: the other types beside pipeline, ZeRO and experts. name: (model flags
# of the serial reference, parallel flags).
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
COMBINED_RUNS = {
    "PP2 x CP2 (allgather), ZeRO-2 over DP x CP": (("--num-layers", "2"), ["--pipeline-model-parallel-size", "2",
                                                   "--zero-stage", "2"] + cp_flags(2, "allgather")),
    "CP2 (a2a) x DP2, MoE with EP2": (MOE, ["--expert-model-parallel-size", "2"] + cp_flags(2, "a2a")),
}


@pytest.fixture(scope="module")
def cp4_world():
    runs = [(name, BASE + LLAMA + flags + ["--train-iters", ITERS]) for name, flags in CP4_RUNS.items()]
    runs += [(name, BASE + list(model) + flags + ["--train-iters", ITERS])
             for name, (model, flags) in COMBINED_RUNS.items()]
    return run_world(_world_worker, 4, runs, (CP4_TYPES, (2, 2)), timeout=300)


@pytest.mark.parametrize("name", COMBINED_RUNS)
@pytest.mark.slow
def test_pretrain_cp_types_with_pipeline_zero_and_experts_match_single_process(cp4_world, name):
    serial, worst = serial_log(COMBINED_RUNS[name][0]), 0.0
    for out in cp4_world:
        worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
        assert worst < TOL, (name, worst)
    print(f"{name}: largest relative loss / grad-norm difference vs 1 process:", worst)


@pytest.mark.parametrize("name", CP4_RUNS)
@pytest.mark.slow
def test_pretrain_cp4_each_type_matches_single_process(cp4_world, name):
    serial, worst = serial_log(tuple(LLAMA)), 0.0
    for out in cp4_world:
        worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
        assert worst < TOL, (name, worst)
    print(f"CP=4 llama {name}: largest relative loss / grad-norm difference vs 1 process:", worst)


@pytest.mark.slow
def test_gpt_cp4_each_type_matches_serial(cp4_world):
    """Loss and every gradient, GQA (2 groups) and RoPE, for the four types at CP=4."""
    print("GPT (GQA, RoPE) CP=4 all types, largest relative error:", _check_gpt(cp4_world, CP4_TYPES))


# -- 8 ranks: with tensor and sequence parallelism --------------------------------------------
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EIGHT_RUNS = {"TP2 x CP4 (a2a+p2p 2x2) x DP1": TP2_SP + cp_flags(4, "a2a+p2p", (2, 2)),
              "TP2 x CP2 (a2a) x DP2": TP2_SP + cp_flags(2, "a2a")}


@pytest.mark.slow
def test_pretrain_8_ranks_tp_sp_with_hierarchical_and_a2a_match_single_process():
    serial, worst = serial_log(), 0.0
    runs = [(name, BASE + flags + ["--train-iters", ITERS]) for name, flags in EIGHT_RUNS.items()]
    for out in run_world(_world_worker, 8, runs, timeout=300):
        for name in EIGHT_RUNS:
            worst = max(worst, worst_rel([r[1:] for r in out[name]], serial))
            assert worst < TOL, (name, worst)
    print("8 ranks (TP2 x CP4 a2a+p2p 2x2; TP2 x CP2 a2a x DP2): largest relative difference:", worst)
