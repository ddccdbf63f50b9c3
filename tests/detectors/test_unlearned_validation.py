"""unlearned_validation: a validation loss that stays where training began while the
training loss falls far below it."""

from __future__ import annotations

import pytest
from _helpers import assert_resumes, run

from stethoscope.advice import RunningStatistics, TrainingSetup
from stethoscope.detectors import UnlearnedValidation
from stethoscope.observation import Observation
from stethoscope.running_statistics import StatisticsLag

START = 2.3  # ln 10: a classifier of 10 classes at its start


def validations(vals, trains, *, start=START, every=23) -> list[Observation]:
    """One validation per epoch of ``every`` steps, at its last step."""
    return [
        Observation(
            step=(e + 1) * every - 1,
            epoch=e,
            val_loss=float(v),
            train_loss=float(t),
            start_loss=start,
        )
        for e, (v, t) in enumerate(zip(vals, trains, strict=True))
    ]


LAGGING = RunningStatistics("bn", "momentum=0.999", 0.999)


@pytest.mark.parametrize(
    ("vals", "trains", "expected"),
    [
        pytest.param(
            [2.3, 2.3, 2.3], [1.5, 0.9, 0.4], [68], id="at-the-start-twice-while-training-learned"
        ),
        pytest.param([2.3, 2.3, 2.3], [1.9, 1.5, 1.3], [], id="training-not-far-enough-below"),
        pytest.param(
            [1.5, 2.3, 2.3, 2.4],
            [1.2, 0.8, 0.5, 0.3],
            [],
            id="it-validated-better-once: overfitting's",
        ),
        pytest.param([2.3, 2.3, 1.2, 2.3, 2.3], [1.6, 1.6, 0.9, 0.5, 0.3], [], id="not-in-a-row"),
    ],
)
def test_a_validation_that_stays_at_the_start_is_named(vals, trains, expected):
    d = UnlearnedValidation()
    d.setup = TrainingSetup(running_statistics=LAGGING)
    assert [f.step for f in run(d, validations(vals, trains))] == expected


def test_the_message_names_the_lagging_batch_norm_and_its_share():
    d = UnlearnedValidation()
    d.setup = TrainingSetup(framework="keras", running_statistics=LAGGING)
    (f,) = run(d, validations([2.3, 2.31], [0.6, 0.3]))
    assert f.severity.value == "warning" and f.where == "bn"
    assert (
        "momentum=0.999" in f.message and "96% of their initial values after 46 steps" in f.message
    )
    assert "half of them after 693" in f.message and "momentum=0.9" in f.message


def test_without_a_batch_norm_the_message_points_at_the_data():
    d = UnlearnedValidation()
    (f,) = run(d, validations([2.3, 2.31], [0.6, 0.3]))
    assert f.where is None and "validation data" in f.message and "batch norm to" in f.message


def test_a_loss_that_can_fall_below_zero_is_left_alone():
    d = UnlearnedValidation()
    assert run(d, validations([-1.0, -1.0], [-3.0, -4.0], start=-0.5)) == []
    assert run(UnlearnedValidation(), validations([2.3, 2.3], [0.3, 0.2], start=-0.5)) == []


def test_it_says_so_once_and_is_done():
    d = UnlearnedValidation()
    found = run(d, validations([2.3] * 6, [0.5] * 6))
    assert [f.step for f in found] == [45] and d.finished(200)


def test_it_resumes_from_a_checkpoint():
    obs = validations([2.3, 2.3, 2.3], [1.5, 0.9, 0.4])
    assert [f.step for f in assert_resumes(UnlearnedValidation, obs, at=1)] == [68]


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"no_better": 0}, "no_better"),
        ({"learned": 1.5}, "learned"),
        ({"patience": 0}, "patience"),
        ({"worse": 0}, "worse"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        UnlearnedValidation(**kwargs)


def lagged(vals, trains, errors, *, updates=23) -> list[Observation]:
    """Validations that also carry the batch norms' error (None: not measured there)."""
    out = validations(vals, trains)
    for e, (obs, error) in enumerate(zip(out, errors, strict=True)):
        if error is not None:
            n = updates * (e + 1)
            obs.val_running_statistics = StatisticsLag(
                "net.4", "momentum=0.001", error, 0.999**n, n
            )
    return out


@pytest.mark.parametrize(
    ("vals", "trains", "errors", "expected"),
    [
        # validates far better than the start, still 10x worse than it trains
        pytest.param([1.3, 1.0, 0.9], [0.8, 0.1, 0.05], [0.3, 0.3, 0.3], [68], id="in-part"),
        pytest.param([1.3, 1.0, 0.9], [0.8, 0.1, 0.05], [0.05, 0.04, 0.03], [], id="norms-fine"),
        # the norms are off, but the validation does not suffer from it
        pytest.param([0.2, 0.12, 0.1], [0.3, 0.1, 0.08], [0.3, 0.3, 0.3], [], id="val-not-worse"),
        pytest.param(
            [1.3, 1.0, 0.9, 0.8],
            [0.8, 0.1, 0.1, 0.1],
            [0.3, 0.05, 0.3, 0.3],
            [91],
            id="not-in-a-row",
        ),
        pytest.param(
            [1.3, 1.0, 0.9, 0.8],
            [0.8, 0.1, 0.05, 0.05],
            [0.3, 0.3, None, 0.3],
            [91],
            id="unmeasured-keeps-the-count",
        ),
    ],
)
def test_batch_norms_that_normalise_otherwise_at_inference_are_named(
    vals, trains, errors, expected
):
    d = UnlearnedValidation()
    d.setup = TrainingSetup(framework="lightning", running_statistics=LAGGING)
    assert [f.step for f in run(d, lagged(vals, trains, errors))] == expected


def test_the_statistics_are_judged_after_32_updates_only():
    # at 10 updates a validation none counts; at 23 the first is too early, so the
    # second starts the count
    d = UnlearnedValidation()
    d.setup = TrainingSetup(framework="lightning", running_statistics=LAGGING)
    found = run(d, lagged([1.3, 1.0, 0.9], [0.8, 0.1, 0.05], [0.3] * 3, updates=10))
    assert [f.step for f in found] == []
    found = run(UnlearnedValidation(), lagged([1.3, 1.0, 0.9], [0.8, 0.1, 0.05], [0.3] * 3))
    assert [f.step for f in found] == [68]


@pytest.mark.parametrize(
    ("framework", "advice"),
    [("lightning", "raise the momentum (momentum=0.1"), ("keras", "lower the momentum")],
)
def test_the_lag_message_names_the_layer_its_share_and_which_way_to_turn(framework, advice):
    d = UnlearnedValidation()
    d.setup = TrainingSetup(framework=framework, running_statistics=LAGGING)
    (f,) = run(d, lagged([1.3, 1.0], [0.8, 0.1], [0.36, 0.36], updates=40))
    assert f.where == "net.4" and f.value == pytest.approx(0.36) and f.threshold == 0.1
    assert "10x the training loss 0.1" in f.message
    assert "net.4 (momentum=0.001) still hold 92% of their values at the start after 80 " in (
        f.message
    )
    assert "0.6 standard deviations (RMS)" in f.message and advice in f.message


def test_a_model_with_batch_norms_is_watched_after_it_validated_better():
    d = UnlearnedValidation()
    d.setup = TrainingSetup(running_statistics=LAGGING)
    run(d, validations([1.0], [0.8]))  # better than the start: that rule is done
    assert not d.finished(30)
    d = UnlearnedValidation()
    run(d, validations([1.0], [0.8]))  # nothing else to watch without a batch norm
    assert d.finished(30)
