"""A non-finite loss on a step whose gradients and weights were not measured: read them
at once, while they are still there."""

from __future__ import annotations

import math
from typing import Any

from stethoscope.callbacks._lightning.device import to_host
from stethoscope.engine import Decision
from stethoscope.observation import Observation

__all__ = ["look_if_nonfinite"]


def look_if_nonfinite(
    judged: Observation, current_step: int, monitor: Any, reductions: Any
) -> Decision | None:
    """After a non-finite loss on a step whose gradients or weights were not measured,
    read them at once, while they are still there (judged in the step's own batch end;
    a reading judged later, on a GPU, would find the next step's), and have every
    detector that reads them judge what the step lacked, due or not: the parameter that
    went bad is named on this step, whatever the schedule. Off the healthy path.

    Returns the monitor's decision, or None when there was nothing to look at.
    """
    loss = judged.loss
    if loss is None or math.isfinite(loss):
        return None
    if judged.grad_norm is not None and judged.weight_norm is not None:
        return None
    if judged.step != current_step or not monitor.judges_replicated:
        return None  # off rank zero under DDP, the detectors that would read them are idle
    if monitor.sharded:
        # each rank holds a shard: the whole model's norms need every rank, and the
        # others' losses were finite (they do not look); the next sampled step names them
        return None
    reading = reductions.gradients_and_weights_now(judged.step, judged.epoch, judged.lr)
    if reading is None:
        return None
    # waits for the device: off the healthy path, and the numbers are needed now
    values = to_host(reading.values).wait().numpy()
    obs = reductions.observation(reading, values, monitor.rank)
    if judged.grad_norm is not None:
        obs.grad_norm = None  # judged already
    if judged.weight_norm is not None:
        obs.weight_norm = None
    return monitor.observe(obs, forced=True)
