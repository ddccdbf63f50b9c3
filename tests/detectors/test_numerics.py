"""Layer 1: nonfinite_loss, nonfinite_gradients and nonfinite_weights on synthetic sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import INF, NAMES, NAN, assert_actionable, loss_obs, make_obs, run, steps

from stethoscope.advice import TrainingSetup, small_epsilon
from stethoscope.detectors import NonfiniteGradients, NonfiniteLoss, NonfiniteWeights


def healthy_norms(seed: int, n: int = 200) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0.0, 1.0, (n, len(NAMES)))


# -- nonfinite_loss -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        pytest.param([2.3, 2.2, NAN, 2.0], [2], id="nan"),
        pytest.param([2.3, INF, 2.0], [1], id="+inf"),
        pytest.param([2.3, 2.2, 2.1, -INF], [3], id="-inf"),
        pytest.param([NAN], [0], id="single-step-nan"),
        pytest.param([NAN, NAN, 1.0, INF], [0, 1, 3], id="every-nonfinite-step"),
        pytest.param([2.3], [], id="single-step-finite"),
        pytest.param([-5.0, -1e30, 0.0, 1e30], [], id="negative-zero-huge-finite"),
        pytest.param([1.0] * 50, [], id="constant"),
    ],
)
def test_nonfinite_loss_fires_at_every_nonfinite_step(losses, expected):
    found = run(NonfiniteLoss(), loss_obs(losses))
    assert steps(found) == [(s, "error") for s in expected]
    for f in found:
        assert f.detector == "nonfinite_loss"
        assert f.where == "loss"
        assert f.threshold is None
        x = losses[f.step]
        assert math.isnan(f.value) if math.isnan(x) else f.value == x


@pytest.mark.parametrize(("loss", "word"), [(NAN, "NaN"), (INF, "+Inf"), (-INF, "-Inf")])
def test_nonfinite_loss_message_says_what_and_how_to_fix(loss, word):
    (f,) = run(NonfiniteLoss(), [make_obs(17, loss=loss)])
    assert word in f.message
    assert_actionable(f, "batch", "learning rate")


def test_nonfinite_loss_ignores_a_missing_loss():
    assert run(NonfiniteLoss(), [make_obs(0), make_obs(1, grads=[NAN])]) == []


def test_nonfinite_loss_quiet_on_a_long_healthy_run():
    rng = np.random.default_rng(0)
    losses = 2.3 * np.exp(-np.arange(2000) / 400) * rng.lognormal(0.0, 0.3, 2000)
    assert run(NonfiniteLoss(), loss_obs(losses)) == []


# -- nonfinite_gradients --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "where"),
    [
        pytest.param({1: NAN}, "layer0.bias", id="nan-middle"),
        pytest.param({2: INF}, "layer1.weight", id="inf-middle"),
        pytest.param({0: NAN}, "layer0.weight", id="nan-first"),
        pytest.param({3: -INF}, "layer1.bias", id="-inf-last"),
        # backward order runs output → input: the last bad parameter in registration order
        pytest.param({1: NAN, 2: NAN}, "layer1.weight", id="two-middle-names-the-later"),
        pytest.param({0: INF, 1: NAN, 2: NAN, 3: NAN}, "layer1.bias", id="all"),
    ],
)
def test_nonfinite_gradients_names_the_first_bad_parameter_in_backward_order(bad, where):
    norms = healthy_norms(1, 30)
    for i, v in bad.items():
        norms[20, i] = v
    found = run(NonfiniteGradients(), [make_obs(t, grads=g) for t, g in enumerate(norms)])
    assert steps(found) == [(20, "error")]
    (f,) = found
    assert f.where == where
    expected = bad[NAMES.index(where)]
    assert math.isnan(f.value) if math.isnan(expected) else f.value == expected
    assert f.threshold is None
    assert f"{len(bad)} of 4 parameters" in f.message
    assert where in f.message
    assert_actionable(f, "learning rate", "clip gradients")


@pytest.mark.parametrize(
    "grads",
    [
        pytest.param(np.array([]), id="empty"),
        pytest.param(np.zeros(4), id="all-zero"),
        pytest.param(np.array([1e-300, 1e300, 0.0, 5.0]), id="tiny-and-huge-finite"),
        pytest.param(np.array([3.0]), id="one-parameter"),
    ],
)
def test_nonfinite_gradients_quiet_on_finite_or_empty_gradients(grads):
    assert run(NonfiniteGradients(), [make_obs(0, grads=grads)]) == []


def test_nonfinite_gradients_fires_on_a_single_step_and_on_each_bad_step():
    obs = [make_obs(t, grads=[1.0, NAN if t in (0, 3) else 1.0]) for t in range(5)]
    found = run(NonfiniteGradients(), obs)
    assert steps(found) == [(0, "error"), (3, "error")]
    assert {f.where for f in found} == {"p1"}


def test_nonfinite_gradients_quiet_on_a_healthy_twin():
    norms = healthy_norms(2, 500)
    assert run(NonfiniteGradients(), [make_obs(t, grads=g) for t, g in enumerate(norms)]) == []


def _scaled(detector: NonfiniteGradients) -> NonfiniteGradients:
    detector.setup = TrainingSetup(precision="16-mixed", loss_scaler="GradScaler")
    return detector


def test_under_a_loss_scaler_an_overflow_is_the_scalers_until_it_repeats():
    """A GradScaler skips a step whose gradients overflow and halves its scale: info, and
    the streak starts again at a finite step; ``patience`` overflows in a row: training
    has stalled, an error."""
    over = [1.0, INF, 1.0, 1.0]
    grads = [over, over, [1.0] * 4, over, over, over, over]
    found = run(
        _scaled(NonfiniteGradients(patience=4)),
        [make_obs(t, loss=2.0, grads=g) for t, g in enumerate(grads)],
    )
    assert steps(found) == [
        (0, "info"),
        (1, "info"),
        (3, "info"),
        (4, "info"),
        (5, "info"),
        (6, "error"),
    ]
    assert "GradScaler skips this step" in found[0].message
    assert "since step 3" in found[-1].message and found[-1].where == NAMES[1]
    assert_actionable(found[-1])


def test_under_a_loss_scaler_a_nonfinite_loss_and_no_scaler_stay_errors():
    obs = [make_obs(0, loss=NAN, grads=[1.0, NAN, 1.0, 1.0])]
    assert steps(run(_scaled(NonfiniteGradients()), obs)) == [(0, "error")]
    obs = [make_obs(0, loss=2.0, grads=[1.0, INF, 1.0, 1.0])]
    assert steps(run(NonfiniteGradients(), obs)) == [(0, "error")]


def test_nonfinite_gradients_refuses_a_bad_patience():
    with pytest.raises(ValueError, match="patience=0"):
        NonfiniteGradients(patience=0)


# -- nonfinite_weights ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "where"),
    [
        pytest.param({1: NAN}, "layer0.bias", id="nan-middle"),
        pytest.param({1: NAN, 3: INF}, "layer0.bias", id="two-names-the-first"),
        pytest.param({3: -INF}, "layer1.bias", id="-inf-last"),
        pytest.param({0: INF, 2: NAN}, "layer0.weight", id="first-and-middle"),
    ],
)
def test_nonfinite_weights_names_the_first_bad_parameter(bad, where):
    norms = healthy_norms(3, 12)
    for i, v in bad.items():
        norms[7, i] = v
    found = run(NonfiniteWeights(), [make_obs(t, weights=w) for t, w in enumerate(norms)])
    assert steps(found) == [(7, "error")]
    (f,) = found
    assert f.where == where
    expected = bad[NAMES.index(where)]
    assert math.isnan(f.value) if math.isnan(expected) else f.value == expected
    assert f"{len(bad)} of 4 parameters" in f.message
    assert_actionable(f, "checkpoint", "learning rate")


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param(np.array([]), id="empty"),
        pytest.param(np.zeros(4), id="all-zero"),
        pytest.param(np.array([1e300, 1e-300, 2.0, 1.0]), id="tiny-and-huge-finite"),
    ],
)
def test_nonfinite_weights_quiet_on_finite_or_empty_weights(weights):
    assert run(NonfiniteWeights(), [make_obs(0, weights=weights)]) == []


def test_nonfinite_weights_ignores_nonfinite_gradients_and_quiet_on_healthy_twin():
    norms = healthy_norms(4, 300)
    obs = [make_obs(t, weights=w, grads=[NAN] * 4) for t, w in enumerate(norms)]
    assert run(NonfiniteWeights(), obs) == []


def test_nonfinite_weights_single_step():
    (f,) = run(NonfiniteWeights(), [make_obs(0, weights=[NAN])])
    assert (f.step, f.where, f.severity.value) == (0, "p0", "error")
    assert "lower learning rate" in f.message


@pytest.mark.parametrize(
    ("eps", "said"), [(1e-8, "eps=1e-08 is 0 in float16"), (1e-7, "up to 2441x the usual one")]
)
def test_nonfinite_weights_under_an_epsilon_small_for_float16_names_it(eps, said):
    detector = NonfiniteWeights()
    risk = small_epsilon("AdamW", "eps", eps, ["float16"])
    detector.setup = TrainingSetup(framework="lightning", small_epsilon=risk)
    (f,) = run(detector, [make_obs(0, weights=[NAN])])
    assert said in f.message and "learning rate" not in f.message
    assert f.message.endswith(
        'set eps=1e-4, or keep float32 weights and optimizer state (precision="16-mixed").'
    )
    assert detector.current_advice() == "restart with a larger epsilon (1e-4)"
