"""The GPU check's preflight: what every Triton kernel needs, checked once in seconds before any part.

Why: Triton 3.6 builds a C extension with the host's C compiler the first time each compiled
kernel signature is launched (``cuda_utils`` from driver.c once, then one launcher per
signature: ``triton/backends/nvidia/driver.py`` ``CudaLauncher`` -> ``runtime/build.py``
``_build``), and keeps every cubin and launcher in its cache folder. Without a compiler, or
without Python.h, or with a cache folder it cannot write, *every* kernel of every part fails,
one by one, each with the same traceback, and the check spends its 480 s finding that out.
So the check looks first and stops at once with the fix.

Checked (each lands in summary.json's ``preflight`` object):
- the C compiler Triton will pick, exactly as ``runtime/build.py`` picks it: ``$CC`` as given
  (even empty: Triton then runs ""), else ``gcc`` on PATH, else ``clang``; and that it builds a
  Python extension the way Triton builds its launchers (``-O3 -shared -fPIC`` with Python.h of
  the probed interpreter), timed: the launcher-build cost on this host (docs: the budget's C);
- libcuda.so.1 can be found as Triton links its launchers with it ($TRITON_LIBCUDA_PATH, else
  ``/sbin/ldconfig -p``, else $LD_LIBRARY_PATH: ``libcuda_dirs`` in the nvidia driver.py);
- the Triton cache folder (``$TRITON_CACHE_DIR``, else ``$TRITON_HOME``/.triton/cache, else
  ~/.triton/cache) is writable;
- nvcc's version (informative: Triton compiles with its bundled ptxas, not nvcc), the driver
  and its CUDA version (nvidia-smi), torch's CUDA version, ``torch.cuda.is_available()`` and
  the free GPU memory (from the probe process: this module never imports torch);
- a warning, not a failure, when less than 90% of the GPU's memory is free (another process
  holds the GPU: the figures of (c) and (d) would suffer).

Standard library only: the check must report even where ``import torch`` is broken.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

CMD_S = 5.0  # each helper command (cc, nvcc, nvidia-smi) gets at most this long
FREE_WARN = 0.9
FIX_CC = ("Fix: install a C compiler on this host (Debian/Ubuntu: apt-get install gcc; RHEL/Rocky: "
          "dnf install gcc), or set CC to one's path (export CC=/path/to/gcc or clang)")

EXTENSION = """#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "gpu_check_cc", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_gpu_check_cc(void) { return PyModule_Create(&def); }
"""


def triton_c_compiler(env: dict) -> dict:
    """The compiler Triton 3.6's ``_build`` will run: {"from", "cc" (as Triton runs it), "path"
    (resolved on PATH, None if it cannot be found)}; "cc" is None when there is none at all."""
    search = env.get("PATH", os.defpath)
    if "CC" in env:  # Triton: cc = os.environ.get("CC"), used as given when set
        cc = env["CC"]
        return {"from": "CC", "cc": cc, "path": shutil.which(cc, path=search) if cc else None}
    for name in ("gcc", "clang"):  # Triton: gcc if found, else clang
        path = shutil.which(name, path=search)
        if path:
            return {"from": f"{name} on PATH", "cc": path, "path": path}
    return {"from": None, "cc": None, "path": None}


def _run(argv: list, env: dict | None = None, timeout: float = CMD_S) -> tuple[int | None, str]:
    """(exit status or None if it could not run or timed out, stdout + stderr)."""
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              text=True, timeout=timeout, env=env)
        return done.returncode, done.stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"


def build_extension(cc: str, include: str | None, env: dict) -> dict:
    """Build a minimal Python extension as Triton builds a launcher; {"ok", "seconds", "error"}."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_cc_") as tmp:
        src, so = os.path.join(tmp, "gpu_check_cc.c"), os.path.join(tmp, "gpu_check_cc.so")
        with open(src, "w") as f:
            f.write(EXTENSION)
        argv = [cc, src, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", so] + ([f"-I{include}"] if include else [])
        t0 = time.monotonic()
        rc, text = _run(argv, env=env, timeout=20.0)
        seconds = round(time.monotonic() - t0, 2)
    ok = rc == 0
    return {"ok": ok, "seconds": seconds, "error": None if ok else text.strip()[-600:] or f"exit {rc}"}


def triton_cache_dir(env: dict) -> dict:
    """Triton's cache folder (knobs.cache.dir) and whether a file can be created in it."""
    home = env.get("TRITON_HOME") or os.path.expanduser("~/")
    path = env.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".gpu_check_"):
            pass
        return {"path": path, "writable": True, "error": None}
    except OSError as e:
        return {"path": path, "writable": False, "error": f"{type(e).__name__}: {e}"}


def libcuda(env: dict) -> dict:
    """Where Triton 3.6 will link libcuda.so.1 from (``libcuda_dirs`` in its nvidia driver.py:
    $TRITON_LIBCUDA_PATH, else ``/sbin/ldconfig -p``, else $LD_LIBRARY_PATH): {"dirs", "error"}."""
    rc, text = (0, "") if env.get("TRITON_LIBCUDA_PATH") else _run(["/sbin/ldconfig", "-p"])
    dirs = sorted({os.path.dirname(line.split()[-1]) for line in text.splitlines() if "libcuda.so.1" in line}) \
        if rc == 0 else []
    if env.get("TRITON_LIBCUDA_PATH"):
        dirs = [env["TRITON_LIBCUDA_PATH"]]
    elif not dirs and env.get("LD_LIBRARY_PATH"):
        dirs = [d for d in env["LD_LIBRARY_PATH"].split(":") if os.path.exists(os.path.join(d, "libcuda.so.1"))]
    found = any(os.path.exists(os.path.join(d, "libcuda.so.1")) for d in dirs)
    return {"dirs": dirs, "error": None if found else (text.strip()[-200:] if rc != 0 else "libcuda.so.1 not found")}


