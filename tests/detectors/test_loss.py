"""Layer 1: loss_spike, loss_not_decreasing and unstable_loss on synthetic loss curves."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _helpers import (
    NAN,
    alarms,
    assert_actionable,
    batch8_loss,
    decaying_loss,
    loss_obs,
    make_obs,
    run,
    steps,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from stethoscope.detectors import LossNotDecreasing, LossSpike, UnstableLoss
from stethoscope.detectors._stats import SortedWindow, median, push, robust_sigma

SEEDS = range(5)


def noisy(seed: int = 0, n: int = 400, level: float = 2.3, sigma: float = 0.1) -> np.ndarray:
    """A flat loss with multiplicative lognormal noise."""
    return level * np.random.default_rng(seed).lognormal(0.0, sigma, n)


def v_shape(seed: int | None = None) -> np.ndarray:
    """2.3 → 1.0 over 200 steps, then +0.02 per step: back above the start by step ~265."""
    t = np.arange(700)
    x = np.where(t < 200, 2.3 - 1.3 * t / 200, 1.0 + 0.02 * (t - 200))
    if seed is not None:
        x = x * np.random.default_rng(seed).lognormal(0.0, 0.1, len(x))
    return x


def warmup_run(seed: int, n: int = 1000, sigma: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """LR rises linearly from 0 over 500 steps; the loss follows the cumulative LR.

    The loss is flat for the first ~100 steps and its best 50-step mean has dropped ~6% by
    step 200. With ``sigma=0.1`` that is within 2 standard errors of the windowed means on
    about half the seeds; with ``sigma=0.05`` it is significant on every seed, and only the
    LR clock keeps ``loss_not_decreasing`` quiet (see the test below).
    """
    lr = 1e-3 * np.minimum(np.arange(n) / 500, 1.0)
    rng = np.random.default_rng(seed)
    return 2.3 * np.exp(-np.cumsum(lr) / 0.5) * rng.lognormal(0, sigma, n), lr


def negative_decreasing(seed: int) -> np.ndarray:
    """A Gaussian NLL-like loss going -1 → -3 with additive noise."""
    t = np.arange(1500)
    return -1 - 2 * (1 - np.exp(-t / 300)) + np.random.default_rng(seed).normal(0, 0.1, len(t))


def converged_then_up_1_5x(seed: int) -> np.ndarray:
    """Converges 2.3 → 0.005 in 500 steps, then drifts up to 0.0075 (healthy: docs/detectors.md)."""
    level = np.concatenate(
        [2.3 * (0.005 / 2.3) ** (np.arange(500) / 499), 0.005 * (1 + 0.5 * np.arange(500) / 499)]
    )
    return level * np.random.default_rng(seed).lognormal(0.0, 0.3, len(level))


# -- healthy traps: no warning, no error, on several seeds -----------------------------------------
TRAPS = {
    "decaying-hard-batches": lambda s: loss_obs(decaying_loss(s)),
    "batch8": lambda s: loss_obs(batch8_loss(s)),
    "batch8-decaying": lambda s: loss_obs(batch8_loss(s, tau=1000)),
    "lr-warmup": lambda s: loss_obs(*warmup_run(s)),
    "negative-decreasing": lambda s: loss_obs(negative_decreasing(s)),
    "converged-rises-1.5x": lambda s: loss_obs(converged_then_up_1_5x(s)),
}


# Regressions of d6cb240. Before it, with a 20-step warm-up, envelope factor 2 and memory 1000:
# - loss_spike fired right after warm-up on "decaying-hard-batches" in 13/100 seeds (seed 3:
#   step 22) and on batch-8 mixture noise in 4/100 (all at steps 20-26);
# - loss_not_decreasing fired at step 200 on "batch8-decaying" in 12/100 seeds (seed 4: 1.7%
#   progress), because batch-8 noise moves a 50-step mean by ~9% of a 10% bar.
# "decaying-hard-batches" models a healthy run that must stay silent (docs/detectors.md: "a loss
# converging to ~0.005 (hard batches jump 10x there)"; LossSpike's docstring): lognormal(0.3)
# minibatch noise and 1% hard batches at 2x. It is not quiet on every seed: 1/100 false alarm
# remains; seeds 0-4 are not among them by measurement, not by choice (the trap kept its seeds).
# The rate is pinned over 100 seeds in test_loss_spike_false_alarm_rate_on_2x_hard_batches.
def _trap_cases():
    for cls in (LossSpike, LossNotDecreasing, UnstableLoss):
        for trap in TRAPS:
            if (cls.name, trap) == ("loss_not_decreasing", "batch8"):
                continue  # a stationary loss *is* not decreasing: it may fire
            yield pytest.param(cls, trap, id=f"{cls.name}-{trap}")


@functools.cache
def _trap(trap: str, seed: int):
    return TRAPS[trap](seed)  # shared by the three detectors; none of them mutates it


@functools.cache
def _alarm_steps(detector: type, trap: str, seed: int) -> tuple[int, ...]:
    """The steps of the warnings and errors ``detector`` raises on a trap (cached: the
    false-alarm rate below reuses the five trap seeds)."""
    observations = _trap(trap, seed) if seed in SEEDS else TRAPS[trap](seed)
    return tuple(f.step for f in alarms(run(detector(), observations)))


@pytest.mark.parametrize(("detector", "trap"), list(_trap_cases()))
def test_loss_detectors_quiet_on_healthy_traps(detector, trap):
    for seed in SEEDS:
        assert _alarm_steps(detector, trap, seed) == (), f"seed {seed}"


@pytest.mark.parametrize("seed", SEEDS)
def test_lr_warmup_trap_would_fire_without_the_lr_clock(seed):
    # at sigma=0.05 the ~6% progress by step 200 is significant (2 standard errors of the
    # windowed means ~3% of the initial loss): without the LR clock it fires, with it it waits
    loss, lr = warmup_run(seed, sigma=0.05)
    (f,) = run(LossNotDecreasing(), loss_obs(loss))
    assert (f.step, f.severity.value) == (200, "warning")
    assert 0.04 < f.value < 0.08
    assert run(LossNotDecreasing(), loss_obs(loss, lr=lr)) == []


# -- loss_spike: false alarms and recall on the harsh synthetic curve ---------------------------
def test_loss_spike_false_alarm_rate_on_2x_hard_batches():
    """A documented trade-off, not a bug: before the envelope has seen one, a hard batch on 30%
    (lognormal(0.3)) noise can reach 3-5x the median, indistinguishable from a 5x spike.
    Measured: 1/100 seeds fires (28 at step 385); with 3x hard batches 6/100, with none 0/100
    (with tail=3: 4/100 and 19/100). The bar: at most 3/100 with 2x hard batches."""
    fired = {}
    for seed in range(100):
        if found := _alarm_steps(LossSpike, "decaying-hard-batches", seed):
            fired[seed] = found
    assert len(fired) <= 3, fired


def test_loss_spike_catches_a_10x_spike_on_the_noisy_decaying_curve():
    # the same curve (lognormal(0.3) noise, no hard batches), one batch 10x at step 600; only
    # the first 650 steps are fed: a spike cannot change what came before it. Measured: 48/50,
    # the exact step and nothing else (seeds 14 and 28 miss it).
    caught = []
    for seed in range(50):
        x = decaying_loss(seed, hard=1.0)[:650]  # the 2000-step curve, cut
        x[600] *= 10
        caught.append(steps(alarms(run(LossSpike(), loss_obs(x)))) == [(600, "warning")])
    assert sum(caught) >= 45, [s for s, ok in enumerate(caught) if not ok]


# -- loss_spike -----------------------------------------------------------------------------------
def _spiked(at: int, by: float, n: int = 400, seed: int = 0) -> np.ndarray:
    x = noisy(seed, n)
    x[at] = by * 2.3  # a multiple of the level, not of that step's noise
    return x


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        pytest.param(_spiked(300, 10), [300], id="10x-at-300"),
        pytest.param(_spiked(300, 3), [300], id="3x-at-300"),
        pytest.param(_spiked(300, 1.8), [], id="1.8x-below-ratio"),
        pytest.param(_spiked(32, 10), [32], id="first-judged-step"),
        pytest.param(_spiked(31, 10), [], id="during-warmup"),
        pytest.param(
            np.where(np.isin(np.arange(400), [150, 300]), 23.0, noisy(1)),
            [150, 300],
            id="two-spikes-baseline-unpoisoned",
        ),
        pytest.param(np.where(np.arange(400) == 100, NAN, _spiked(300, 10)), [300], id="nan"),
        pytest.param(noisy(0, 1), [], id="single-step"),
        pytest.param([1.0] * 40 + [1.5], [], id="constant-then-1.5x"),
        pytest.param([1.0] * 40 + [1.99], [], id="constant-then-just-below-2x"),
        pytest.param([1.0] * 40 + [2.5], [40], id="constant-then-2.5x"),
        pytest.param([-1.0] * 40 + [5.0], [40], id="negative-constant-then-positive"),
    ],
)
def test_loss_spike_fires_at_the_spike(losses, expected):
    losses = np.asarray(losses, dtype=float)
    found = run(LossSpike(), loss_obs(losses))
    assert steps(found) == [(s, "warning") for s in expected]
    for f in found:
        assert f.where == "loss"
        assert f.value == losses[f.step]
        center = median([x for x in losses[max(0, f.step - 128) : f.step] if np.isfinite(x)])
        assert f"{f.value - center:.3g} above the recent median {center:.4g}" in f.message
        assert f.threshold == pytest.approx(_spike_threshold(losses[: f.step]))
        assert f.value > f.threshold
        assert_actionable(f, "inspect that batch", "learning rate")


def _spike_threshold(before: np.ndarray) -> float:
    """The documented bar, from the detector's state after ``before``: median + largest term
    (z=6 robust sigmas, tail=4 envelopes (x sqrt(300 / jumps seen) while under 300), min_jump=0.1
    of the initial loss, ratio 2 - 1 = 1 median, not below 0)."""
    d = LossSpike()
    run(d, loss_obs(before))
    win, st = d.state["window"], d.state
    center = median(win)
    terms = (
        6 * robust_sigma(win, center),
        4 * st["envelope"] * max(1.0, 300 / st["seen"]) ** 0.5,
        0.1 * abs(st["initial"]),
        max(center, 0.0),
    )
    return center + max(terms)


@pytest.mark.parametrize(
    ("hard", "spike", "expected"),
    [
        pytest.param(None, 2.5, [300], id="quiet-run-flags-2.5x"),
        pytest.param(None, 3.0, [300], id="quiet-run-flags-3x"),
        pytest.param(1.9, 2.5, [], id="after-1.9x-hard-batches-2.5x-is-healthy"),
        # tail=4: a jump 2.2x, or 3.3x, the largest healthy one (0.9 levels) is still healthy
        pytest.param(1.9, 3.0, [], id="after-1.9x-hard-batches-3x-is-healthy"),
        pytest.param(1.9, 4.0, [], id="after-1.9x-hard-batches-4x-is-healthy"),
        pytest.param(1.9, 4.5, [300], id="after-1.9x-hard-batches-4.5x-is-a-spike"),
    ],
)
def test_loss_spike_envelope_learns_the_runs_healthy_jumps(hard, spike, expected):
    # the envelope at step 300: the 0.9 x 2.3 jump of the hard batch at 275, decayed by
    # (1 - 1/300)^25, ~1.93; the bar is 4x that above the median ~2.27, a loss of ~9.99 = 4.3x
    x = noisy(0, 400, sigma=0.05)
    if hard is not None:
        x[25::50] = hard * 2.3  # below the 2x ratio bar: these widen the envelope (25: in warm-up)
    x[300] = spike * 2.3
    assert steps(run(LossSpike(), loss_obs(x))) == [(s, "warning") for s in expected]


@pytest.mark.parametrize(("hard", "expected"), [(None, [40]), (1.9, [])])
def test_loss_spike_learns_healthy_jumps_during_warmup(hard, expected):
    x = noisy(0, 100, sigma=0.05)
    if hard is not None:
        x[[10, 20]] = hard * 2.3  # both inside the 32-step warm-up, after its first 5 steps
    x[40] = 2.5 * 2.3
    assert steps(run(LossSpike(), loss_obs(x))) == [(s, "warning") for s in expected]


@pytest.mark.parametrize(
    ("at", "by", "expected"),
    [
        # the envelope learnt one 0.46 jump (step 20) and ~30 tiny ones: at step 60 its bar is
        # 4 x sqrt(300 / 55) = 9.3 envelopes, so a 6-envelope jump (a loss of ~5.1) is quiet
        pytest.param(60, 5.06 / 2.3, [], id="young-envelope-6x-is-healthy"),
        pytest.param(60, 10.0, [60], id="young-envelope-10x-still-a-spike"),
        pytest.param(360, 5.06 / 2.3, [360], id="mature-envelope-flags-the-same-loss"),
    ],
)
def test_loss_spike_a_young_envelope_asks_for_more(at, by, expected):
    x = noisy(0, 400, sigma=0.05)
    x[20] = 1.2 * 2.3
    x[at] = by * 2.3
    assert steps(run(LossSpike(), loss_obs(x))) == [(s, "warning") for s in expected]


def test_loss_spike_checkpoint_without_the_jump_count_is_mature():
    d = LossSpike()
    run(d, loss_obs(noisy(0, 100)))
    old = {k: v for k, v in d.state_dict().items() if k != "seen"}
    resumed = LossSpike()
    resumed.load_state_dict(old)
    assert resumed.state["seen"] == 300 and d.state["seen"] == 100 - 5


def test_loss_spike_repeated_spikes_stay_visible():
    x = noisy(0, 600, sigma=0.05)
    x[50::50] = 4 * 2.3  # after the warm-up (which learns every jump): spikes never widen it
    assert [s for s, _ in steps(run(LossSpike(), loss_obs(x)))] == list(range(50, 600, 50))


def test_loss_spike_on_a_noisy_negative_loss():
    x = negative_decreasing(0)
    x[800] = 2.0
    assert steps(run(LossSpike(), loss_obs(x))) == [(800, "warning")]


def test_loss_spike_scales_its_floor_to_where_the_run_started():
    """A run that learns its task in its first steps: near 1.4 for 8 steps, then down to
    0.002 by step 30. The median of its first 32 losses (0.09) is far below the start;
    that of its first 8 is the start, and a hard batch at 0.06 (4% of it) at step 60 is
    no spike (it was one with the first 32). A batch back at 70% of the start still is."""
    rng = np.random.default_rng(0)
    x = np.r_[
        np.linspace(1.4, 1.1, 8),
        np.geomspace(1.0, 0.002, 22),
        0.002 * rng.lognormal(0.0, 0.3, 300),
    ]
    x[60] = 0.06
    assert run(LossSpike(), loss_obs(x)) == []
    x[120] = 1.0
    assert steps(run(LossSpike(), loss_obs(x))) == [(120, "warning")]


def test_loss_spike_does_not_count_nonfinite_losses_towards_warmup():
    losses = [NAN, float("inf")] * 10 + [1.0] * 31 + [10.0]
    assert run(LossSpike(), loss_obs(losses)) == []  # only 31 finite losses before the spike
    losses = [NAN, float("inf")] * 10 + [1.0] * 32 + [10.0]
    assert steps(run(LossSpike(), loss_obs(losses))) == [(52, "warning")]


def test_loss_spike_sets_suspect_below_the_warning_bar():
    d = LossSpike()
    run(d, loss_obs(noisy(0, 300)))
    center = median(d.state["window"])
    assert d.update(make_obs(300, loss=1.75 * center)) == []  # past half the 2x bar, below it
    assert d.suspect is not None
    d.update(make_obs(301, loss=center))
    assert d.suspect is None


def test_loss_spike_constant_zero_loss_then_a_jump():
    # regression of d6cb240: the message divided by the median (ZeroDivisionError)
    (f,) = run(LossSpike(), loss_obs([0.0] * 40 + [0.5]))
    assert (f.step, f.severity.value, f.value, f.threshold) == (40, "warning", 0.5, 0.0)
    assert "0.5 above the recent median 0:" in f.message


# -- loss_not_decreasing --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("losses", "lr", "expected"),
    [
        pytest.param(noisy(0, 300), 1e-7, [200], id="flat-2.3-lr-1e-7"),
        pytest.param(noisy(1, 300), 1e-7, [200], id="flat-2.3-lr-1e-7-seed1"),
        pytest.param(noisy(0, 700), 1e-7, [200, 400, 600], id="again-every-patience"),
        pytest.param(noisy(0, 300), None, [200], id="flat-without-lr"),
        pytest.param([1.0] * 300, 1e-7, [200], id="constant"),
        pytest.param([-1.0] * 300, 1e-7, [200], id="negative-constant"),
        pytest.param(
            np.where(np.arange(300) % 10 == 3, NAN, 1) * noisy(0, 300), 1e-7, [200], id="with-nans"
        ),
        pytest.param(
            noisy(0, 500, sigma=0.05),
            np.where(np.arange(500) < 150, 1e-4, 2.5e-4),
            [350],
            id="lr-doubled-restarts-clock",
        ),
        pytest.param(
            noisy(0, 500, sigma=0.05),
            np.where(np.arange(500) < 150, 1e-4, 1.9e-4),
            [200, 400],
            id="lr-raised-less-than-2x",
        ),
        pytest.param(noisy(0, 199), 1e-7, [], id="short-of-patience"),
        pytest.param([2.3], 1e-7, [], id="single-step"),
        pytest.param([0.0] * 300, 1e-7, [], id="constant-zero-is-converged"),
        pytest.param(
            np.linspace(2.3, 1.7, 300) * np.random.default_rng(0).lognormal(0, 0.02, 300),
            1e-4,
            [],
            id="slow-real-progress",
        ),
        pytest.param(decaying_loss(0, 600), 1e-3, [], id="decaying"),
    ],
)
def test_loss_not_decreasing(losses, lr, expected):
    losses = np.asarray(losses, dtype=float)
    found = run(LossNotDecreasing(), loss_obs(losses, lr=lr))
    assert steps(found) == [(s, "warning") for s in expected]
    for f in found:
        assert f.where == "loss"
        assert f.threshold == 0.1
        assert f.value < 0.1
        assert_actionable(f, "learning rate")
        assert "200 steps" in f.message


@pytest.mark.parametrize(("a", "expected"), [(0.0, [200]), (0.16, [200]), (0.18, [])])
def test_loss_not_decreasing_needs_the_missing_progress_to_be_significant(a, expected):
    # blocks of 50 at 2.0, 50 at 1.9, 200 at 1.95, each +-a alternating: every 50-step mean is
    # exact, so progress = 5%. The last window's robust sigma is 1.4826 a, and 2 standard errors
    # of a difference of 50-step means are 2 x 1.4826 a x sqrt(2/50) / 2.0 = 0.297 a: it is
    # "no progress" only while 0.05 + 0.297 a < 0.1, i.e. a < 0.169
    level = np.concatenate([np.full(50, 2.0), np.full(50, 1.9), np.full(200, 1.95)])
    losses = level + a * np.where(np.arange(300) % 2 == 0, 1.0, -1.0)
    found = run(LossNotDecreasing(), loss_obs(losses))
    assert steps(found) == [(s, "warning") for s in expected]
    assert all(f.value == pytest.approx(0.05) for f in found)


def test_loss_not_decreasing_value_is_the_progress_of_the_best_window():
    losses = np.concatenate([np.full(50, 2.0), np.full(50, 1.9), np.full(200, 1.95)])
    (f,) = run(LossNotDecreasing(), loss_obs(losses))
    assert f.step == 200
    assert f.value == pytest.approx(0.05)  # best 50-step mean 1.9 vs initial 2.0


# -- unstable_loss --------------------------------------------------------------------------------
def test_unstable_loss_warns_then_errors_on_a_climb_back_above_the_start():
    x = v_shape()
    found = run(UnstableLoss(), loss_obs(x))
    # level = median of the last 50 = the loss 24.5 steps back. initial = level at step 49
    # = 2.14; the rise bar is 0.4 x 2.14 = 0.856 above the best level, crossed at step 274,
    # so the warning comes 20 steps later; the level passes 2 x 2.14 at step 389: error at 408.
    assert steps(found) == [(293, "warning"), (408, "error")]
    warning, error = found
    initial = median(list(x[:50]))
    assert warning.value == pytest.approx(median(list(x[244:294])))
    assert warning.value > warning.threshold
    assert error.threshold == pytest.approx(2 * initial)
    assert error.value > error.threshold
    assert {f.where for f in found} == {"loss"}
    assert_actionable(warning, "lower")
    assert_actionable(error, "learning rate", "checkpoint")


@pytest.mark.parametrize("seed", range(3))
def test_unstable_loss_noisy_climb_within_a_window(seed):
    found = run(UnstableLoss(), loss_obs(v_shape(seed)))
    assert [f.severity.value for f in found] == ["warning", "error"]
    assert 285 <= found[0].step <= 305
    assert 398 <= found[1].step <= 418


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        pytest.param(
            np.where(np.arange(600) % 10 == 0, 10, 1) * 2.3 * np.exp(-np.arange(600) / 300),
            [],
            id="single-spikes-leave-the-level",
        ),
        pytest.param(
            np.where(
                np.arange(600) < 200,
                -1 - 2 * np.arange(600) / 200,
                -3 + 0.02 * np.arange(-200, 400),
            ),
            [(277, "warning")],
            id="negative-climb-warns-never-diverges",
        ),
        pytest.param([1.0] * 300, [], id="constant"),
        pytest.param([0.0] * 300, [], id="constant-zero"),
        pytest.param(np.where(np.arange(300) % 7 == 0, NAN, 1) * noisy(0, 300), [], id="nans"),
        pytest.param([5.0], [], id="single-step"),
        pytest.param(np.linspace(1, 3, 49), [], id="shorter-than-window"),
    ],
)
def test_unstable_loss_edge_cases(losses, expected):
    assert steps(run(UnstableLoss(), loss_obs(losses))) == expected


def test_unstable_loss_rise_must_last_patience_steps():
    # best level 1.0, then 40 steps at 2.0: the 50-step median is 2.0 while the block fills
    # more than half the window, steps 125-163 (at exactly half, 1.5, the MAD noise bar holds)
    x = np.concatenate([np.full(100, 1.0), np.full(40, 2.0), np.full(100, 1.0)])
    assert run(UnstableLoss(patience=40), loss_obs(x)) == []
    assert steps(run(UnstableLoss(patience=39), loss_obs(x))) == [(163, "warning")]


@settings(max_examples=80, deadline=None)
@given(
    xs=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300),
    size=st.integers(1, 64),
    cut=st.integers(0, 300),
)
def test_sorted_window_follows_its_window(xs, size, cut):
    # the running median equals the median of the window, also after the window is replaced
    # (a reset or a restored checkpoint) mid-way
    sw, window, plain = SortedWindow(), [], []
    for i, x in enumerate(xs):
        if i == cut:
            window = list(window)  # what load_state_dict does: a new list, same values
        sw.push(window, x, size)
        push(plain, x, size)
        assert window == plain
        assert sw.median(window) == median(plain)


# -- a policy-gradient loss: both signs, no scale -------------------------------------------------
def actor_critic_loss(seed: int, n: int = 400) -> np.ndarray:
    """An actor-critic's loss on a cart-pole, as measured: the critic's smooth-L1 (>= 0)
    plus the actor's -log_prob x advantage (either sign), summed over an episode whose
    length grows from ~20 to ~80 steps; 3-25% of the losses negative, the first by step
    25, its level 2.9 at first and 12 by step 180 (unstable_loss called that a
    divergence)."""
    rng = np.random.default_rng(seed)
    length = 20 + 60 * np.minimum(np.arange(n) / 180, 1.0)
    return length * (
        0.15 + 0.1 * rng.standard_normal(n)
    ) ** 2 * 5 + length * 0.05 * rng.standard_normal(n)


def reinforce_loss(seed: int, n: int = 400) -> np.ndarray:
    """REINFORCE with normalised returns: sum over the episode of -log_prob x return, ~80%
    negative, its magnitude growing with the episode's length (tens to thousands)."""
    rng = np.random.default_rng(seed)
    length = 20 * np.exp(np.arange(n) / 100)
    return length * (rng.standard_normal(n) - 0.8)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "loss", [actor_critic_loss, reinforce_loss], ids=["actor-critic", "reinforce"]
)
@pytest.mark.parametrize("cls", [UnstableLoss, LossSpike, LossNotDecreasing], ids=lambda c: c.name)
def test_a_policy_gradient_loss_is_left_alone_and_said_once(cls, loss, seed):
    x = loss(seed)
    first = int(np.argmax((x < 0) != (x[0] < 0)))  # the first loss of the other sign
    found = run(cls(), loss_obs(x))
    assert alarms(found) == []
    (said,) = found
    assert said.severity == "info" and said.step == first and said.where == "loss"
    assert "took both signs" in said.message and "policy-gradient" in said.message


def test_the_actor_critic_loss_was_called_a_divergence():
    # what the rule makes of it without the signs: an error, as a new user's trial met
    x = np.abs(actor_critic_loss(0))
    assert "error" in [f.severity.value for f in run(UnstableLoss(), loss_obs(x))]


def test_a_loss_that_crosses_zero_as_it_learns_is_still_judged():
    """A Gaussian NLL: 1.0 down to -3 (zero crossed at step ~90, past the first window),
    then a climb back to -1.2: still a rise, and still named."""
    t = np.arange(600)
    x = np.where(t < 200, 1.0 - 4.0 * t / 200, -3 + 0.006 * (t - 200))
    x = x + np.random.default_rng(0).normal(0, 0.02, len(t))
    found = run(UnstableLoss(), loss_obs(x))
    assert [f.severity.value for f in found] == ["warning"]
