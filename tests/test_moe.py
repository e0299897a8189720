"""Mixture of experts: router math, the serial layer against a float64 per-token loop, and
expert parallelism (EP2, EP4 on gloo) against the serial layer. fp32, ~1e-5."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megalite.moe import MoELayer, TopKRouter, grouped_mlp
from megalite.moe.router import capacity
from megalite.testing import run_world
from tests.device_twins import device_cases

H, FFN, E, K, T = 16, 12, 8, 2, 20  # T tokens per rank (not a power of two)
SEED, STD = 1234, 0.3
AUX, ZC = 0.1, 0.01
ERRORS: dict[str, float] = {}


def _err(name, got, want, tol=1e-5):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got - want).abs().max().item() / max(0.1, want.abs().max().item())  # relative, floor 0.1
    ERRORS[name] = max(ERRORS.get(name, 0.0), err)
    assert err <= tol, f"{name}: max error {err:.3g} > {tol}"


def _data(tokens, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)


def _layer(ep_group=None, cf=None, swiglu=True, token_group=None):
    layer = MoELayer(H, FFN, E, K, ep_group=ep_group, token_group=token_group, capacity_factor=cf,
                     swiglu=swiglu, aux_loss_coeff=AUX, z_loss_coeff=ZC)
    layer.init_weights(SEED, "layers.0.mlp.", std=STD)
    return layer


def _run(layer, x, g, share_scale=1.0):
    """loss = sum(out * g) / T_local + share_scale * moe_loss: a per-rank mean; over a token
    group of P ranks (``share_scale`` P) the ranks' losses sum to P times the batch's loss,
    as context-parallel ranks' do (megalite.moe.block)."""
    x = x.clone().requires_grad_(True)
    out, moe_loss = layer(x)
    ((out * g).sum() / x.shape[0] + share_scale * moe_loss).backward()
    s = layer.last_stats
    return dict(out=out.detach(), dx=x.grad, grads=layer.global_named_grads("layers.0.mlp."),
                aux=s.aux_loss.detach(), z=s.z_loss.detach(), kept=s.kept, ids=s.expert_ids)


# -- router -----------------------------------------------------------------------------------------

def test_router_topk_weights_and_hand_computed_losses():
    logits = [[2.0, 1.0, 0.0, -1.0], [0.5, 0.7, 3.0, 0.0], [1.0, -2.0, 0.0, 2.5]]
    router = TopKRouter(4, 4, 2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))  # logits = x
    r = router(torch.tensor(logits))
    # by hand, in plain Python
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    top = [sorted(range(4), key=lambda e: -p[e])[:2] for p in probs]
    assert r.expert_ids.tolist() == top  # [[0,1],[2,1],[3,0]] (no ties)
    for t, (p, c) in enumerate(zip(probs, top)):
        want = [p[c[0]] / (p[c[0]] + p[c[1]]), p[c[1]] / (p[c[0]] + p[c[1]])]
        assert r.weights[t].tolist() == pytest.approx(want, abs=1e-6)
    assert torch.allclose(r.weights.sum(-1), torch.ones(3))
    f = [sum(c.count(e) for c in top) / (3 * 2) for e in range(4)]
    P = [sum(p[e] for p in probs) / 3 for e in range(4)]
    assert r.aux_loss.item() == pytest.approx(4 * sum(fe * pe for fe, pe in zip(f, P)), abs=1e-6)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits]
    assert r.z_loss.item() == pytest.approx(sum(v * v for v in lse) / 3, abs=1e-5)
    assert r.tokens_per_expert.tolist() == [sum(c.count(e) for c in top) for e in range(4)]
    # uniform routing gives aux = 1
    u = TopKRouter(4, 4, 1)
    with torch.no_grad():
        u.weight.copy_(torch.eye(4))
    assert u(torch.eye(4) * 5).aux_loss.item() == pytest.approx(1.0)


def test_router_capacity_first_come_deterministic():
    # 6 tokens, 2 experts, k=1, all prefer expert 0 except token 4: C = ceil(1.0*6*1/2) = 3
    router = TopKRouter(2, 2, 1, capacity_factor=1.0)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    x = torch.tensor([[3.0, 0], [2, 0], [1, 0], [4, 0], [0, 1], [5, 0]])
    for _ in range(2):
        r = router(x)
        assert r.expert_ids[:, 0].tolist() == [0, 0, 0, 0, 1, 0]
        assert r.kept[:, 0].tolist() == [True, True, True, False, True, False]
        assert r.weights[~r.kept].abs().sum() == 0 and (r.weights[r.kept] > 0).all()
        assert r.tokens_per_expert.tolist() == [3, 1]
    assert capacity(1.0, 6, 1, 2) == 3 and capacity(1.25, 20, 2, 8) == 7


