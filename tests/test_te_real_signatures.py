"""Every transformer-engine name and keyword megalite uses, checked against TE's own sources.

transformer-engine cannot be imported here (its compiled parts need CUDA), but its Python
layer is a pure wheel: ``transformer-engine==2.8.0`` (the last before ``te.autocast``, 2.9) and
2.20.2 (the newest release when pinned) are pinned with their sha256 in
tests/reference_archives.json, fetched before the tests by tools/fetch_test_references.py
(scripts/setup_env.sh runs it), unpacked from that cache (the sums checked again) and read with
``ast``.

The calls are recorded, not listed by hand: megalite runs against ``tests/te_standin.py``
with every TE entry point wrapped, on the paths that reach them all (TE linears with and
without the fused norm, TE's attention and norms, ``--tp-comm-overlap``'s ``initialize_ub`` /
``destroy_ub``, FP8 under both TE versions' autocasts); each recorded call must name a real
class or function that accepts every keyword passed (or ``**kwargs``) and the positional
count. The methods fp8.py calls on TE modules, the recipe's formats, and the stand-in's own
signatures (they must use TE's argument names) are checked too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megalite.testing import run_world
from tests import te_standin
from tests.reference_cache import unpacked_wheel
from tests.test_tensor_parallel import PRETRAIN

OLD, NEW = "2.8.0", "2.20.2"  # NEW: the newest release on the registry when pinned (2026-12-06)


class TESource:
    """Looks names up in an unpacked TE wheel's Python files, following imports (no import)."""

    def __init__(self, root: Path):
        self.root, self.trees = root, {}
        info = next(root.glob("transformer_engine-*.dist-info")).name
        self.version = info[len("transformer_engine-"):-len(".dist-info")]

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            base = self.root / module.replace(".", "/")
            path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
            self.trees[module] = ast.parse(path.read_text()) if path.exists() else None
        return self.trees[module]

    def find(self, module: str, name: str, depth: int = 0):
        """(module, ClassDef/FunctionDef) defining ``module.name``, or None."""
        tree = self.tree(module)
        if tree is None or depth > 10:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return module, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = node.module or ""
                        if node.level:
                            parts = module.split(".")
                            pkg = parts if self.tree_is_package(module) else parts[:-1]
                            src = ".".join(pkg[:len(pkg) - node.level + 1] + ([src] if src else []))
                        found = self.find(src, alias.name, depth + 1)
                        if found is None and self.tree(f"{src}.{alias.name}") is not None:
                            return f"{src}.{alias.name}", self.tree(f"{src}.{alias.name}")
                        if found:
                            return found
        return None

    def tree_is_package(self, module: str) -> bool:
        return (self.root / module.replace(".", "/") / "__init__.py").exists()

    def resolve(self, dotted: str):
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            found = self.find(".".join(parts[:cut]), parts[cut])
            if found is None:
                continue
            for attr in parts[cut + 1:]:  # module attributes (te.module.base.initialize_ub)
                if not isinstance(found[1], ast.Module):
                    return None
                found = self.find(found[0], attr)
                if found is None:
                    return None
            return found
        return None

    def bases(self, module: str, cls: ast.ClassDef):
        yield module, cls
        for b in cls.bases:
            name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            found = self.find(module, name) if name else None
            if found and isinstance(found[1], ast.ClassDef):
                yield from self.bases(*found)

    def accepts(self, dotted: str):
        """(positional parameter names, keyword names, takes **kwargs) of a callable."""
        found = self.resolve(dotted)
        assert found is not None, f"TE {self.version} has no {dotted}"
        module, node = found
        if isinstance(node, ast.FunctionDef):
            return _params(node, skip_self=False)
        for _, cls in self.bases(module, node):
            init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                return _params(init, skip_self=True)
        fields = [n.target.id for _, cls in reversed(list(self.bases(module, node))) for n in cls.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]  # a dataclass
        return fields, set(fields), False

    def has_member(self, dotted_class: str, member: str) -> bool:
        module, node = self.resolve(dotted_class)
        for _, cls in self.bases(module, node):
            for n in cls.body:
                if isinstance(n, ast.FunctionDef) and n.name == member:
                    return True
                targets = (n.targets if isinstance(n, ast.Assign)
                           else [n.target] if isinstance(n, ast.AnnAssign) else [])
                if any(isinstance(t, ast.Name) and t.id == member for t in targets):
                    return True
        return False


