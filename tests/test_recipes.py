"""The launch recipes in examples/recipes/ hold: for every recipe and GPU count, the training flags
the script launches parse with pretrain_gpt.py's parser and pass megalite's validation for that
world; the layout is tools/plan_parallel.py's recommendation for the model, batch and H100 80GB
nodes of 8 GPUs; a GPU count without a layout is refused with exit code 2 (and where the recipe
says the model does not fit, the planner finds no layout either); and a meta dry run
(tools/dry_run.py, one rank per pipeline stage) fits every role within the planner's allowance
(80 GiB less its headroom) with the measured peak within 5% of the planner's estimate, the bound
tests/test_planner_truth.py and tests/test_moe_planning.py hold the planner to.

The flags come from the scripts themselves (ACTION=print and ACTION=print-dry-run), so what is
tested is what a launch runs. The dry run of one GPU count per recipe (the cheapest) is in the
default run (with its layout check, and the counts where nothing fits); the other counts' dry
runs and layout checks, the SFT recipe's prepare step, and the Qwen3-30B-A3B, DeepSeek-V3 and
Llama-3 70B dry runs (``SLOW_DRY_RUNS``: the biggest models, 3-12 s each) are marked slow.

Cost: a meta dry run takes time in proportion to the micro-batches of a step, M = global batch /
(micro batch x DP). Without PP one micro-batch's activations are in flight whatever M is; with PP
P the schedules hold at most P (1F1B, ZB-H1 with M >= P) or 2P chunk-micro-batches (ZBV), and the
interleaved 1F1B reaches its steady state by M = 2P, so a layout whose step has more
micro-batches is dry-run with the global batch cut to max(2, P) (ZBV and interleaved: 2P)
micro-batches per DP rank (the planner is given the same batch, so the comparison is like for like;
the peak differs from the full batch's only by the step's token arrays, megabytes).
docs/recipes.md lists these numbers and the estimated steps. Each planner search and each dry run
is one process's work: the selected ones run two at a time in forks of the test process
(tests/side_by_side.py), each test asserting on its own recipe's result.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import tempfile

import pytest

from megalite.arguments import build_parser, config_from_args
from megalite.config import validate
from megalite.parallel.grid import GridLayout
from megalite.planner import DEFAULT_HEADROOM, GiB
from tests.side_by_side import SideBySide, selected_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES_DIR = os.path.join(ROOT, "examples", "recipes")
GPU_MEMORY_GB = 80
GPUS_PER_NODE = 8
MAX_MICRO_BATCHES = 2  # per step and DP rank (with PP P at least P, ZBV and interleaved 2P) in the dry runs here (module docstring)

# recipe: (GPU counts with a layout, the one dry-run in the default run, counts the model does
# not fit, counts refused for another reason)
RECIPES = {
    "gpt3-1.3b": ([8, 64, 512], 512, [], []),
    "gpt3-13b": ([8, 64, 512], 8, [], []),  # DP 8 ZeRO-2 (Mixtral's default count is the pipelined one)
    "llama3-8b": ([8, 64, 512], 512, [], []),
    "llama3-70b": ([64, 512], 64, [8], []),
    "mixtral-8x7b": ([64, 512], 64, [8], []),
    "llama3-8b-sft": ([8, 64], 8, [], [512]),
    "qwen3-30b-a3b": ([64, 256, 1024], 256, [], []),  # the cheapest search (PP 2 zbv; 1,024's takes 5 s)
    "deepseek-v3": ([256, 1024], 1024, [64], []),
}
# Their dry runs (61 and 48 layers of hundreds of experts on meta: 8-16 s; Llama-3 70B's 80
# layers interleaved, 2P = 4 micro-batches: 6-8 s) only in the slow tier; the default run keeps
# these recipes' layout checks.
SLOW_DRY_RUNS = {"qwen3-30b-a3b", "deepseek-v3", "llama3-70b"}
# Qwen3-30B-A3B at 256 GPUs (PP 2 zbv, 11 s) has the same shape as at 64 on twice the EP ranks' DP:
# measured by hand (docs/recipes.md), its layout check stays in the slow tier.
UNTESTED_DRY_RUNS = {("qwen3-30b-a3b", 256)}
SIZES = [(r, g) for r, (sizes, _, _, _) in RECIPES.items() for g in sizes]
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "zero_stage", "overlap_grad_reduce",
               "recompute_granularity", "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
               "accumulate_allreduce_grads_in_fp32")


def run_recipe(recipe: str, gpus: int, action: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACTION": action, "GPUS": str(gpus), "MEGALITE_HOME": ROOT}
    for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_SUBMIT_DIR", "NNODES"):
        env.pop(key, None)
    return subprocess.run(["bash", os.path.join(RECIPES_DIR, f"{recipe}.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def recipe_flags(recipe: str, gpus: int, action: str) -> list[str]:
    done = run_recipe(recipe, gpus, action)
    assert done.returncode == 0, (recipe, gpus, done.stderr)
    return shlex.split(done.stdout)


def dry_run_flags(recipe: str, gpus: int) -> tuple[list[str], list[str]]:
    """tools/dry_run.py's own arguments (world, GPUs per node, memory) and the pretrain_gpt.py flags."""
    argv = recipe_flags(recipe, gpus, "print-dry-run")
    own = argv[:6]
    assert own == ["--world-size", str(gpus), "--gpus-per-node", str(GPUS_PER_NODE), "--gpu-memory-gb",
                   str(GPU_MEMORY_GB)], own
    return own, argv[6:]


