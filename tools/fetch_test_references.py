"""Fetch the release archives some tests read as references, before the tests run.

    python3 tools/fetch_test_references.py            fetch what is missing; verify what is cached
    python3 tools/fetch_test_references.py --check    verify only (no network): exit 1 if any is
                                                      missing or damaged
    python3 tools/fetch_test_references.py --show flash-attn==2.8.3
                                                      the registry's files and sha256 for a release
                                                      (to pin a new one in the manifest)

The archives (flash-attn source archives, transformer-engine wheels) are pinned, each with its
sha256, in tests/reference_archives.json. They land in a cache keyed by version,
``$MEGALITE_TEST_REFERENCES`` (default ``~/.cache/megalite/test-references``), as
``<package>/<version>/<file>`` (a file the manifest lists under ``extract``, taken out of its
archive when fetched, beside it under its path in the archive): outside the checkout, so that a
fresh clone (CI makes one for each run) and ``.venv-latest`` find them without fetching again; a
pin, not the location, is what keeps them from going stale. Each file's sha256 is checked on fetch
(a download that differs is refused and never enters the cache) and again on every use
(tests/reference_cache.py). A second run with everything cached only checks the sums, without the
network.

Nothing is built or run: the file is resolved through the package index pip uses (its JSON
simple API, PEP 691: ``PIP_INDEX_URL``, else pip's configured ``global.index-url``, else pip's
default) and downloaded as it is. ``pip download`` would run a source archive's setup.py to read
its metadata (flash-attn's imports torch and probes for CUDA). Only the standard library and pip's
configuration are used, so any ``python3`` with pip runs this.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import ssl
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "reference_archives.json"
CACHE_ENV = "MEGALITE_TEST_REFERENCES"
FETCH_COMMAND = "python3 tools/fetch_test_references.py"  # from the repository root
_JSON_API = "application/vnd.pypi.simple.v1+json"


@dataclass(frozen=True)
class Archive:
    package: str
    version: str
    file: str
    sha256: str
    extract: dict[str, str] = field(default_factory=dict)  # path in the archive -> its sha256


class ArchiveError(Exception):
    """A reference archive that cannot be used; the message says why and what fixes it."""


class ArchiveMissing(ArchiveError):
    pass


class ArchiveDamaged(ArchiveError):
    pass


def archives(manifest: Path = MANIFEST) -> list[Archive]:
    return [Archive(**entry) for entry in json.loads(manifest.read_text())["archives"]]


def find(package: str, version: str, manifest: Path = MANIFEST) -> Archive:
    for archive in archives(manifest):
        if (archive.package, archive.version) == (package, version):
            return archive
    raise ArchiveError(f"{package}=={version} is not pinned in {manifest}: add it there "
                       f"({FETCH_COMMAND} --show {package}=={version} prints its sha256)")


def cache_root() -> Path:
    where = os.environ.get(CACHE_ENV)
    return Path(where) if where else Path.home() / ".cache" / "megalite" / "test-references"


def cached_path(archive: Archive, root: Path | None = None) -> Path:
    return (root or cache_root()) / archive.package / archive.version / archive.file


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def member_path(archive: Archive, member: str, root: Path | None = None) -> Path:
    """Where a file listed in ``archive.extract`` is kept: its path in the archive, beside the archive."""
    return cached_path(archive, root).parent / member


def _checked(path: Path, sha256: str, what: str) -> Path:
    if not path.is_file():
        raise ArchiveMissing(f"{what} is not in the test-reference cache ({path}): run `{FETCH_COMMAND}` from the "
                             f"repository root (scripts/setup_env.sh runs it)")
    got = sha256_of(path)
    if got != sha256:
        raise ArchiveDamaged(f"{path} is damaged or not the pinned file: its sha256 is {got}, "
                             f"tests/reference_archives.json pins {sha256}; run `{FETCH_COMMAND}` from the "
                             f"repository root to fetch it again")
    return path


def verified(archive: Archive, root: Path | None = None) -> Path:
    """The cached file of ``archive``, its sha256 checked; ArchiveMissing or ArchiveDamaged if not."""
    return _checked(cached_path(archive, root), archive.sha256,
                    f"{archive.package}=={archive.version} ({archive.file})")


def verified_member(archive: Archive, member: str, root: Path | None = None) -> Path:
    """The kept copy of ``member`` (one of ``archive.extract``), its sha256 checked."""
    return _checked(member_path(archive, member, root), archive.extract[member],
                    f"{member} of {archive.package}=={archive.version}")


# -- fetching ------------------------------------------------------------------------------------
def _pip_setting(name: str) -> str | None:
    run = subprocess.run([sys.executable, "-m", "pip", "config", "get", name], capture_output=True, text=True,
                         check=False)
    return (run.stdout.strip() or None) if run.returncode == 0 else None


def index_url() -> str:
    """The package index pip would use."""
    url = os.environ.get("PIP_INDEX_URL") or _pip_setting("global.index-url")
    if url:
        return url.rstrip("/")
    try:
        from pip._internal.models.index import PyPI
    except ImportError as exc:
        raise ArchiveError(f"cannot tell which package index to use (no pip for {sys.executable}): "
                           f"set PIP_INDEX_URL") from exc
    return PyPI.simple_url.rstrip("/")


def _ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or _pip_setting("global.cert")
    return ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()


def _open(url: str, accept: str | None = None):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    context = _ssl_context() if url.startswith("https") else None
    return urllib.request.urlopen(request, timeout=120, context=context)


def release_files(package: str, index: str, open_url=_open) -> dict[str, dict]:
    """The index's files of ``package``: name -> {"url", "hashes", ...} (PEP 691)."""
    with open_url(f"{index}/{package}/", _JSON_API) as answer:
        return {f["filename"]: f for f in json.load(answer)["files"]}


