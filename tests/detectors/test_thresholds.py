"""The bars the recovery ladder skips by (``threshold()``) are the detectors' own rules:
just above one the detector fires, just below it it stays quiet, whatever the history."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _helpers import make_obs

from stethoscope.detectors import ExplodingGradients, LossSpike


def _fires(detector, obs) -> bool:
    trial = copy.deepcopy(detector)  # judging changes the state: judge a copy
    return any(f.severity >= "warning" for f in trial.update(obs))


@pytest.mark.parametrize("seed", range(12))
def test_the_gradient_bar_is_where_exploding_gradients_fires(seed):
    rng = np.random.default_rng(seed)
    detector = ExplodingGradients()
    assert detector.threshold() is None  # still learning the run's level
    level = 10 ** rng.uniform(-3, 1)
    noise = rng.uniform(0.01, 0.6)
    for step in range(int(rng.integers(5, 40))):
        total = level * 10 ** (noise * rng.standard_normal())
        detector.update(make_obs(step, grads=[total]))
    bar = detector.threshold()
    assert bar is not None
    assert _explodes(detector, make_obs(99, grads=[bar * 1.001]))
    assert not _explodes(detector, make_obs(99, grads=[bar * 0.999]))


def _explodes(detector, obs) -> bool:
    """Whether ``obs`` is an explosive step: a warning or worse, or on a calm run the
    first of a streak (a lone jump there is a suspicion, judged by the steps after)."""
    trial = copy.deepcopy(detector)
    return bool(any(f.severity >= "warning" for f in trial.update(obs)) or trial.state["streak"])


@pytest.mark.parametrize("seed", range(12))
def test_the_loss_bar_is_where_loss_spike_fires(seed):
    rng = np.random.default_rng(seed)
    detector = LossSpike()
    start = rng.uniform(0.5, 5)
    for step in range(int(rng.integers(32, 300))):
        loss = start * (0.3 + 0.7 * np.exp(-step / 100)) * (1 + rng.uniform(0, 0.2))
        detector.update(make_obs(step, loss=loss))
        if step < 31:
            assert detector.threshold() is None
    bar = detector.threshold()
    assert bar is not None
    assert _fires(detector, make_obs(999, loss=bar * 1.0001 + 1e-9))
    assert not _fires(detector, make_obs(999, loss=bar * 0.9999))


def test_passed_by_is_the_threshold_for_a_spike_and_none_otherwise():
    detector = LossSpike()
    for step in range(100):
        detector.update(make_obs(step, loss=1.0 + 0.01 * (step % 7)))
    bar = detector.threshold()
    assert detector.passed_by(bar * 1.01) == bar
    assert detector.passed_by(bar * 0.99) is None and detector.passed_by(1.0) is None
