"""``--transformer-impl`` and the FP8 flags (Megatron's names): what can run where.

``--transformer-impl local`` (the default) builds every block from megalite's own layers.
``transformer_engine`` asks for NVIDIA transformer-engine's linears, fused LayerNorm-linears
and attention, and ``--fp8-format {e4m3,hybrid}`` (with ``--fp8-amax-history-len`` and
``--fp8-amax-compute-algo``, delayed scaling) for FP8 training through it.

transformer-engine needs a CUDA GPU with cuDNN and installs only there; it exists on neither
of megalite's test machines, so the layers behind this flag are not built yet (issue #14).
:func:`check_transformer_impl` therefore refuses it with what is missing and the way out,
and checks the FP8 flags' values and that they come with transformer-engine.
"""
from __future__ import annotations

from megalite.layers.backends import te_missing

TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("e4m3", "hybrid")
AMAX_ALGOS = ("most_recent", "max")


def check_transformer_impl(m) -> None:
    """Raise ConfigError for a setting that cannot run here (called by config.validate)."""
    from megalite.config import ConfigError

    if m.transformer_impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"--transformer-impl {m.transformer_impl!r} is unknown. Fix: local or transformer_engine.")
    if m.fp8_format is not None:
        if m.fp8_format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format {m.fp8_format!r} is unknown. Fix: e4m3 (forward and backward) or "
                              f"hybrid (e4m3 forward, e5m2 gradients).")
        if m.fp8_amax_compute_algo not in AMAX_ALGOS or m.fp8_amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-compute-algo {m.fp8_amax_compute_algo!r} / --fp8-amax-history-len "
                              f"{m.fp8_amax_history_len}: Fix: most_recent or max, and a history of at least 1.")
        if m.transformer_impl != "transformer_engine":
            raise ConfigError(f"--fp8-format {m.fp8_format} trains in FP8 through transformer-engine's layers. "
                              f"Fix: add --transformer-impl transformer_engine (on a GPU with transformer-engine "
                              f"installed), or drop --fp8-format.")
    if m.transformer_impl == "transformer_engine":
        why = te_missing()
        if why:
            raise ConfigError(f"--transformer-impl transformer_engine cannot run: {why}. Fix: install it on a "
                              f"GPU machine, or use --transformer-impl local (megalite's own layers).")
        raise ConfigError("--transformer-impl transformer_engine: transformer-engine is installed, but megalite's "
                          "path through its layers is not built yet (issue #14). Fix: --transformer-impl local.")
