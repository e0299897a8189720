"""What a test reads of a pinned reference archive, from the cache only (never the network).

tools/fetch_test_references.py fills the cache before the tests (scripts/setup_env.sh runs it);
here each use checks the file's sha256 against tests/reference_archives.json again. A missing
file skips the test with the command that fetches it, or fails it under ``CI=true`` (a CI run
must not check less because a fetch went wrong); a damaged one fails it everywhere.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.skip_policy import in_ci
from tools.fetch_test_references import ArchiveError, ArchiveMissing, find, verified, verified_member


def _or_skip_or_fail(check):
    try:
        return check()
    except ArchiveMissing as exc:
        if in_ci():
            pytest.fail(f"CI=true: {exc}", pytrace=False)
        pytest.skip(str(exc))
    except ArchiveError as exc:
        pytest.fail(str(exc), pytrace=False)


def archive_path(package: str, version: str, root: Path | None = None) -> Path:
    """The verified cached archive of ``package==version``."""
    return _or_skip_or_fail(lambda: verified(find(package, version), root))


def extracted_file(package: str, version: str, member: str, root: Path | None = None) -> Path:
    """The verified copy of ``member`` (a path the manifest lists under the archive's ``extract``)."""
    return _or_skip_or_fail(lambda: verified_member(find(package, version), member, root))


def unpacked_wheel(package: str, version: str, into: Path, root: Path | None = None) -> Path:
    """The verified wheel of ``package==version`` unpacked into ``into`` (returned)."""
    with zipfile.ZipFile(archive_path(package, version, root)) as wheel:
        wheel.extractall(into)
    return into
