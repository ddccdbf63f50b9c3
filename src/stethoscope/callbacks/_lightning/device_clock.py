"""The overhead budget's clock on an accelerator: each step timed on the device's own
timeline.

On a GPU the host runs ahead of the device: the host's time between two step starts is
how long it took to queue a step, not how long the device spent on it, so the budget
clocked by the host never sees what a sampled step's reductions cost the GPU. This clock
records a timing event on the device's stream at each step start, and once two
consecutive ones have passed (a query, never a wait) hands the device's time between
them to the monitor: a step's time as the device spent it, a few steps late. What lies
between a pause and the next step (a validation, an epoch's start) is no step's time:
that interval is dropped, as the host's clock drops it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from stethoscope.callbacks._base import StepClock
from stethoscope.callbacks._lightning.device import Accelerator, DeviceEvent, accelerator_for

__all__ = ["DeviceStepClock", "step_clock_for"]


def step_clock_for(device: torch.device) -> StepClock | DeviceStepClock:
    """The overhead budget's clock for steps run on ``device``: the device's own timeline
    on an accelerator, which the host runs ahead of; else the host's."""
    accelerator = accelerator_for(device)
    return StepClock() if accelerator is None else DeviceStepClock(accelerator, device)


@dataclass
class _Mark:
    event: DeviceEvent
    sampled: bool
    steps: int
    timed: bool = True  # whether the interval from here to the next mark is a step's


class DeviceStepClock:
    """Times each step from its start to the next one's on ``device``'s timeline, for
    the overhead budget (the interface of :class:`~stethoscope.callbacks._base.StepClock`).

    Args:
        accelerator: The device's accelerator (its timing events).
        device: The device the steps run on.
    """

    #: Marks kept while the device is behind; past it the oldest are dropped unread
    #: (the clock never waits).
    DEPTH = 64

    def __init__(self, accelerator: Accelerator, device: torch.device) -> None:
        self.accelerator, self.device = accelerator, device
        self._marks: deque[_Mark] = deque()

    def start(self, monitor: Any, *, sampled: bool, steps: int = 1) -> None:
        """A step starts: mark it on the device, and hand ``monitor`` the device's time of
        every step whose end has passed (with no budget to measure for, nothing is)."""
        if monitor.budget is None:
            return
        marks = self._marks
        marks.append(_Mark(self.accelerator.mark(self.device, timing=True), sampled, steps))
        while len(marks) >= 2 and marks[1].event.query():
            begin = marks.popleft()
            if begin.timed:
                seconds = begin.event.elapsed_time(marks[0].event) / 1000.0
                monitor.clock(seconds, sampled=begin.sampled, steps=begin.steps)
        while len(marks) > self.DEPTH:
            marks.popleft()

    def pause(self) -> None:
        """The step in progress ends here: what comes before the next step (a validation,
        an epoch's end) is no step's time. A mark where it ends closes the step's interval
        (in a full-batch run every step is followed by a validation, and a clock that
        forgot those steps would time none)."""
        marks = self._marks
        if marks and marks[-1].timed:
            marks.append(_Mark(self.accelerator.mark(self.device, timing=True), False, 0, False))

    def drop(self) -> None:
        """Forget the step in progress: its time held what was no step's."""
        if self._marks:
            self._marks[-1].timed = False