def _params(fn: ast.FunctionDef, skip_self: bool):
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args][1 if skip_self else 0:]
    keywords = {p.arg for p in a.args + a.kwonlyargs}
    return positional, keywords, a.kwarg is not None


def check_call(src: TESource, name: str, npos: int, keywords) -> list[str]:
    positional, accepted, var_kw = src.accepts(name)
    bad = []
    if npos > len(positional):
        bad.append(f"{name}: {npos} positional arguments, TE {src.version} takes {len(positional)}")
    unknown = set(keywords) - accepted - set(positional[npos:]) if not var_kw else set()
    if unknown:
        bad.append(f"{name}: TE {src.version} has no keyword(s) {sorted(unknown)}")
    return bad


# -- recording megalite's calls ----------------------------------------------------------------
ENTRY_POINTS = {  # the stand-in's module attribute -> TE's dotted name
    ("pytorch", "Linear"): "transformer_engine.pytorch.Linear",
    ("pytorch", "LayerNormLinear"): "transformer_engine.pytorch.LayerNormLinear",
    ("pytorch", "LayerNorm"): "transformer_engine.pytorch.LayerNorm",
    ("pytorch", "RMSNorm"): "transformer_engine.pytorch.RMSNorm",
    ("pytorch", "DotProductAttention"): "transformer_engine.pytorch.DotProductAttention",
    ("pytorch", "fp8_autocast"): "transformer_engine.pytorch.fp8_autocast",
    ("pytorch", "autocast"): "transformer_engine.pytorch.autocast",
    ("base", "initialize_ub"): "transformer_engine.pytorch.module.base.initialize_ub",
    ("base", "destroy_ub"): "transformer_engine.pytorch.module.base.destroy_ub",
    ("recipe", "DelayedScaling"): "transformer_engine.common.recipe.DelayedScaling",
}
CALLS: list = []


def _record(monkeypatch, version: str):
    root = te_standin.install(monkeypatch, version=version)
    owners = {"pytorch": root.pytorch, "base": root.pytorch.module.base, "recipe": root.common.recipe}
    for (owner, attr), dotted in ENTRY_POINTS.items():
        target = getattr(owners[owner], attr, None)
        if target is None:
            continue

        def wrapped(*args, _target=target, _dotted=dotted, **kwargs):
            CALLS.append((_dotted, len(args), tuple(sorted(kwargs))))
            return _target(*args, **kwargs)
        monkeypatch.setattr(owners[owner], attr, wrapped)


def _recording_worker(rank, world, version, extra):
    from megalite.train.pretrain import pretrain
    with pytest.MonkeyPatch.context() as mp:
        _record(mp, version)
        del CALLS[:]
        pretrain(PRETRAIN + extra)
        return sorted(set(CALLS))


TE = ["--transformer-impl", "transformer_engine"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4"]
RUNS = {  # what each TE version's run goes through
    # TP2 SP, --tp-comm-overlap, FP8, LayerNormLinear + Linear + TE attention and final norm
    "2.9": (2, TE + FP8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                           "--tp-comm-overlap", "--tp-comm-bootstrap-backend", "gloo", "--train-iters", "2",
                           "--lr-warmup-iters", "0"]),
    # RMSNorm, SwiGLU, no bias, FP8 through TE 2.8's fp8_autocast
    "2.8": (1, TE + FP8 + ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--train-iters", "2",
                           "--lr-warmup-iters", "0"]),
}


