"""The test-reference cache: pinned archives fetched before the tests, each sum checked on fetch
and on use, a missing one skipped (or failed under CI) with the command that fetches it.

The fetch runs against a stand-in package index (a function answering the two requests the
fetcher makes: the release's file list, the file), so no test needs the network; the checks on
use run on copies of the real cached archives, one byte flipped."""
import hashlib
import io
import json
import re
import shutil
import tarfile

import pytest

from tests import flash_attn_real, reference_cache, test_te_real_signatures
from tools import fetch_test_references as refs

INTERFACE = "flash_attn-{v}/flash_attn/flash_attn_interface.py"


def test_the_manifest_pins_every_archive_the_tests_read():
    pinned = {(a.package, a.version): a for a in refs.archives()}
    for version in flash_attn_real.VERSIONS:
        archive = pinned[("flash-attn", version)]
        assert archive.file == f"flash_attn-{version}.tar.gz" and INTERFACE.format(v=version) in archive.extract
    for version in (test_te_real_signatures.OLD, test_te_real_signatures.NEW):
        assert pinned[("transformer-engine", version)].file == f"transformer_engine-{version}-py3-none-any.whl"
    sums = [a.sha256 for a in pinned.values()] + [s for a in pinned.values() for s in a.extract.values()]
    assert all(re.fullmatch("[0-9a-f]{64}", s) for s in sums) and len(set(sums)) == len(sums)


def _copy_into(tmp_path, package, version, member=None):
    """A cache under tmp_path holding a copy of the real cached archive (or extracted file)."""
    archive = refs.find(package, version)
    source = (reference_cache.extracted_file(package, version, member) if member
              else reference_cache.archive_path(package, version))
    target = refs.member_path(archive, member, tmp_path) if member else refs.cached_path(archive, tmp_path)
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target)
    return target


def _flip_a_byte(path, at=1000):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("member", [False, True], ids=["TE wheel", "flash-attn interface file"])
def test_a_damaged_file_is_refused_on_use(tmp_path, member):
    """One byte flipped in a copy of a real cached file: the test that reads it fails (not skips),
    naming the file, both sums and the command that fetches it again."""
    if member:
        version = flash_attn_real.VERSIONS[0]
        path = _copy_into(tmp_path, "flash-attn", version, INTERFACE.format(v=version))
        def use():
            return reference_cache.extracted_file("flash-attn", version, INTERFACE.format(v=version), tmp_path)
    else:
        path = _copy_into(tmp_path, "transformer-engine", test_te_real_signatures.OLD)
        def use():
            return reference_cache.archive_path("transformer-engine", test_te_real_signatures.OLD, tmp_path)
    assert use() == path  # intact: the cached file itself
    pinned = refs.sha256_of(path)
    _flip_a_byte(path)
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as failed:
        use()
    assert failed.type is pytest.fail.Exception, failed.type  # not a skip: a damaged file is never fine
    message = str(failed.value)
    assert str(path) in message and pinned in message and refs.sha256_of(path) in message, message
    assert refs.FETCH_COMMAND in message and "damaged" in message, message


@pytest.mark.parametrize("ci", [None, "true"])
def test_a_missing_archive_skips_with_the_command_or_fails_under_ci(tmp_path, monkeypatch, ci):
    monkeypatch.delenv("CI", raising=False)
    if ci:
        monkeypatch.setenv("CI", ci)
    """(Both outcomes caught, then told apart: a skip escaping pytest.raises would skip this test.)"""
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as stopped:
        reference_cache.archive_path("transformer-engine", test_te_real_signatures.NEW, tmp_path)
    assert stopped.type is (pytest.fail.Exception if ci else pytest.skip.Exception), stopped.type
    assert refs.FETCH_COMMAND in str(stopped.value) and str(tmp_path) in str(stopped.value), stopped.value


# -- fetching, against a stand-in index ----------------------------------------------------------------
def _release(tmp_path):
    """A small source archive with one file to extract, and a manifest pinning both."""
    member, text = "demo-1.0/demo/interface.py", b"def f():\n    return 1\n"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in (("demo-1.0/setup.py", b"raise SystemExit('never run')\n"), (member, text)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    entry = {"package": "demo", "version": "1.0", "file": "demo-1.0.tar.gz",
             "sha256": hashlib.sha256(data).hexdigest(), "extract": {member: hashlib.sha256(text).hexdigest()}}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"archives": [entry]}))
    return manifest, refs.Archive(**entry), data


class Index:
    """Answers the fetcher's two requests: the JSON file list of ``demo``, and the file."""

    def __init__(self, data, listed_sha256):
        self.data, self.listed, self.requests = data, listed_sha256, []

    def __call__(self, url, accept=None):
        self.requests.append(url)
        if url == "index/demo/":
            assert accept == "application/vnd.pypi.simple.v1+json"
            files = [{"filename": "demo-1.0.tar.gz", "url": "files/demo-1.0.tar.gz",
                      "hashes": {"sha256": self.listed}}]
            return io.BytesIO(json.dumps({"files": files}).encode())
        assert url == "files/demo-1.0.tar.gz", url
        return io.BytesIO(self.data)


def test_fetch_caches_checked_files_and_a_second_run_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "index")
    manifest, archive, data = _release(tmp_path)
    root, index, log = tmp_path / "cache", Index(data, archive.sha256), []
    refs.fetch_all(root, manifest, open_url=index, log=log.append)
    assert len(index.requests) == 2
    assert refs.verified(archive, root).read_bytes() == data
    member = refs.verified_member(archive, next(iter(archive.extract)), root)
    assert member.read_text() == "def f():\n    return 1\n"
    assert not list(root.rglob("*.part")) and not (member.parent.parent / "setup.py").exists()

    del log[:]
    refs.fetch_all(root, manifest, open_url=index, log=log.append)  # all cached: sums checked, no request
    assert len(index.requests) == 2 and log == ["  demo==1.0: cached, sha256 ok"], log

    _flip_a_byte(refs.cached_path(archive, root), at=10)  # damaged in the cache: fetched again
    _flip_a_byte(member, at=3)
    refs.fetch_all(root, manifest, open_url=index, log=log.append)
    assert len(index.requests) == 4
    assert refs.verified(archive, root) and refs.verified_member(archive, next(iter(archive.extract)), root)


@pytest.mark.parametrize("what", ["the download", "the index's sum"])
def test_fetch_refuses_a_file_that_is_not_the_pinned_one(tmp_path, monkeypatch, what):
    """A download whose sha256 differs from the pin (one byte flipped), or a file the index lists
    with another sum, is refused with both sums named, and nothing enters the cache."""
    monkeypatch.setenv("PIP_INDEX_URL", "index")
    manifest, archive, data = _release(tmp_path)
    flipped = bytearray(data)
    flipped[20] ^= 0x01
    other = hashlib.sha256(bytes(flipped)).hexdigest()
    index = Index(bytes(flipped), other) if what == "the index's sum" else Index(bytes(flipped), archive.sha256)
    with pytest.raises(refs.ArchiveDamaged) as refused:
        refs.fetch_all(tmp_path / "cache", manifest, open_url=index, log=lambda line: None)
    assert archive.sha256 in str(refused.value) and other in str(refused.value) and "refused" in str(refused.value)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert len(index.requests) == (1 if what == "the index's sum" else 2)  # a listed mismatch: not downloaded
