"""The planner's context-parallel types: per-step traffic equal to context_parallel.traffic's
theory times layers and micro-batches, on the links megalite's grid puts each level on;
allgather's transient memory; the heads rule; the type the search picks and the reasons it
gives; the printed flags, parsed by pretrain_gpt.py's parser."""
import json
import math
import shlex

import pytest

from megalite.arguments import build_parser as pretrain_parser
from megalite.arguments import config_from_args
from megalite.config import ModelConfig, validate
from megalite.context_parallel.traffic import cp_attention_traffic
from megalite.planner.search import candidate_layouts, explain, plan
from megalite.planner import GiB, Hardware, Layout, communication, estimate, group_spans_nodes, precision
from megalite.planner.checks import check_layout
from megalite.planner.cp import transient_bytes
from megalite.planner.flags import pretrain_flags
from tools import plan_parallel

BF16 = precision("bf16", fp32_grads=True)
CP_KINDS = ("cp", "cp_inner", "cp_outer")


def gqa():  # 16 heads, 4 key/value groups, head dim 64
    return ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                       vocab_size=1000, seq_length=4096)


def long_mha():  # a2a divides: 32 heads
    return ModelConfig(num_layers=4, hidden_size=4096, num_attention_heads=32, vocab_size=32000, seq_length=65536)


def long_h24():  # 24 heads: a2a over CP 8 with TP 2, or CP 2 with TP 8, does not divide
    return ModelConfig(num_layers=4, hidden_size=3072, num_attention_heads=24, vocab_size=32000, seq_length=131072)


# -- traffic ---------------------------------------------------------------------------------------

def _forward_by_hand(kind: str, inner: int, b: int, s: int, heads: int, groups: int, d: int, c: int, e: int) -> dict:
    """The forward wire bytes of one layer, from the traffic table (what recomputation repeats).
    An all-to-all over n ranks carries lcm(G, n) key/value groups when n does not divide G."""
    local = s // c
    if kind == "p2p":
        return {"cp": (c - 1) * 2 * b * groups * local * d * e}
    if kind == "a2a":
        return {"cp": (2 * heads + 2 * math.lcm(groups, c)) * b * local * d * e * (c - 1) / c}
    if kind == "allgather":
        return {"cp": 2 * b * groups * s * d * e * (c - 1) / c}
    outer, g = c // inner, math.lcm(groups, inner)  # a2a+p2p
    return {"inner": (2 * heads + 2 * g) * b * local * d * e * (inner - 1) / inner,
            "outer": (outer - 1) * 2 * b * g * local * d * e}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("kind,inner", [("p2p", 1), ("a2a", 1), ("allgather", 1), ("a2a+p2p", 2),
                                        ("a2a+p2p", 4)])
def test_cp_traffic_per_step_is_the_theory_times_layers_and_micro_batches(kind, inner, recompute):
    m, hw = gqa(), Hardware(80, 8, 4)
    layout = Layout(tp=2, pp=2, dp=1, cp=8, recompute=recompute, cp_comm_type=kind, cp_inner=inner)
    micro, M, layers = 2, 3, 4  # 8 layers over PP 2
    comm = communication(m, layout, 10**6, micro, M, BF16, hw)
    theory = cp_attention_traffic(kind, batch=micro, seq=4096, heads=8, groups=2, head_dim=64, cp=8,
                                  element_size=2, inner=inner if kind == "a2a+p2p" else None)
    again = _forward_by_hand(kind, inner, micro, 4096, 8, 2, 64, 8, 2) if recompute != "none" else {}
    names = {"cp": "cp", "inner": "cp_inner", "outer": "cp_outer"}
    expected = {names[level]: M * layers * (w + again.get(level, 0)) for level, w in theory.wire.items()}
    assert {k: c["bytes"] for k, c in comm.items() if k in CP_KINDS} == pytest.approx(expected, rel=1e-12)
    # Links from megalite's rank order: TP 2 x CP 8 = 16 ranks span two 8-GPU nodes; an inner
    # group of A consecutive CP ranks is 2A consecutive ranks, inside one node.
    links = {k: comm[k]["link"] for k in expected}
    if kind == "a2a+p2p":
        assert links == {"cp_inner": "NVLink", "cp_outer": "InfiniBand"}
    else:
        assert links == {"cp": "InfiniBand"}
    for k in expected:
        gbps = hw.nvlink_gbps if links[k] == "NVLink" else hw.ib_gbps
        assert comm[k]["seconds"] == pytest.approx(expected[k] / (gbps * 1e9))


