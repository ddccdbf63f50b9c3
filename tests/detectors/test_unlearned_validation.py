"""unlearned_validation: a validation loss that stays where training began while the
training loss falls far below it."""

from __future__ import annotations

import pytest
from _helpers import assert_resumes, run

from stethoscope.advice import RunningStatistics, TrainingSetup
from stethoscope.detectors import UnlearnedValidation
from stethoscope.observation import Observation

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
    [({"no_better": 0}, "no_better"), ({"learned": 1.5}, "learned"), ({"patience": 0}, "patience")],
)
def test_bad_arguments_name_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        UnlearnedValidation(**kwargs)
