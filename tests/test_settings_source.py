"""Each setting defined once (issue 37, item 1): the dataclass fields' marks are the one source.

* every command line recorded before the parser was rebuilt gives the same Config
  (tests/fixtures/command_line_configs.json, written by the hand mapping it replaced);
* every flag of the parser sets a field of one owner (no flag travels on the namespace alone),
  and every marked field has a flag;
* a checkpoint's fixed settings are exactly the fields marked ``fixed``;
* the run's own settings and what setup works out are typed: the loop and the driver never read
  an argparse namespace;
* the planner prints the flags the settings name;
* the plain settings sit on the ground floor: ``config_types`` imports only the ground floor, and
  the grid imports the settings from there, not from ``config`` (which imports the layers).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest

from megalite.arguments import OWNERS, build_parser, config_from_args, flag_for, parse_settings
from megalite.checkpoint.settings import FIXED
from megalite.config_types import ModelConfig, TrainConfig
from megalite.flag_spec import fixed_settings, flags_of_field, settings_of, setting

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "command_line_configs.json").read_text())
ADDED = {("model", "moe_token_dispatcher_type"),  # a flag that used to stop at the namespace
         ("model", "qk_layernorm"), ("model", "kv_channels")}  # issue 38's Qwen3 settings, off by default
ADDED |= {("model", f"moe_router_{name}") for name in  # issue 38: DeepSeek-V3 routing, new flags
          ("score_function", "num_groups", "group_topk", "topk_scaling_factor", "enable_expert_bias",
           "bias_update_rate")}
ADDED |= {("model", k) for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                               "qk_pos_emb_head_dim", "v_head_dim")}  # issue 38's MLA, off by default
ADDED |= {("model", "mtp_num_layers"), ("model", "mtp_loss_scaling_factor")}  # issue 38's MTP, off by default
ADDED |= {("train", f"muon_{k}") for k in ("momentum", "split_qkv", "use_nesterov", "scale_mode",  # issue 39's
                                        "fp32_matmul_prec", "num_ns_steps", "tp_mode", "extra_scale_factor")}  # Muon
ADDED |= {("train", k) for k in ("qk_clip", "qk_clip_threshold", "qk_clip_alpha", "log_max_attention_logit")}  # QK-clip


@pytest.mark.parametrize("case", RECORDED, ids=[" ".join(c["argv"][:2]) or "defaults" for c in RECORDED])
def test_every_recorded_command_line_gives_the_same_config(case):
    now = json.loads(json.dumps(config_from_args(build_parser().parse_args(case["argv"]), 1234,
                                                 eod_token=3).to_dict(), default=list))
    for section, values in case["config"].items():
        mine = {k: v for k, v in now[section].items() if (section, k) not in ADDED}
        assert mine == values, section


def test_every_flag_sets_a_field_and_every_field_has_a_flag():
    owned = {}
    for owner, _ in OWNERS:
        for f, _ in settings_of(owner):
            for one in flags_of_field(f):
                assert one.dest not in owned, (one.dest, owner, owned.get(one.dest))
                owned[one.dest] = owner
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert dests == set(owned)


def test_special_flags_reach_their_fields():
    s = parse_settings(["--use-distributed-optimizer", "--disable-bias-linear", "--use-rope-scaling",
                        "--position-embedding-type", "rope", "--rope-scaling-factor", "4",
                        "--hierarchical-context-parallel-sizes", "2", "3", "--save", "ck", "--async-save",
                        "--inject-fault", "nan@3", "--skip-batches", "4-5", "--vocab-size", "77", "--device", "cpu",
                        "--log-json", "l.json"])
    c, r = s.config, s.run
    assert c.train.zero_stage == 1 and c.model.add_bias_linear is False
    assert c.model.rope_scaling["factor"] == 4.0 and c.parallel.hierarchical_context_parallel_sizes == (2, 3)
    assert (r.checkpoint.save, r.checkpoint.async_save, r.resilience.inject_fault) == ("ck", True, ["nan@3"])
    assert (r.resilience.skip_batches, r.vocab_size, r.launch.device, r.logging.log_json) == (["4-5"], 77, "cpu",
                                                                                              "l.json")
    assert {"vocab_size", "save", "use_distributed_optimizer"} <= r.given and "lr" not in r.given
    assert parse_settings(["--zero-stage", "2", "--use-distributed-optimizer"]).config.train.zero_stage == 2


def test_fixed_settings_are_the_marked_fields():
    marked = {f.name for f, marks in settings_of(ModelConfig) if marks.fixed}
    # 35 flags (issue 38: --qk-layernorm, --kv-channels; MLA's six; the router's six; --mtp-num-layers)
    # + attention_kind
    assert set(FIXED) == marked and len(FIXED) == 36

    @dataclasses.dataclass
    class Toy:  # a new model setting marked fixed is fixed, named by its flag
        width: int = setting(3, fixed=True)
        depth: int = setting(2)

    assert fixed_settings(Toy) == {"width": ("--width", ("width",))}


def test_the_planner_prints_the_settings_flags():
    assert flag_for("add_bias_linear") == "--disable-bias-linear"
    assert flag_for("zero_stage") == "--zero-stage" and flag_for("bf16") == "--bf16"
    with pytest.raises(KeyError):
        flag_for("no_such_setting")


def test_no_module_reads_an_argparse_namespace_after_parsing():
    """The driver, the loop and the resilience rules read typed settings: no ``args.``, no Namespace."""
    for name in ("train/pretrain.py", "train/loop.py", "resilience/flags.py", "run_settings.py"):
        tree = ast.parse((ROOT / "megalite" / name).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "args"]
        assert reads == [], (name, reads)
        assert "Namespace" not in (ROOT / "megalite" / name).read_text(), name


def test_run_fields_are_typed():
    from megalite.train.loop import Run
    untyped = [f.name for f in dataclasses.fields(Run) if f.type == "object"]
    assert untyped == ["tokenizer"]  # megalite's tokenizers share no base class


def _megalite_imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megalite"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("megalite")}
    return out


def test_plain_settings_sit_on_the_ground_floor():
    assert _megalite_imports(ROOT / "megalite" / "config_types.py") == {"megalite.errors", "megalite.flag_spec",
                                                                       "megalite.context_parallel.comm_types"}
    assert _megalite_imports(ROOT / "megalite" / "flag_spec.py") == set()
    grid = _megalite_imports(ROOT / "megalite" / "parallel" / "grid.py")
    assert "megalite.config" not in grid and "megalite.config_types" in grid


def test_config_keeps_its_names():
    """``from megalite.config import X`` still works for the settings and the rules."""
    import megalite.config as config
    import megalite.config_types as types
    for name in ("Config", "ModelConfig", "ParallelConfig", "TrainConfig", "DataConfig", "ConfigError",
                 "validate_layout", "llama3_rope_scaling"):
        assert getattr(config, name) is getattr(types, name)
    assert callable(config.validate)


def test_dataclass_defaults_are_the_parsers():
    """A field's default is its flag's unless the flag marks another (vocabulary: the tokenizer's;
    MoE layer frequency: the flag's text)."""
    parsed = vars(build_parser().parse_args([]))
    for owner, _ in OWNERS:
        for f, marks in settings_of(owner):
            flags = flags_of_field(f)
            if marks.flags is None and "flag_default" not in dict(marks.kwargs):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert parsed[flags[0].dest] == default, f.name
    assert TrainConfig().pipeline_schedule == parsed["pipeline_schedule"]


def test_a_switch_that_defaults_on_must_name_its_flag():
    """``--x`` can only turn a switch on: one that defaults to True lists the flag that turns it off."""
    @dataclasses.dataclass
    class Toy:
        bias: bool = setting(True)

    with pytest.raises(TypeError, match="bias defaults to True"):
        flags_of_field(dataclasses.fields(Toy)[0])
