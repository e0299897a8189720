"""The grid: coordinates, groups and checks, computed for many layouts and run for real."""
import itertools

import pytest
import torch

from megalite.config import ConfigError, ParallelConfig, validate_layout
from megalite.parallel import comm
from megalite.parallel.grid import GROUP_ORDER, GridLayout, build_grid
from megalite.testing import run_world

LAYOUTS = [  # (tp, cp, dp, pp)
    (1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1),
    (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 1), (2, 2, 2, 1), (2, 1, 2, 2),
    (2, 2, 2, 2), (4, 1, 2, 2), (8, 1, 2, 4), (4, 2, 4, 2), (1, 1, 64, 1), (8, 2, 2, 2),
    (3, 1, 5, 1), (1, 4, 1, 4),
]


@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_layout_coordinates_and_groups(tp, cp, dp, pp):
    layout = GridLayout(tp, cp, dp, pp)
    world = tp * cp * dp * pp
    assert layout.world_size == world
    seen = set()
    for rank in range(world):
        c = layout.coord(rank)
        # The documented formula, fastest-varying first.
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert layout.rank_of(c.tp, c.cp, c.dp, c.pp) == rank
        seen.add((c.tp, c.cp, c.dp, c.pp))
    assert len(seen) == world
    sizes = {"tp": tp, "cp": cp, "dp": dp, "dp_cp": dp * cp, "pp": pp, "mp": tp * pp,
             "tp_cp": tp * cp, "stage": tp * cp * dp}
    for kind, size in sizes.items():
        groups = layout.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind  # a partition
        assert all(len(g) == size for g in groups), kind
        varying = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "cp dp",
                   "mp": "tp pp", "tp_cp": "tp cp", "stage": "tp cp dp"}[kind].split()
        for g in groups:
            coords = [layout.coord(r) for r in g]
            for dim in ("tp", "cp", "dp", "pp"):
                values = {getattr(c, dim) for c in coords}
                if dim in varying:
                    assert len(values) == getattr(layout, dim), (kind, dim)
                else:
                    assert len(values) == 1, (kind, dim)
    # TP groups are consecutive ranks (one node's NVLink domain).
    for g in layout.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))
    # Embedding groups: first and last stage of each pipeline.
    for g, pipe in zip(layout.groups("embedding"), layout.groups("pp")):
        assert g == sorted({pipe[0], pipe[-1]})
        assert all(layout.coord(r).pp in (0, pp - 1) for r in g)
    # Neighbours wrap around the pipeline and the CP ring and keep other coordinates.
    for rank in range(world):
        c, n = layout.coord(rank), layout.neighbours(rank)
        assert layout.coord(n["pp_next"]).pp == (c.pp + 1) % pp
        assert layout.coord(n["pp_prev"]).pp == (c.pp - 1) % pp
        assert layout.coord(n["cp_next"]).cp == (c.cp + 1) % cp
        assert layout.coord(n["cp_next"]).tp == c.tp and layout.coord(n["pp_next"]).dp == c.dp


def test_16_rank_layout_explicit():
    layout = GridLayout(tp=2, cp=2, dp=2, pp=2)
    assert layout.coord(13).__dict__ == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    assert layout.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert layout.group_of("cp", 0) == [0, 2]
    assert layout.group_of("dp", 0) == [0, 4]
    assert layout.group_of("dp_cp", 0) == [0, 2, 4, 6]
    assert layout.group_of("pp", 5) == [5, 13]
    assert layout.group_of("mp", 0) == [0, 1, 8, 9]
    assert layout.group_of("embedding", 3) == [3, 11]


def test_describe_table():
    text = GridLayout(tp=2, cp=1, dp=2, pp=2).describe(gpus_per_node=4)
    lines = text.splitlines()
    assert "TP 2 x CP 1 x DP 2 x PP 2" in lines[0] and "2 node(s)" in lines[0]
    assert lines[1].split() == ["rank", "node", "local", "tp", "cp", "dp", "pp"]
    assert lines[2 + 5].split() == ["5", "1", "1", "1", "0", "0", "1"]


def test_from_config_computes_dp():
    layout = GridLayout.from_config(ParallelConfig(tensor_model_parallel_size=2,
                                                   pipeline_model_parallel_size=2), 16)
    assert (layout.tp, layout.cp, layout.dp, layout.pp) == (2, 1, 4, 2)


def test_world_not_divisible_message():
    with pytest.raises(ConfigError) as e:
        validate_layout(ParallelConfig(tensor_model_parallel_size=4,
                                       pipeline_model_parallel_size=2), 12)
    msg = str(e.value)
    assert "world size (12)" in msg and "TP*CP*PP = 4*1*2 = 8" in msg and "Fix" in msg


def test_nonpositive_size_message():
    with pytest.raises(ConfigError, match="--context-parallel-size must be a positive integer, got 0"):
        validate_layout(ParallelConfig(context_parallel_size=0), 4)


def test_tp_across_nodes_warns_with_cost():
    warnings = validate_layout(ParallelConfig(tensor_model_parallel_size=8), 16, gpus_per_node=4)
    assert len(warnings) == 1
    assert "spans nodes (4 GPUs per node)" in warnings[0] and "InfiniBand" in warnings[0]
    assert validate_layout(ParallelConfig(tensor_model_parallel_size=4), 16, gpus_per_node=8) == []
    # 3 does not divide 8: some TP groups straddle a node boundary.
    assert validate_layout(ParallelConfig(tensor_model_parallel_size=3), 24, gpus_per_node=8)