def download(archive: Archive, root: Path | None = None, index: str | None = None, open_url=_open) -> Path:
    """Downloads ``archive`` into the cache; refuses (nothing cached) unless its sha256 is the pin's."""
    files = release_files(archive.package, index or index_url(), open_url)
    if archive.file not in files:
        raise ArchiveError(f"the package index has no {archive.file} for {archive.package}")
    listed = files[archive.file].get("hashes", {}).get("sha256")
    if listed and listed != archive.sha256:
        raise ArchiveDamaged(f"the package index lists sha256 {listed} for {archive.file}, "
                             f"tests/reference_archives.json pins {archive.sha256}: refused")
    path = cached_path(archive, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        with open_url(files[archive.file]["url"]) as answer, open(partial, "wb") as out:
            for block in iter(lambda: answer.read(1 << 20), b""):
                out.write(block)
        got = sha256_of(partial)
        if got != archive.sha256:
            raise ArchiveDamaged(f"the download of {archive.file} has sha256 {got}, tests/reference_archives.json "
                                 f"pins {archive.sha256}: refused, nothing cached")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _read_members(path: Path, wanted: set[str]) -> dict[str, bytes]:
    """The bytes of the ``wanted`` files of a .tar.gz (read as a stream) or a wheel (a zip)."""
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            return {name: z.read(name) for name in wanted if name in z.namelist()}
    found = {}
    with tarfile.open(path, "r|*") as tar:
        for info in tar:
            if info.isfile() and info.name in wanted:
                found[info.name] = tar.extractfile(info).read()
                if len(found) == len(wanted):
                    break
    return found


def extract_members(archive: Archive, root: Path | None = None) -> None:
    """Keeps each file of ``archive.extract``, taken from the verified archive, if its sha256 is the pin's."""
    found = _read_members(verified(archive, root), set(archive.extract))
    for member, sha256 in archive.extract.items():
        if member not in found:
            raise ArchiveError(f"{archive.file} has no {member} (tests/reference_archives.json lists it)")
        got = hashlib.sha256(found[member]).hexdigest()
        if got != sha256:
            raise ArchiveDamaged(f"{member} of {archive.file} has sha256 {got}, tests/reference_archives.json "
                                 f"pins {sha256}: refused")
        path = member_path(archive, member, root)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_bytes(found[member])
        partial.replace(path)


def fetch_all(root: Path | None = None, manifest: Path = MANIFEST, open_url=_open, log=print) -> None:
    """Every pinned archive into the cache: kept if its sum checks, fetched if missing or damaged;
    then the files to extract from it, likewise."""
    for archive in archives(manifest):
        name = f"{archive.package}=={archive.version}"
        try:
            verified(archive, root)
            log(f"  {name}: cached, sha256 ok")
        except ArchiveMissing:
            log(f"  {name}: fetching {archive.file}")
            download(archive, root, open_url=open_url)
            log(f"  {name}: fetched, sha256 ok")
        except ArchiveDamaged as exc:
            log(f"  {name}: {exc}; fetching it again")
            download(archive, root, open_url=open_url)
            log(f"  {name}: fetched, sha256 ok")
        try:
            for member in archive.extract:
                verified_member(archive, member, root)
        except ArchiveError:
            extract_members(archive, root)
            log(f"  {name}: extracted {', '.join(archive.extract)}, sha256 ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify the cache only (no network)")
    parser.add_argument("--show", metavar="PACKAGE==VERSION",
                        help="list the index's files and sha256 of a release")
    args = parser.parse_args(argv)
    if args.show:
        package, _, version = args.show.partition("==")
        for name, info in release_files(package, index_url()).items():
            if version in name:
                print(name, info.get("hashes", {}).get("sha256"))
        return 0
    print(f"test references ({cache_root()}):")
    try:
        if not args.check:
            fetch_all()
        problems = []
        for archive in archives():
            for check in [lambda: verified(archive)] + [lambda m=m: verified_member(archive, m)
                                                        for m in archive.extract]:
                try:
                    check()
                except ArchiveError as exc:
                    problems.append(str(exc))
    except (ArchiveError, OSError) as exc:  # OSError: no network, a full disk, ...
        print(f"fetch_test_references: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"fetch_test_references: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
