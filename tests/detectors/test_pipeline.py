"""Layer 1: the pipeline detectors on sequences of observations: collapsed_lr's per-epoch
decay stepped every batch, against warm-ups, cosine annealing and constant rates; the
others' mistakes against their healthy twins."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_resumes, assert_sentence, make_obs, run

from stethoscope.advice import TrainingSetup
from stethoscope.detectors import (
    CollapsedLearningRate,
    EvalMode,
    LogitsMismatch,
    LossDividedTwice,
    UnzeroedGradients,
)
from stethoscope.detectors.pipeline import probability_floor
from stethoscope.observation import Observation


def losses(n: int, *, learns: bool, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    level = 2.3 * np.exp(-np.arange(n) / 60) + 0.1 if learns else np.full(n, 2.3)
    return level * rng.lognormal(0.0, 0.05, n)


def run_with(lrs, loss) -> list:
    return run(
        CollapsedLearningRate(),
        [make_obs(t, loss=x, lr=lr) for t, (x, lr) in enumerate(zip(loss, lrs, strict=True))],
    )


def step_lr(n: int, every: int = 30) -> list[float]:
    """StepLR(step_size=every, gamma=0.1) from 0.1, stepped every batch."""
    return [0.1 * 0.1 ** (t // every) for t in range(n)]


def test_a_per_epoch_decay_stepped_every_batch_collapses_the_rate():
    n = 200
    loss = losses(n, learns=False)  # a slow task: 90 batches teach it nothing yet
    (found,) = run_with(step_lr(n), loss)
    # a thousandth of the peak at step 90, under it from step 120
    assert found.severity == "warning" and found.step == 120 and found.where == "lr"
    assert found.value == pytest.approx(1e-5) and found.threshold == pytest.approx(1e-4)
    assert_sentence(found, "cadence", names=["collapsed", "every batch"])


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(lambda t, n: 1e-3, id="constant"),
        pytest.param(lambda t, n: 1e-3 * min(1.0, t / 50), id="warm-up-from-0"),
        pytest.param(
            lambda t, n: 1e-3 * 0.5 * (1 + math.cos(math.pi * t / (n - 1))), id="cosine-to-0"
        ),
        pytest.param(lambda t, n: 1e-3 * 0.1 ** (t // 100), id="a-decade-per-100"),
    ],
)
def test_a_schedule_that_anneals_after_the_loss_fell_is_no_collapse(schedule):
    n = 400
    lrs = [schedule(t, n) for t in range(n)]
    assert run_with(lrs, losses(n, learns=True)) == []


def test_without_learning_rates_it_says_nothing():
    assert run_with([None] * 200, losses(200, learns=False)) == []


def test_it_judges_once_and_resumes():
    n = 200
    obs = [
        make_obs(t, loss=x, lr=lr)
        for t, (x, lr) in enumerate(zip(losses(n, learns=False), step_lr(n), strict=True))
    ]
    assert len(assert_resumes(CollapsedLearningRate, obs, at=50)) == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="drop=2"):
        CollapsedLearningRate(drop=2)
    with pytest.raises(ValueError, match="window=0"):
        CollapsedLearningRate(window=0)


# -- eval_mode --------------------------------------------------------------------------------
def modes(pattern: list[tuple[str, ...]]) -> list:
    obs = []
    for t, off in enumerate(pattern):
        o = make_obs(t * 16, loss=1.0)
        o.eval_modules = off
        obs.append(o)
    return obs


def test_two_sampled_steps_in_eval_mode_are_a_warning():
    found = run(EvalMode(), modes([(), (), ("<model>", "net.3"), ("<model>", "net.3"), ()]))
    (f,) = found
    assert f.severity == "warning" and f.step == 48 and f.where == "<model>"
    assert_sentence(f, "self.train()", names=["whole model", "eval mode"])


def test_one_step_in_eval_mode_is_a_suspicion_only():
    d = EvalMode()
    assert run(d, modes([(), ("net.dropout",), ()])) == []
    d.update(modes([("net.dropout",)])[0])
    assert d.suspect and "net.dropout" in d.suspect


def test_it_names_the_modules_and_warns_once():
    off = tuple(f"net.{i}" for i in range(5))
    (f,) = run(EvalMode(), modes([off] * 6))
    assert "net.0, net.1, net.2 and 2 more" in f.message and f.where == "net.0"


def test_eval_mode_resumes():
    assert len(assert_resumes(EvalMode, modes([(), ("m",), ("m",)]), at=2)) == 1


# -- unzeroed_gradients ------------------------------------------------------------------------
def stale(counts: list[float], stepped: int = 4) -> list:
    obs = []
    for t, n in enumerate(counts):
        o = make_obs(t * 16, loss=1.0, grads=[0.1] * stepped, weights=[1.0] * stepped)
        o.stale_grads = n
        obs.append(o)
    return obs


def test_gradients_left_from_before_on_two_steps_are_a_warning():
    (f,) = run(UnzeroedGradients(), stale([0, 0, 4, 4, 4]))
    assert f.severity == "warning" and f.step == 48 and f.value == 4.0
    assert_sentence(f, "zero_grad", names=["never zeroed"])


@pytest.mark.parametrize(
    "counts",
    [[0] * 10, [4, 0, 4, 0, 4, 0], [1, 1, 1, 1]],  # zeroed; one step in two; a few only
    ids=["zeroed", "not-in-a-row", "a-few-parameters"],
)
def test_zeroed_gradients_are_quiet(counts):
    assert run(UnzeroedGradients(), stale(counts)) == []


def test_unzeroed_resumes():
    assert len(assert_resumes(UnzeroedGradients, stale([0, 4, 4]), at=2)) == 1


# -- logits_mismatch ----------------------------------------------------------------------


def predicted(
    step: int, *, probs: bool, loss: float = 1.0, expects: str = "", width: int = 4, **losses
):
    return Observation(
        step=step,
        loss=loss,
        output_probs=1.0 if probs else 0.0,
        output_width=width,
        loss_expects=expects,
        **losses,
    )


@pytest.mark.parametrize(
    ("probs", "expects", "words"),
    [
        (True, "logits", "from_logits=True"),
        (False, "probabilities", "from_logits=False"),
    ],
)
def test_an_output_the_configured_loss_does_not_take_is_named(probs, expects, words):
    found = run(LogitsMismatch(), [predicted(t, probs=probs, expects=expects) for t in (0, 16)])
    (finding,) = found
    assert finding.step == 16 and finding.where == "loss" and words in finding.message
    assert_sentence(finding, "from_logits")


@pytest.mark.parametrize(("probs", "expects"), [(True, "probabilities"), (False, "logits")])
def test_an_output_the_configured_loss_takes_is_left_alone(probs, expects):
    assert (
        run(LogitsMismatch(), [predicted(t, probs=probs, expects=expects) for t in range(9)]) == []
    )


def test_probabilities_whose_loss_is_their_cross_entropy_went_through_a_softmax_twice():
    """The training loss is what cross_entropy makes of the probabilities as logits, not
    their log-likelihood: a softmax before cross_entropy."""
    steps = [
        predicted(t, probs=True, loss=0.8, loss_as_logits=0.8, loss_as_probs=0.3) for t in (0, 16)
    ]
    (found,) = run(LogitsMismatch(), steps)
    assert "applied twice" in found.message and f"{probability_floor(4):.3f}" in found.message
    assert_sentence(found, "nll_loss")


def test_probabilities_fed_to_their_log_likelihood_are_left_alone():
    steps = [
        predicted(t, probs=True, loss=0.3, loss_as_logits=0.8, loss_as_probs=0.3) for t in range(9)
    ]
    assert run(LogitsMismatch(), steps) == []


def test_logits_whose_loss_is_their_negative_mean_were_never_log_softmaxed():
    steps = [
        predicted(t, probs=False, loss=-5.0, loss_as_logits=1.2, loss_as_log_probs=-5.0)
        for t in (0, 16)
    ]
    (found,) = run(LogitsMismatch(), steps)
    assert "without bound" in found.message
    assert_sentence(found, "log_softmax")


@pytest.mark.parametrize("loss", [1.25, 0.9])  # label smoothing, a weight penalty
def test_a_loss_that_is_neither_way_of_taking_the_output_is_left_alone(loss):
    steps = [
        predicted(
            t, probs=probs, loss=loss, loss_as_logits=1.2, loss_as_log_probs=-5.0, loss_as_probs=0.3
        )
        for t in range(9)
        for probs in (True, False)
    ]
    assert run(LogitsMismatch(), steps) == []


def test_one_column_within_0_and_1_fed_as_logits_must_stay_there_for_a_span_of_steps():
    """A fresh model's one logit can lie within [0, 1] on every row (a GAN's
    discriminator on a generator that has not spread yet) and leave as it learns; a
    sigmoid's stays."""
    span = LogitsMismatch.one_column_span
    logit = [predicted(t, probs=t < 48, expects="logits", width=1) for t in range(0, 96, 16)]
    assert run(LogitsMismatch(), logit) == []
    sigmoid = [predicted(t, probs=True, expects="logits", width=1) for t in range(0, 257, 16)]
    (found,) = run(LogitsMismatch(), sigmoid)
    assert found.step == span and "from_logits=True" in found.message
    # after a break, the span counts from the first step of the new streak
    broken = [predicted(t, probs=t != 64, expects="logits", width=1) for t in range(0, 257, 16)]
    assert run(LogitsMismatch(), broken)[0].step == 80 + span


