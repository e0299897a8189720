"""Muon (issue 39, phase 1): the rule against an independent float64 reference, the settings'
refusals, and training with it in one process (checkpoint resume bit-identical).

The reference is written from the equations of the Muon and AdamW papers, per parameter, on the
model's own (TP=1) tensors in float64: the logical matrices are picked by explicit row indices
(a fused QKV's rows by KV group: heads-per-group query heads, a key head, a value head; SwiGLU's
[gate; up] halves; each stacked expert), not by the rule's views.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, validate
from megalite.data_parallel.muon import MUON
from megalite.data_parallel.update_rule import rule_named
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.model.gpt import GPTModel

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                    seq_length=16, max_position_embeddings=16, swiglu=True, num_experts=4, moe_layer_freq=[0, 1],
                    untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
A, B, C = 3.4445, -4.7750, 2.0315  # the quintic Newton-Schulz coefficients (Jordan et al., Muon)


# -- the reference, float64, from the equations ---------------------------------------------------

def ns64(u: torch.Tensor, steps: int) -> torch.Tensor:
    x = u.double()
    if x.shape[0] > x.shape[1]:
        return ns64(x.T, steps).T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = A * x + B * (s @ x) + C * (s @ s @ x)
    return x


def scale(m: int, n: int, mode: str) -> float:
    return {"spectral": math.sqrt(max(m, n)), "unit_rms_norm": math.sqrt(m / n),
            "shape_scaling": math.sqrt(max(1.0, m / n))}[mode]


def row_sets(name: str, shape, split_qkv: bool) -> list:
    """Each logical matrix as (expert index or None, row indices)."""
    heads, groups, d = MODEL.num_attention_heads, MODEL.num_query_groups, MODEL.head_dim
    hpg = heads // groups
    if len(shape) == 3:
        halves = 2 if name.endswith("w1") else 1
        r = shape[1] // halves
        return [(e, list(range(h * r, (h + 1) * r))) for e in range(shape[0]) for h in range(halves)]
    if name.endswith("qkv.weight") and split_qkv:
        def rows(slot_of):
            return [g * (hpg + 2) * d + s * d + i for g in range(groups) for s in slot_of for i in range(d)]
        return [(None, rows(range(hpg))), (None, rows([hpg])), (None, rows([hpg + 1]))]
    if name.endswith("fc1.weight"):
        half = shape[0] // 2
        return [(None, list(range(half))), (None, list(range(half, shape[0])))]
    return [(None, list(range(shape[0])))]


def is_muon(name: str, p) -> bool:
    return p.ndim >= 2 and not any(k in name for k in ("embeddings", "output_layer", "router"))


def reference_steps(params: dict, grads: list[dict], t: TrainConfig, lr: float) -> dict:
    """``params`` after one step per entry of ``grads``: Muon on the hidden matrices, AdamW on the rest."""
    w = {n: p.double().clone() for n, p in params.items()}
    m = {n: torch.zeros_like(p) for n, p in w.items()}
    v = {n: torch.zeros_like(p) for n, p in w.items()}
    beta, b1, b2 = t.muon_momentum, t.adam_beta1, t.adam_beta2
    for step, g_all in enumerate(grads, start=1):
        for n in w:
            g = g_all[n].double()
            if is_muon(n, w[n]):
                m[n] = beta * m[n] + (1 - beta) * g
                u = (1 - beta) * g + beta * m[n] if t.muon_use_nesterov else m[n]
                o = torch.zeros_like(u)
                for e, rows in row_sets(n, tuple(w[n].shape), t.muon_split_qkv):
                    src = u[e][rows] if e is not None else u[rows]
                    val = ns64(src, t.muon_num_ns_steps) * scale(*src.shape, t.muon_scale_mode)
                    if e is None:
                        o[rows] = val
                    else:
                        o[e][rows] = val
                w[n] = w[n] * (1 - lr * t.weight_decay) - lr * t.muon_extra_scale_factor * o
            else:
                wd = t.weight_decay if (w[n].ndim >= 2 and "norm" not in n) else 0.0
                w[n] = w[n] * (1 - lr * wd)
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                mh, vh = m[n] / (1 - b1 ** step), v[n] / (1 - b2 ** step)
                w[n] = w[n] - lr * mh / (vh.sqrt() + t.adam_eps)
    return w


# -- the rule through the optimizer seam ----------------------------------------------------------

def muon_steps(t: TrainConfig, grads: list[dict], lr: float):
    torch.manual_seed(0)
    model = GPTModel(MODEL)
    for p in model.parameters():
        torch.nn.init.normal_(p.data, std=0.02)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = DistributedOptimizer([model], t, None, stage=0, overlap=False, rule=rule_named(t.optimizer))
    names = {p: n for n, p in model.named_parameters()}
    for g_all in grads:
        opt.zero_grad()
        for b in opt.sync.buckets:
            flat = opt.sync.shard_grad(b)
            for p, (first, numel) in zip(b.params, b.offsets):
                flat[first: first + numel].copy_(g_all[names[p]].reshape(-1))
        opt.step(lr)
    return start, {n: p.detach() for n, p in model.named_parameters()}


CASES = {
    "spectral": dict(),
    "unit_rms_norm+nesterov": dict(muon_scale_mode="unit_rms_norm", muon_use_nesterov=True),
    "shape_scaling+no-split-qkv": dict(muon_scale_mode="shape_scaling", muon_split_qkv=False,
                                       muon_extra_scale_factor=0.2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("steps", [1, 10])
def test_muon_equals_the_float64_reference(case, steps):
    t = TrainConfig(optimizer="muon", weight_decay=0.1, muon_momentum=0.95, muon_fp32_matmul_prec="high",
                    **CASES[case])
    torch.manual_seed(1)
    shapes = {n: p.shape for n, p in GPTModel(MODEL).named_parameters()}
    grads = [{n: torch.randn(s) for n, s in shapes.items()} for _ in range(steps)]
    start, got = muon_steps(t, grads, lr=0.02)
    want = reference_steps(start, grads, t, lr=0.02)
    for n in want:
        torch.testing.assert_close(got[n].double(), want[n], rtol=2e-5, atol=2e-5, msg=n)
        assert not torch.equal(got[n], start[n]), n  # every parameter moved


def test_the_rule_takes_the_matrices_and_leaves_the_rest_to_adamw():
    from megalite.data_parallel.muon import takes_muon
    model = GPTModel(MODEL)
    taken = {n for n, p in model.named_parameters() if takes_muon(n, p)}
    assert taken == {n for n, p in model.named_parameters() if is_muon(n, p)}
    assert "layers.1.mlp.experts.w1" in taken and "layers.0.attn.qkv.weight" in taken
    assert not {"word_embeddings.weight", "output_layer.weight", "layers.1.mlp.router.weight"} & taken
    with pytest.raises(ValueError, match="Muon cannot classify parameter odd of shape"):
        takes_muon("odd", torch.nn.Parameter(torch.zeros(2, 2, 2)))
    assert MUON.record()["name"] == "muon" and (MUON.bytes_of(True), MUON.bytes_of(False)) == (8, 12)


# -- the settings ----------------------------------------------------------------------------------

def _config(**train) -> Config:
    return Config(model=dataclasses.replace(MODEL, num_experts=None, moe_layer_freq=1),
                  train=TrainConfig(optimizer="muon", **train), data=DataConfig(mock_data=True))


@pytest.mark.parametrize("train, message", [
    (dict(muon_tp_mode="sideways"), "--muon-tp-mode 'sideways' is unknown"),
    (dict(zero_stage=3), "--optimizer muon with --zero-stage 3"),
    (dict(zero_stage=1, offload_optimizer=True), "--optimizer muon with --offload-optimizer"),
    (dict(muon_num_ns_steps=0), "--muon-num-ns-steps must be >= 1, got 0"),
    (dict(muon_momentum=1.0), "--muon-momentum must be in [0, 1), got 1.0"),
])
def test_validate_refuses_what_muon_does_not_do_yet(train, message):
    validate(_config())
    validate(_config(muon_tp_mode="duplicated"))
    validate(_config(muon_tp_mode="distributed"))
    validate(_config(zero_stage=2))
    with pytest.raises(ConfigError) as e:
        validate(_config(**train))
    assert message in str(e.value) and "Fix:" in str(e.value), str(e.value)


# -- blockwise TP: Newton-Schulz per shard, against its own per-shard reference -------------------

def test_blockwise_is_newton_schulz_per_shard():
    """Each TP rank's shard (built offline: no world) orthogonalised per logical matrix of the shard
    (its q, k, v of whole KV groups; its gate and up halves; a row-parallel shard whole), scaled by
    the full matrix's shape: one step of SGD momentum from zero, so U = (1 - beta) G."""
    from megalite.data_parallel.muon import FlatMuon
    from megalite.data_parallel.update_rule import ParamPlace, ShardGeometry
    from megalite.parallel.comm import OfflineGroup
    cfg = dataclasses.replace(MODEL, num_experts=None, moe_layer_freq=1, num_layers=1)
    t = TrainConfig(optimizer="muon", weight_decay=0.0, muon_fp32_matmul_prec="high", muon_tp_mode="blockwise")
    lr, tp = 0.02, 2
    torch.manual_seed(3)
    for rank in range(tp):
        group = OfflineGroup(rank, tp)
        model = GPTModel(cfg, tp_group=group)
        named = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "embeddings" not in n
                 and "output_layer" not in n]
        masters = [torch.cat([p.detach().reshape(-1) for _, p in named]).float().zero_()]
        places, at = [], 0
        for n, p in named:
            places.append(ParamPlace(n, p, 0, at, at + p.numel(), 0))
            at += p.numel()
        torch.manual_seed(10 + rank)
        grads = [torch.randn(at)]
        states = {"momentum": [torch.zeros(at)], "exp_avg_sq": [torch.zeros(0)]}  # matrices only: no exp_avg_sq
        FlatMuon(masters, states, [[]], t, geometry=ShardGeometry(tuple(places), group, cfg)).step(grads, lr)
        for place in places:
            n, p = place.name, place.param
            u = (1 - t.muon_momentum) * grads[0][place.start:place.stop].double().view(p.shape)
            want = torch.zeros_like(u)
            split = p.tp_split
            if n.endswith("qkv.weight"):
                hpg, d = cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
                groups = p.shape[0] // ((hpg + 2) * d)
                sets = [[g * (hpg + 2) * d + s * d + i for g in range(groups) for s in slots for i in range(d)]
                        for slots in (range(hpg), [hpg], [hpg + 1])]
            elif n.endswith("fc1.weight"):
                half = p.shape[0] // 2
                sets = [list(range(half)), list(range(half, 2 * half))]
            else:
                sets = [list(range(p.shape[0]))]
            for rows in sets:
                m, k = len(rows), p.shape[1]
                fm, fk = (m * tp, k) if split.dim == 0 else (m, k * tp)
                want[rows] = ns64(u[rows], t.muon_num_ns_steps) * scale(fm, fk, t.muon_scale_mode)
            got = -masters[0][place.start:place.stop].double().view(p.shape) / lr
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=n)
        assert [place.name.split('.')[-2] for place in places] == ['qkv', 'proj', 'fc1', 'fc2']


