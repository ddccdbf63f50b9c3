"""Layer 1: loss_at_chance on synthetic losses and labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_resumes, assert_sentence, run

from stethoscope.detectors import LossAtChance, LossNotDecreasing
from stethoscope.observation import Observation

K = 3


def observe(losses, *, p=None, lr=None, every: int = 16, seed: int = 0) -> list[Observation]:
    """Sampled steps (every ``every``) of a run whose loss is ``losses[t]``, with a batch
    of 32 labels drawn with class frequencies ``p`` (balanced by default)."""
    rng = np.random.default_rng(seed)
    p = np.full(K, 1 / K) if p is None else np.asarray(p)
    out = []
    for t in range(0, len(losses), every):
        labels = rng.choice(len(p), size=32, p=p).astype(np.int64)
        out.append(Observation(step=t, loss=float(losses[t]), labels=labels, lr=lr))
    return out


def noisy(level: float, n: int, seed: int = 0) -> np.ndarray:
    return level * (1 + 0.01 * np.random.default_rng(seed).standard_normal(n))


def test_a_loss_at_ln_k_for_the_patience_is_a_warning_once():
    found = run(LossAtChance(), observe(noisy(math.log(K), 1200)))
    (f,) = found
    assert f.severity == "warning" and f.where == "loss"
    assert f.threshold == pytest.approx(math.log(K), rel=0.02)
    assert f.value == pytest.approx(math.log(K), rel=0.02)
    assert_sentence(f, "labels", "inputs", names=("chance",))


def test_a_fall_from_a_confident_start_to_chance_is_no_learning():
    """From 3.0 at initialisation down to ln K and stuck there: loss_not_decreasing sees
    the fall as progress; this detector sees where it ended."""
    losses = np.r_[np.linspace(3.0, math.log(K), 200), noisy(math.log(K), 800)]
    assert (
        run(LossNotDecreasing(), [Observation(step=t, loss=x) for t, x in enumerate(losses)]) == []
    )
    assert len(run(LossAtChance(), observe(losses))) == 1


def test_a_loss_below_chance_is_learning():
    losses = np.r_[noisy(math.log(K), 100), np.linspace(math.log(K), 0.3, 1100)]
    assert run(LossAtChance(), observe(losses)) == []


def test_chance_is_the_entropy_of_the_labels_not_ln_k_when_they_are_imbalanced():
    p = [0.9, 0.05, 0.05]
    entropy = -sum(q * math.log(q) for q in p)  # 0.394: predicting the frequencies
    assert len(run(LossAtChance(), observe(noisy(entropy, 1200), p=p))) == 1
    # at ln K the model does worse than the prior: not "at chance"
    assert run(LossAtChance(), observe(noisy(math.log(K), 1200), p=p)) == []


def test_a_warm_up_restarts_the_clock():
    losses = noisy(math.log(K), 1200)
    obs = observe(losses)
    for o in obs:  # the learning rate doubles every 64 steps until step 640
        o.lr = 1e-4 * 2 ** min(o.step // 64, 10)
    (f,) = run(LossAtChance(), obs)
    assert f.step >= 640 + 300


def test_too_few_labels_or_none_is_quiet():
    obs = [Observation(step=t, loss=math.log(K)) for t in range(0, 2000, 16)]
    assert run(LossAtChance(), obs) == []
    small = observe(noisy(math.log(K), 1200))
    for o in small:
        o.labels = o.labels[:1]  # 75 labels in all: fewer than 500
    assert run(LossAtChance(), small) == []


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="tolerance"):
        LossAtChance(tolerance=0)
    with pytest.raises(ValueError, match="patience"):
        LossAtChance(patience=0)


def test_it_resumes_from_a_checkpoint():
    obs = observe(noisy(math.log(K), 1200))
    assert len(assert_resumes(LossAtChance, obs, at=30)) == 1


def test_a_checkpoint_of_step_and_loss_pairs_continues_alike():
    """Checkpoints written before the span was kept as two lists held [step, loss] pairs."""
    obs = observe(noisy(math.log(K), 1200))
    d = LossAtChance()
    run(d, obs[:10])  # counted, not yet at chance for the patience
    old = d.state_dict()
    old["recent"] = [[s, x] for s, x in zip(old.pop("steps"), old.pop("losses"), strict=True)]
    restored = LossAtChance()
    restored.load_state_dict(old)
    assert restored.state_dict() == d.state_dict()
    assert run(restored, obs[10:]) == run(d, obs[10:]) != []


def test_labels_are_wanted_until_counted_then_no_longer_read():
    d = LossAtChance()
    assert d.wanting(0) == {"labels"}
    obs = observe(noisy(math.log(K), 1200))
    run(d, obs[:15])  # 480 labels: not yet 500
    assert d.wanting(16 * 15) == {"labels"}
    run(d, obs[15:16])
    assert d.wanting(16 * 16) == frozenset()
    assert d.state["chance"] == pytest.approx(math.log(K), rel=0.02)


def test_a_vocabulary_too_large_to_count_is_given_up():
    """A language model's tokens: 20 x K labels are never reached in MAX_READS batches,
    so the labels stop being read and the detector finishes."""
    rng = np.random.default_rng(0)
    d = LossAtChance()
    for t in range(LossAtChance.MAX_READS):
        assert not d.finished(t * 16)
        d.update(Observation(step=t * 16, loss=5.0, labels=rng.integers(0, 50257, 64)))
    assert d.state["chance"] is None and d.finished(LossAtChance.MAX_READS * 16)


def test_the_band_widens_with_the_uncertainty_of_imbalanced_labels():
    """500 labels of which 9 in 10 are class 0 fix chance only to within about 0.04
    nats: a loss 10% below that estimate is still "at chance", one 40% below is not."""
    p = [0.9, 0.05, 0.05]
    d = LossAtChance()
    run(d, observe(noisy(1.0, 1200), p=p)[:16])
    chance, se = d.state["chance"], d.state["chance_se"]
    assert 0.02 < se < 0.06
    assert len(run(LossAtChance(), observe(noisy(chance * 0.9, 1200), p=p))) == 1
    assert run(LossAtChance(), observe(noisy(chance * 0.6, 1200), p=p)) == []


def test_labels_that_are_not_integer_classes_are_not_counted():
    obs = observe(noisy(math.log(K), 1200))
    for o in obs:
        o.labels = o.labels.astype(np.float32)  # a regression target
    d = LossAtChance()
    assert run(d, obs) == [] and d.state["counts"] == []
    assert d.finished(16) and d.wanting(16) == {"labels"}  # finished: never planned again


def test_every_loss_counts_so_a_noisy_plateau_above_chance_is_not_at_chance():
    """Batch-32 losses with a 20% spread: a plateau 7% above ln K is told apart from chance
    with the 300 losses of the span (it was not, with one loss in 16), and a plateau at
    ln K is still at chance."""
    rng = np.random.default_rng(0)

    def run_every_step(level: float) -> list:
        d = LossAtChance()
        out = []
        for t in range(1200):
            labels = rng.integers(0, K, 32) if t % 16 == 0 else None
            loss = level * (1 + 0.2 * rng.standard_normal())
            out += d.update(Observation(step=t, loss=loss, labels=labels))
        return out

    assert run_every_step(1.07 * math.log(K)) == []
    assert len(run_every_step(math.log(K))) == 1


def test_batches_without_labels_stop_being_asked_for():
    """A run whose batches hold no labels: after MAX_READS asks the detector finishes,
    and nothing more is planned for it."""
    d = LossAtChance()
    for t in range(0, 16 * LossAtChance.MAX_READS, 16):
        assert d.wanting(t) == {"labels"}
        d.update(Observation(step=t, loss=1.0))
    assert d.finished(16 * LossAtChance.MAX_READS)
