"""The clocks the overhead budget reads: a step's time ends where a pause begins (a
validation, an epoch's end), on the host and on a device's timeline."""

from __future__ import annotations

import time

import torch
from _accelerator import SimulatedAccelerator

from stethoscope.callbacks._base import StepClock
from stethoscope.callbacks._lightning.device_clock import DeviceStepClock


class _Monitor:
    """What a clock hands the budget: each step's seconds and whether it was sampled."""

    budget = object()

    def __init__(self) -> None:
        self.clocked: list[tuple[float, bool]] = []

    def clock(self, seconds: float, *, sampled: bool, steps: int = 1) -> None:
        self.clocked.append((seconds, sampled))


def test_the_host_clock_ends_a_step_where_a_pause_begins():
    monitor, clock = _Monitor(), StepClock()
    clock.start(monitor, sampled=True)
    clock.pause()
    time.sleep(0.05)  # a validation: no step's time
    clock.pause()  # the next epoch's start pauses again: the step still ended at the first
    clock.start(monitor, sampled=False)
    assert len(monitor.clocked) == 1
    seconds, sampled = monitor.clocked[0]
    assert sampled and seconds < 0.04


def test_the_host_clock_forgets_a_dropped_step():
    monitor, clock = _Monitor(), StepClock()
    clock.start(monitor, sampled=False)
    clock.drop()
    clock.start(monitor, sampled=False)
    assert monitor.clocked == []


def test_the_device_clock_ends_a_step_at_a_mark_where_a_pause_begins():
    accelerator = SimulatedAccelerator(lag=0)
    monitor, clock = _Monitor(), DeviceStepClock(accelerator, torch.device("cpu"))
    clock.start(monitor, sampled=True)
    accelerator.advance(3.0)  # the step: 3 ms on the device
    clock.pause()
    accelerator.advance(50.0)  # the validation
    clock.pause()
    clock.start(monitor, sampled=False)
    assert monitor.clocked == [(0.003, True)]
    accelerator.advance(2.0)
    clock.drop()
    clock.start(monitor, sampled=False)
    assert monitor.clocked == [(0.003, True)]  # the dropped step is not clocked
