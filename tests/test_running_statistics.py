"""The ``val_norms`` statistic's definition: a batch norm's running statistics against
the batches they were taken from, recovered from two readings of the buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stethoscope.running_statistics import LAGGING, MIN_UPDATES, StatisticsLag, lag_error


def moved(keep: float, steps: int, batch_mean, batch_var, start=(0.0, 1.0)):
    """Running statistics after ``steps`` updates by batches of fixed statistics."""
    mean, var = np.full_like(batch_mean, start[0]), np.full_like(batch_var, start[1])
    for _ in range(steps):
        mean = keep * mean + (1 - keep) * batch_mean
        var = keep * var + (1 - keep) * batch_var
    return mean, var


def test_the_error_is_the_mean_square_of_how_inference_misnormalises():
    rng = np.random.default_rng(0)
    b_mean, b_var = rng.normal(size=8), rng.uniform(0.05, 0.5, size=8)
    mean, var = moved(0.99, 40, b_mean, b_var)
    share = 0.99**40
    error = lag_error(np.zeros(8), np.ones(8), mean, var, share, 1e-5)
    # by sampling: activations of the batches' statistics, normalised both ways
    x = b_mean + np.sqrt(b_var) * rng.normal(size=(200_000, 8))
    trained = (x - b_mean) / np.sqrt(b_var + 1e-5)
    inferred = (x - mean) / np.sqrt(var + 1e-5)
    assert error == pytest.approx(((inferred - trained) ** 2).mean(), rel=0.02)
    assert error > LAGGING


def test_statistics_that_follow_their_batches_have_no_error():
    b_mean, b_var = np.array([0.5, -1.0]), np.array([0.2, 3.0])
    mean, var = moved(0.9, 200, b_mean, b_var)
    assert lag_error(np.zeros(2), np.ones(2), mean, var, 0.9**200, 1e-5) < 1e-6


def test_a_start_of_its_own_is_recovered_exactly():
    # a pretrained model's statistics, moved towards a new data set's
    b_mean, b_var = np.array([2.0, 0.0]), np.array([1.0, 0.1])
    start = (np.array([0.3, 0.1]), np.array([4.0, 2.0]))
    mean, var = np.array(start[0]), np.array(start[1])
    for _ in range(50):
        mean, var = 0.999 * mean + 0.001 * b_mean, 0.999 * var + 0.001 * b_var
    direct = (
        (np.sqrt((b_var + 1e-3) / (var + 1e-3)) - 1) ** 2
        + ((b_mean - mean) / np.sqrt(var + 1e-3)) ** 2
    ).mean()
    assert lag_error(*start, mean, var, 0.999**50, 1e-3) == pytest.approx(direct, rel=1e-6)


def test_numpy_and_torch_agree():
    rng = np.random.default_rng(1)
    args = [rng.uniform(0.1, 2, size=16) for _ in range(4)]
    a = lag_error(*args, 0.7, 1e-5)
    b = lag_error(*(torch.tensor(v) for v in args), torch.tensor(0.7, dtype=torch.float64), 1e-5)
    assert float(b) == pytest.approx(float(a), rel=1e-12)


def test_a_lag_counts_only_past_its_first_updates():
    assert StatisticsLag("bn", "momentum=0.999", 0.3, 0.9, MIN_UPDATES).lagging
    assert not StatisticsLag("bn", "momentum=0.999", 0.3, 0.9, MIN_UPDATES - 1).lagging
    assert not StatisticsLag("bn", "momentum=0.999", 0.09, 0.9, 100).lagging