def parse(flags: list[str]):
    return build_parser().parse_args(flags)


def config_of(flags: list[str], vocab_size: int):
    from tools.dry_run import mock_eod

    return config_from_args(parse(flags), vocab_size, eod_token=mock_eod(vocab_size))


def test_every_recipe_script_is_covered():
    scripts = sorted(f[:-3] for f in os.listdir(RECIPES_DIR) if f.endswith(".sh") and f != "launch.sh")
    assert scripts == sorted(RECIPES)


@pytest.mark.parametrize("recipe,gpus", SIZES)
def test_training_flags_parse_and_validate(recipe, gpus):
    """The flags a launch hands pretrain_gpt.py parse, and the configuration passes validate() for
    the recipe's world; the dry run's flags are the same run less its data and checkpoint flags."""
    train = recipe_flags(recipe, gpus, "print")
    _, dry = dry_run_flags(recipe, gpus)
    args = parse(train)
    assert args.data_path and args.tokenizer_type == "HuggingFaceTokenizer" and args.save
    vocab = parse(dry).vocab_size
    config = config_of(train, vocab)
    validate(config, gpus, GPUS_PER_NODE)
    layout = GridLayout.from_config(config.parallel, gpus, experts=bool(config.model.num_experts))
    assert layout.world_size == gpus
    train_args, dry_args = vars(args), vars(parse(dry))
    differ = {k for k in train_args if train_args[k] != dry_args[k]}
    assert differ <= {"data_path", "split", "tokenizer_type", "tokenizer_model", "save", "load", "save_interval",
                      "keep_last", "eval_interval", "eval_iters", "log_interval", "log_json", "finetune",
                      "vocab_size"}, differ


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_other_gpu_counts_are_refused(recipe):
    sizes, _, no_fit, other = RECIPES[recipe]
    for gpus in [16, *no_fit, *other]:
        done = run_recipe(recipe, gpus, "print")
        assert done.returncode == 2 and done.stdout == "", (recipe, gpus)
        assert f"{recipe}: no layout for GPUS={gpus}" in done.stderr and "tools/plan_parallel.py" in done.stderr
        counts = ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}"
        assert f"has layouts for {counts} GPUs" in done.stderr, done.stderr
        if gpus in no_fit:
            assert "cannot hold" in done.stderr


