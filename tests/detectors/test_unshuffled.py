"""Layer 1: unshuffled_data on batches of labels: blocks of one class against shuffled
batches, skewed labels, token ids; and the engine's word when no labels ever come."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_resumes, assert_sentence, run

from stethoscope.detectors import UnshuffledData, default_detectors
from stethoscope.engine import Monitor
from stethoscope.observation import Observation
from stethoscope.testing import CapturingSink


def batches_of(labels: np.ndarray, batch: int = 32) -> list[Observation]:
    return [
        Observation(step=t, labels=labels[i : i + batch].astype(np.int64))
        for t, i in enumerate(range(0, len(labels) - batch + 1, batch))
    ]


def dataset(k: int = 10, n: int = 3200, seed: int = 0, p: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(k, size=n, p=p)


@pytest.mark.parametrize("k", [2, 10, 100])
def test_sorted_labels_are_blocks(k):
    (found,) = run(UnshuffledData(), batches_of(np.sort(dataset(k))))
    assert found.severity == "warning" and found.where == "labels"
    assert found.value < found.threshold
    assert_sentence(found, "shuffle", names=["blocks", "not shuffled"])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "p",
    [None, np.r_[0.9, np.full(9, 0.1 / 9)], np.r_[0.5, 0.3, 0.1, 0.05, 0.05]],
    ids=["balanced", "one-class-90%", "skewed-5"],
)
def test_shuffled_batches_are_no_blocks_whatever_the_skew(seed, p):
    k = 10 if p is None or len(p) == 10 else len(p)
    assert run(UnshuffledData(), batches_of(dataset(k, seed=seed, p=p))) == []


def test_small_batches_are_judged_against_batches_as_small():
    # 8 labels of 100 classes: a shuffled batch holds at most 8 classes, and that is fine
    assert run(UnshuffledData(), batches_of(dataset(100, n=8 * 400, seed=1), batch=8)) == []
    (found,) = run(UnshuffledData(), batches_of(np.sort(dataset(100, n=8 * 400)), batch=8))
    assert found.detector == "unshuffled_data"


def test_token_ids_and_tiny_batches_are_left_alone():
    tokens = np.random.default_rng(0).integers(0, 50_000, 32 * 20)
    assert run(UnshuffledData(), batches_of(np.sort(tokens))) == []
    assert run(UnshuffledData(), batches_of(np.sort(dataset(10)), batch=4)) == []


def test_it_judges_once_and_resumes():
    obs = batches_of(np.sort(dataset(10)))
    found = assert_resumes(UnshuffledData, obs, at=4)
    assert len(found) == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"fraction=1\.5"):
        UnshuffledData(fraction=1.5)
    with pytest.raises(ValueError, match="batches=0"):
        UnshuffledData(batches=0)


def test_with_no_labels_the_summary_says_it_is_silent_and_why():
    sink = CapturingSink()
    monitor = Monitor(detectors=default_detectors(), sinks=[sink])
    for step in range(64):  # the adapter measured everything planned, but found no labels
        plan = monitor.plan(step)
        obs = Observation(step=step, loss=1.0)
        if "labels" in plan:
            obs.names = ("w",)
        monitor.observe(obs)
    rows = {r.detector: r for r in monitor.summary(0).rows}
    assert rows["unshuffled_data"].verdict == (
        "silent: no integer class labels could be read from the batches"
    )
    assert "class_imbalance" not in rows  # it says nothing of its own (no blind_to)


def test_labels_that_come_late_end_the_silence():
    monitor = Monitor(detectors=[UnshuffledData()], sinks=[])
    for step in range(40):
        monitor.observe(Observation(step=step, loss=1.0))
    assert "unshuffled_data" in {r.detector for r in monitor.summary(0).rows}
    labels = dataset(10)
    monitor.observe(Observation(step=40, loss=1.0, labels=labels[:32]))
    assert "unshuffled_data" not in {r.detector for r in monitor.summary(0).rows}


def _silent_from(validations: bool) -> int:
    """The first step after which the summary calls unshuffled_data silent, in a run
    whose batches hold no labels; ``validations``: one after every step."""
    from stethoscope.detectors import Overfitting

    monitor = Monitor(detectors=[UnshuffledData(), Overfitting()], sinks=[])
    for step in range(64):
        monitor.observe(Observation(step=step, loss=1.0))
        if validations:
            monitor.observe_validation(step, step, 1.0)
        if "unshuffled_data" in {r.detector for r in monitor.summary(0).rows}:
            return step
    return -1


def test_a_validation_is_no_step_that_lacked_the_labels():
    """A validation's observation carries the validation's numbers, never a batch's
    labels: it is not counted as a step that could not read them. A full-batch run
    validates after every step, and was called silent in half the steps."""
    assert _silent_from(validations=True) == _silent_from(validations=False) > 0
