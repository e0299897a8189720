"""constraints.txt pins every dependency the project names, so CI installs what the suite last
passed with; ``scripts/setup_env.sh --latest`` keeps only the machine's pin (torch's CPU wheel)."""
import re
import subprocess

from tests.dependency_versions import ROOT, canonical, dependency_names, requirements

MARKER = "# ---- reproducible"


def _pins(text: str) -> dict[str, str]:
    return {canonical(name): pin for name, pin in requirements(text) if pin is not None}


def test_every_named_dependency_is_pinned():
    pins = _pins((ROOT / "constraints.txt").read_text())
    unpinned = [n for n in dependency_names() if canonical(n) not in pins]
    assert not unpinned, (f"{unpinned}: named in requirements*.txt but not pinned with == in constraints.txt; "
                          "CI would install whatever release is newest that day. Pin the version the suite "
                          "passes with (scripts/setup_env.sh prints the installed ones).")


def test_latest_keeps_only_the_machine_pin():
    """The filter setup_env.sh --latest applies (its own sed line, read from the script)."""
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    (sed,) = re.findall(r"^\s*(sed '[^']*' constraints\.txt)", script, flags=re.M)
    kept = subprocess.run(["bash", "-c", sed], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert (ROOT / "constraints.txt").read_text().count(MARKER) == 1
    assert _pins(kept) == {"torch": "2.13.0"}
    assert "transformers" in _pins((ROOT / "constraints.txt").read_text())
