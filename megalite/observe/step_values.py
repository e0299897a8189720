"""A train step's figures stay on the device until the log line needs them.

Reading a GPU value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``) waits
for every kernel queued before it: the host stops feeding the GPU, and the next step's
launches no longer overlap this step's work. So the step decides everything on the device
(the inf/NaN skip, clipping, the fp16 loss scale: see :class:`LossScaler` and
:mod:`megalite.data_parallel.adamw`) and returns its loss, gradient norm, skip flag, loss
scale and MoE figures as device scalars in a :class:`StepResult`. The training loop reads
them once per log interval, all steps of the interval together, with
:func:`resolve_steps`: one ``tolist()`` of one stacked tensor, the only sync. Reading a
field of a single result (``result.loss``) resolves that result alone (one sync), for
callers that want a value at once.
"""
from __future__ import annotations

import torch

MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_min", "moe_load_max")


class LossScaler:
    """fp16 loss scaling. Dynamic: halve on inf/nan gradients (step skipped), double after
    ``growth_interval`` clean steps. Static when ``static_scale`` is given. Scale 1 otherwise.

    A dynamic scale lives on the device after the first :meth:`update` (a float32 scalar;
    the clean-step count an int64 one) and is updated there from the device ``found_inf``:
    ``clean <- 0 if inf else clean + 1``; ``scale <- max(min, scale / 2)`` if inf, ``2 scale``
    if ``clean % growth_interval == 0``, else unchanged."""

    def __init__(self, enabled: bool, initial_scale: float = 2.0**16, static_scale: float | None = None,
                 growth_interval: int = 1000, min_scale: float = 1.0):
        self.enabled = enabled
        self.dynamic = enabled and static_scale is None
        self.scale: torch.Tensor | float = (static_scale or initial_scale) if enabled else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self._clean_steps: torch.Tensor | int = 0

    def update(self, found_inf: torch.Tensor | bool) -> None:
        if not self.dynamic:
            return
        found = found_inf if isinstance(found_inf, torch.Tensor) else torch.tensor(bool(found_inf))
        scale, clean = self.scale, self._clean_steps
        if not isinstance(scale, torch.Tensor):  # the first update: fills, not host copies (no sync)
            scale = torch.full((), float(scale), dtype=torch.float32, device=found.device)
            clean = torch.full((), int(clean), dtype=torch.int64, device=found.device)
        clean = torch.where(found, torch.zeros_like(clean), clean + 1)
        grown = torch.where((clean % self.growth_interval == 0) & ~found, scale * 2, scale)
        self.scale = torch.where(found, (scale / 2).clamp_min(self.min_scale), grown)
        self._clean_steps = clean

    def state_dict(self) -> dict:
        """Host values (a sync, at checkpoint time)."""
        return {"scale": float(self.scale), "clean_steps": int(self._clean_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]


def _scalar(value, device) -> torch.Tensor:
    """A 1-element float32 tensor on ``device``. A host number is written by a fill kernel
    (``torch.full``): ``torch.tensor(x, device="cuda")`` would copy from the host and wait."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


class StepResult:
    """One step's figures: ``loss``, ``grad_norm``, ``lr``, ``loss_scale``, ``skipped``,
    ``times_ms`` (forward, backward, grad_sync, optimizer), ``moe`` (None for a dense
    model) and ``mtp_loss`` (None without multi-token prediction), ``max_attention_logit`` (None without QK-clip or its log). Given as device scalars (or host numbers); read as host numbers."""

    def __init__(self, loss, grad_norm, lr: float, loss_scale, skipped, timers=None, moe=None, mtp_loss=None,
                 max_attention_logit=None):
        self._device = {"loss": loss, "grad_norm": grad_norm, "loss_scale": loss_scale, "skipped": skipped}
        if mtp_loss is not None:  # multi-token prediction: the depths' mean loss (megalite.model.mtp)
            self._device["mtp_loss"] = mtp_loss
        if max_attention_logit is not None:  # QK-clip's statistic, the model's max (megalite.model.qk_clip)
            self._device["max_attention_logit"] = max_attention_logit
        self._moe = moe  # a device vector of the MOE_KEYS, or None
        self.lr, self._timers = lr, timers
        self._host: dict | None = None

    def _tensors(self) -> list[str]:
        return [k for k, v in self._device.items() if isinstance(v, torch.Tensor)]

    def pending(self) -> list[torch.Tensor]:
        """The device values to read, as float32 tensors on one device (the loss's)."""
        keys = self._tensors()
        device = self._device[keys[0]].device if keys else torch.device("cpu")
        values = [_scalar(self._device[k], device) for k in keys]
        if self._moe is not None:
            values.append(self._moe.detach().to(device=device, dtype=torch.float32).reshape(-1))
        return values

    def set_host(self, values: list[float]) -> None:
        keys = self._tensors() + (list(MOE_KEYS) if self._moe is not None else [])
        host = {k: v for k, v in self._device.items() if not isinstance(v, torch.Tensor)}
        host.update(zip(keys, values))
        skipped = host["skipped"]
        host["skipped"] = skipped == skipped and bool(skipped)  # NaN (meta: no value) is not a skip
        self._host = host

    def _get(self, key):
        if self._host is None:
            resolve_steps([self])
        return self._host[key]

    loss = property(lambda self: self._get("loss"))
    grad_norm = property(lambda self: self._get("grad_norm"))
    loss_scale = property(lambda self: self._get("loss_scale"))
    skipped = property(lambda self: self._get("skipped"))

    @property
    def mtp_loss(self) -> float | None:
        """The MTP depths' mean loss (None without multi-token prediction)."""
        return self._get("mtp_loss") if "mtp_loss" in self._device else None

    @property
    def max_attention_logit(self) -> float | None:
        """The step's largest attention logit over the model (None unless tracked)."""
        return self._get("max_attention_logit") if "max_attention_logit" in self._device else None

    @property
    def moe(self) -> dict | None:
        if self._moe is None:
            return None
        if self._moe.device.type == "meta":
            return dict.fromkeys(MOE_KEYS)
        return {k: self._get(k) for k in MOE_KEYS}

    @property
    def times_ms(self) -> dict | None:
        """Phase times (CUDA events are read after the values' sync, so they are complete)."""
        return self._timers.milliseconds() if self._timers is not None else None


def resolve_steps(results: list[StepResult]) -> None:
    """Read the device values of all ``results`` with ONE device->host transfer. On meta
    there are no values: NaN (the caller reports n/a)."""
    todo = [r for r in results if r._host is None]
    if not todo:
        return
    parts = [r.pending() for r in todo]
    flat = [t for p in parts for t in p]
    flat = [t.to(flat[0].device) for t in flat] if flat else []  # one device (a no-op unless they differ)
    if not flat:
        values = []
    elif flat[0].device.type == "meta":
        values = [float("nan")] * sum(t.numel() for t in flat)
    else:
        values = torch.cat(flat).tolist()  # the one sync
    position = 0
    for r, p in zip(todo, parts):
        n = sum(t.numel() for t in p)
        r.set_host(values[position: position + n])
        position += n