def _stub(folder, name: str) -> None:
    """An executable that prints its name and arguments, one per line, and exits 0."""
    path = folder / name
    path.write_text(f'#!/bin/bash\nprintf "%s\\n" {name} "$@"\n')
    path.chmod(0o755)


@pytest.mark.parametrize("slurm", [False, True], ids=["by-hand", "sbatch"])
def test_train_launches_torchrun_per_node_with_the_printed_flags(slurm, tmp_path):
    """ACTION=train (stand-ins for torchrun and srun print what they are given): one torchrun per
    node with 8 ranks, the c10d rendezvous on MASTER_ADDR (under SLURM the allocation's first
    host, through srun), and pretrain_gpt.py with exactly the flags ACTION=print shows."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "torchrun")
    _stub(bin_dir, "srun")
    env = {**os.environ, "ACTION": "train", "MEGALITE_HOME": ROOT, "MEGALITE_VENV": "", "LOG_DIR": str(tmp_path / "logs"),
           "PATH": f"{bin_dir}{os.pathsep}{os.path.join(ROOT, 'tests', 'slurm_standin')}{os.pathsep}{os.environ['PATH']}"}
    for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_SUBMIT_DIR", "NNODES", "GPUS", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if slurm:
        env.update(SLURM_JOB_ID="4242", SLURM_NNODES="8", SLURM_JOB_NODELIST="gpu[07-14]", SLURM_CPUS_PER_TASK="64")
    else:
        env.update(NNODES="8", MASTER_ADDR="node0")
    done = subprocess.run(["bash", os.path.join(RECIPES_DIR, "llama3-8b.sh"), "--train-iters", "10"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()
    head = argv[:argv.index("torchrun")]
    assert head == (["srun", "--cpus-per-task=64"] if slurm else [])
    launcher = argv[argv.index("torchrun") + 1:]
    program = launcher.index(os.path.join(ROOT, "pretrain_gpt.py"))
    options = launcher[:program]
    endpoint = "gpu07:24242" if slurm else "node0:29500"
    for option, value in [("--nnodes", "8"), ("--nproc-per-node", "8"), ("--rdzv-backend", "c10d"),
                          ("--rdzv-endpoint", endpoint), ("--rdzv-id", "4242" if slurm else "megalite")]:
        assert options[options.index(option) + 1] == value, (option, options)
    env["ACTION"] = "print"  # the same environment: GPUS = 8 nodes x 8
    printed = subprocess.run(["bash", os.path.join(RECIPES_DIR, "llama3-8b.sh"), "--train-iters", "10"], env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert launcher[program + 1:] == shlex.split(printed)
    assert "--tensor-model-parallel-size 2" in printed and "--zero-stage 1" in printed  # the 64-GPU layout
    assert "--sequence-parallel" in printed and "--pipeline-model-parallel-size" not in printed
    assert (tmp_path / "logs").is_dir()


def planner_argv(flags: list[str], gpus: int) -> list[str]:
    """The planner's flags among the recipe's (the same names), and the hardware."""
    from tools import plan_parallel

    known = set(plan_parallel.build_parser()._option_string_actions)
    argv, keep = [], False
    for token in flags:
        if token.startswith("--"):
            keep = token in known
        if keep:
            argv.append(token)
    return argv + ["--gpu-memory-gb", str(GPU_MEMORY_GB), "--gpus-per-node", str(GPUS_PER_NODE),
                   "--nodes", str(gpus // GPUS_PER_NODE)]


def recommendation(argv: list[str]) -> dict | None:
    """tools/plan_parallel.py's recommendation (from --json; None where no layout fits)."""
    from tools import plan_parallel

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        out = os.path.join(folder, "plan.json")
        assert plan_parallel.main(argv + ["--json", out]) == 0
        with open(out) as f:
            return json.load(f)["recommendation"]


