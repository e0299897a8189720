"""gpu_check's preflight (tools/gpu_check_preflight.py), on a CPU.

Why these: the preflight exists so that a GPU host without a C compiler (or without Python.h,
or with a read-only Triton cache) fails in seconds with the fix, instead of every Triton kernel
of every part failing one by one for 480 s. So: the compiler is found exactly as Triton 3.6's
runtime/build.py finds it; a missing one stops ``main()`` before any part starts, with the fix
in summary.txt and summary.json; a working one builds a launcher-like extension here (gcc is
on this machine) and every fact lands in summary.json's ``preflight`` object.
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from tools import gpu_check
from tools import gpu_check_preflight as pre
from tools.gpu_check_runner import Command, Part

INCLUDE = {"python": "3.11.7", "python_include": None, "python_h": True}


@pytest.fixture
def info():
    import sysconfig
    include = sysconfig.get_paths()["include"]
    return dict(INCLUDE, python_include=include, python_h=os.path.isfile(os.path.join(include, "Python.h")),
                cuda=True, cuda_version="13.0", gpu="Stand-in GPU", memory_gib=139.8, memory_free_gib=139.0)


def gpu_host(tmp_path, **more) -> dict:
    """This machine's environment as a GPU host's: a stand-in libcuda.so.1 where Triton looks
    ($TRITON_LIBCUDA_PATH; no driver is installed here) and a fresh Triton cache folder."""
    lib = tmp_path / "libcuda"
    lib.mkdir(exist_ok=True)
    (lib / "libcuda.so.1").write_text("")
    return {**os.environ, "TRITON_LIBCUDA_PATH": str(lib), "TRITON_CACHE_DIR": str(tmp_path / "cache"), **more}


def nowhere(tmp_path) -> dict:
    """An environment whose PATH holds no program and no CC: no compiler to be found."""
    (tmp_path / "empty").mkdir(exist_ok=True)
    env = {k: v for k, v in gpu_host(tmp_path).items() if k != "CC"}
    return dict(env, PATH=str(tmp_path / "empty"))


def test_the_compiler_is_found_as_triton_finds_it(tmp_path):
    """$CC as given (even when it is not on PATH), else gcc, else clang (runtime/build.py)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("clang", "gcc"):
        (bin_ / name).write_text("#!/bin/sh\n")
        (bin_ / name).chmod(0o755)
    env = dict(nowhere(tmp_path), PATH=str(bin_))
    assert pre.triton_c_compiler(env) == {"from": "gcc on PATH", "cc": str(bin_ / "gcc"), "path": str(bin_ / "gcc")}
    (bin_ / "gcc").unlink()
    assert pre.triton_c_compiler(env)["path"] == str(bin_ / "clang")
    assert pre.triton_c_compiler(dict(env, CC="clang")) == {"from": "CC", "cc": "clang", "path": str(bin_ / "clang")}
    assert pre.triton_c_compiler(dict(env, CC="/no/such/cc"))["path"] is None
    assert pre.triton_c_compiler(dict(env, CC=""))["path"] is None  # Triton would run ""


def test_no_compiler_is_a_problem_with_the_fix(tmp_path, info):
    t0 = time.monotonic()
    pf = pre.preflight(info, nowhere(tmp_path))
    assert time.monotonic() - t0 < 10 and not pf["ok"]
    assert pf["c_compiler"]["cc"] is None and len(pf["problems"]) == 1
    assert "no C compiler" in pf["problems"][0] and "install" in pf["problems"][0] and "set CC" in pf["problems"][0]
    pf = pre.preflight(info, dict(nowhere(tmp_path), CC="/no/such/cc"))
    assert not pf["ok"] and "CC='/no/such/cc' is not an executable" in pf["problems"][0]


def test_missing_python_headers_and_a_read_only_cache_are_problems(tmp_path, info):
    if pre.triton_c_compiler(dict(os.environ))["path"] is None:
        pytest.skip("no C compiler on this machine")
    (tmp_path / "no_headers").mkdir()
    pf = pre.preflight(dict(info, python_include=str(tmp_path / "no_headers"), python_h=False), gpu_host(tmp_path))
    assert not pf["ok"] and not pf["c_compiler"]["build"]["ok"]
    assert "Python.h is missing" in pf["problems"][0] and "python3.11-dev" in pf["problems"][0]
    (tmp_path / "a_file").write_text("")
    pf = pre.preflight(info, gpu_host(tmp_path, TRITON_CACHE_DIR=str(tmp_path / "a_file" / "cache")))
    assert not pf["triton_cache"]["writable"] and "export TRITON_CACHE_DIR" in pf["problems"][-1]
    assert len(pf["problems"]) == 1


