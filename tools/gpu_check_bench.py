"""tools/bench_kernels.py, keeping each finished section's rows as it goes.

    python tools/gpu_check_bench.py ROWS.jsonl [bench_kernels flags...]

Runs ``tools/bench_kernels.py`` with the flags given (its cases, its order, its table and
``--json`` at the end) and appends the rows of every section (attention causal, attention
full, layernorm, rmsnorm, cross-entropy, grouped GEMM) to ROWS.jsonl the moment the section
returns, flushed: scripts/gpu_check.sh part (d) runs under a hard budget, and a run cut short
still brings back the sections it finished.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SECTIONS = ("bench_attention", "bench_rowwise", "bench_grouped")


def keep_rows(bench, path: str) -> None:
    """Wrap the bench module's section functions so each appends its rows to ``path``."""
    def wrap(fn):
        def section(*args, **kwargs):
            rows = fn(*args, **kwargs)
            with open(path, "a") as f:
                for row in rows:
                    f.write(json.dumps(row, default=str) + "\n")
                f.flush()
            print(f"gpu_check_bench: {fn.__name__}: {len(rows)} rows kept in {path}", flush=True)
            return rows
        return section

    for name in SECTIONS:
        setattr(bench, name, wrap(getattr(bench, name)))


def main(argv: list) -> None:
    if not argv:
        sys.exit("usage: gpu_check_bench.py ROWS.jsonl [bench_kernels flags...]")
    path, flags = argv[0], argv[1:]
    open(path, "w").close()
    from tools import bench_kernels as bench  # imports torch and the kernels

    keep_rows(bench, path)
    sys.argv = [bench.__file__, *flags]
    bench.main()


if __name__ == "__main__":
    main(sys.argv[1:])