def planned_layout(recipe: str, gpus: int) -> tuple[list[str], dict | None]:
    """The recipe's dry-run flags (at its first count where it has no layout for ``gpus``: the model
    and batch flags are the same at every count) and the planner's recommendation for them at
    ``gpus``: searched over the recipe's CP size (test_layout_is_the_planners_recommendation), or
    in full where the recipe has no layout."""
    sizes = RECIPES[recipe][0]
    _, flags = dry_run_flags(recipe, gpus if gpus in sizes else sizes[0])
    if gpus not in sizes:
        return flags, recommendation(planner_argv(flags, gpus))
    max_cp = str(parse(flags).context_parallel_size)
    return flags, recommendation(planner_argv(flags, gpus) + ["--max-context-parallel", max_cp])


# The default run checks each recipe's dry-run count and every count where nothing fits; the
# other counts are slow (as their dry runs are).
PLANS = [pytest.param(r, g, marks=[] if g == default or g in no_fit else [pytest.mark.slow], id=f"{r}-{g}")
         for r, (sizes, default, no_fit, _) in RECIPES.items() for g in sizes + no_fit]


@pytest.mark.parametrize("recipe,gpus", PLANS)
def test_layout_is_the_planners_recommendation(recipe, gpus, recipe_work):
    """tools/plan_parallel.py, given the recipe's model and batch and GPUS H100 80GB (8 per
    node), recommends the recipe's layout: every flag it prints has the recipe's value, and so
    has every layout flag. Where the recipe says the model does not fit, no layout fits.

    The search is limited to the recipe's CP size C (--max-context-parallel C, 1 for most: the
    full search over context-parallel sizes and types takes 3-70 s for the MoE models, 0.1-5 s
    so): a recipe keeps its CP size, and among those layouts it runs the fastest estimated step
    that fits (issue 40; a larger CP is sometimes faster still: tools/plan_parallel.py without
    --max-context-parallel says by how much). Where nothing fits, the full search says so."""
    flags, rec = recipe_work.result("plan", recipe, gpus)
    if gpus not in RECIPES[recipe][0]:
        assert rec is None, (recipe, gpus, rec and rec["description"])
        return
    assert rec is not None, (recipe, gpus)
    planned, ours = vars(parse(rec["pretrain_flags"])), vars(parse(flags))
    defaults = vars(parse([]))
    keys = {k for k in planned if planned[k] != defaults[k]} | set(LAYOUT_KEYS)
    assert {k: ours[k] for k in keys} == {k: planned[k] for k in keys}, rec["description"]


def dry_run(recipe: str, gpus: int) -> tuple[int, list[dict], str]:
    """tools/dry_run.py on the recipe's dry-run flags (the batch cut as the module docstring says):
    its exit code, its roles (from --json) and what it printed."""
    from tools import dry_run as tool

    own, flags = dry_run_flags(recipe, gpus)
    args = parse(flags)
    config = config_of(flags, args.vocab_size)
    layout = GridLayout.from_config(config.parallel, gpus, experts=bool(config.model.num_experts))
    per_dp = args.micro_batch_size * layout.dp
    interleaved = args.num_layers_per_virtual_pipeline_stage is not None  # its steady state from 2P on
    most = max(MAX_MICRO_BATCHES, layout.pp * (2 if args.pipeline_schedule == "zbv" or interleaved else 1))
    if args.global_batch_size > per_dp * most:
        flags = flags + ["--global-batch-size", str(per_dp * most)]
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()) as printed:
        out = os.path.join(folder, "dry.json")
        code = tool.main(own + flags + ["--json", out])
        with open(out) as f:
            roles = json.load(f)["roles"]
    return code, roles, printed.getvalue()


def planned_or_dry_run(kind: str, recipe: str, gpus: int):
    return planned_layout(recipe, gpus) if kind == "plan" else dry_run(recipe, gpus)