@pytest.fixture(scope="module")
def recorded():
    return {v: run_world(_recording_worker, world, v, extra, timeout=300)[0] for v, (world, extra) in RUNS.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return {v: TESource(unpacked_wheel("transformer-engine", v, tmp_path_factory.mktemp(f"te-{v}")))
            for v in (OLD, NEW)}


def test_the_wheels_are_the_versions_on_each_side_of_the_autocast_switch(sources):
    """2.8.0 exports only fp8_autocast, the newest also autocast: megalite's ``hasattr(te,
    "autocast")`` picks each one's, and the stand-in's ``version`` imitates both."""
    old, new = sources[OLD], sources[NEW]
    assert (old.version, new.version) == (OLD, NEW)
    assert old.resolve("transformer_engine.pytorch.fp8_autocast") is not None
    assert old.resolve("transformer_engine.pytorch.autocast") is None
    assert new.resolve("transformer_engine.pytorch.autocast") is not None


def test_every_te_call_megalite_makes_exists_with_its_keywords(recorded, sources):
    # each run used the entry points it was meant to
    names = {v: {c[0].rsplit(".", 1)[1] for c in calls} for v, calls in recorded.items()}
    assert names["2.9"] >= {"Linear", "LayerNormLinear", "DotProductAttention", "LayerNorm", "initialize_ub",
                            "destroy_ub", "DelayedScaling", "autocast"} and "fp8_autocast" not in names["2.9"]
    assert names["2.8"] >= {"LayerNormLinear", "RMSNorm", "DelayedScaling", "fp8_autocast"}
    assert "autocast" not in names["2.8"]
    problems = []
    for run, src in (("2.9", sources[NEW]), ("2.8", sources[OLD])):
        for name, npos, keywords in recorded[run]:
            problems += check_call(src, name, npos, keywords)
    # the layers, norms, recipe and userbuffers are the same calls under both versions: check
    # each against the other version as well (megalite claims all of TE 2.x from 2.8)
    for run, src in (("2.9", sources[OLD]), ("2.8", sources[NEW])):
        for name, npos, keywords in recorded[run]:
            if not name.endswith("autocast"):
                problems += check_call(src, name, npos, keywords)
    assert not problems, "\n".join(sorted(set(problems)))


def _fp8_module_methods() -> set[str]:
    """The methods megalite/layers/fp8.py calls on TE modules (``module.X(...)``)."""
    tree = ast.parse((Path(__file__).parents[1] / "megalite" / "layers" / "fp8.py").read_text())
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "module"}


def test_fp8_state_methods_and_recipe_formats_exist(sources):
    methods = _fp8_module_methods()
    assert methods == {"init_fp8_metadata", "get_fp8_meta_tensors", "reset_fp8_meta_tensors"}, methods
    for src in sources.values():
        for cls in ("Linear", "LayerNormLinear"):
            for m in methods:
                assert src.has_member(f"transformer_engine.pytorch.{cls}", m), (src.version, cls, m)
        for fmt in ("E4M3", "HYBRID"):  # fp8.py's recipe.Format members
            assert src.has_member("transformer_engine.common.recipe.Format", fmt), (src.version, fmt)


def test_the_standin_uses_te_argument_names(sources):
    """Every parameter of the stand-in's entry points is one of TE's (so a keyword megalite passes
    that the stand-in accepts, TE accepts too)."""
    import inspect
    standin = {"Linear": te_standin.Linear, "LayerNormLinear": te_standin.LayerNormLinear,
               "LayerNorm": te_standin.LayerNorm, "RMSNorm": te_standin.RMSNorm,
               "DotProductAttention": te_standin.DotProductAttention, "fp8_autocast": te_standin.fp8_autocast,
               "autocast": te_standin.autocast, "module.base.initialize_ub": te_standin.initialize_ub}
    problems = []
    for name, obj in standin.items():
        ours = set(inspect.signature(obj).parameters)
        src = sources[NEW]
        _, theirs, var_kw = src.accepts(f"transformer_engine.pytorch.{name}")
        if not var_kw and ours - theirs:
            problems.append(f"{name}: the stand-in takes {sorted(ours - theirs)}, TE {src.version} does not")
    _, theirs, _ = sources[NEW].accepts("transformer_engine.common.recipe.DelayedScaling")
    ours = set(inspect.signature(te_standin.DelayedScaling).parameters)
    if ours - theirs:
        problems.append(f"DelayedScaling: the stand-in takes {sorted(ours - theirs)}")
    assert not problems, problems