def test_zero_ownership_balances_newton_schulz_cost_over_the_buckets():
    from megalite.data_parallel.muon import ns_cost, owners
    big, small = torch.zeros(64, 32), torch.zeros(32, 32)
    assert ns_cost(big) == 64 * 32 * 32 and ns_cost(torch.zeros(4, 8, 16)) == 4 * 8 * 16 * 8
    load = [0, 0]
    assert owners([("a", small, 0), ("b", big, 1024), ("c", small, 3072)], load) == [1, 0, 1]
    assert owners([("d", small, 0)], load) == [0] and load == [ns_cost(big) + ns_cost(small), 2 * ns_cost(small)]


def test_a_step_with_found_inf_changes_nothing():
    """fp16's overflow skip, decided on the device: weights, momentum and the step count unchanged."""
    t = TrainConfig(optimizer="muon", weight_decay=0.1, muon_fp32_matmul_prec="high")
    torch.manual_seed(0)
    model = GPTModel(MODEL)
    for p in model.parameters():
        torch.nn.init.normal_(p.data, std=0.02)
    opt = DistributedOptimizer([model], t, None, stage=0, overlap=False, rule=MUON)
    for b in opt.sync.buckets:
        opt.sync.shard_grad(b).normal_()
    opt.step(0.02)
    before = [x.clone() for x in opt.master + opt.state["momentum"] + opt.state["exp_avg_sq"]]
    opt.step(0.02, found_inf=torch.ones(()))
    after = opt.master + opt.state["momentum"] + opt.state["exp_avg_sq"]
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and opt.step_count == 1
    opt.step(0.02, found_inf=torch.zeros(()))
    assert not torch.equal(before[0], opt.master[0]) and opt.step_count == 2