@pytest.fixture(scope="module")
def recipe_work(request):
    """The planner's searches, then the dry runs, that this session selected, handed at once to two
    workers (tests/side_by_side.py: each is one process's work; the CI machine has two cores)."""
    cases = [("plan", *case) for case in selected_cases(request, "test_layout_is_the_planners_recommendation",
                                                        ("recipe", "gpus"))]
    cases += [("dry run", *case) for case in selected_cases(request, "test_dry_run_fits_and_matches_the_planner",
                                                           ("recipe", "gpus"))]
    runs = SideBySide(planned_or_dry_run, cases)
    yield runs
    runs.close()


def _dry_params():
    params = []
    for recipe, (sizes, default, _, _) in RECIPES.items():
        for gpus in (g for g in sizes if (recipe, g) not in UNTESTED_DRY_RUNS):
            marks = [] if gpus == default and recipe not in SLOW_DRY_RUNS else [pytest.mark.slow]
            params.append(pytest.param(recipe, gpus, marks=marks, id=f"{recipe}-{gpus}"))
    return params


@pytest.mark.parametrize("recipe,gpus", _dry_params())
def test_dry_run_fits_and_matches_the_planner(recipe, gpus, recipe_work):
    """Every role of the layout, one iteration on meta: its peak fits 80 GiB less the planner's
    headroom, and is within 5% of the planner's estimate for the same rank."""
    code, roles, text = recipe_work.result("dry run", recipe, gpus)
    allowance = GPU_MEMORY_GB * GiB * (1 - DEFAULT_HEADROOM)
    assert code == 0 and "): yes" in text.splitlines()[-1], text
    assert roles
    for role in roles:
        assert role["fits"] and role["measured_bytes"] <= allowance, (recipe, gpus, role["role"])
        assert abs(role["difference"]) < 0.05, (recipe, gpus, role["role"], role["measured_bytes"] / GiB,
                                                role["planned_bytes"] / GiB)


@pytest.mark.slow
def test_sft_prepare_imports_the_model_and_tokenizes_the_data(tmp_path):
    """ACTION=prepare of the SFT recipe on a tiny random Llama (made by transformers, no download)
    with a chat-template tokenizer: the import writes a checkpoint carrying the tokenizer, and
    the JSONL becomes an indexed dataset with its loss mask, at the paths the training flags name."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import sys

    import torch

    from tests.test_sft import CHAT, save_folder

    hf = save_folder(tmp_path / "hf")
    with open(os.path.join(hf, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(vocab),
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    lines = [{"messages": CHAT}, {"prompt": "What is 2+2?", "response": " It is 4."}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    paths = {"HF_MODEL": hf, "IMPORTED": str(tmp_path / "imported"), "SFT_JSONL": str(tmp_path / "sft.jsonl"),
             "SFT_DATA": str(tmp_path / "sft"), "CKPT_DIR": str(tmp_path / "run")}
    env = {**os.environ, **paths, "ACTION": "prepare", "MEGALITE_HOME": ROOT, "MEGALITE_VENV": "",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", os.path.join(RECIPES_DIR, "llama3-8b-sft.sh")], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "imported" / "latest").exists()
    carried = set(os.listdir(next((tmp_path / "imported").glob("iter_*")) / "huggingface"))
    assert "tokenizer.json" in carried, carried
    for suffix in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx"):
        assert (tmp_path / f"sft{suffix}").exists(), suffix
    # The training command of the same environment names them (GPUS=8's layout).
    env.update(ACTION="print", GPUS="8")
    flags = shlex.split(subprocess.run(["bash", os.path.join(RECIPES_DIR, "llama3-8b-sft.sh")], env=env,
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    args = parse(flags)
    assert args.finetune and args.load == paths["IMPORTED"] and args.data_path == [paths["SFT_DATA"]]
    assert args.tokenizer_model == hf and args.save == paths["CKPT_DIR"]
    # Once the run has saved, the script resumes from its own checkpoint instead.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("1")
    flags = shlex.split(subprocess.run(["bash", os.path.join(RECIPES_DIR, "llama3-8b-sft.sh")], env=env,
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    args = parse(flags)
    assert not args.finetune and args.load == paths["CKPT_DIR"]
