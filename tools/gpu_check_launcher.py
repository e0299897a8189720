#!/usr/bin/env python
"""What a cold Triton cache costs in C launcher builds: the figure behind gpu_check's cost C.

    /tmp/venv-t36/bin/python tools/gpu_check_launcher.py [--builds 6] [--json out.json]

Why: Triton 3.6 on a CUDA machine compiles, besides each kernel variant's cubin, a small C
extension (the "launcher") with the host's C compiler the first time a compiled kernel is
launched (``CudaLauncher`` in ``triton/backends/nvidia/driver.py``: ``make_launcher`` writes the
source, ``runtime/build.py``'s ``_build`` runs ``cc src.c -O3 -shared -fPIC -Wno-psabi`` with
Python.h, Triton's bundled ``cuda.h`` and ``-l:libcuda.so.1``), plus ``cuda_utils`` (driver.c)
once. ``tools/compile_kernels.py`` times ``triton.compile`` only, so gpu_check's first
per-variant figure (0.6 s) left these builds out.

The launcher source depends on the kernel's argument types alone (constexpr values, tile
configs and pointer dtypes do not change it; Triton caches the built module under a hash of the
source), so a cold cache builds one launcher per distinct signature, not per variant. This
tool takes every variant ``tools/compile_kernels.py`` knows (all dtypes), makes its launcher
source exactly as ``CudaLauncher`` does (from an ``ASTSource``: no kernel is compiled), counts
the distinct sources, and builds ``--builds`` of them plus ``cuda_utils`` with Triton's own
``_build`` (the real command line and flags). No libcuda exists on a machine without a GPU, so
the link step uses an empty stand-in ``libcuda.so.1`` (the linker only records the name: a
shared object may keep undefined symbols); everything else is what the GPU host runs.

Needs Triton 3.6 (the GPU host's version; ENV_NOTES: a side venv) and a C compiler. Triton 3.9
(this repository's CPU venv) has no ``make_launcher``: it launches every kernel through one generic
launcher inside ``cuda_utils``, built once, so the per-signature cost measured here is 3.6's.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.nvidia import driver  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import build  # noqa: E402

from tools.compile_kernels import TORCH_DTYPES, jobs  # noqa: E402


def launcher_source(fn, types: dict, consts: dict) -> str:
    """The C source ``CudaLauncher.__init__`` generates for this variant (no compilation)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n].removesuffix(":16") for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return driver.make_launcher(src.constants, dict(src.signature), None)


def stub_libcuda(folder: str) -> None:
    """An empty ``libcuda.so.1`` to link against where the driver is not installed."""
    empty = os.path.join(folder, "empty.c")
    open(empty, "w").write("int megalite_stub_libcuda;\n")
    subprocess.check_call(["cc" if not os.environ.get("CC") else os.environ["CC"], empty, "-shared", "-fPIC",
                           "-Wl,-soname,libcuda.so.1", "-o", os.path.join(folder, "libcuda.so.1")])


def timed_build(name: str, src: str, libdir: str) -> float:
    """Seconds of Triton's own ``_build`` of ``src`` (a fresh folder, as compile_module_from_src)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name + ".c")
        open(path, "w").write(src)
        t0 = time.perf_counter()
        build._build(name, path, tmp, [driver.libdevice_dir, libdir], driver.include_dirs, driver.libraries, [])
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", type=int, default=6, help="distinct launcher sources to build and time")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if not hasattr(driver, "make_launcher"):
        sys.exit(f"gpu_check_launcher: Triton {triton.__version__} builds no launcher per signature (no "
                 "make_launcher in triton/backends/nvidia/driver.py); run this under Triton 3.6, the GPU host's")
    variants, sources = 0, {}
    for dtype in TORCH_DTYPES:
        for name, fn, types, consts, *_ in jobs(dtype):
            src = launcher_source(fn, {k: types[k] for k in fn.arg_names if k in types}, consts)
            sources.setdefault(hashlib.sha256(src.encode()).hexdigest(), (name, src))
            variants += 1
    print(f"Triton {triton.__version__}: {variants} kernel variants (tools/compile_kernels.py, all dtypes) "
          f"need {len(sources)} distinct launcher sources", flush=True)
    with tempfile.TemporaryDirectory() as libdir:
        stub_libcuda(libdir)
        utils = timed_build("cuda_utils", open(os.path.join(os.path.dirname(driver.__file__), "driver.c")).read(),
                            libdir)
        print(f"cuda_utils (driver.c, once per cold cache): {utils:.2f} s", flush=True)
        times = []
        for name, src in list(sources.values())[:args.builds]:
            times.append(timed_build("__triton_launcher", src, libdir))
            print(f"launcher of {name:<46} {len(src.splitlines()):4d} lines  {times[-1]:.2f} s", flush=True)
    mean = sum(times) / max(1, len(times))
    cc = os.environ.get("CC") or "gcc (or clang) from PATH"
    print(f"mean launcher build {mean:.2f} s ({len(times)} builds, {cc}, -O3 -shared -fPIC; one process)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, variants=variants, distinct_launchers=len(sources),
                           cuda_utils_s=round(utils, 3), launcher_s=[round(t, 3) for t in times],
                           mean_launcher_s=round(mean, 3)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