def test_no_libcuda_where_triton_looks_is_a_problem(tmp_path, info):
    """Triton 3.6 links every launcher with libcuda.so.1 and asserts it finds one."""
    pf = pre.preflight(info, gpu_host(tmp_path, TRITON_LIBCUDA_PATH=str(tmp_path)))
    assert not pf["ok"] and pf["libcuda"]["error"] and "TRITON_LIBCUDA_PATH" in pf["problems"][0]
    assert pre.libcuda(gpu_host(tmp_path))["error"] is None


def stand_in_stages(marker: Path) -> list:
    code = f"open({str(marker)!r}, 'w').write('ran')"
    return [[Part("a", "stand-in a", 5, lambda out: [Command([sys.executable, "-c", code], "a.log")],
                  lambda out, o: (True, {}, ""))]]


def test_main_stops_before_any_part_without_a_compiler(tmp_path, monkeypatch):
    """The whole path: probe (stood in: a GPU), preflight, then no part starts; exit 1 at once,
    the fix in summary.txt, the preflight in summary.json."""
    marker = tmp_path / "part_ran"
    monkeypatch.chdir(tmp_path)  # main() changes to the repository; restored after the test
    monkeypatch.setattr(gpu_check, "probe", lambda py: (dict(INCLUDE, cuda=True, gpu="Stand-in GPU"), "Stand-in"))
    monkeypatch.setattr(gpu_check, "build_stages", lambda py, bench: stand_in_stages(marker))
    env = nowhere(tmp_path)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("TRITON_CACHE_DIR", env["TRITON_CACHE_DIR"])
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", env["TRITON_LIBCUDA_PATH"])
    t0 = time.monotonic()
    rc = gpu_check.main(["--out", str(tmp_path / "out")])
    assert rc == 1 and time.monotonic() - t0 < 10 and not marker.exists()
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "preflight FAILED: no C compiler" in text and "apt-get install gcc" in text and "set CC" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["overall"] == "fail" and summary["failed_parts"] == ["preflight"] and summary["finished"]
    assert summary["preflight"]["c_compiler"]["cc"] is None and summary["preflight"]["problems"]
    assert [p["status"] for p in summary["parts"]] == ["skipped"]


def test_preflight_fields_land_in_summary_json(tmp_path, info, monkeypatch):
    if pre.triton_c_compiler(dict(os.environ))["path"] is None:
        pytest.skip("no C compiler on this machine")
    for key, value in gpu_host(tmp_path).items():
        monkeypatch.setenv(key, value)
    pf = pre.preflight(info)
    assert pf["ok"] and pf["c_compiler"]["build"]["ok"] and pf["c_compiler"]["build"]["seconds"] > 0
    marker = tmp_path / "part_ran"
    rc = gpu_check.run_check(stand_in_stages(marker), tmp_path / "out", info, "", time.monotonic(), limit_s=60,
                             preflight=pf, min_run_s=0.5)
    assert rc == 0 and marker.exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    got = summary["preflight"]
    assert got["c_compiler"]["path"] == pf["c_compiler"]["path"] and got["c_compiler"]["version"]
    assert got["triton_cache"] == {"path": str(tmp_path / "cache"), "writable": True, "error": None}
    assert got["cuda_torch"] == "13.0" and got["cuda_available"] is True
    assert got["gpu_memory_free_gib"] == 139.0 and got["gpu_memory_total_gib"] == 139.8
    assert {"nvcc", "driver", "cuda_driver", "python_include", "python_h", "seconds"} <= set(got)
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "preflight (" in text and "builds a launcher-like extension in" in text


def test_a_busy_gpu_is_a_warning_not_a_failure(tmp_path, info):
    pf = pre.preflight(dict(info, memory_free_gib=60.0), gpu_host(tmp_path))
    assert pf["warnings"] and "60.0 of 139.8 GiB" in pf["warnings"][0]
    assert pf["ok"] or not pre.triton_c_compiler(dict(os.environ))["path"]


def test_the_probe_reports_what_the_preflight_needs(capsys):
    """The probe's script (run here in-process; torch is imported already) gives the folder of
    Python.h as runtime/build.py finds it, and no GPU here."""
    exec(compile(gpu_check.PROBE, "probe", "exec"), {})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("GPU_CHECK_PROBE "))
    got = json.loads(line.split(" ", 1)[1])
    assert got["python_include"] and got["python_h"] is os.path.isfile(os.path.join(got["python_include"], "Python.h"))
    assert got["cuda"] is False and "memory_free_gib" not in got
