"""No name the checkout puts on ``sys.path`` hides an installed package or the standard library.

Python puts the current directory first on ``sys.path`` for ``python -c``, ``python -``, a REPL
and pytest's root, and a script's own folder for ``python tools/x.py``. A module or a regular
package (a folder with ``__init__.py``) there with the import name of an installed distribution
hides that distribution from everything run from the checkout: transformers 5.25 imports
Hugging Face's ``kernels`` whenever one is installed, and got megalite's top-level ``kernels/``
instead (issue 35). A folder *without* ``__init__.py`` is only a namespace portion, which the
import system takes after any regular package or module on the path (PEP 420), so
megalite's ``kernels/`` (imported as ``megalite.kernels``) has none.

The check asks Python itself, from each folder the checkout puts first on ``sys.path``, where each
clashing name resolves: a clash fails when the spec lies in the checkout, naming the checkout's
file and the distributions (or the standard library) it hides.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_import_cycles import package_dirs

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", "node_modules"}
EXTENSION_SUFFIXES = (".so", ".pyd")


def mapped_folders(root: Path) -> set[Path]:
    """Folders setup.py's ``package_dir`` installs under another name (``kernels`` ->
    ``megalite.kernels``): never run as scripts, never on ``sys.path`` themselves."""
    return {folder for name, folder in package_dirs(root).items() if folder != root / name.replace(".", "/")}


def path_folders(root: Path) -> list[Path]:
    """The root, plus every folder holding a script that Python would put first on sys.path:
    a folder with a ``.py`` file directly in it that is neither inside a package nor mapped."""
    skip = mapped_folders(root)
    found = [root]
    for folder, subdirs, files in os.walk(root):
        here = Path(folder)
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith(".")
                            and not (here / d / "__init__.py").exists() and here / d not in skip)
        if here != root and any(f.endswith(".py") for f in files):
            found.append(here)
    return found


def importable_names(folder: Path) -> dict[str, Path]:
    """Top-level import name -> entry, for what ``import NAME`` could find in ``folder``:
    modules, extension modules, regular packages and namespace portions."""
    names = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name in SKIP_DIRS:
            continue
        if entry.is_dir():
            name = entry.name
        elif entry.suffix == ".py":
            name = entry.stem
        elif entry.suffix in EXTENSION_SUFFIXES:
            name = entry.name.split(".")[0]
        else:
            continue
        if name.isidentifier():
            names[name] = entry
    return names


def installed_names(own_distribution: str = "megalite") -> dict[str, list[str]]:
    """Import name -> who owns it: the installed distributions (``packages_distributions``, our
    own left out) and the standard library."""
    owners: dict[str, list[str]] = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        name = name.split("/")[0].removesuffix(".py")
        others = [d for d in dists if d.lower() != own_distribution]
        if name.isidentifier() and others:
            owners.setdefault(name, []).extend(d for d in others if d not in owners.get(name, []))
    for name in sys.stdlib_module_names:
        owners.setdefault(name, []).append("the standard library")
    return owners


_WHERE = """
import sys
first = sys.path.pop(0)  # this probe's own imports must not come from the folder it probes
import json
sys.path.insert(0, first)
out = {}
for name in sys.argv[1:]:
    # The import system's own search, without sys.modules (which holds this probe's imports):
    # the meta path in order, built-in and frozen modules first, then sys.path.
    spec = None
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(name, None)
        except Exception as exc:  # a broken package resolved somewhere: report where it failed
            spec = exc
        if spec is not None:
            break
    if isinstance(spec, Exception):
        out[name] = [repr(spec)]
    else:
        out[name] = [] if spec is None else [str(p) for p in [spec.origin, *(spec.submodule_search_locations or [])] if p]
