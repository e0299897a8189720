"""megalite's imports only go down its floors (DESIGN.md 4c): no module reaches, through any
chain of imports, back to itself.

The graph is read from the source with ``ast``, never by importing: every ``import`` and
``from ... import`` counts wherever it stands (module level, inside a function or class,
relative or absolute), except those under ``if TYPE_CHECKING:``, which never run. A name
imported from a package counts as an import of its submodule when one exists
(``from megalite.layers import attention``). The top-level ``kernels/`` folder is read under the
name setup.py installs it as (``package_dir``).
"""
from __future__ import annotations

import ast
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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The known modules that module ``name`` (file ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    targets = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
    known = modules(package_dirs(root))
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
    package-attribute imports and through the mapped kernels folder, and ignores
    TYPE_CHECKING imports."""
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
