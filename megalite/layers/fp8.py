"""FP8 training through transformer-engine: the autocast around the layers, and the delayed-
scaling state kept in checkpoints.

``--fp8-format e4m3|hybrid`` (hybrid: e4m3 forward, e5m2 gradients) with delayed scaling:
every TE module quantizes its input, weight and output gradient with scales taken from a
history of their absolute maxima (``--fp8-amax-history-len`` steps, reduced by
``--fp8-amax-compute-algo`` max or most_recent): scale = fp8_max / amax. Each step's amaxes are
all-reduced (MAX) over every rank of the pipeline stage (the grid's ``stage`` group, TP x CP x
DP, as Megatron's amax reduction group), so all ranks quantize a tensor alike, which TE's FP8
all-gathers under sequence parallelism need. Only the forward runs inside the autocast; TE
does the backward's scaling itself.

**Checkpoint state.** The scales and amax histories are the only state FP8 adds. They are
saved as plain tensors (never TE's pickled ``_extra_state``, which TE 2.18+ refuses to load
anyway): ``{module}.fp8.scaling_fwd.scale`` / ``.amax_history`` and the ``scaling_bwd`` pair,
through TE's ``get_fp8_meta_tensors()``. After the reduction they are equal on every rank of
a stage, so one rank writes them and any layout reads them. TE creates the state in a
module's first FP8 forward; a loaded state therefore waits on the module and is copied in
(``reset_fp8_meta_tensors``) at the start of its first forward under the autocast, after
TE's own ``init_fp8_metadata`` made the tensors: so a resumed run quantizes its first step
with the saved scales, as the uninterrupted run did.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

SCALINGS = ("scaling_fwd", "scaling_bwd")
FIELDS = ("scale", "amax_history")


def fp8_recipe(cfg, reduce_amax: bool = True):
    """TE's DelayedScaling for the config (None when FP8 is off). ``reduce_amax`` False: a
    stage of one rank, nothing to reduce (TE would otherwise reduce over the whole world)."""
    if cfg.fp8_format is None:
        return None
    from transformer_engine.common import recipe

    fmt = recipe.Format.E4M3 if cfg.fp8_format == "e4m3" else recipe.Format.HYBRID
    return recipe.DelayedScaling(fp8_format=fmt, amax_history_len=cfg.fp8_amax_history_len,
                                 amax_compute_algo=cfg.fp8_amax_compute_algo, reduce_amax=reduce_amax)


def fp8_autocast(cfg, amax_group, model: nn.Module | None = None):
    """The context the layers' forward runs in: TE's FP8 autocast with the config's recipe,
    reducing amaxes over ``amax_group`` (None: a stage of one rank, no reduction); a no-op
    without ``--fp8-format``. ``model``: its TE
    modules get a loaded FP8 state copied in once the autocast has started."""
    if cfg.fp8_format is None:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    recipe = fp8_recipe(cfg, reduce_amax=amax_group is not None)
    if hasattr(te, "autocast"):  # TE >= 2.9; fp8_autocast is deprecated there
        ctx = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    else:
        ctx = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
    if model is None:
        return ctx
    return _with_pending_state(ctx, model)


@contextlib.contextmanager
def _with_pending_state(ctx, model: nn.Module):
    with ctx:
        for module in model.modules():
            pending = getattr(module, "megalite_fp8_pending", None)
            if pending is not None:
                module.init_fp8_metadata()  # TE's own first-forward set-up, under the recipe in force
                _copy_in(module, pending)
                module.megalite_fp8_pending = None
        yield


def _fp8_modules(model: nn.Module):
    for name, module in model.named_modules():
        if callable(getattr(module, "get_fp8_meta_tensors", None)):
            yield name, module


def fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every TE module's scales and amax histories (CPU copies; empty for
    modules that have not run in FP8 yet)."""
    out = {}
    for name, module in _fp8_modules(model):
        # a state loaded but not yet copied in (the module has not run in FP8 since) is saved as loaded
        tensors = module.get_fp8_meta_tensors() or getattr(module, "megalite_fp8_pending", None)
        if tensors is None:
            continue
        for scaling in SCALINGS:
            for field, t in zip(FIELDS, tensors[scaling]):
                out[f"{name}.fp8.{scaling}.{field}"] = t.detach().float().cpu()
    return out


def load_fp8_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Give every TE module its saved scales and histories (copied in at its first FP8
    forward); returns how many modules got one. A history of another length (a changed
    ``--fp8-amax-history-len``) keeps its newest rows, or is padded with zeros."""
    done = 0
    for name, module in _fp8_modules(model):
        keys = [f"{name}.fp8.{s}.{f}" for s in SCALINGS for f in FIELDS]
        if not all(k in tensors for k in keys):
            continue
        state = {s: [tensors[f"{name}.fp8.{s}.scale"], tensors[f"{name}.fp8.{s}.amax_history"]] for s in SCALINGS}
        if module.get_fp8_meta_tensors() is not None:
            _copy_in(module, state)
        else:
            module.megalite_fp8_pending = state
        done += 1
    return done


def _copy_in(module, state) -> None:
    current = module.get_fp8_meta_tensors()
    fitted = {}
    for scaling in SCALINGS:
        scale, history = state[scaling]
        rows = current[scaling][1].shape[0]
        if history.shape[0] != rows:  # keep the newest rows (row 0 is the current step's amax)
            pad = torch.zeros(max(0, rows - history.shape[0]), *history.shape[1:], dtype=history.dtype)
            history = torch.cat([history[:rows], pad])
        device = current[scaling][0].device
        fitted[scaling] = [scale.to(device), history.to(device)]
    module.reset_fp8_meta_tensors(fitted)  # in place: TE's global amax buffers hold these tensors
