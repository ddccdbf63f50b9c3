"""Layer 1: overfitting on synthetic sequences of validation and mean training losses."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _helpers import NAN, assert_resumes, assert_sentence, run

from stethoscope.detectors import Overfitting
from stethoscope.observation import Observation

STEPS_PER_EPOCH = 100


def val_obs(vals, trains, epochs=None) -> list[Observation]:
    """One validation per epoch (unless ``epochs`` says otherwise), at its last step."""
    epochs = range(len(vals)) if epochs is None else epochs
    return [
        Observation(
            step=(e + 1) * STEPS_PER_EPOCH - 1 + i,
            epoch=e,
            val_loss=None if v is None else float(v),
            train_loss=None if t is None else float(t),
        )
        for i, (v, t, e) in enumerate(zip(vals, trains, epochs, strict=True))
    ]


def falling(n: int, start: float = 1.0, stop: float = 0.3) -> list[float]:
    return list(np.linspace(start, stop, n))


# the classic U: validation bottoms out at 0.8 in epoch 2 and climbs back while training falls
U_VAL = [1.0, 0.9, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05]


@pytest.mark.parametrize(
    ("vals", "trains", "expected"),
    [
        pytest.param(U_VAL, falling(8), [5], id="val-up-10%-twice-while-train-falls"),
        pytest.param(
            [*U_VAL[:5], 0.87, 0.95, 0.95], falling(8), [7], id="rise-must-be-more-than-10%"
        ),
        pytest.param(
            [1.0, 0.8, 0.9, 0.85, 0.9, 0.85, 0.9], falling(7), [], id="streak-broken-each-time"
        ),
        pytest.param([1.0, 0.8, 0.9, NAN, 0.9], falling(5), [4], id="nan-skipped-not-a-break"),
        pytest.param([1.0, 0.8, None, 0.9, 0.9], falling(5), [4], id="none-skipped"),
        pytest.param(
            [1.0, 0.8, 0.9, 0.9, 0.95, 1.0, 1.2], falling(7), [3], id="said-once-per-best"
        ),
        pytest.param(U_VAL, [1.0, 0.9, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05], [], id="train-rises-too"),
        pytest.param(
            U_VAL, [1.0, 0.9, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8], [], id="train-flat-is-not-falling"
        ),
        pytest.param(U_VAL, [None] * 8, [], id="no-train-loss"),
        pytest.param(U_VAL, [NAN] * 8, [], id="nan-train-loss"),
        pytest.param([0.8, 0.88, 0.88, 0.88, 0.88], falling(5), [], id="rise-of-10%-exactly"),
        pytest.param([0.5], [0.5], [], id="one-validation"),
        pytest.param([], [], [], id="no-validation"),
    ],
)
def test_overfitting_fires_at_the_expected_validation(vals, trains, expected):
    obs = val_obs(vals, trains)
    found = run(Overfitting(), obs)
    assert [f.epoch for f in found] == expected
    for f in found:
        best = min(v for v in vals[: f.epoch] if v is not None and v == v)
        assert (f.detector, f.severity.value, f.where) == ("overfitting", "warning", "validation")
        assert f.step == obs[f.epoch].step
        assert f.value == vals[f.epoch]
        assert f.threshold == pytest.approx(best * 1.1)
        assert f"validation loss rose to {vals[f.epoch]:.3g} from its best {best:.3g}" in (
            f.message
        )
        assert_sentence(f, "stop early", "weight decay", names=("validation",))


def test_overfitting_new_best_then_again_must_rise_past_the_rise_it_undid():
    """Above its best by 12.5% twice (a warning), then a new best, 0.7, that undid that
    rise: the next rise must pass 12.5% of 0.7, and 0.8 (14%) twice does."""
    found = run(Overfitting(), val_obs([1.0, 0.8, 0.9, 0.9, 0.7, 0.8, 0.8], falling(7)))
    assert [f.epoch for f in found] == [3, 6]
    assert [f.threshold for f in found] == [pytest.approx(0.88), pytest.approx(0.7 * 1.125)]


# a healthy run whose validation loss is noisy: the zoo's small ResNet at SGD lr 0.1
# (momentum 0.9) on digits, validated each epoch (seed 2, measured: 2.87, 0.143, 0.483,
# 0.122, 0.075, 0.0997), its first validation put at 0.6 so that the scale of the task
# does not hide the rise, and two more validations of the same noise
NOISY_VAL = [0.6, 0.1432, 0.4827, 0.1223, 0.0751, 0.0997, 0.0952, 0.0612]
NOISY_TRAIN = [0.2665, 0.0882, 0.0848, 0.0766, 0.0273, 0.0139, 0.0122, 0.0101]


def test_a_noisy_validation_loss_is_no_overfitting():
    """0.14 to 0.48 and back to 0.12: the validation loss swings 240% over its best and
    undoes it, so 0.0997 and 0.0952, 33% and 27% over its best 0.075, are its noise (was:
    a warning at the second, two validations more than 10% above the best)."""
    assert run(Overfitting(), val_obs(NOISY_VAL, NOISY_TRAIN)) == []


def test_the_rises_undone_long_ago_are_forgotten():
    """Twelve validations after the noisy start, its 240% swing no longer counts: the
    model that then overfits is named at its second validation 50% above its best (the
    bar: 10% above it)."""
    vals = [*NOISY_VAL[:5], *np.linspace(0.074, 0.06, 10), 0.09, 0.095]
    found = run(Overfitting(), val_obs(vals, falling(len(vals), 0.3, 0.001)))
    assert [f.epoch for f in found] == [len(vals) - 1]
    assert found[0].threshold == pytest.approx(0.06 * 1.1)
    assert run(Overfitting(), val_obs(vals[:13] + vals[-2:], falling(15, 0.3, 0.001))) == []


def test_a_swing_that_was_not_undone_is_no_noise():
    """The U of overfitting: the validation loss rises and never comes back below its
    best, so no rise was undone and 10% is the bar."""
    d = Overfitting()
    run(d, val_obs(U_VAL, falling(8)))
    assert d.state["undone"] == []


def test_the_undone_rises_survive_a_resume():
    obs = val_obs(NOISY_VAL, NOISY_TRAIN)
    for at in (2, 3, 4, 6):
        assert assert_resumes(Overfitting, obs, at) == []


def test_overfitting_message_says_when_the_best_was():
    (f,) = run(Overfitting(), val_obs(U_VAL, falling(8)))
    assert "(3 epoch(s) ago, at epoch 2) while the training loss fell from 0.8 to 0.5;" in (
        f.message
    )


def test_overfitting_several_validations_per_epoch_count_validations():
    obs = val_obs([1.0, 0.8, 0.9, 0.9], falling(4), epochs=[0, 0, 0, 0])
    (f,) = run(Overfitting(), obs)
    assert f.step == obs[3].step
    assert "(2 validation(s) ago)" in f.message


@pytest.mark.parametrize("seed", range(5))
def test_overfitting_quiet_on_a_noisy_plateau(seed):
    # validation converged at 0.8 with ±2% noise from one validation to the next; training
    # still falls, so only the size and persistence of the rise can keep it quiet
    n = 60
    vals = 0.8 * np.random.default_rng(seed).lognormal(0.0, 0.02, n)
    assert run(Overfitting(), val_obs(vals, falling(n))) == []


# a steady climb from a best of 0.8: 1.25% per validation, never 10% above it
CLIMB = [1.0, 0.8, 0.81, 0.82, 0.83, 0.84, 0.85, 0.86]


@pytest.mark.parametrize(
    ("vals", "trains", "expected"),
    [
        pytest.param(CLIMB, falling(8), [7], id="six-rises-7.5%-in-all"),
        pytest.param(CLIMB[:-1], falling(7), [], id="five-rises-are-not-a-climb"),
        pytest.param(
            [1.0, 0.8, 0.801, 0.802, 0.803, 0.804, 0.805, 0.806], falling(8), [], id="under-5%"
        ),
        pytest.param(
            [1.0, 0.8, 0.81, 0.82, 0.83, 0.82, 0.84, 0.85, 0.86],
            falling(9),
            [],
            id="a-dip-restarts",
        ),
        pytest.param(CLIMB, [1.0, 0.9, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0], [], id="train-rises-too"),
        pytest.param([*CLIMB, 0.87, 0.89], falling(10), [7], id="said-once-per-best"),
    ],
)
def test_overfitting_fires_on_a_steady_climb(vals, trains, expected):
    found = run(Overfitting(), val_obs(vals, trains))
    assert [f.epoch for f in found] == expected
    for f in found:
        assert f.value == vals[f.epoch]
        assert f.threshold == pytest.approx(vals[f.epoch - 6] + 0.05 * 0.8)
        assert "rising on each of the last 6 validations, while the training loss fell" in (
            f.message
        )


def test_overfitting_climb_adds_few_alarms_on_a_noisy_plateau():
    """Measured over 1000 plateaus of 60 validations at 2% noise: 19 alarms without the climb
    rule (the 10% bar twice), 26 with it. Pinned over 300: at most 3 more than without."""
    fired = {True: 0, False: 0}
    for seed in range(300):
        obs = val_obs(0.8 * np.random.default_rng(seed).lognormal(0.0, 0.02, 60), falling(60))
        for climb in fired:
            fired[climb] += bool(run(Overfitting(trend=6 if climb else 10**6), obs))
    assert fired[True] - fired[False] <= 3, fired


def test_overfitting_patience_1_and_a_larger_rise():
    obs = val_obs([*U_VAL, 1.1], falling(9))
    assert [f.epoch for f in run(Overfitting(patience=1), obs)] == [4]
    assert [f.epoch for f in run(Overfitting(min_rise=0.25), obs)] == [8]  # above 1.0 twice


def test_overfitting_suspects_a_single_rise():
    d = Overfitting()
    obs = val_obs([1.0, 0.8, 0.9, 0.8], falling(4))
    d.update(obs[0])
    d.update(obs[1])
    d.update(obs[2])
    assert d.suspect == "validation loss 0.9 above its best 0.8"
    d.update(obs[3])
    assert d.suspect is None


def test_overfitting_a_zero_best_counts_any_rise_past_the_floor():
    # the task's scale is 0.5 (the first training loss): the floor is 0.005
    found = run(Overfitting(), val_obs([0.0, 1e-2, 1e-2], [0.5, 0.4, 0.3]))
    assert [f.epoch for f in found] == [2]
    assert run(Overfitting(), val_obs([0.0, 1e-3, 1e-3], [0.5, 0.4, 0.3])) == []


def test_overfitting_quiet_on_a_negligible_rise_after_a_near_perfect_fit():
    # from 1.4 to 0.001, then up by 0.0006 (60% of the best, 0.04% of the task): quiet
    vals = [0.3, 0.01, 0.001, 0.0016, 0.0016, 0.0016]
    assert run(Overfitting(), val_obs(vals, [1.4, 0.2, 0.05, 0.04, 0.03, 0.02])) == []
    with pytest.raises(ValueError, match="floor"):
        Overfitting(floor=0)


def test_the_task_scale_includes_where_the_run_started():
    """A run that learns its task within its first epoch: the first validation is 0.0007
    and the first epoch's mean training loss 0.25, but the run started at 1.4. A rise to
    0.01 is 0.7% of that start: quiet. Without the start (a detector fed no start_loss)
    the scale is 0.25 and the same rise warns."""
    vals = [0.0007, 0.0058, 0.01, 0.0101, 0.0101]
    trains = [0.25, 0.001, 5e-4, 2e-4, 1e-4]
    obs = val_obs(vals, trains)
    assert len(run(Overfitting(), obs)) == 1
    for o in obs:
        o.start_loss = 1.4
    assert run(Overfitting(), obs) == []


def test_overfitting_quiet_on_a_small_rise_of_a_negative_loss():
    # best -2.0; -1.99 is 0.5% of |best| above it, far below the 10% a positive loss needs
    assert run(Overfitting(), val_obs([-1.5, -2.0, -1.99, -1.99, -1.99], falling(5))) == []


def test_overfitting_state_round_trip_keeps_the_best():
    vals = [1.0, 0.8, 0.85, 0.9, 0.95]
    obs = val_obs(vals, falling(5))
    for at in (1, 2, 3, 4):
        assert [f.epoch for f in assert_resumes(Overfitting, obs, at)] == [4]
    assert run(Overfitting(), obs[2:]) == []  # fresh: 0.85 becomes the best


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"min_rise": 0}, "min_rise=0"),
        ({"min_rise": -0.1}, "min_rise=-0.1"),
        ({"patience": 0}, "patience=0"),
        ({"patience": 1.5}, "patience=1.5"),
        ({"trend": 0}, "trend=0"),
        ({"trend_rise": -0.05}, "trend_rise=-0.05"),
    ],
)
def test_overfitting_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        Overfitting(**kwargs)
    assert "overfitting" in str(info.value)