# -- state bytes per class -------------------------------------------------------------------------

DENSE = dataclasses.replace(MODEL, num_experts=None, moe_layer_freq=1)
MLA_MTP = dataclasses.replace(MODEL, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                              qk_pos_emb_head_dim=4, v_head_dim=8, num_query_groups=4, mtp_num_layers=1,
                              moe_shared_expert_intermediate_size=32, position_embedding_type="rope")


def planned_state_bytes(m, rule, dp: int = 1, zero: int = 0) -> float:
    """The planner's fp32 master + optimizer-state bytes of one rank (pipeline stage 0)."""
    from megalite.planner.estimate import stage_memory
    from megalite.planner.types import Layout, precision
    layout = Layout(dp=dp, zero=zero, experts=bool(m.num_experts))
    return stage_memory(m, layout, 0, 1, 1, precision("bf16", rule=rule))[1]["master_and_optimizer"]


def held_state_bytes(opt) -> int:
    mem = opt.memory_bytes()
    return mem["master_weights"] + mem["optimizer_state"]


@pytest.mark.parametrize("m", [DENSE, MODEL, MLA_MTP], ids=["gqa_swiglu", "moe", "mla_shared_mtp"])
def test_a_muon_matrix_holds_8_bytes_the_rest_12_and_the_planner_counts_them(m):
    """Master + momentum for a Muon matrix, master + both Adam moments for the rest: what
    DistributedOptimizer allocates, to the byte, equals the planner's count (from the parts'
    shapes), the memory tracker's and the whole model's matrix count preflight uses; AdamW keeps
    12 everywhere. (DP 2 ZeRO-1:
    test_muon_parallel.py's two-rank world.)"""
    from megalite.data_parallel.accounting import matrix_parameters, model_parameters
    from megalite.data_parallel.rule_types import ADAMW
    from megalite.model.counting import total_matrix_parameters
    from megalite.observe.memory_tracker import training_tracker
    muon = DistributedOptimizer([GPTModel(m)], TrainConfig(optimizer="muon"), None, overlap=False, rule=MUON)
    psi, matrices = model_parameters(muon), matrix_parameters(muon)
    names = {p: n for n, p in muon.chunks[0].named_parameters()}
    assert matrices == sum(p.numel() for p, n in names.items() if MUON.is_matrix(n, p)) > psi // 2
    assert held_state_bytes(muon) == 8 * matrices + 12 * (psi - matrices) == planned_state_bytes(m, MUON)
    assert sum(s.numel() for s in muon.state["exp_avg_sq"]) == psi - matrices
    tracked = training_tracker(muon.chunks, muon).summary()["live_by_category"]["optimizer state"]
    assert tracked == held_state_bytes(muon)  # --track-memory counts the same bytes
    adam = DistributedOptimizer([GPTModel(m)], TrainConfig(), None, overlap=False)
    assert held_state_bytes(adam) == 12 * psi == planned_state_bytes(m, ADAMW)
    assert total_matrix_parameters(m) == matrices  # the whole model's: what preflight's disk check counts
    for piece in muon.places:
        kept = muon.state_piece("exp_avg_sq", piece.shard, piece.start, piece.stop - piece.start)
        assert (kept is None) == MUON.is_matrix(piece.name, piece.param), piece.name


