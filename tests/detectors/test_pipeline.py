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
from stethoscope.detectors.logits import SMOOTHING, _smoothing, probability_floor
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


@pytest.mark.parametrize("terms", [64.0, 17.0])
def test_a_loss_summed_over_the_batch_is_read_as_the_sum_of_its_terms(terms):
    """``reduction='sum'``: the loss is the mean times the terms. A softmax twice is named
    all the same, and says it read a sum; a healthy summed cross-entropy is left alone."""
    twice = [
        predicted(
            t, probs=True, loss=0.8 * terms, loss_as_logits=0.8, loss_as_probs=0.3, loss_terms=terms
        )
        for t in (0, 16)
    ]
    (found,) = run(LogitsMismatch(), twice)
    assert "applied twice" in found.message and f"{terms:.0f} terms" in found.message
    healthy = [
        predicted(
            t,
            probs=False,
            loss=(1.2 - t / 1000) * terms,
            loss_as_logits=1.2 - t / 1000,
            loss_as_softmax=1.38,
            loss_as_log_probs=-5.0,
            loss_terms=terms,
        )
        for t in range(0, 160, 16)
    ]
    assert run(LogitsMismatch(), healthy) == []


def test_a_mean_loss_is_not_read_as_a_sum():
    """Read as a sum, a mean loss is the mean over the terms again: nothing the rule
    could take for a way of taking the output."""
    steps = [
        predicted(
            t, probs=True, loss=0.3, loss_as_logits=0.3 / 64, loss_as_probs=0.3, loss_terms=64.0
        )
        for t in range(0, 160, 16)
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


# -- logits_mismatch under label smoothing (one constant that fits every sampled step) -----------
def test_the_smoothing_interval_holds_the_constant_that_mixes_the_two_losses():
    # 0.9 * 1.0 + 0.1 * 3.0 = 1.2: a smoothing of 0.1, within rounding
    lo, hi = _smoothing(1.2, 1.0, 3.0, None)
    assert lo <= 0.1 <= hi and hi - lo < 2e-3
    lo, hi = _smoothing(1.0, 1.0, 3.0, None)  # unsmoothed: 0
    assert lo == 0.0 <= hi < 1e-3
    # a later step narrows the interval, or rules the way out with another constant
    held = _smoothing(1.2, 1.0, 3.0, None)
    assert _smoothing(0.9 * 0.5 + 0.1 * 2.0, 0.5, 2.0, held) is not None
    assert _smoothing(0.7 * 0.5 + 0.3 * 2.0, 0.5, 2.0, held) is None
    assert _smoothing(0.4 * 1.0 + 0.6 * 3.0, 1.0, 3.0, None) is None  # past SMOOTHING
    assert _smoothing(0.5, 1.0, 3.0, None) is None  # below the labels' own loss
    assert _smoothing(1.0, None, 3.0, None) is None  # that way unmeasured
    # where the two agree the loss must be the labels' (any smoothing fits)
    assert _smoothing(1.0, 1.0, 1.0, None) == [0.0, SMOOTHING]
    assert _smoothing(1.5, 1.0, 1.0, None) is None
    # the uniform loss unmeasured: unsmoothed alone
    assert _smoothing(1.0, 1.0, None, None) is not None
    assert _smoothing(1.2, 1.0, None, None) is None


def _smoothed(t: int, e: float, *, probs: bool, ways: dict) -> Observation:
    """A step with each way of taking the output's losses, ``way: (at_labels, uniform)``;
    the training loss is the first way's, mixed with the uniform by ``e``."""
    fields = {}
    for way, (at, uniform) in ways.items():
        fields[f"loss_as_{way}"], fields[f"uniform_as_{way}"] = at, uniform
    at, uniform = next(iter(ways.values()))
    return predicted(t, probs=probs, loss=(1 - e) * at + e * uniform, **fields)


def test_probabilities_label_smoothed_through_cross_entropy_went_through_a_softmax_twice():
    seq = [
        _smoothed(t, 0.1, probs=True, ways={"logits": (1.3 - t / 100, 1.39), "probs": (0.4, 2.5)})
        for t in range(0, 64, 16)
    ]
    (found,) = run(LogitsMismatch(), seq)
    assert "applied twice" in found.message


def test_logits_whose_loss_is_their_softmaxs_cross_entropy_had_a_softmax_in_the_step():
    ways = {"softmax": (1.35, 1.386), "logits": (0.6, 2.0)}
    seq = [_smoothed(t, 0.0, probs=False, ways=ways) for t in range(0, 64, 16)]
    (found,) = run(LogitsMismatch(), seq)
    assert "training step" in found.message and "applied twice" in found.message


def test_a_label_smoothed_cross_entropy_of_logits_is_left_alone():
    seq = [
        _smoothed(
            t, 0.1, probs=False, ways={"logits": (0.6 - t / 1000, 2.0), "softmax": (1.3, 1.386)}
        )
        for t in range(0, 128, 16)
    ]
    assert run(LogitsMismatch(), seq) == []


def test_a_smoothing_that_changes_from_step_to_step_fits_no_way():
    """A loss between the two ways by a different share on each step (a regulariser's
    own term) is no constant label smoothing: left alone."""
    ways = {"logits": (1.3, 1.39), "probs": (0.4, 2.5)}
    seq = [
        _smoothed(t, 0.05 + 0.1 * (i % 3), probs=True, ways=ways)
        for i, t in enumerate(range(0, 128, 16))
    ]
    assert run(LogitsMismatch(), seq) == []


# -- logits_mismatch of a binary or multi-label output ------------------------------------------
def _binary(t: int, *, unit: bool, loss: float, **bce) -> Observation:
    fields = {f"bce_as_{k}": v for k, v in bce.items()}
    return Observation(
        step=t, loss=loss, output_probs=0.0, output_width=3, output_in_unit=float(unit), **fields
    )


def test_a_sigmoids_output_fed_to_bce_with_logits_must_stay_within_0_and_1_for_a_span():
    span = LogitsMismatch.one_column_span
    ways = {"logits": 0.75, "probs": 0.3, "sigmoid": 0.8}
    seq = [_binary(t, unit=True, loss=0.75, **ways) for t in range(0, span + 1, 16)]
    (found,) = run(LogitsMismatch(), seq)
    assert found.step == span and "sigmoid is applied twice" in found.message
    assert_sentence(found, "binary_cross_entropy")
    # a fresh model's logits within [0, 1] that leave as it learns are never named
    fresh = [_binary(t, unit=t < 64, loss=0.75, **ways) for t in range(0, 2 * span, 16)]
    assert run(LogitsMismatch(), fresh) == []


def test_logits_whose_loss_is_their_sigmoids_bce_had_a_sigmoid_in_the_step():
    seq = [
        _binary(t, unit=False, loss=0.8, logits=0.4, probs=float("nan"), sigmoid=0.8)
        for t in range(0, 48, 16)
    ]
    (found,) = run(LogitsMismatch(), seq)
    assert "written between" in found.message and "applied twice" in found.message


@pytest.mark.parametrize(
    ("unit", "loss"), [(False, 0.4), (True, 0.3), (False, 0.55)]
)  # logits to with_logits, probabilities to bce, neither (a weighted loss)
def test_a_binary_loss_taken_the_right_way_is_left_alone(unit, loss):
    ways = {"logits": 0.4, "probs": 0.3, "sigmoid": 0.8}
    seq = [_binary(t, unit=unit, loss=loss, **ways) for t in range(0, 512, 16)]
    assert run(LogitsMismatch(), seq) == []
