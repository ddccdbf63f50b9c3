"""Layer 1: class_imbalance and unnormalized_input on synthetic labels and input statistics."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from _helpers import NAN, assert_resumes, assert_sentence, run

from stethoscope.detectors import ClassImbalance, UnnormalizedInput
from stethoscope.observation import Observation


# -- class_imbalance ------------------------------------------------------------------------------
def label_obs(batches) -> list[Observation]:
    """One observation per batch of integer labels, at steps 0, 1, 2 …"""
    return [Observation(step=t, labels=np.asarray(b, np.int64)) for t, b in enumerate(batches)]


def balanced(n: int = 40, k: int = 10, batch: int = 32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, k, batch) for _ in range(n)]


def skewed(n: int, major: int = 95, minor: int = 5, ignored: int = 0) -> list[np.ndarray]:
    """Batches of ``major`` 0s, ``minor`` 1s and ``ignored`` -100s (ignore_index)."""
    return [np.r_[[0] * major, [1] * minor, [-100] * ignored] for _ in range(n)]


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        pytest.param(skewed(10), (4, 19.0, 475, 25), id="95/5-after-500"),
        pytest.param(skewed(10, ignored=100), (4, 19.0, 475, 25), id="ignore-index-dropped"),
        pytest.param(
            [np.r_[[0] * 95, [2] * 5]] * 10, (4, math.inf, 475, 0), id="class-never-seen-is-0"
        ),
        pytest.param(
            [np.r_[[0] * 50, [2] * 50]] * 10, (4, math.inf, 250, 0), id="gap-in-0..k-1-counts-0"
        ),
        pytest.param([np.r_[[0] * 950, [1] * 50]], (0, 19.0, 950, 50), id="one-big-batch"),
        pytest.param(skewed(10, 100, 10), None, id="exactly-10x"),
        pytest.param(skewed(10, 90, 10), None, id="9x"),
        pytest.param(balanced(), None, id="balanced-10-classes"),
        pytest.param(skewed(4), None, id="400-labels-not-enough"),
        pytest.param([[0] * 100] * 10, None, id="one-class-only"),
        pytest.param([[]] * 10, None, id="empty-batches"),
        pytest.param([[-100] * 100] * 10, None, id="all-ignored"),
        pytest.param([], None, id="no-batch"),
    ],
)
def test_class_imbalance(batches, expected):
    found = run(ClassImbalance(), label_obs(batches))
    if expected is None:
        assert found == []
        return
    (f,) = found
    step, ratio, big, small = expected
    assert (f.step, f.detector, f.severity.value, f.where) == (
        step,
        "class_imbalance",
        "warning",
        "labels",
    )
    assert (f.value, f.threshold) == (ratio, 10.0)
    seen = sum(int(np.sum(np.asarray(b) >= 0)) for b in batches[: step + 1])
    assert f"Labels are imbalanced: class 0 has {big} of the first {seen} labels and " in (
        f.message
    )
    rare = "never appears" if small == 0 else f"has {small}"
    assert re.search(rf"class \d {rare} \(ratio {ratio:.3g} > 10\)", f.message), f.message
    assert_sentence(f, "balanced sampler", "shuffled", names=("labels",))


def test_class_imbalance_judges_once():
    batches = balanced(16, batch=32) + skewed(20)  # judged balanced at 512 labels, then skewed
    d = ClassImbalance()
    assert run(d, label_obs(batches)) == []
    assert d.state["judged"]
    assert run(ClassImbalance(), label_obs(skewed(20) + balanced(16))) != []


@pytest.mark.parametrize("seed", range(3))
def test_class_imbalance_quiet_on_balanced_labels(seed):
    assert run(ClassImbalance(), label_obs(balanced(40, seed=seed))) == []


def test_class_imbalance_many_classes_wait_for_20_per_class():
    # 1000 balanced classes: after 500 labels most classes have 0 or 1, so the ratio would be
    # infinite; the judgement waits for 20 x 1000 labels
    d = ClassImbalance()
    found = run(d, label_obs(balanced(19, k=1000, batch=1000)))
    assert found == [] and not d.state["judged"]
    assert d.update(Observation(step=19, labels=np.arange(1000))) == []
    assert d.state["judged"]
    assert 20_000 <= sum(d.state["counts"]) < 21_000


def test_class_imbalance_1000_classes_with_one_rare_class_fires_after_20k():
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 1000, 1000) for _ in range(20)]  # class 0 never drawn
    found = run(ClassImbalance(), label_obs(batches))
    assert [(f.step, f.value) for f in found] == [(19, math.inf)]
    assert "class 0 never appears" in found[0].message


def test_class_imbalance_custom_ratio_and_samples():
    d = ClassImbalance(ratio=3, samples=100)
    (f,) = run(d, label_obs(skewed(3, 80, 20)))
    assert (f.step, f.value, f.threshold) == (0, 4.0, 3.0)


def test_class_imbalance_state_round_trip_mid_count():
    batches = skewed(5) + balanced(5, k=2, batch=100)
    for at in (1, 2, 3, 6):
        found = assert_resumes(ClassImbalance, label_obs(batches), at)
        assert [(f.step, f.value) for f in found] == [(4, 19.0)]
    # fresh after the first 200 labels: judges 300 skewed and 200 balanced ones, ratio ~3
    assert run(ClassImbalance(), label_obs(batches[2:])) == []


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"ratio": 1}, "ratio=1"),
        ({"ratio": 0.5}, "ratio=0.5"),
        ({"ratio": 0}, "ratio=0"),
        ({"samples": 0}, "samples=0"),
        ({"samples": 1.5}, "samples=1.5"),
    ],
)
def test_class_imbalance_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        ClassImbalance(**kwargs)
    assert "class_imbalance" in str(info.value)


# -- unnormalized_input ---------------------------------------------------------------------------
def input_obs(batches, count: int = 32) -> list[Observation]:
    """One observation per batch of per-feature mean squares, ``count`` samples each."""
    return [
        Observation(step=t, input_sq=np.asarray(sq, float), input_count=count)
        for t, sq in enumerate(batches)
    ]


def mean_squares(x: np.ndarray, batch: int = 32) -> list[np.ndarray]:
    """Per-batch, per-feature mean of the squares of samples x features data."""
    return [np.mean(np.square(x[i : i + batch]), axis=0) for i in range(0, len(x), batch)]


def standardised(n: int = 256, features: int = 20, seed: int = 0) -> np.ndarray:
    """Student-t (3 degrees of freedom) data, standardised: every feature's RMS is exactly 1,
    values beyond ±5 are common."""
    x = np.random.default_rng(seed).standard_t(3, (n, features))
    return (x - x.mean(axis=0)) / x.std(axis=0)


def images(n: int = 320, top: float = 1.0, seed: int = 0) -> np.ndarray:
    """Per-channel values of 3-channel images, uniform in 0..``top``."""
    return np.random.default_rng(seed).uniform(0, top, (n, 3))


def one_feature_times(factor: float, index: int = 7, features: int = 20) -> np.ndarray:
    x = standardised(features=features)
    x[:, index] *= factor
    return x


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        pytest.param(
            mean_squares(images(top=255)), (7, "p90", 255 / math.sqrt(3), 5.0), id="pixels-0..255"
        ),
        pytest.param(
            mean_squares(one_feature_times(1000)),
            (7, "input[7]", 1000.0, 50.0),
            id="one-feature-x1000",
        ),
        pytest.param(
            mean_squares(one_feature_times(100)),
            (7, "input[7]", 100.0, 50.0),
            id="one-feature-x100",
        ),
        pytest.param(mean_squares(one_feature_times(20)), None, id="one-feature-x20-tolerated"),
        pytest.param(
            mean_squares(one_feature_times(1000, features=10)),
            (7, "p90", None, 5.0),
            id="one-in-ten-is-the-90th-percentile",
        ),
        pytest.param(
            [np.full(20, 1e-10)] * 10, (7, "input", 1e-5, 1 / 500), id="vanishingly-small"
        ),
        pytest.param(
            [np.full(20, 2e-6)] * 10, (7, "input", math.sqrt(2e-6), 1 / 500), id="just-below-1/500"
        ),
        pytest.param([np.full(20, 5e-6)] * 10, None, id="just-above-1/500"),
        pytest.param(mean_squares(standardised()), None, id="standardised-heavy-tailed"),
        pytest.param(mean_squares(images()), None, id="pixels-0..1"),
        pytest.param(mean_squares(images(top=1.0) * 4.5), None, id="rms-2.6"),
        pytest.param([np.full(20, 25.0)] * 10, None, id="rms-exactly-5"),
        pytest.param(mean_squares(images(n=224, top=255)), None, id="224-samples-not-enough"),
        pytest.param([], None, id="no-batch"),
        pytest.param([np.zeros(0)] * 10, None, id="no-feature"),
    ],
)
def test_unnormalized_input(batches, expected):
    found = run(UnnormalizedInput(), input_obs(batches))
    if expected is None:
        assert found == []
        return
    (f,) = found
    step, where, value, threshold = expected
    rms = np.sqrt(np.mean(np.asarray(batches[: step + 1]), axis=0))
    assert (f.step, f.detector, f.severity.value, f.threshold) == (
        step,
        "unnormalized_input",
        "warning",
        pytest.approx(threshold),
    )
    if where == "p90":  # the typical feature is off: ``where`` names the largest one
        few = rms.size < UnnormalizedInput.TYPICAL_FEATURES  # the typical one: the median
        assert f.where == f"input[{int(np.argmax(rms))}]"
        assert f.value == pytest.approx(np.percentile(rms, 50 if few else 90))
        label = "median" if few else "90th percentile"
        assert f"the typical ({label}) input feature has an RMS of" in f.message
    else:
        assert f.where == where
        assert f.value == pytest.approx(rms.max())
    if value is not None:
        assert f.value == pytest.approx(value, rel=0.1)
    assert f"over the first {32 * (step + 1)} samples" in f.message
    if where == "input":
        assert f.message.startswith("Inputs are vanishingly small")
        assert_sentence(f, "dividing by 255 twice", "standardise")
    else:
        assert f.message.startswith("Inputs are not normalised")
        assert_sentence(f, "standardise each feature", "scale images to 0..1")


def polynomial(degree: int, n: int = 320, seed: int = 0) -> np.ndarray:
    """x, x^2, ..., x^degree of x ~ N(0, 1): raw polynomial features (RMS 1, 1.7, 3.9, 10,
    31, 102, ...), as pytorch/examples' regression fits with one Linear."""
    x = np.random.default_rng(seed).standard_normal((n, 1))
    return np.concatenate([x**i for i in range(1, degree + 1)], axis=1)


