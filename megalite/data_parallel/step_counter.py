"""The step count every update rule's stepper keeps: one fp32 scalar on the shards' device.

An update rule (:mod:`megalite.data_parallel.update_rule`) writes only its math: its stepper
subclasses :class:`DeviceStepCount`, calls ``super().__init__(masters)`` and, in ``step``, adds
1 to ``self.steps`` for an applied step and 0 for a skipped one (a ``found_inf`` of 1), on the
device, so the step needs no host sync. ``step_count`` reads the count as an int (one sync; a
checkpoint reads and writes it); on meta tensors (a dry run) it reads 0, since a meta tensor
has no value.
"""
from __future__ import annotations

import torch


class DeviceStepCount:
    """``steps``: the device tensor that counts the applied steps (fp32, 0-dimensional, on the
    first master shard's device, or the CPU for a rank that holds none); ``step_count``: it as an int."""

    def __init__(self, masters) -> None:
        device = masters[0].device if masters else torch.device("cpu")
        self.steps = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def step_count(self) -> int:
        """The applied steps so far (a meta tensor has no value: 0 there)."""
        return 0 if self.steps.device.type == "meta" else int(self.steps.item())

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.steps.fill_(value)
