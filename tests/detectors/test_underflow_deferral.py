"""Layer 1: a zero or vanishing gradient held in 16 bits with no loss scaling is the
format's (``gradient_underflow``): all_zero, vanishing_gradients, frozen_weights and
small_updates leave it, and still find what they find in float32, under a loss scaler,
and where the backward pass did not flush whole."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _helpers import NUMEL, alarms, make_obs, run

from stethoscope.advice import TrainingSetup
from stethoscope.detectors import AllZero, FrozenWeights, SmallUpdates, VanishingGradients
from stethoscope.detectors._underflow import flushed, underflow_format

WEIGHTS = np.array([5.0, 0.5, 3.0, 0.3])
TRUE16 = TrainingSetup(framework="lightning", precision="16-true", low_precision=True)
SCALED = dataclasses.replace(TRUE16, precision="16-mixed", loss_scaler="GradScaler")
FULL = TrainingSetup(framework="lightning")


def obs(step: int, grads, *, dtype: str = "float16", loss: float = 1.4e-6, **kw):
    o = make_obs(step, loss=loss, lr=3e4, grads=grads, weights=WEIGHTS, **kw)
    return dataclasses.replace(o, dtypes=(dtype,) * len(o.names))


def with_setup(detector, setup: TrainingSetup):
    detector.setup = setup
    return detector


def flushed_steps(n: int = 6, **kw):
    return [obs(t, np.zeros(4), updates=np.zeros(4), **kw) for t in range(n)]


# -- the predicate ---------------------------------------------------------------------------------
def test_a_backward_pass_is_flushed_only_whole_unscaled_16_bit_and_with_a_loss():
    zero = obs(0, np.zeros(4))
    assert flushed(zero, TRUE16)
    assert not flushed(zero, SCALED)  # a loss scaler lifts them
    assert not flushed(obs(0, np.zeros(4), dtype="float32"), TRUE16)
    assert not flushed(obs(0, np.zeros(4), loss=0.0), TRUE16)  # nothing left to learn
    assert not flushed(obs(0, np.zeros(4), loss=float("nan")), TRUE16)
    assert not flushed(obs(0, np.array([0.0, 0.0, 0.0, 1e-3])), TRUE16)  # the output's stands
    # the precision probe's share of exact zeros, where measured, is what it reads
    partial = dataclasses.replace(zero, grad_zero=np.array([1.0, 1.0, 1.0, 0.5]))
    assert not flushed(partial, TRUE16)


def test_the_underflow_range_is_below_the_formats_smallest_normal():
    o = obs(0, np.full(4, 1e-9))
    every = np.ones(4, bool)
    assert underflow_format(o, TRUE16, every, 1e-6).name == "float16"
    assert underflow_format(o, TRUE16, every, 1e-3) is None  # float16's normal range
    assert underflow_format(o, SCALED, every, 1e-6) is None
    assert underflow_format(obs(0, np.ones(4), dtype="float32"), TRUE16, every, 1e-40) is None
    # bfloat16 keeps float32's range: a small gradient is within it
    assert underflow_format(obs(0, np.ones(4), dtype="bfloat16"), TRUE16, every, 1e-9) is None


# -- each detector leaves the flush to gradient_underflow ------------------------------------------
@pytest.mark.parametrize(
    "make", [AllZero, VanishingGradients, FrozenWeights, SmallUpdates], ids=lambda c: c.name
)
def test_a_whole_float16_backward_pass_flushed_unscaled_is_left_to_gradient_underflow(make):
    assert alarms(run(with_setup(make(), TRUE16), flushed_steps(60))) == []


@pytest.mark.parametrize("make", [AllZero, VanishingGradients, FrozenWeights], ids=lambda c: c.name)
@pytest.mark.parametrize("setup,dtype", [(FULL, "float32"), (SCALED, "float16")])
def test_the_same_zeros_in_float32_or_under_a_loss_scaler_are_still_found(make, setup, dtype):
    found = alarms(run(with_setup(make(), setup), flushed_steps(dtype=dtype)))
    assert [f.detector for f in found][:1] == [make.name]


def test_a_dead_layer_in_float16_is_still_all_zero_where_the_output_layer_has_a_gradient():
    grads = np.array([0.0, 0.0, 1e-3, 1e-3])
    found = run(with_setup(AllZero(), TRUE16), [obs(t, grads) for t in range(3)])
    assert [f.where for f in alarms(found)] == ["layer0.weight"]


def test_vanishing_gradients_within_float16s_normal_range_are_still_vanishing():
    # a loss of 1e4 and an RMS of 1e-4: vanished (< 1e-7 per unit of loss), and float16
    # holds 1e-4 as a normal number, so the format lost nothing
    rms = 1e-4
    grads = rms * np.sqrt(np.asarray(NUMEL, dtype=float))
    seq = [obs(t, grads, loss=1e4) for t in range(6)]
    [f] = alarms(run(with_setup(VanishingGradients(), TRUE16), seq))
    assert "vanished" in f.message


def test_a_first_layer_starved_below_float16s_normal_range_is_left_to_gradient_underflow():
    # the first matrix's gradient 1e-7 per element, the last's healthy: subnormal in float16
    grads = np.array([1e-7 * np.sqrt(NUMEL[0]), 1e-2, 1.0, 1e-1])
    seq = [obs(t, grads, loss=2.3) for t in range(6)]
    assert alarms(run(with_setup(VanishingGradients(), TRUE16), seq)) == []
    found = alarms(
        run(
            with_setup(VanishingGradients(), FULL),
            [dataclasses.replace(o, dtypes=("float32",) * 4) for o in seq],
        )
    )
    assert [f.where for f in found] == ["layer0.weight"]