def _real_grid_worker(rank, world_size):
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=1,
                                     pipeline_model_parallel_size=2, expert_model_parallel_size=2),
                      world_size, rank, experts=True)
    out = {"coord": grid.coord.__dict__}
    # Each group really connects the ranks the layout says: all-reduce the rank ids. A group
    # of one rank is None (nothing to communicate); comm.all_reduce skips it.
    for kind in GROUP_ORDER:
        t = torch.tensor([float(rank)])
        group = getattr(grid, f"{kind}_group")
        assert (group is None) == (len(getattr(grid, f"{kind}_ranks")) == 1)
        comm.all_reduce(t, group)
        out[kind] = (getattr(grid, f"{kind}_ranks"), t.item())
    return out


def test_real_8_rank_grid_2x2x2():
    results = run_world(_real_grid_worker, 8)
    layout = GridLayout(tp=2, cp=1, dp=2, pp=2, ep=2, experts=True)
    for rank, out in enumerate(results):
        assert out["coord"] == layout.coord(rank).__dict__
        for kind in GROUP_ORDER:
            ranks, total = out[kind]
            assert ranks == layout.group_of(kind, rank)
            assert total == sum(ranks)


def test_group_plan_partitions_each_kind_without_groups_of_one():
    """What create_groups builds: per kind, non-overlapping groups of 2+ ranks (the NCCL path
    splits the world once per kind with exactly these lists)."""
    from megalite.parallel.grid import group_plan

    layout = GridLayout(tp=2, cp=1, dp=2, pp=2)
    plan = dict(group_plan(layout))
    assert plan["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan["cp"] == [] and plan["tp_cp"] == plan["tp"]  # CP=1: no cp groups; tp_cp is tp
    assert plan["dp"] == plan["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and plan["embedding"] == plan["pp"]
    for kind, groups in plan.items():
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)), kind  # a partition: split_group's requirement
    # PP=4: the embedding groups are first+last stage only; middle stages are in none.
    plan = dict(group_plan(GridLayout(tp=1, cp=1, dp=1, pp=4)))
    assert plan["embedding"] == [[0, 3]] and plan["tp"] == [] and plan["pp"] == [[0, 1, 2, 3]]
    assert plan["ep"] == plan["edp"] == []  # a dense model makes no expert groups


def test_expert_groups_in_megatron_order():
    """Inside each stage's TP*CP*DP ranks: EP groups are consecutive runs, EDP groups stride by
    EP; together they partition the stage."""
    from megalite.parallel.grid import group_plan

    layout = GridLayout(tp=2, cp=1, dp=4, pp=2, ep=4, experts=True)
    plan = dict(group_plan(layout))
    assert plan["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert plan["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.expert_coord(13) == (1, 1) and layout.edp == 2
    table = layout.describe(8)
    assert "experts: EP 4 x EDP 2 per stage" in table and table.splitlines()[-1].split()[-2:] == ["3", "1"]


def test_hierarchical_context_parallel_groups_tp2_cp4_dp2():
    """a2a+p2p with A x B = 2 x 2: inside each CP group (ranks in CP order) the inner groups are
    runs of A consecutive CP ranks (the all-to-all), the outer ones take every A-th (the ring).
    A is on the layout but not in the record a checkpoint keeps (A changes no shard)."""
    from megalite.parallel.grid import group_plan

    layout = GridLayout.from_config(ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=4,
                                                   hierarchical_context_parallel_sizes=(2, 2)), 16)
    assert layout.cp_inner == 2
    assert layout.record() == {"tp": 2, "cp": 4, "dp": 2, "pp": 1, "ep": 1, "experts": False}
    assert layout.group_of("cp", 0) == [0, 2, 4, 6]
    plan = dict(group_plan(layout))
    assert plan["cp_inner"] == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert plan["cp_outer"] == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]
    for rank in range(16):  # inner: cp // A equal; outer: cp % A equal; same tp, dp
        c = layout.coord(rank)
        for kind, key in (("cp_inner", lambda d: d.cp // 2), ("cp_outer", lambda d: d.cp % 2)):
            ranks = layout.group_of(kind, rank)
            assert all((layout.coord(r).tp, layout.coord(r).dp, key(layout.coord(r)))
                       == (c.tp, c.dp, key(c)) for r in ranks) and len(ranks) == 2
    assert "CP 4 = 2 all-to-all x 2 ring" in layout.describe(8).splitlines()[0]
    # A = 1 (every other type): inner groups of one (no communicator), outer = the CP group.
    plain = dict(group_plan(GridLayout(tp=2, cp=4, dp=2)))
    assert plain["cp_inner"] == [] and plain["cp_outer"] == plain["cp"]
    assert GridLayout(tp=2, cp=4, dp=2).record() == layout.record()


def _hierarchical_grid_worker(rank, world_size):
    grid = build_grid(ParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=(2, 2)),
                      world_size, rank)
    sums = [comm.all_reduce(torch.tensor([float(rank)]), g).item() for g in grid.cp_hierarchy]
    return grid.cp_inner_ranks, grid.cp_outer_ranks, sums


def test_real_hierarchical_groups_cp4():
    """build_grid takes A from the sizes, and the groups really connect those ranks."""
    for rank, (inner, outer, sums) in enumerate(run_world(_hierarchical_grid_worker, 4)):
        assert inner == [rank - rank % 2, rank - rank % 2 + 1] and outer == [rank % 2, rank % 2 + 2]
        assert sums == [sum(inner), sum(outer)]