def test_inner_and_outer_groups_follow_the_grid():
    assert not group_spans_nodes(Layout(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_inner=4), "cp_inner", 8)
    assert group_spans_nodes(Layout(tp=4, cp=8, cp_comm_type="a2a+p2p", cp_inner=4), "cp_inner", 8)
    assert group_spans_nodes(Layout(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_inner=4), "cp_outer", 8)
    assert not group_spans_nodes(Layout(tp=1, cp=8, cp_comm_type="a2a+p2p", cp_inner=2), "cp_outer", 8)


# -- memory ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp,recompute", [(2, 1, "none"), (2, 2, "full"), (1, 2, "selective")])
def test_allgather_holds_the_full_kv_and_fp32_gradients_on_top(tp, pp, recompute):
    m, hw, micro = gqa(), Hardware(80, 8, 2), 2
    base = dict(tp=tp, pp=pp, dp=16 // (tp * pp * 4), cp=4, recompute=recompute)
    ring = estimate(m, Layout(**base), 64, micro, BF16, hw)
    gathered = estimate(m, Layout(**base, cp_comm_type="allgather"), 64, micro, BF16, hw)
    ulysses = estimate(m, Layout(**base, cp_comm_type="a2a"), 64, micro, BF16, hw)
    # K and V of the whole sequence for this TP rank's groups (bf16), dK, dV in fp32, and the
    # longest block's fp32 dK, dV (7 of the 8 chunks at C=4)
    transient = 2 * micro * (4 // tp) * 4096 * 64 * (2 + 4 + 4 * 7 / 8)
    assert gathered.memory["total"] - ring.memory["total"] == transient
    assert gathered.memory["activations"] - ring.memory["activations"] == transient
    assert ulysses.memory == ring.memory  # H/C heads of the whole sequence: the shards' size


# -- the heads rule --------------------------------------------------------------------------------

def test_heads_rule_refuses_a2a_and_the_search_never_proposes_it():
    m, hw = long_h24(), Hardware(8, 8, 2)
    reason = check_layout(m, Layout(tp=2, cp=8, cp_comm_type="a2a"), 16, 1, hw)
    assert "heads per TP rank (24/2 = 12) must be divisible by CP (8)" in reason
    reason = check_layout(m, Layout(tp=8, cp=4, cp_comm_type="a2a+p2p", cp_inner=2), 16, 1, hw)
    assert "heads per TP rank (24/8 = 3) must be divisible by A" in reason
    assert check_layout(m, Layout(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_inner=4), 16, 1, hw) is None
    p = plan(m, hw, 16, 1)
    for e in p.estimates:
        lay = e.layout
        per_rank = 24 // lay.tp
        if lay.cp_comm_type == "a2a":
            assert per_rank % lay.cp == 0, lay
        if lay.cp_comm_type == "a2a+p2p":
            assert per_rank % lay.cp_inner == 0 and 1 < lay.cp_inner < lay.cp, lay
    breaking = [lay for lay in candidate_layouts(m, hw) if lay.cp_comm_type == "a2a" and (24 // lay.tp) % lay.cp]
    assert breaking and all(lay in p.invalid for lay in breaking)


def test_candidates_are_every_type_and_inner_size():
    layouts = candidate_layouts(gqa(), Hardware(80, 8, 1), max_cp=8)
    kinds = {(lay.cp, lay.cp_comm_type, lay.cp_inner) for lay in layouts}
    assert kinds == {(1, "p2p", 1), (2, "p2p", 1), (2, "a2a", 1), (2, "allgather", 1),
                     (4, "p2p", 1), (4, "a2a", 1), (4, "allgather", 1), (4, "a2a+p2p", 2),
                     (8, "p2p", 1), (8, "a2a", 1), (8, "allgather", 1), (8, "a2a+p2p", 2), (8, "a2a+p2p", 4)}
    fixed = {lay.cp_comm_type for lay in candidate_layouts(gqa(), Hardware(80, 8, 1), 8, "allgather") if lay.cp > 1}
    assert fixed == {"allgather"}


# -- the choice and its reasons --------------------------------------------------------------------

def _type_line(p) -> str:
    return next(r for r in p.reasons if r.startswith("CP type "))


def _rival(p, kind, inner=1):
    lay = p.choice.layout
    return next(e for e in p.estimates if e.layout == Layout(lay.tp, lay.pp, lay.dp, lay.cp, lay.zero,
                                                            lay.recompute, lay.ep, kind, inner))


def _ladder_choice(p, tp: int, cp: int):
    """The plan explained as if its choice were the first layout with this TP and CP in the
    practitioners' order that fits (its CP types follow each other fastest first): the CP type's
    choice inside one layout. Issue 40 ranks layouts by estimated step, which here prefers another
    grid (a larger CP, whose ring hides behind attention)."""
    p.choice = next(e for e in p.estimates if e.fits and (e.layout.tp, e.layout.cp) == (tp, cp))
    p.reasons = explain(p)
    return p


def test_the_ring_hides_inside_a_node_where_a2a_sends_less():
    """TP 4 x CP 2 inside a node: a2a sends a third of the ring's bytes, but its all-to-alls are on
    the critical path while the ring hides behind each block's attention, so p2p has the shorter
    estimated step (issue 40; it was a2a, by bytes, before); allgather does not fit."""
    p = plan(long_mha(), Hardware(12, 8, 1), 8, 1)
    assert p.choice.layout.cp_comm_type == "p2p" and p.choice.layout.cp == 4  # the ring, hidden (issue 40)
    p = _ladder_choice(p, 4, 2)
    lay = p.choice.layout
    assert (lay.tp, lay.cp, lay.cp_comm_type) == (4, 2, "p2p") and p.choice.comm["cp"]["link"] == "NVLink"
    line = _type_line(p)
    assert line.startswith("CP type p2p: the shortest estimated step of this layout's types that fit")
    a2a, gathered = _rival(p, "a2a"), _rival(p, "allgather")
    assert a2a.fits and p.choice.comm["cp"]["bytes"] == 3 * a2a.comm["cp"]["bytes"]  # 12 kv against 4 kv
    assert p.choice.step["cp"] == 0 < a2a.step["cp"] and p.choice.step_seconds < a2a.step_seconds
    assert f"a2a 0.00 GiB on InfiniBand + {a2a.comm['cp']['bytes'] / GiB:.2f} GiB on NVLink" in line
    extra = transient_bytes(long_mha(), gathered.layout, 1, 2)  # bf16 K/V, fp32 dK/dV and block gradients
    assert extra == 2 * 1 * (long_mha().num_query_groups // 4) * long_mha().seq_length * long_mha().head_dim * (2 + 4 + 4 * 3 / 4)
    assert not gathered.fits and f"{gathered.memory['total'] / GiB:.1f} GiB (with {extra / GiB:.2f} GiB of full-" in line
    assert "> 10.8 usable" in line


def test_across_nodes_the_hierarchical_type_and_the_rule_that_refuses_a2a():
    p = plan(long_h24(), Hardware(8, 8, 2), 16, 1)
    lay = p.choice.layout
    assert (lay.tp, lay.cp, lay.cp_comm_type, lay.cp_inner) == (2, 8, "a2a+p2p", 4)
    comm = p.choice.comm
    assert comm["cp_inner"]["link"] == "NVLink" and comm["cp_outer"]["link"] == "InfiniBand"
    line = _type_line(p)
    ib = lambda e: sum(c["bytes"] for k, c in e.comm.items() if k in CP_KINDS and c["link"] == "InfiniBand")  # noqa
    for kind, inner in (("a2a+p2p", 2), ("p2p", 1)):  # more bytes on InfiniBand than the chosen
        rival = _rival(p, kind, inner)
        assert rival.fits and ib(rival) > ib(p.choice) and rival.comm_seconds > p.choice.comm_seconds
        assert f"{kind}{' 2x4' if inner == 2 else ''} {ib(rival) / GiB:.2f} GiB on InfiniBand" in line
    assert f"a2a+p2p 4x2 {ib(p.choice) / GiB:.2f} GiB on InfiniBand" in line
    assert ("Not a2a: --cp-comm-type a2a with --num-attention-heads 24, --tensor-model-parallel-size 2 and "
            "--context-parallel-size 8: the all-to-all gives each CP rank whole heads, so the heads per TP "
            "rank (24/2 = 12) must be divisible by CP (8).") in p.reasons


def test_across_nodes_the_ring_when_allgather_does_not_fit():
    p = _ladder_choice(plan(long_h24(), Hardware(10, 8, 2), 16, 1), 8, 2)
    lay = p.choice.layout
    assert (lay.tp, lay.cp, lay.cp_comm_type) == (8, 2, "p2p") and p.choice.comm["cp"]["link"] == "InfiniBand"
    gathered = _rival(p, "allgather")
    assert gathered.comm_seconds < p.choice.comm_seconds and not gathered.fits  # faster, but too big
    line = _type_line(p)
    assert "allgather" in line and "> 9.0 usable" in line
    assert any(r.startswith("Not a2a:") and "(24/8 = 3) must be divisible by CP (2)" in r for r in p.reasons)


# -- flags and the command line --------------------------------------------------------------------

@pytest.mark.parametrize("layout,world,printed", [
    (Layout(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_inner=4), 16,
     ["--cp-comm-type=a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "2"]),
    (Layout(tp=2, cp=4, dp=2, cp_comm_type="a2a"), 16, ["--cp-comm-type=a2a"]),
    (Layout(tp=2, cp=2, dp=2, cp_comm_type="allgather"), 8, ["--cp-comm-type=allgather"]),
    (Layout(tp=2, cp=2, dp=2), 8, []),  # p2p: the default, not printed
    (Layout(tp=2, dp=4), 8, []),
])
def test_printed_flags_parse_and_round_trip(layout, world, printed):
    m = ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1000, seq_length=1024)
    flags = pretrain_flags(m, layout, 16, 1)
    assert [f for f in flags if "cp-comm" in f or "hierarchical" in f or f in ("4", "2")] == printed
    args = pretrain_parser().parse_args(flags + ["--mock-data"])
    config = config_from_args(args, m.vocab_size)
    validate(config, world, 8)
    assert args.context_parallel_size == layout.cp
    if layout.cp > 1:
        assert config.model.cp_comm_type == layout.cp_comm_type
    sizes = config.parallel.hierarchical_context_parallel_sizes
    assert sizes == ((layout.cp_inner, layout.cp // layout.cp_inner) if layout.cp_comm_type == "a2a+p2p" else None)


H24 = ["--num-layers", "4", "--hidden-size", "3072", "--num-attention-heads", "24", "--seq-length", "131072",
       "--vocab-size", "32000", "--global-batch-size", "16", "--micro-batch-size", "1", "--gpu-memory-gb", "8",
       "--gpus-per-node", "8", "--nodes", "2"]


def _printed_flags(text: str) -> list[str]:
    lines = text.splitlines()
    return shlex.split(lines[lines.index(next(x for x in lines if x.startswith("The recommendation as"))) + 1])


@pytest.mark.parametrize("fixed", [None, "p2p", "allgather"])
def test_cli_searches_or_fixes_the_type(fixed, capsys, tmp_path):
    out = tmp_path / "plan.json"
    extra = ["--cp-comm-type", fixed] if fixed else []
    assert plan_parallel.main(H24 + extra + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())["recommendation"]
    flags = _printed_flags(text)
    assert flags == rec["pretrain_flags"]
    args = pretrain_parser().parse_args(flags + ["--mock-data"])
    validate(config_from_args(args, 32000), 16, 8)
    lay = rec["layout"]
    assert args.cp_comm_type == lay["cp_comm_type"] and args.context_parallel_size == lay["cp"]
    if fixed is None:
        assert (lay["cp_comm_type"], lay["cp_inner"]) == ("a2a+p2p", 4)
        assert args.hierarchical_context_parallel_sizes == [4, 2] and "CP type" in text and "a2a+p2p 4x2" in text
    else:
        assert lay["cp_comm_type"] == fixed and f"fixed by --cp-comm-type {fixed}" in text
        assert ("--cp-comm-type" in " ".join(flags)) == (fixed != "p2p")
        assert all(c["layout"]["cp_comm_type"] == fixed for c in json.loads(out.read_text())["candidates"]
                   if c["layout"]["cp"] > 1)


def test_printed_flags_keep_a_qwen3_attention():
    """A Qwen3-shaped model (QK-norm, a head size apart from hidden / heads): the planner's printed
    command line builds the same attention (a lost --kv-channels changes every shape)."""
    m = ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1000, seq_length=1024,
                    qk_layernorm=True, kv_channels=128, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope")
    flags = pretrain_flags(m, Layout(tp=2, dp=4), 16, 1)
    config = config_from_args(pretrain_parser().parse_args(flags + ["--mock-data"]), m.vocab_size)
    validate(config, 8, 8)
    assert (config.model.qk_layernorm, config.model.kv_channels, config.model.head_dim) == (True, 128, 128)