def test_a_mismatch_must_hold_on_sampled_steps_in_a_row():
    steps = [predicted(t, probs=t != 16, expects="logits") for t in (0, 16, 32)]
    assert run(LogitsMismatch(), steps) == []
    assert run(LogitsMismatch(patience=1), steps[:1])[0].step == 0


# -- loss_divided_twice ---------------------------------------------------------------------


def divided(k: int, **setup) -> LossDividedTwice:
    detector = LossDividedTwice()
    detector.setup = TrainingSetup(framework="lightning", divided_again=k, **setup)
    return detector


def measured(steps) -> list[Observation]:
    """Steps whose gradients (norms 3 and 4: 5 in all) were measured, after one that
    measured the loss alone."""
    return [make_obs(0, loss=1.0)] + [make_obs(t, loss=1.0, grads=[3.0, 4.0]) for t in steps]


@pytest.mark.parametrize(
    ("setup", "severity", "effect"),
    [
        ({}, "warning", "2 times smaller"),  # SGD: every step is halved
        ({"adaptive": True}, "info", "barely change"),  # Adam: scale-free
        ({"adaptive": True, "clipping": "gradient_clip_val=1.0"}, "warning", "true norm 2"),
    ],
    ids=["sgd", "adam", "adam-clipped"],
)
def test_a_loss_divided_twice_is_said_once_at_the_first_measured_gradients(setup, severity, effect):
    detector = divided(2, **setup)
    assert detector.applies() and not detector.finished(0)
    (f,) = run(detector, measured([4, 8]))
    assert (f.severity, f.step, f.value, f.where) == (severity, 4, 2.0, "loss")
    assert "norm 5 at step 4" in f.message and effect in f.message
    assert_sentence(f, "accumulate_grad_batches", names=["accumulate_grad_batches=2", "1/2"])
    assert detector.finished(8)


def test_a_loss_divided_once_is_no_concern_of_it():
    detector = divided(1)
    assert not detector.applies() and detector.finished(0)
    assert LossDividedTwice().finished(0)  # no setup: Keras, or no DeepSpeed


def test_a_loss_divided_once_is_no_concern_of_it_even_when_run():
    assert run(divided(1), measured([4, 8])) == []


class _DividedByFour(LossDividedTwice):
    setup = TrainingSetup(divided_again=4)


@pytest.mark.parametrize("at", [1, 2])  # before it has said it, and after
def test_loss_divided_twice_resumes(at):
    (f,) = assert_resumes(_DividedByFour, measured([4, 8]), at=at)
    assert f.step == 4 and f.value == 4.0