print(json.dumps(out))
"""


def resolve_from(folder: Path, names: list[str]) -> dict[str, list[str]]:
    """Where ``import NAME`` finds each name for ``python -c`` run in ``folder`` (which Python
    puts first on sys.path, as it does a script's own folder)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", _WHERE, *names], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def in_checkout(path: Path, root: Path) -> bool:
    """Whether ``path`` is the checkout's own (a virtual environment inside it is not)."""
    path, root = path.resolve(), root.resolve()
    if not path.is_relative_to(root):
        return False
    first = path.relative_to(root).parts[:1]
    return not first or (first[0] not in SKIP_DIRS and not first[0].startswith("."))


def shadowing(root: Path, owners: dict[str, list[str]]) -> list[str]:
    """One line per name of the checkout that hides an installed package or a stdlib module."""
    problems = []
    for folder in path_folders(root):
        names = importable_names(folder)
        clashes = sorted(set(names) & set(owners))
        if not clashes:
            continue
        for name, locations in resolve_from(folder, clashes).items():
            inside = [p for p in locations if os.path.isabs(p) and in_checkout(Path(p), root)]
            kind = ("a regular package" if (names[name] / "__init__.py").exists() else "a namespace portion"
                    if names[name].is_dir() else "a module")
            # A namespace portion hides nothing; it only matters when it merges into an installed
            # namespace package of the same name (locations both inside and outside the checkout).
            merges = kind == "a namespace portion" and len(inside) < len(locations)
            if inside and (kind != "a namespace portion" or merges):
                where = names[name].relative_to(root)
                problems.append(f"{where}{'/' if names[name].is_dir() else ''} ({kind}, imported as `{name}` from "
                                f"{folder.relative_to(root) if folder != root else 'the repository root'}) hides "
                                f"`{name}` of {', '.join(owners[name])}")
    return problems


def test_no_name_of_the_checkout_hides_an_installed_package():
    owners = installed_names()
    problems = shadowing(ROOT, owners)
    assert not problems, ("names of the checkout shadow installed packages for anything run from it "
                          "(python -c, pytest, tools/); rename the file or folder, or, for a folder "
                          "installed under another name (setup.py package_dir), drop its __init__.py "
                          "(kernels/README.md says why):\n  " + "\n  ".join(problems))


def test_the_checker_names_a_planted_clash(tmp_path):
    """A checkout with a regular ``numpy`` package, a ``json.py`` and a script folder holding a
    ``numpy.py`` is caught, each with both names; a namespace ``numpy/`` (no ``__init__.py``,
    installed under another name as megalite's ``kernels/`` is) is not."""
    (tmp_path / "setup.py").write_text('setup(package_dir={"mine.numpy": "numpy"})\n')
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "norms.py").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "run.py").write_text("")
    owners = {"numpy": ["numpy"], "json": ["the standard library"]}
    assert shadowing(tmp_path, owners) == []

    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "json.py").write_text("")
    (tmp_path / "tools" / "numpy.py").write_text("")
    found = shadowing(tmp_path, owners)
    assert found == [
        "json.py (a module, imported as `json` from the repository root) hides `json` of the standard library",
        "numpy/ (a regular package, imported as `numpy` from the repository root) hides `numpy` of numpy",
        "tools/numpy.py (a module, imported as `numpy` from tools) hides `numpy` of numpy",
    ], found


@pytest.mark.slow  # a subprocess importing transformers (5 s); the static check above is fast
def test_transformers_imports_the_real_kernels_package_from_the_repository_root():
    """The direct case: from the repository root, transformers' hub-kernels integration imports,
    with Hugging Face's ``kernels`` distribution installed (constraints.txt pins it), and
    ``megalite.kernels`` is still the checkout's folder."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` distribution is not installed: run scripts/setup_env.sh "
                    "(requirements-dev.txt asks for it, so this check always has it)")
    code = ("import transformers.integrations.hub_kernels, kernels, megalite.kernels.norms as n, json; "
            "from transformers.utils.import_utils import is_kernels_available as ok; "
            "print(json.dumps([kernels.__file__, n.__file__, ok()]))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    hub_kernels, our_norms, available = json.loads(result.stdout.strip().splitlines()[-1])
    installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    assert Path(hub_kernels).resolve() == Path(installed).resolve(), (hub_kernels, installed)
    assert Path(our_norms).resolve() == ROOT / "kernels" / "norms.py"
    assert available is True


_WHERE_KERNELS = """
import json, sys
if "--plain" in sys.argv:  # a plain checkout on PYTHONPATH: no editable install's finder
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
import importlib.util  # finds the file without compiling its kernels (megalite/__init__ runs)
print(json.dumps(importlib.util.find_spec("megalite.kernels.norms").origin))
"""


def _kernels_file(cwd: Path, *flags: str, pythonpath: Path | None = None) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, "-c", _WHERE_KERNELS, *flags], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(json.loads(result.stdout.strip().splitlines()[-1])).resolve()


@pytest.mark.slow  # builds a wheel, three interpreters (3 s)
def test_megalite_kernels_is_found_by_every_install(tmp_path):
    """``megalite.kernels`` (a folder without ``__init__.py``) is found from outside the checkout
    by a plain checkout on PYTHONPATH (megalite/__init__.py registers it), by the editable install
    the suite runs in, and by a regular install (the wheel setup.py builds, unpacked)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ours = ROOT / "kernels" / "norms.py"
    assert _kernels_file(elsewhere, "--plain", pythonpath=ROOT) == ours

    editable = [d for d in importlib.metadata.distributions(name="megalite")
                if json.loads(d.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable")]
    assert editable, "the suite runs in scripts/setup_env.sh's editable install of megalite (pip install -e .)"
    assert _kernels_file(elsewhere) == ours

    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "setup.py", source)
    for folder in ("megalite", "kernels"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("megalite-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:  # a pure-Python wheel: unpacking it is installing it
        archive.extractall(site)
    assert not (site / "kernels").exists()  # installed under megalite/ only: nothing to shadow
    assert _kernels_file(elsewhere, pythonpath=site) == (site / "megalite" / "kernels" / "norms.py").resolve()
