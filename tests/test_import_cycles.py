"""megalite's imports only go down its floors (DESIGN.md 4c, docs/architecture.md): no module
reaches, through any chain of imports, back to itself, and no module imports one on a higher
floor (:data:`FLOORS`).

The graph is read from the source with ``ast``, never by importing: every ``import`` and
``from ... import`` counts wherever it stands (module level, inside a function or class,
relative or absolute), those under ``if TYPE_CHECKING:`` included (a circle of type hints is
still a circle: the hint names a module the reader must understand first). A name imported
from a package counts as an import of its submodule when one exists
(``from megalite.layers import attention``). The top-level ``kernels/`` folder is read under the
name setup.py installs it as (``package_dir``).
"""
from __future__ import annotations

import ast
import functools
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def package_dirs(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Package name -> folder: megalite/ plus what setup.py's ``package_dir`` maps."""
    dirs = {"megalite": root / "megalite"}
    setup = root / "setup.py"
    if setup.exists():
        for node in ast.walk(ast.parse(setup.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "package_dir":
                for name, folder in ast.literal_eval(node.value).items():
                    if name:
                        dirs[name] = root / folder
    return dirs


def modules(dirs: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under each package folder."""
    found = {}
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package,) + parts)] = path
    return found


def type_checking_imports(tree: ast.AST) -> list[ast.AST]:
    """The import statements under ``if TYPE_CHECKING:`` (counted in the graph like any other)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found += [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


@functools.lru_cache(maxsize=None)
def _parsed(path: str, mtime_ns: int, size: int) -> ast.AST:
    return ast.parse(pathlib.Path(path).read_text(), filename=path)


def parse(path: pathlib.Path) -> ast.AST:
    """The file's syntax tree, parsed once per version of the file (the checks here share it)."""
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


def imports_of(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The known modules that module ``name`` (file ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parse(path)
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets += [base] + [f"{base}.{alias.name}" for alias in node.names]
    out = set()
    for target in targets:
        while target and target not in known:  # a name inside a module: the module itself
            target = target.rpartition(".")[0]
        # A module importing its own package (or itself) is not a floor crossing.
        if target and target != name and not name.startswith(target + "."):
            out.add(target)
    return out


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the known modules it imports; computed once per version of the files (the checks
    here share it: read it, do not change it)."""
    known = modules(package_dirs(root))
    return _graph(tuple(sorted((name, str(path), path.stat().st_mtime_ns, path.stat().st_size)
                               for name, path in known.items())))


@functools.lru_cache(maxsize=None)
def _graph(files: tuple) -> dict[str, set[str]]:
    known = {name: pathlib.Path(path) for name, path, _, _ in files}
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(found: list[list[str]]) -> str:
    return "\n".join(" <-> ".join(c) for c in found)


def test_megalite_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert "megalite.kernels.flash_attention" in graph  # kernels/ is read as megalite.kernels
    assert "megalite.config" in graph["megalite.model.gpt"]  # the graph is really read
    found = cycles(graph)
    assert not found, ("import cycle(s) in megalite/: a concern sits on the wrong floor (DESIGN.md "
                       "4c); move the shared piece down:\n" + describe(found))


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_cycle_is_found_and_named(tmp_path):
    """A synthetic package: the checker sees cycles through function-level, relative and
    package-attribute imports, through the mapped kernels folder and through TYPE_CHECKING
    imports (a circle of type hints is a circle)."""
    _write(tmp_path, {
        "setup.py": 'setup(package_dir={"megalite.kernels": "kernels"})\n',
        "megalite/__init__.py": "",
        "megalite/errors.py": "",
        "megalite/config.py": "from megalite.errors import ConfigError\n",
        "megalite/layers/__init__.py": "",
        "megalite/layers/attention.py": "from ..config import ModelConfig\nfrom megalite.kernels import flash\n",
        "megalite/model.py": """\
            from typing import TYPE_CHECKING
            from megalite.layers import attention
            if TYPE_CHECKING:
                from megalite.moe import MoE
            """,
        "megalite/moe.py": "import megalite.model\n",
        "kernels/flash.py": "from megalite.kernels import _utils\n",
        "kernels/_utils.py": "",
    })
    assert cycles(import_graph(tmp_path)) == [["megalite.model", "megalite.moe"]]
    _write(tmp_path, {"megalite/model.py": "from megalite.layers import attention\n"})
    assert cycles(import_graph(tmp_path)) == []

    _write(tmp_path, {"megalite/config.py": """\
        from megalite.errors import ConfigError
        def validate():
            from megalite.moe import settings
        """})
    assert cycles(import_graph(tmp_path)) == [
        ["megalite.config", "megalite.layers.attention", "megalite.model", "megalite.moe"]]

    _write(tmp_path, {"megalite/config.py": "", "kernels/_utils.py": "from .. import config\n"})
    graph = import_graph(tmp_path)
    assert "megalite.config" in graph["megalite.kernels._utils"]
    assert cycles(graph) == []
    _write(tmp_path, {"megalite/config.py": "import megalite.layers.attention as a\n"})
    assert describe(cycles(import_graph(tmp_path))) == (
        "megalite.config <-> megalite.kernels._utils <-> megalite.kernels.flash <-> megalite.layers.attention")


# -- the floors --------------------------------------------------------------------------------------

# docs/architecture.md's floors, ground up: module (or package) -> floor. A module takes the floor
# of its longest listed prefix; an import may go to the same floor or below, never above. A few
# submodules sit below their package's floor because they are plain tables or rules that a lower
# floor asks (each says why); every module of megalite/ must have a floor.
FLOORS = {
    # 1: the ground floor: no megalite imports beyond each other
    "megalite": 1, "megalite.errors": 1, "megalite.flag_spec": 1, "megalite.config_types": 1,
    "megalite.context_parallel.comm_types": 1,  # the CP types, a plain table the settings' choices read "megalite.device": 1, "megalite.observe.memory_tracker": 1,
    "megalite.observe.timers": 1, "megalite.observe.host_syncs": 1, "megalite.host_memory": 1, "megalite.observe.progress": 1,
    "megalite.observe.plotting": 1, "megalite.observe.step_values": 1, "megalite.testing": 1,
    # 2: the grid, collectives and random streams; data; what needs only them
    "megalite.parallel": 2, "megalite.data": 2, "megalite.resilience.faults": 2, "megalite.model.recompute": 2,
    "megalite.resilience": 2, "megalite.launch": 2, "megalite.run_settings": 2,
    "megalite.observe.profiling": 2,  # it reads the run's LoggingSettings
    "megalite.kernels": 3,
    "megalite.layers": 4, "megalite.model.generation": 4,
    "megalite.context_parallel": 5,
    # the rules config.validate() asks, each beside its layers' checks (below config):
    "megalite.moe.settings": 5,  # the MoE flag rules
    "megalite.pipeline.schedule_kinds": 5,  # the schedule table (plain data)
    "megalite.pipeline.orders": 5,  # each schedule's operation order (plain functions the table names)
    "megalite.pipeline.checks": 5,  # the schedule rules, read from the table
    # the update rules and the ZeRO arithmetic (torch only), which the parts' counting and the planners ask:
    "megalite.data_parallel.adamw": 5, "megalite.data_parallel.update_rule": 5, "megalite.data_parallel.accounting": 5,
    "megalite.data_parallel.step_counter": 5,  # the steppers' device step count (torch only)
    "megalite.data_parallel.rule_types": 5, "megalite.data_parallel.muon": 5,  # the rules under the registry
    "megalite.config": 6, "megalite.arguments": 6,
    "megalite.moe": 7,
    "megalite.model": 8,
    "megalite.data_parallel": 9, "megalite.pipeline": 9,
    "megalite.checkpoint": 10, "megalite.planner": 10, "megalite.observe.monitor": 10, "megalite.train.preflight": 10,
    "megalite.observe.timeline": 10,
    # the planner's own floors (megalite/planner/__init__.py): its types at the bottom, the package's
    # re-exports on top
    "megalite.planner.types": 10.0, "megalite.planner.flags": 10.1, "megalite.planner.layers": 10.1,
    "megalite.planner.cp": 10.1, "megalite.planner.documents": 10.1, "megalite.planner.checks": 10.1,
    "megalite.planner.update_traffic": 10.1, "megalite.planner.hardware": 10.1,
    "megalite.planner.pipeline": 10.2, "megalite.planner.step_time": 10.25, "megalite.planner.estimate": 10.3, "megalite.planner.search": 10.4,
    "megalite.planner": 10.5,
    "megalite.train.step": 11, "megalite.observe.step_log": 11, "megalite.train.loop": 11, "megalite.train.pretrain": 11,
    "megalite.testing.reference_step": 11,  # test support: the plain step beside the one it is compared with
}

# Upward imports that remain, each with its reason (importer, imported): aim for none.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def floor_of(module: str) -> float | None:
    """The floor of ``module``: that of its longest prefix in :data:`FLOORS` (None: not listed)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import that goes up a floor."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a))


def type_checking_count(root: pathlib.Path) -> list[str]:
    """'file:line' of every import under ``if TYPE_CHECKING:`` in megalite/ and kernels/."""
    found = []
    for path in sorted(modules(package_dirs(root)).values()):
        for node in type_checking_imports(parse(path)):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_module_has_a_floor():
    missing = sorted(m for m in import_graph(ROOT) if floor_of(m) is None)
    assert not missing, "give each a floor in FLOORS (docs/architecture.md's list):\n" + "\n".join(missing)


def test_imports_only_go_down_the_floors():
    """No import reaches a higher floor than its module's, but the listed exceptions; and each
    listed exception still exists (a fixed one leaves the list)."""
    found = upward_imports(import_graph(ROOT))
    unexpected = [f"{a} (floor {floor_of(a)}) imports {b} (floor {floor_of(b)})" for a, b in found
                  if (a, b) not in KNOWN_UPWARD]
    assert not unexpected, ("upward import(s): move the shared piece down (docs/architecture.md):\n"
                            + "\n".join(unexpected))
    stale = sorted(set(KNOWN_UPWARD) - set(found))
    assert not stale, f"no longer upward, drop from KNOWN_UPWARD: {stale}"


def test_no_type_checking_imports():
    """A TYPE_CHECKING import hides an edge from a reader (and, before, from this checker): none."""
    found = type_checking_count(ROOT)
    assert found == [], "TYPE_CHECKING import(s); import the type from its floor instead:\n" + "\n".join(found)


def test_an_upward_type_hint_is_found(tmp_path):
    """A synthetic package: an upward import hidden under TYPE_CHECKING is counted, is an edge of
    the graph and is reported as upward; one going down is not."""
    _write(tmp_path, {
        "megalite/__init__.py": "",
        "megalite/errors.py": "",
        "megalite/parallel/__init__.py": "",
        "megalite/parallel/grid.py": "from megalite.errors import ConfigError\n",
        "megalite/planner/__init__.py": "",
        "megalite/planner/types.py": "from megalite.parallel.grid import GridLayout\n",
    })
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [] and type_checking_count(tmp_path) == []
    _write(tmp_path, {"megalite/parallel/grid.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from megalite.planner.types import Layout
        """})
    graph = import_graph(tmp_path)
    assert type_checking_count(tmp_path) == ["megalite/parallel/grid.py:3"]
    assert upward_imports(graph) == [("megalite.parallel.grid", "megalite.planner.types")]
    assert cycles(graph) == [["megalite.parallel.grid", "megalite.planner.types"]]