def nvcc_version(env: dict) -> str | None:
    """"13.0 (V13.0.88)" from ``nvcc --version`` (PATH, else /usr/local/cuda/bin), or None."""
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if nvcc is None and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if nvcc is None:
        return None
    rc, text = _run([nvcc, "--version"])
    found = re.search(r"release ([\d.]+), (V[\d.]+)", text)
    return f"{found.group(1)} ({found.group(2)})" if rc == 0 and found else None


def driver_versions(env: dict) -> dict:
    """{"driver", "cuda_driver"} from nvidia-smi's header ("Driver Version: ... CUDA Version: ...")."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    rc, text = _run([smi]) if smi else (None, "")
    driver = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return {"driver": driver.group(1) if driver else None, "cuda_driver": cuda.group(1) if cuda else None}


def preflight(info: dict, env: dict | None = None) -> dict:
    """The facts above for the interpreter the probe ran (``info``: the probe's dict), with
    ``problems`` (each ends with its fix: the check stops on any) and ``warnings``."""
    env = dict(os.environ if env is None else env)
    t0 = time.monotonic()
    problems, warnings = [], []
    cc = triton_c_compiler(env)
    include = info.get("python_include")
    if cc["cc"] is None:
        problems.append("no C compiler: Triton 3.6 builds a C launcher for each kernel signature at its first "
                        "launch (triton/runtime/build.py takes $CC, else gcc, else clang from PATH) and found none, "
                        f"so every Triton kernel would fail. {FIX_CC}")
    elif cc["path"] is None:
        problems.append(f"CC={cc['cc']!r} is not an executable on PATH: Triton 3.6 runs $CC as given to build its "
                        f"kernel launchers, so every Triton kernel would fail. {FIX_CC}")
    else:
        cc["version"] = (_run([cc["path"], "--version"])[1].strip().splitlines() or [None])[0]
        cc.update(build=build_extension(cc["path"], include, env))
        if not cc["build"]["ok"]:
            headers = "" if info.get("python_h", True) else (
                f" Python.h is missing from {include}: install the Python development headers for "
                f"{info.get('python_executable') or 'the probed python'} (Debian/Ubuntu: apt-get install "
                f"python{'.'.join(str(info.get('python', '3')).split('.')[:2])}-dev; RHEL: python3-devel).")
            problems.append(f"{cc['path']} cannot build a Python extension the way Triton 3.6 builds its kernel "
                            f"launchers (-O3 -shared -fPIC with Python.h):{headers} Compiler output: "
                            f"{cc['build']['error'][-300:]} {FIX_CC if not headers else ''}".rstrip())
    cuda_lib = libcuda(env)
    if cuda_lib["error"] and info.get("cuda"):
        problems.append(f"Triton 3.6 cannot find libcuda.so.1 to link its kernel launchers with (/sbin/ldconfig -p, "
                        f"then LD_LIBRARY_PATH: {cuda_lib['error']}). Fix: run /sbin/ldconfig as root, or export "
                        "TRITON_LIBCUDA_PATH=<the folder holding libcuda.so.1>")
    cache = triton_cache_dir(env)
    if not cache["writable"]:
        problems.append(f"Triton's cache folder {cache['path']} is not writable ({cache['error']}): every compiled "
                        "kernel and launcher is kept there. Fix: export TRITON_CACHE_DIR=/a/writable/folder")
    free, total = info.get("memory_free_gib"), info.get("memory_gib")
    if free is not None and total and free < FREE_WARN * total:
        warnings.append(f"only {free:.1f} of {total:.1f} GiB of GPU memory is free: another process holds the GPU "
                        "(nvidia-smi lists it); the speed figures of (c), (d) and (f) may suffer")
    return {"c_compiler": cc, "python_include": include, "python_h": info.get("python_h"), "libcuda": cuda_lib,
            "triton_cache": cache, "nvcc": nvcc_version(env), **driver_versions(env),
            "cuda_torch": info.get("cuda_version"), "cuda_available": info.get("cuda"),
            "gpu_memory_free_gib": free, "gpu_memory_total_gib": total,
            "seconds": round(time.monotonic() - t0, 2), "problems": problems, "warnings": warnings,
            "ok": not problems}


def describe(pf: dict) -> str:
    """One summary.txt line of the preflight's facts."""
    cc, build = pf["c_compiler"], pf["c_compiler"].get("build") or {}
    compiler = (f"{cc['path']} ({cc['from']}; builds a launcher-like extension in {build['seconds']:.2f} s)"
                if build.get("ok") else "NONE usable")
    return (f"preflight ({pf['seconds']:.1f} s): C compiler {compiler}; Triton cache {pf['triton_cache']['path']} "
            f"{'writable' if pf['triton_cache']['writable'] else 'NOT WRITABLE'}; libcuda.so.1 in "
            f"{', '.join(pf['libcuda']['dirs']) or 'NONE'}; nvcc {pf['nvcc'] or 'none'}; "
            f"driver {pf['driver'] or '?'} (CUDA {pf['cuda_driver'] or '?'}), torch CUDA {pf['cuda_torch']}; "
            f"GPU memory free {pf['gpu_memory_free_gib']} of {pf['gpu_memory_total_gib']} GiB")