def test_grouped_mlp_empty_groups_give_zero_grads():
    w1 = torch.randn(3, 8, 4, requires_grad=True)
    w2 = torch.randn(3, 4, 4, requires_grad=True)
    x = torch.randn(5, 4)
    y = grouped_mlp(x, [2, 0, 3], w1, w2)
    want = torch.cat([F.linear(F.silu(a) * b, w2[e]) for e, rows in ((0, x[:2]), (2, x[2:]))
                      for a, b in [F.linear(rows, w1[e]).chunk(2, -1)]])
    assert torch.allclose(y, want)
    y.sum().backward()
    assert w1.grad[1].abs().sum() == 0
    w1.grad = None
    grouped_mlp(x[:0], [0, 0, 0], w1, w2).sum().backward()  # no rows at all: zeros, not None
    assert w1.grad is not None and w1.grad.abs().sum() == 0


# -- serial layer vs a float64 per-token loop -----------------------------------------------------

def _naive(layer, x, g, swiglu):
    """Float64 reference: for each token, sum over its k experts, written as a plain loop."""
    W = layer.router.weight.detach().double().requires_grad_(True)
    w1 = layer.experts.w1.detach().double().requires_grad_(True)
    w2 = layer.experts.w2.detach().double().requires_grad_(True)
    x = x.double().requires_grad_(True)
    logits = x @ W.t()
    probs = logits.softmax(-1)
    outs, counts = [], [0] * E
    for t in range(x.shape[0]):
        top_p, top_e = probs[t].topk(K)
        top_p = top_p / top_p.sum()
        acc = torch.zeros(H, dtype=torch.float64)
        for p, e in zip(top_p, top_e.tolist()):
            counts[e] += 1
            h = w1[e] @ x[t]
            h = F.silu(h[:FFN]) * h[FFN:] if swiglu else F.gelu(h, approximate="tanh")
            acc = acc + p * (w2[e] @ h)
        outs.append(acc)
    out = torch.stack(outs)
    aux = E * sum(counts[e] / (x.shape[0] * K) * probs[:, e].mean() for e in range(E))
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    ((out * g.double()).sum() / x.shape[0] + AUX * aux + ZC * z).backward()
    return out, x.grad, W.grad, w1.grad, w2.grad, aux, z


@pytest.mark.parametrize("swiglu", [True, False])
def test_serial_layer_matches_per_token_loop(swiglu):
    layer = _layer(swiglu=swiglu)
    x, g = _data(3 * T)
    got = _run(layer, x, g)
    out, dx, dW, dw1, dw2, aux, z = _naive(layer, x, g, swiglu)
    tag = "swiglu" if swiglu else "gelu"
    _err(f"serial/{tag}/out", got["out"], out)
    _err(f"serial/{tag}/dx", got["dx"], dx)
    _err(f"serial/{tag}/d router", layer.router.weight.grad, dW)
    _err(f"serial/{tag}/d w1", layer.experts.w1.grad, dw1)
    _err(f"serial/{tag}/d w2", layer.experts.w2.grad, dw2)
    _err(f"serial/{tag}/aux", got["aux"], aux)
    _err(f"serial/{tag}/z", got["z"], z)
    assert got["grads"]["layers.0.mlp.experts.3.fc2.weight"] is not None


# -- expert parallel --------------------------------------------------------------------------------

def _ep_worker(rank, world, cf):
    import torch.distributed as dist
    from megalite.parallel.comm import count_collectives

    group = dist.group.WORLD
    x, g = _data(world * T)
    mine = slice(rank * T, (rank + 1) * T)
    results = {}
    # same: every rank holds the same tokens; dp: rank r holds slice r and routes it on its own
    # (data parallel); slice / capacity: the slices are one routed batch (token group = EP group)
    cases = {"same": (x[:T], g[:T], None, None), "dp": (x[mine], g[mine], None, None),
             "slice": (x[mine], g[mine], None, group), "capacity": (x[mine], g[mine], cf, group)}
    for name, (xr, gr, factor, tokens) in cases.items():
        layer = _layer(group, factor, token_group=tokens)
        with count_collectives() as stats:
            results[name] = _run(layer, xr, gr, share_scale=world if tokens is not None else 1.0)
        results[name]["stats"] = {k: dict(v) for k, v in stats.items()}
        results[name]["local"] = list(layer.local_experts)
    return results