def test_the_typical_of_few_features_is_their_median_not_their_largest():
    """Of four features the 90th percentile (8.3 here) lies between the two largest: it
    read x^4 alone and warned; their median (2.8) is the typical feature. The largest,
    10, is far under the 10 x scale bar of one outlying feature."""
    assert run(UnnormalizedInput(), input_obs(mean_squares(polynomial(4)))) == []


@pytest.mark.parametrize(
    ("data", "label"),
    [
        pytest.param(polynomial(6), "median", id="x-to-x^6-median-7"),
        pytest.param(images(top=255), "median", id="three-raw-channels"),
        pytest.param(one_feature_times(1000, features=10), "90th percentile", id="ten-features"),
    ],
)
def test_the_typical_feature_is_named_by_its_statistic(data, label):
    (f,) = run(UnnormalizedInput(), input_obs(mean_squares(data)))
    assert f"the typical ({label}) input feature has an RMS of" in f.message


def test_a_few_features_of_which_one_is_far_off_are_still_named():
    """Among four, one raw feature 100x (RMS 100): the median is fine, the largest is not."""
    x = standardised(features=4)
    x[:, 2] *= 100
    (f,) = run(UnnormalizedInput(), input_obs(mean_squares(x)))
    assert f.where == "input[2]" and "input feature 2 has an RMS of 100" in f.message


