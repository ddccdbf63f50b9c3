"""``Detector.absorb``, the loss readers' fast path for the steps that waited: what it
takes in, ``update`` on each of those steps would have taken in too, raising nothing,
and leaving the same state; and on a healthy run it takes in nearly every step."""

from __future__ import annotations

import copy
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stethoscope.detectors import (
    CollapsedLearningRate,
    LossAtChance,
    LossNotDecreasing,
    LossSpike,
    NonfiniteLoss,
    UnstableLoss,
)
from stethoscope.detectors.base import Detector
from stethoscope.observation import Observation

BATCH = 15  # the most steps that wait together


def _detectors() -> list[Detector]:
    """Every loss reader, with windows short enough for a test to fill."""
    chance = LossAtChance(patience=40)
    chance.state["counts"] = [100, 100, 100]  # as if its labels were counted
    chance.state["chance"] = math.log(3)
    tracing = NonfiniteLoss()
    tracing.state["tracing"] = 3  # a trace is awaited: every step is update()'s
    return [
        LossSpike(warmup=8, window=16),
        LossNotDecreasing(window=10, patience=30),
        UnstableLoss(window=10, patience=5),
        chance,
        NonfiniteLoss(),
        tracing,
        CollapsedLearningRate(window=5),
    ]


def _observation(step: int, loss: float, lr: float | None) -> Observation:
    return Observation.of_loss(step, 0, 0, lr, loss)


def _check_absorb(d: Detector, steps: list[int], losses: list[float], lrs: list) -> int:
    """Offer ``d`` the steps from each index on, as the monitor does, checking each run it
    takes against update() on a copy; returns how many steps it took in all."""
    taken_in_all, i = 0, 0
    while i < len(steps):
        if d.finished(steps[i]):
            i += 1
            continue
        twin = copy.deepcopy(d)
        taken = d.absorb(steps, losses, lrs, i)
        assert i <= taken <= len(steps)
        for j in range(i, taken):
            found = twin.update(_observation(steps[j], losses[j], lrs[j]))
            assert (found, twin.suspect, twin.request) == ([], None, frozenset()), (
                f"{d.name} took in step {steps[j]}, where update() raises something"
            )
        assert twin.state == d.state, f"{d.name}: absorb left another state than update()"
        taken_in_all += taken - i
        if taken == i:  # not taken: judged one by one, as the monitor would
            d.update(_observation(steps[i], losses[i], lrs[i]))
            i += 1
        else:
            i = taken
    return taken_in_all


losses_st = st.lists(
    st.one_of(
        st.floats(0.5, 1.5),  # a healthy level
        st.floats(0.0, 20.0),  # anything: spikes, drops
    ),
    min_size=60,
    max_size=120,
)
lrs_st = st.lists(
    st.sampled_from([None, 1e-3, 1e-3, 1e-3, 3e-3, 1e-2, 1e-7]), min_size=1, max_size=8
)


@settings(max_examples=25, deadline=None)
@given(losses=losses_st, lrs=lrs_st, drift=st.floats(-0.01, 0.02))
def test_what_absorb_takes_in_update_would_take_in_alike(losses, lrs, drift):
    losses = [max(loss + drift * t, 0.0) for t, loss in enumerate(losses)]
    steps = list(range(len(losses)))
    lr_of = [lrs[(t // 25) % len(lrs)] for t in steps]  # a schedule that changes now and then
    for d in _detectors():
        for start in range(0, len(steps), BATCH):
            end = min(start + BATCH, len(steps))
            _check_absorb(d, steps[start:end], losses[start:end], lr_of[start:end])


def test_a_healthy_run_is_nearly_all_absorbed():
    rng = random.Random(0)
    n = 600
    losses = [2.0 * math.exp(-t / 200) + 0.3 + 0.05 * rng.gauss(0, 1) for t in range(n)]
    steps = list(range(n))
    lrs = [1e-3] * n
    for d in _detectors():
        taken = 0
        for start in range(0, n, BATCH):
            end = min(start + BATCH, n)
            taken += _check_absorb(d, steps[start:end], losses[start:end], lrs[start:end])
        if isinstance(d, NonfiniteLoss) and d.state["tracing"] is not None:
            assert taken == 0
        elif isinstance(d, LossAtChance):
            assert taken >= n * 14 // 16 - 1, (d.name, taken)  # all but its stride's steps
        else:
            # what the window fills and a judgement or two take one by one; the rest at once
            assert taken >= n - 60, (d.name, taken)


def _shape(name: str, n: int = 300) -> tuple[list[float], list[float | None]]:
    """Losses (and learning rates) that make each loss reader raise something."""
    rng = random.Random(1)
    noise = [0.01 * rng.gauss(0, 1) for _ in range(n)]
    lrs: list[float | None] = [1e-3] * n
    level = [1.0] * n
    if name == "rise":  # unstable_loss: the level climbs and stays
        level = [1.0 if t < 100 else 1.8 for t in range(n)]
    elif name == "diverge":  # unstable_loss's error
        level = [1.0 if t < 100 else 2.5 for t in range(n)]
    elif name == "spike":  # loss_spike, once
        level = [5.0 if t == 120 else 1.0 for t in range(n)]
    elif name == "at_chance":  # loss_at_chance, and no progress
        level = [math.log(3)] * n
    elif name == "warm_up":  # the learning rate doubling: the clocks start again
        lrs = [1e-5 * 2 ** (t // 20) for t in range(n)]
    elif name == "collapse":  # collapsed_lr: a per-epoch decay stepped every batch
        lrs = [1e-2 * 0.1 ** (t // 30) for t in range(n)]
    elif name == "both_signs":  # a policy gradient's: the loss readers leave it alone
        level = [1.0 if t % 7 else -0.5 for t in range(n)]
    return [lv + e for lv, e in zip(level, noise, strict=True)], lrs


@pytest.mark.parametrize(
    "shape", ["rise", "diverge", "spike", "at_chance", "warm_up", "collapse", "both_signs"]
)
def test_absorb_hands_back_each_step_that_raises(shape):
    losses, lrs = _shape(shape)
    steps = list(range(len(losses)))
    raised = 0
    for d in _detectors():
        ref = copy.deepcopy(d)
        for t in steps:  # what judging one by one raises
            found = ref.update(_observation(t, losses[t], lrs[t]))
            raised += bool(found or ref.suspect or ref.request)
        for start in range(0, len(steps), BATCH):
            end = min(start + BATCH, len(steps))
            _check_absorb(d, steps[start:end], losses[start:end], lrs[start:end])
        assert d.state == ref.state
    assert raised  # each shape makes some detector raise something