def _check_ep(world, results, name, serial, scale):
    """EP results (per rank) vs the serial run; ``scale``: EP gradients / serial gradients
    for parameters whose gradient sums contributions from every rank (see layer.py). For
    "dp", ``serial`` is the list of per-slice serial runs."""
    cat = lambda key: torch.cat([r[name][key] for r in results])  # noqa: E731
    router_key = "layers.0.mlp.router.weight"
    if name in ("slice", "capacity"):
        _err(f"EP{world}/{name}/out", cat("out"), serial["out"])
        _err(f"EP{world}/{name}/dx", cat("dx") / world, serial["dx"])
        assert torch.equal(cat("kept"), serial["kept"]) and torch.equal(cat("ids"), serial["ids"])
        # aux and z: each rank returns its share; the shares add up to the batch's value
        _err(f"EP{world}/{name}/aux", torch.stack([r[name]["aux"] for r in results]).sum(), serial["aux"])
        _err(f"EP{world}/{name}/z", torch.stack([r[name]["z"] for r in results]).sum(), serial["z"])
        router = torch.stack([r[name]["grads"][router_key] for r in results]).mean(0)
        _err(f"EP{world}/{name}/d router", router, serial["grads"][router_key])
        expert_grads = serial["grads"]
    else:
        per_rank = serial if name == "dp" else [serial] * world
        for r, ref in zip(results, per_rank):
            for key in ("out", "dx", "aux", "z"):
                _err(f"EP{world}/{name}/{key}", r[name][key], ref[key])
            _err(f"EP{world}/{name}/d router", r[name]["grads"][router_key], ref["grads"][router_key])
        # an expert's gradient collects every rank's tokens: the sum of the ranks' serial gradients
        expert_grads = {k: sum(ref["grads"][k] for ref in per_rank) / scale for k in per_rank[0]["grads"]}
    owners = {}
    for rank, r in enumerate(results):
        assert r[name]["local"] == list(range(rank * E // world, (rank + 1) * E // world))
        for key, grad in r[name]["grads"].items():
            if ".experts." in key:
                assert key not in owners, f"{key} on two ranks"
                owners[key] = rank
                _err(f"EP{world}/{name}/d experts", grad / scale, expert_grads[key])
    assert len(owners) == 2 * E  # every expert's fc1 and fc2, re-assembled by global index
    # fwd: counts + rows + rows back; bwd: rows back + rows. Over a token group: the counts
    # all-reduced (f), and with capacity the ids and token places all-gathered.
    expect = {"same": (0, 0), "dp": (0, 0), "slice": (1, 0), "capacity": (1, 2)}[name]
    for r in results:
        assert r[name]["stats"]["all_to_all"]["calls"] == 5
        got = tuple(r[name]["stats"].get(k, {}).get("calls", 0) for k in ("all_reduce", "all_gather"))
        assert got == expect, (name, got)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_serial(world):
    cf = 1.0
    results = run_world(_ep_worker, world, cf, timeout=60)
    x, g = _data(world * T)
    serial_same = _run(_layer(), x[:T], g[:T])
    serial_slices = [_run(_layer(), x[r * T:(r + 1) * T], g[r * T:(r + 1) * T]) for r in range(world)]
    serial_all = _run(_layer(), x, g)
    serial_cap = _run(_layer(cf=cf), x, g)
    # Every rank computes the gradient of its own loss; expert gradients collect every rank's
    # tokens: the gradient of sum_r L_r = world * (serial loss).
    _check_ep(world, results, "same", serial_same, scale=world)
    _check_ep(world, results, "dp", serial_slices, scale=1)
    _check_ep(world, results, "slice", serial_all, scale=world)
    dropped = (~serial_cap["kept"]).sum().item()
    assert 0 < dropped < serial_cap["kept"].numel(), "capacity case must drop some assignments"
    _check_ep(world, results, "capacity", serial_cap, scale=world)


# -- placement: everything on the input's device ----------------------------------------------------

@pytest.mark.parametrize("cf", [None, 1.25])
def test_serial_layer_on_meta(cf):
    with torch.device("meta"):
        layer = MoELayer(H, FFN, E, K, capacity_factor=cf, aux_loss_coeff=AUX, z_loss_coeff=ZC)
    layer.init_weights(SEED)  # nothing to draw on meta
    x = torch.randn(2, T, H, device="meta", requires_grad=True)
    out, loss = layer(x)
    (out.sum() + loss).backward()
    assert out.shape == x.shape and out.device.type == "meta"
    assert x.grad.device.type == "meta" and layer.experts.w1.grad.device.type == "meta"


def _report(errors) -> list[str]:
    return [f"{name:32s} {err:.2e}" for name, err in sorted(errors.items())]


def test_report_errors():
    """Reports the largest errors measured above (printed; run with -s): one line per measured
    quantity, each within 1e-5. Run alone, it measures the serial layer first, so the report is
    never empty."""
    if not any(k.startswith("serial/") for k in ERRORS):
        for swiglu in (True, False):
            test_serial_layer_matches_per_token_loop(swiglu)
    serial = {f"serial/{tag}/{q}" for tag in ("swiglu", "gelu")
              for q in ("out", "dx", "d router", "d w1", "d w2", "aux", "z")}
    assert serial <= set(ERRORS), sorted(serial - set(ERRORS))
    lines = _report(ERRORS)
    assert len(lines) == len(ERRORS) >= len(serial)
    for line, (name, err) in zip(lines, sorted(ERRORS.items())):
        print(line)
        assert line.startswith(name) and float(line.split()[-1]) == float(f"{err:.2e}")
        assert 0.0 <= err <= 1e-5, line


def _fake_ep_meta_worker(rank, world, ep):
    """One rank (rank 1) of an EP world of ``ep`` ranks on the fake backend, on meta tensors."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=ep)
    from megalite.parallel.comm import count_collectives

    with torch.device("meta"):
        layer = MoELayer(H, FFN, E, K, ep_group=dist.group.WORLD, capacity_factor=1.25,
                         aux_loss_coeff=AUX, z_loss_coeff=ZC)
    x = torch.randn(T, H, device="meta", requires_grad=True)
    with count_collectives() as stats:
        out, loss = layer(x)
        (out.sum() + loss).backward()
    assert out.device.type == "meta" and layer.experts.w2.grad.device.type == "meta"
    return list(layer.local_experts), {k: dict(v) for k, v in stats.items()}


def test_expert_parallel_rank_on_meta_with_fake_group():
    (local, stats), = run_world(_fake_ep_meta_worker, 1, 4, timeout=60)
    assert local == [2, 3]
    assert stats["all_to_all"]["calls"] == 5
    # balanced routing assumed on meta: T*K rows of H fp32 out and back, forward and backward
    rows = T * K * H * 4
    assert stats["all_to_all"]["bytes"] == 4 * rows + E * 8


@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_gemm_layer_matches_the_loop(swiglu):
    """--moe-grouped-gemm (Triton, in the interpreter here) against the loop of matmuls: the
    layer's output, input gradient and every expert's gradient (empty groups: test_grouped_gemm)."""
    x, g = _data(T)
    loop = _run(_layer(swiglu=swiglu), x, g)
    layer = _layer(swiglu=swiglu)
    layer.experts.grouped_gemm = True
    fused = _run(layer, x, g)
    assert torch.equal(fused["ids"], loop["ids"])  # same routing: the router is not in the experts
    for key in ("out", "dx"):
        _err(f"grouped gemm/{key}", fused[key], loop[key])
    for name, grad in loop["grads"].items():
        _err(f"grouped gemm/{name}", fused["grads"][name], grad)


# the CPU case with the grouped GEMM (~1 s in the interpreter) is in the slow tier: the fast tier
# has its numbers in test_grouped_gemm_layer_matches_the_loop and this body in the loop's CPU case
@pytest.mark.parametrize("device,grouped", device_cases([(False,), pytest.param(True, marks=pytest.mark.slow)],
                                                        [(False,), (True,)], ids=lambda c: str(c[0])))
def test_moe_layer_on_cuda_matches_cpu(grouped, device):
    """On a GPU (scripts/gpu_check.sh): the layer on CUDA in fp32 gives the CPU's numbers, with the
    loop and with the Triton grouped GEMM; everything it makes lives on the GPU. The CPU case
    runs the same comparison with a second copy of the layer on the CPU (grouped: the
    interpreter's kernels against the loop's numbers)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    x, g = _data(T)
    cpu = _run(_layer(cf=1.0), x, g)
    layer = _layer(cf=1.0).to(dev)
    layer.experts.grouped_gemm = grouped
    gpu = _run(layer, x.to(dev), g.to(dev))
    assert gpu["out"].device.type == dev.type and layer.experts.w1.grad.device.type == dev.type
    assert torch.equal(gpu["kept"].cpu(), cpu["kept"])
    for key in ("out", "dx", "aux", "z"):
        _err(f"{device}/{key}", gpu[key].cpu(), cpu[key], tol=1e-4)
    for name, grad in cpu["grads"].items():
        _err(f"{device}/{name}", gpu["grads"][name].cpu(), grad, tol=1e-4)