def test_unnormalized_input_names_the_outlying_feature():
    (f,) = run(UnnormalizedInput(), input_obs(mean_squares(one_feature_times(1000))))
    assert "input feature 7 has an RMS of 1e+03" in f.message


@pytest.mark.parametrize("seed", range(3))
def test_unnormalized_input_quiet_on_standardised_features_whatever_their_tails(seed):
    x = standardised(2000, seed=seed)
    assert np.mean(np.abs(x) > 3) > 0.01  # far more beyond ±3 than a normal has
    assert run(UnnormalizedInput(), input_obs(mean_squares(x))) == []


def test_unnormalized_input_skips_nonfinite_batches():
    batches = mean_squares(images(top=255))
    batches.insert(3, np.array([NAN, 1.0, 1.0]))
    batches.insert(5, np.array([np.inf, 1.0, 1.0]))
    d = UnnormalizedInput()
    found = run(d, input_obs(batches))
    assert [f.step for f in found] == [9]  # two batches later than without them


def test_unnormalized_input_skips_batches_without_samples():
    d = UnnormalizedInput()
    assert run(d, input_obs(mean_squares(images(top=255)), count=0)) == []
    assert d.state["count"] == 0


def test_unnormalized_input_a_different_input_starts_over():
    batches = [np.full(3, 1e4)] * 7 + [np.full(5, 1e4)] * 8
    assert [f.step for f in run(UnnormalizedInput(), input_obs(batches))] == [14]


def test_unnormalized_input_judges_once():
    batches = mean_squares(images()) + mean_squares(images(top=255))
    d = UnnormalizedInput()
    assert run(d, input_obs(batches)) == []
    assert d.state["judged"]


def test_unnormalized_input_single_input_is_named_input():
    (f,) = run(UnnormalizedInput(), input_obs([[255.0**2 / 3]] * 8))
    assert (f.where, f.value) == ("input", pytest.approx(255 / math.sqrt(3)))