# Muon as it was before the per-class state: exp_avg_sq over every parameter, no "held_by" mark.
MUON_BEFORE_THE_SPLIT = dataclasses.replace(MUON, takes_matrix=None, matrix_state=())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:.*deprecating ShardedTensor:FutureWarning")
@pytest.mark.parametrize("fmt", ["megalite", "torch_dcp"])
def test_a_checkpoint_holds_each_parameters_own_state_and_one_from_before_the_split_loads(tmp_path, fmt):
    """Saved and loaded (both formats, and resharded into the other one by
    tools/reshard_checkpoint.py): every state element the run keeps comes back, a Muon matrix has
    no exp_avg_sq piece; a checkpoint written by the Muon that kept exp_avg_sq over every
    parameter loads into today's (only the AdamW-stepped parameters' exp_avg_sq is read)."""
    import json
    import os

    from megalite.checkpoint import load_checkpoint, save_checkpoint, save_dcp_checkpoint
    from megalite.checkpoint.dcp import load_dcp_checkpoint
    from megalite.config import ParallelConfig
    from tools import reshard_checkpoint
    save, load = {"megalite": (save_checkpoint, load_checkpoint),
                  "torch_dcp": (save_dcp_checkpoint, load_dcp_checkpoint)}[fmt]
    model = dataclasses.replace(DENSE, vocab_size=128)  # no padding rows: every element survives
    config = Config(model, ParallelConfig(), TrainConfig(optimizer="muon", micro_batch_size=1, global_batch_size=1),
                    DataConfig(mock_data=True))

    def optimizer(rule, seed):
        model = GPTModel(config.model)
        model.init_weights(seed)
        opt = DistributedOptimizer([model], config.train, None, overlap=False, rule=rule)
        for k, shards in enumerate(opt.state.values()):  # state unlike the weights and unlike zero
            for shard in shards:
                shard.copy_(torch.arange(shard.numel()) * (k + 1) / max(shard.numel(), 1) + seed)
        return opt

    other = {"megalite": ("torch_dcp", load_dcp_checkpoint), "torch_dcp": ("megalite", load_checkpoint)}[fmt]
    for writer, resharded in ((MUON, False), (MUON, True), (MUON_BEFORE_THE_SPLIT, False)):
        root = str(tmp_path / f"{writer.takes_matrix is None}")
        saved = optimizer(writer, 3)
        save(root, 5, saved, None, config, None, consumed_samples=5)
        record = json.load(open(os.path.join(root, "iter_0000005", "metadata.json")))["update_rule"]
        assert [s.get("held_by") for s in record["state"]] == (
            [None, "non-matrix"] if writer is MUON else [None, None])
        loaded = optimizer(MUON, 7)
        if resharded:  # tools/reshard_checkpoint.py into the other format, which carries what the source holds
            reshard_checkpoint.reshard(root, str(tmp_path / "other"), to_format=other[0])
            other[1](str(tmp_path / "other"), loaded, None, config, None)
        else:
            load(root, loaded, None, config, None)
        for piece in loaded.places:
            for kind in ("weight", "momentum", "exp_avg_sq"):
                got = loaded.state_piece(kind, piece.shard, piece.start, piece.stop - piece.start)
                want = saved.state_piece(kind, piece.shard, piece.start, piece.stop - piece.start)
                assert (got is None) == (kind == "exp_avg_sq" and MUON.is_matrix(piece.name, piece.param))
                if got is not None:
                    assert torch.equal(got, want), (writer.takes_matrix, piece.name, kind)


def test_preflight_counts_a_muon_checkpoint_per_class(tmp_path, monkeypatch):
    """The disk check's bytes: 8 per matrix parameter and 12 per other, from the model's counts."""
    from megalite.checkpoint.format import CheckpointError
    from megalite.train import preflight
    free = 8 * 600 + 12 * 400
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: type("U", (), {"free": free})())
    preflight.check_save_location(str(tmp_path), 1000, MUON, matrix_parameters=600)  # fits exactly
    with pytest.raises(CheckpointError, match=r"599 matrix parameters x 8 bytes and 401 others x 12: fp32 weights "
                                              r"and two Muon/Adam state \(one for a matrix\)"):
        preflight.check_save_location(str(tmp_path), 1000, MUON, matrix_parameters=599)  # 4 bytes more
