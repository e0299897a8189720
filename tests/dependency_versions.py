"""The resolved version of every dependency the project names, in one line.

The names come from the files that state them (requirements.txt, requirements-dev.txt,
constraints.txt), so a new dependency is listed once it is required or pinned. Printed by
``scripts/setup_env.sh`` (the first line of ``scripts/test.sh``) and in pytest's header, so a
failing run says what it ran with: ``python -m tests.dependency_versions``.
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ("requirements.txt", "requirements-dev.txt", "constraints.txt")
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:==(\S+))?")


def requirements(text: str) -> list[tuple[str, str | None]]:
    """(name, ``==`` pin or None) of each requirement line; comments and '-r'/'-c'/'-e' lines skipped."""
    found = []
    for line in text.splitlines():
        match = _REQUIREMENT.match(line.split("#", 1)[0].strip())
        if match:
            found.append((match.group(1), match.group(2)))
    return found


def canonical(name: str) -> str:
    """One spelling per distribution (``huggingface_hub`` = ``huggingface-hub``)."""
    return name.lower().replace("_", "-")


def dependency_names(root: pathlib.Path = ROOT) -> list[str]:
    """Distribution names stated in the files, first mention first, each once."""
    names: dict[str, str] = {}
    for file in FILES:
        path = root / file
        if path.exists():
            for name, _ in requirements(path.read_text()):
                names.setdefault(canonical(name), name)
    return list(names.values())


def versions(root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    out = []
    for name in dependency_names(root):
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def line(root: pathlib.Path = ROOT) -> str:
    return "dependencies: " + ", ".join(f"{name} {version}" for name, version in versions(root))


if __name__ == "__main__":
    print(line())
