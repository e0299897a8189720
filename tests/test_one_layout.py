"""Issue 37's one layout and one table of CP types.

- The planner's :class:`~megalite.planner.Layout` is a :class:`~megalite.parallel.grid.GridLayout`
  (the grid's sizes and rank order, defined once) plus the run's choices; the dry run builds it from
  the run's grid and config (``Layout.of_run``), the planner's checks read its ``ParallelConfig``
  back (``parallel_config``), and ``GridLayout.from_config`` of that is the same grid.
- The CP communication types are one table (``megalite.context_parallel.comm_types``): the flag's
  choices equal it, an unknown type is refused by one function with one message wherever it is
  met, and no module of context_parallel/ or the planner compares a type's name with the
  hierarchical type's literal name.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from megalite.arguments import build_parser
from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.context_parallel.checks import check_context_parallel
from megalite.context_parallel.comm_types import CP_COMM_TYPES, CP_TYPES, HIERARCHICAL, cp_comm_type
from megalite.context_parallel.traffic import cp_attention_traffic
from megalite.parallel.grid import GridLayout
from megalite.planner import Hardware, Layout, check_layout
from megalite.planner.cp import cp_variants

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_planner_layout_is_the_grid_layout():
    layout = Layout(2, 2, 4, 4, 1, "selective", 2, "a2a+p2p", 2, "zbv")
    assert isinstance(layout, GridLayout)
    grid_fields = {f.name for f in dataclasses.fields(GridLayout)}
    own = [f.name for f in dataclasses.fields(Layout) if f.name not in grid_fields]
    assert own == ["zero", "recompute", "cp_comm_type", "schedule", "virtual"]  # nothing of the grid copied
    grid = GridLayout(**layout.grid_sizes())
    assert grid.groups("cp_inner") == layout.groups("cp_inner") and layout.world_size == 64
    assert layout.edp == grid.edp == 2 * 4 * 4 // 2
    assert layout.cp_sizes == (2, 2) and Layout(cp=4, cp_comm_type="a2a").cp_sizes is None


def test_the_dry_runs_layout_is_the_planners():
    """A run's config -> its grid -> Layout.of_run -> ParallelConfig -> the same grid again."""
    config = Config(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=64,
                                cp_comm_type="a2a+p2p", attention_dropout=0.0, recompute_granularity="selective"),
                    ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                   context_parallel_size=4, sequence_parallel=True,
                                   hierarchical_context_parallel_sizes=(2, 2)),
                    TrainConfig(micro_batch_size=1, global_batch_size=8, zero_stage=1), DataConfig(mock_data=True))
    grid = GridLayout.from_config(config.parallel, 32)
    layout = Layout.of_run(grid, config.model, config.train)
    assert layout == Layout(tp=2, pp=2, dp=2, cp=4, zero=1, recompute="selective", cp_comm_type="a2a+p2p",
                            cp_inner=2, schedule=config.train.pipeline_schedule)
    assert GridLayout(**layout.grid_sizes()) == grid
    parallel = layout.parallel_config()
    assert GridLayout.from_config(parallel, 32) == grid
    for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "sequence_parallel", "hierarchical_context_parallel_sizes", "expert_model_parallel_size"):
        assert getattr(parallel, f) == getattr(config.parallel, f), f


def test_an_interleaved_runs_layout_is_the_planners():
    """--num-layers-per-virtual-pipeline-stage k -> Layout.of_run's V = L / (PP k) -> the same k back."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=8, seq_length=64)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    grid = GridLayout.from_config(parallel, 4)
    layout = Layout.of_run(grid, model, TrainConfig(), parallel.num_layers_per_virtual_pipeline_stage)
    assert (layout.pp, layout.virtual, layout.schedule_label) == (2, 2, "i1f1b/2")
    assert layout.parallel_config(model.num_layers).num_layers_per_virtual_pipeline_stage == 2
    assert Layout.of_run(grid, model, TrainConfig()).virtual == 1 and Layout(pp=2).parallel_config(8) \
        .num_layers_per_virtual_pipeline_stage is None


def test_one_table_of_cp_types():
    choices = next(a.choices for a in build_parser()._actions if a.dest == "cp_comm_type")
    assert list(choices) == list(CP_COMM_TYPES) == [t.name for t in CP_TYPES]
    assert [t.name for t in CP_TYPES if t.hierarchical] == [HIERARCHICAL]
    assert {kind for kind, _ in cp_variants(8)} == set(CP_COMM_TYPES)


def test_an_unknown_cp_type_is_refused_once_with_one_message():
    with pytest.raises(ConfigError) as direct:
        cp_comm_type("ring")
    message = str(direct.value)
    assert message == "--cp-comm-type 'ring' is unknown. Fix: use one of p2p, a2a, allgather, a2a+p2p."
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64, cp_comm_type="ring",
                        attention_dropout=0.0)
    with pytest.raises(ConfigError) as checked:
        check_context_parallel(model, ParallelConfig(context_parallel_size=2))
    with pytest.raises(ConfigError) as traffic:
        cp_attention_traffic("ring", batch=1, seq=64, heads=8, groups=8, head_dim=8, cp=2)
    refused = check_layout(model, Layout(cp=2, cp_comm_type="ring"), 8, 1, Hardware(80, 2))
    assert str(checked.value) == str(traffic.value) == refused == message


def _name_compared_literals(path: pathlib.Path) -> list[str]:
    """'file:line' of each comparison or membership test against a CP type's literal name."""
    names = set(CP_COMM_TYPES) - {"p2p", "a2a", "allgather"}  # the literal that has its own meaning
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            found += [f"{path.relative_to(ROOT)}:{c.lineno}" for c in consts]
    return found


def test_no_module_compares_the_hierarchical_name():
    """context_parallel/ and the planner ask the table (``.hierarchical``), never compare with the
    literal "a2a+p2p" (the planner's flags module is rewritten by the settings work: not yet)."""
    files = [p for p in sorted((ROOT / "megalite/context_parallel").glob("*.py"))
             + sorted((ROOT / "megalite/planner").glob("*.py")) if p.name not in ("comm_types.py", "flags.py")]
    found = [hit for path in files for hit in _name_compared_literals(path)]
    assert found == [], "compare through megalite.context_parallel.comm_types instead:\n" + "\n".join(found)