@pytest.mark.parametrize("sq", [255.0**2 / 3, 1e-10])
def test_unnormalized_input_single_input_message_reads_well(sq):
    (f,) = run(UnnormalizedInput(), input_obs([[sq]] * 8))
    assert "input input" not in f.message


def test_unnormalized_input_custom_samples_judges_after_the_first_batch():
    (f,) = run(UnnormalizedInput(samples=32), input_obs(mean_squares(images(top=255))))
    assert f.step == 0


def test_unnormalized_input_state_round_trip_mid_count():
    batches = [np.full(3, 1.0)] * 4 + [np.full(3, 200.0)] * 6
    for at in (2, 4, 6):
        found = assert_resumes(UnnormalizedInput, input_obs(batches), at)
        assert [(f.step, round(f.value, 3)) for f in found] == [(7, 10.025)]
    assert run(UnnormalizedInput(), input_obs(batches[4:])) == []  # fresh: 192 samples only


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"scale": 0}, "scale=0"),
        ({"scale": -5.0}, "scale=-5.0"),
        ({"samples": 0}, "samples=0"),
        ({"samples": 2.5}, "samples=2.5"),
    ],
)
def test_unnormalized_input_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        UnnormalizedInput(**kwargs)
    assert "unnormalized_input" in str(info.value)


# -- a language model's labels --------------------------------------------------------------------
def zipf_tokens(n: int, vocab: int = 200, batch: int = 700, seed: int = 0) -> list[np.ndarray]:
    """Batches of next-token targets drawn from a Zipfian vocabulary (word frequencies):
    the rarest of 200 tokens has 1/200 of the commonest's share, or none in 4200."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, vocab + 1)
    return [rng.choice(vocab, size=batch, p=p / p.sum()) for _ in range(n)]


def test_a_language_models_tokens_are_no_classes_to_balance():
    """Targets a model embeds and predicts alike (an LSTM language model's flattened
    next tokens): Zipfian by nature. class_imbalance took them for classes."""
    from stethoscope.advice import TrainingSetup

    batches = label_obs(zipf_tokens(8))
    (classifier,) = run(ClassImbalance(), batches)  # the same counts, from a classifier
    assert classifier.severity == "warning" and "weight the loss by class" in classifier.message
    d = ClassImbalance()
    d.setup = TrainingSetup(vocabulary=200)
    assert not d.applies() and d.finished(0)  # the monitor never runs it, and says why
    why = d.not_applying_because()
    assert "same 200 tokens" in why and "language model" in why


def test_a_language_models_text_order_is_no_unshuffled_data():
    """A language model's batches follow its text (a recurrent one carries its state
    across them): here each holds a few tokens of its own, blocks to a classifier's eye."""
    from stethoscope.advice import TrainingSetup
    from stethoscope.detectors import UnshuffledData

    rng = np.random.default_rng(0)
    batches = label_obs([rng.choice(rng.choice(200, 2), 64) for _ in range(40)])
    (classifier,) = run(UnshuffledData(), batches)
    assert "run in blocks" in classifier.message
    d = UnshuffledData()
    d.setup = TrainingSetup(vocabulary=200)
    assert not d.applies() and d.finished(0)
    assert "in the text's order" in d.not_applying_because()


def test_the_monitor_says_once_which_detectors_sit_a_language_model_out():
    import warnings

    from stethoscope.advice import TrainingSetup
    from stethoscope.detectors import default_detectors
    from stethoscope.engine import Monitor
    from stethoscope.sinks.base import RunContext

    monitor = Monitor(detectors=default_detectors(), sinks=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.start(RunContext(framework="test", setup=TrainingSetup(vocabulary=200)))
    said = [str(w.message) for w in caught if "language model" in str(w.message)]
    assert len(said) == 1 and "class_imbalance and unshuffled_data" in said[0]
    assert monitor.schedule.idle("class_imbalance") and monitor.schedule.idle("unshuffled_data")
    assert not monitor.schedule.idle("loss_at_chance")  # a unigram model is no language model


def test_unnormalized_input_words_fit_a_linear_model():
    """Raw polynomial features of a linear regression: no layer saturates there, the
    problem is ill-conditioned (the old words said "the first layer starts saturated")."""
    x = np.linspace(-3, 3, 256)
    sq = np.array([np.mean(x**2), np.mean(x**4), np.mean(x**6), np.mean(x**8)])
    (found,) = run(UnnormalizedInput(), [Observation(step=0, input_sq=sq, input_count=256)])
    assert "so the first layer starts saturated" not in found.message
    assert (
        "ill-conditioned" in found.message and "in a linear model as in a deep one" in found.message
    )
    assert_sentence(found, "standardise each feature")
