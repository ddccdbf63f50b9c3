"""Layer 1: large_updates, small_updates, frozen_weights, poor_initialization and all_zero on
synthetic weight, update and gradient norms."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from _helpers import (
    GRAD_SHAPE,
    NAN,
    assert_actionable,
    assert_resumes,
    assert_sentence,
    make_obs,
    run,
    steps,
)

from stethoscope.advice import TrainingSetup, small_epsilon
from stethoscope.detectors import (
    AllZero,
    FrozenWeights,
    LargeUpdates,
    PoorInitialization,
    SmallUpdates,
)
from stethoscope.observation import Observation

#: Weight norms of layer0.weight, layer0.bias, layer1.weight, layer1.bias.
WEIGHTS = np.array([5.0, 0.5, 3.0, 0.3])
HEALTHY = 1e-3  # the update ratio of a healthy step (CS231n)


def ratio_obs(
    step: int,
    ratio: float,
    *,
    first: float = HEALTHY,
    bias: float = HEALTHY,
    loss: float | None = 2.3,
    lr: float | None = 1e-3,
) -> Observation:
    """An observation whose layer1.weight moved by ``ratio`` x its norm, layer0.weight by
    ``first`` x and the biases by ``bias`` x theirs."""
    ratios = np.array([first, bias, ratio, bias])
    return make_obs(
        step, loss=loss, lr=lr, grads=GRAD_SHAPE, weights=WEIGHTS, updates=WEIGHTS * ratios
    )


# -- large_updates --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        pytest.param(
            [HEALTHY] * 5 + [2.0] * 3 + [HEALTHY] * 5, [(7, "warning")], id="2x-three-steps"
        ),
        pytest.param(
            [2.0] * 5, [(2, "warning"), (3, "warning"), (4, "warning")], id="2x-warns-each-step"
        ),
        pytest.param([HEALTHY, 20.0, HEALTHY], [(1, "error")], id="20x-error-at-once"),
        pytest.param([2.0, 20.0, HEALTHY], [(1, "error")], id="error-needs-no-streak"),
        pytest.param([2.0, 2.0, HEALTHY, 2.0, 2.0], [], id="streak-broken"),
        pytest.param([1.0] * 5, [], id="exactly-1-is-not-above"),
        pytest.param([10.0], [], id="exactly-the-error-threshold-once"),
        pytest.param([0.5] + [HEALTHY] * 9, [], id="adam-first-step"),
        pytest.param([3.0] + [HEALTHY] * 9, [], id="one-large-step-alone"),
        pytest.param(np.geomspace(5e-3, 3e-4, 50), [], id="healthy-decay-while-converging"),
        pytest.param([], [], id="empty"),
    ],
)
def test_large_updates_fires_at_the_expected_steps(ratios, expected):
    found = run(LargeUpdates(), [ratio_obs(t, r) for t, r in enumerate(ratios)])
    assert steps(found) == expected
    for f in found:
        assert (f.detector, f.where) == ("large_updates", "layer1.weight")
        assert f.value == pytest.approx(ratios[f.step])
        assert f.threshold == (10.0 if f.severity.value == "error" else 1.0)
        assert f"changed layer1.weight by {ratios[f.step]:.3g}x its own norm" in f.message
        assert "at a learning rate of 0.001" in f.message
        assert_actionable(f, "lower it", "warm-up")


def test_large_updates_names_the_worst_matrix_and_ignores_biases():
    obs = [ratio_obs(t, 3.0, first=5.0, bias=100.0) for t in range(3)]
    (f,) = run(LargeUpdates(), obs)
    assert (f.step, f.where, f.value) == (2, "layer0.weight", 5.0)


def test_large_updates_zero_initialised_matrix_is_healthy():
    # a zero-initialised layer1.weight: norm 0 before it first moves (skipped), then a step
    # from zero is exactly its own size (ratio 1.0, not > 1), then ordinary steps
    zero = make_obs(0, grads=GRAD_SHAPE, weights=[5.0, 0.5, 0.0, 0.3], updates=[5e-3, 0, 0, 0])
    first = make_obs(1, grads=GRAD_SHAPE, weights=[5.0, 0.5, 0.01, 0.3], updates=[5e-3, 0, 0.01, 0])
    later = [ratio_obs(t, HEALTHY) for t in range(2, 10)]
    for obs in ([zero] * 3, [zero, first, first, first, *later]):
        assert run(LargeUpdates(), obs) == []


def test_large_updates_nonfinite_norms_are_skipped_without_breaking_the_streak():
    d = LargeUpdates()
    nan = make_obs(2, grads=GRAD_SHAPE, weights=[NAN, 0.5, 3.0, 0.3], updates=[1, 1, NAN, 1])
    found = run(d, [ratio_obs(0, 2.0), ratio_obs(1, 2.0), nan, ratio_obs(3, 2.0)])
    assert steps(found) == [(3, "warning")]


def test_large_updates_without_a_learning_rate_says_nothing_about_it():
    (f,) = run(LargeUpdates(), [ratio_obs(0, 50.0, lr=None)])
    assert "learning rate of" not in f.message and "learning rate is far too high" in f.message


def test_large_updates_under_an_epsilon_small_for_float16_names_it_not_the_learning_rate():
    d = LargeUpdates()
    risk = small_epsilon("Adam", "epsilon", 1e-7, ["float16"])
    d.setup = TrainingSetup(framework="keras", small_epsilon=risk)
    (f,) = run(d, [ratio_obs(0, 50.0)])
    assert "Adam's epsilon=1e-07 lets such a step be up to 2441x the usual one" in f.message
    assert "far too high" not in f.message and "set epsilon=1e-4" in f.message
    assert d.current_advice() == "set a larger epsilon (1e-4)"


def test_large_updates_suspects_a_single_large_step():
    d = LargeUpdates()
    d.update(ratio_obs(0, 2.0))
    assert d.suspect == "update ratio 2 in layer1.weight"
    d.update(ratio_obs(1, HEALTHY))
    assert d.suspect is None


def test_large_updates_state_round_trip_mid_streak():
    ratios = [HEALTHY] * 3 + [2.0] * 4 + [HEALTHY] + [2.0] * 3
    seq = [ratio_obs(t, r) for t, r in enumerate(ratios)]
    for at in (2, 4, 5, 9):
        found = assert_resumes(LargeUpdates, seq, at)
        assert steps(found) == [(5, "warning"), (6, "warning"), (10, "warning")]


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"error_threshold": 0.5}, "error_threshold=0.5"),
        ({"threshold": 20.0}, "error_threshold=10.0"),
        ({"threshold": 0}, "threshold=0"),
        ({"patience": 0}, "patience=0"),
    ],
)
def test_large_updates_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        LargeUpdates(**kwargs)
    assert "large_updates" in str(info.value)


def test_large_updates_equal_thresholds_are_accepted():
    d = LargeUpdates(threshold=2.0, error_threshold=2.0)
    assert steps(run(d, [ratio_obs(0, 3.0)])) == [(0, "error")]


# -- small_updates --------------------------------------------------------------------------------
def small_run(ratios, losses=2.3, lrs=1e-3, every: int = 16) -> list[Observation]:
    """One observation every ``every`` steps; scalars repeat, both matrices move by ``ratio``."""
    n = len(ratios)
    losses = np.broadcast_to(np.asarray(losses, float), (n,))
    lrs = np.broadcast_to(np.asarray(lrs, float), (n,))
    return [
        ratio_obs(every * i, r, first=r, loss=x, lr=lr)
        for i, (r, x, lr) in enumerate(zip(ratios, losses, lrs, strict=True))
    ]


TINY = 1e-7


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        pytest.param(small_run([TINY] * 10), [64], id="tiny-from-the-start-every-16"),
        pytest.param(small_run([TINY] * 100, every=1), [50], id="every-step-min-steps"),
        pytest.param(
            small_run([HEALTHY] * 5 + [TINY] * 10), [144], id="tiny-later-counts-from-then"
        ),
        pytest.param(small_run([TINY] * 3, every=100), [200], id="sparse-needs-patience"),
        pytest.param(small_run([TINY] * 2, every=100), [], id="two-samples-are-not-patience"),
        pytest.param(small_run([TINY] * 3 + [HEALTHY] + [TINY] * 3), [], id="streak-broken"),
        pytest.param(
            small_run([TINY] * 5 + [HEALTHY] + [TINY] * 5), [64, 160], id="again-after-recovery"
        ),
        pytest.param(small_run([1e-5] * 10), [], id="exactly-the-threshold"),
        pytest.param(small_run([TINY]), [], id="one-step"),
        pytest.param([], [], id="empty"),
    ],
)
def test_small_updates_fires_at_the_expected_steps(observations, expected):
    found = run(SmallUpdates(), observations)
    assert [f.step for f in found] == expected
    for f in found:
        assert (f.detector, f.severity.value, f.where) == ("small_updates", "warning", None)
        assert (f.value, f.threshold) == (pytest.approx(TINY), 1e-5)
        assert "at a learning rate of 0.001" in f.message
        assert re.search(r"since step \d+, while the loss is still high", f.message)
        assert_sentence(f, "raise the learning rate", "scheduler")


FAR = 1e-9  # Adam at lr 1e-9 moves an MLP's weights by ~2e-9 of their norm (the fault suite)


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        pytest.param(small_run([FAR] * 100, every=1), [10], id="every-step-far-steps"),
        pytest.param(small_run([FAR] * 10), [32], id="every-16-needs-patience-too"),
        pytest.param(
            small_run([FAR] * 8 + [1e-6] + [FAR] * 20, every=1), [19], id="far-clock-restarts"
        ),
        pytest.param(small_run([1e-6] * 100, every=1), [50], id="between-the-bars-min-steps"),
        pytest.param(
            small_run([FAR] * 100, 2.3, np.geomspace(1e-10, 1e-3, 100), every=1),
            [],
            id="far-during-a-warmup",
        ),
        pytest.param(
            small_run([FAR] * 100, [2.3] + [1.0] * 99, every=1), [], id="far-but-converged"
        ),
    ],
)
def test_small_updates_far_below_the_bar_needs_fewer_steps(observations, expected):
    found = run(SmallUpdates(), observations)
    assert [f.step for f in found] == expected
    for f in found:
        assert "since step" in f.message


def test_small_updates_message_names_the_step_it_started():
    (f,) = run(SmallUpdates(), small_run([HEALTHY] * 5 + [TINY] * 10))
    assert f.step == 144 and "since step 80," in f.message


def test_small_updates_judges_the_median_matrix():
    # one matrix barely moves, the other moves healthily: the median of two is their mean
    seq = [ratio_obs(16 * i, TINY, first=3e-5) for i in range(10)]
    assert run(SmallUpdates(), seq) == []
    seq = [ratio_obs(16 * i, TINY, first=TINY, bias=1.0) for i in range(10)]
    assert [f.step for f in run(SmallUpdates(), seq)] == [64]  # biases are not judged


def cosine(n: int, peak: float = 1e-3) -> np.ndarray:
    return 0.5 * peak * (1 + np.cos(np.pi * np.arange(n) / (n - 1)))


def warmup(n: int, length: int, peak: float = 1e-3) -> np.ndarray:
    return peak * np.minimum(np.arange(n) / length, 1.0)


SMALL_TRAPS = {
    # the update ratio decays 5e-3 → 3e-4 while the loss converges 2.3 → 0.05
    "converging": lambda: small_run(np.geomspace(5e-3, 3e-4, 125), np.geomspace(2.3, 0.05, 125)),
    # a cosine schedule anneals the LR (and the ratio with it) to exactly 0; the loss stays high
    "cosine-to-zero": lambda: small_run(HEALTHY * cosine(125) / 1e-3, 2.3, cosine(125)),
    # step decay x0.001 at step 1000
    "step-decay": lambda: small_run(
        np.where(np.arange(125) < 63, HEALTHY, 1e-6), 2.0, np.where(np.arange(125) < 63, 1e-3, 1e-6)
    ),
    # tiny updates once the loss is below half its initial level: a converged run
    "converged": lambda: small_run([HEALTHY] * 5 + [TINY] * 50, [2.3] * 5 + [1.0] * 50),
    # linear LR warm-up from 0 over 2000 steps, the ratio following the LR up to 1e-3
    "warm-up-2000": lambda: small_run(
        warmup(125 * 16, 2000)[::16], 2.3, warmup(125 * 16, 2000)[::16]
    ),
    "warm-up-2000-every-step": lambda: small_run(
        warmup(300, 2000), 2.3, warmup(300, 2000), every=1
    ),
}


@pytest.mark.parametrize("trap", SMALL_TRAPS)
def test_small_updates_quiet_on_healthy_traps(trap):
    assert run(SmallUpdates(), SMALL_TRAPS[trap]()) == []


@pytest.mark.parametrize("every", [1, 16])
def test_small_updates_quiet_during_a_long_lr_warmup(every):
    # a 10000-step linear warm-up (BERT's length) to a healthy ratio of 1e-3: the ratio is below
    # 1e-5 for the first 100 steps, while the loss has not moved yet
    lr = warmup(400, 10_000)[::every]
    assert run(SmallUpdates(), small_run(lr, 2.3, lr, every=every)) == []


def test_small_updates_fires_on_a_learning_rate_far_too_low_at_its_peak():
    # the same schedule never annealed, at a constant LR of 1e-6: the ratio stays at 1e-6
    found = run(SmallUpdates(), small_run([1e-6] * 10, 2.3, 1e-6))
    assert [f.step for f in found] == [64]
    assert "at a learning rate of 1e-06" in found[0].message


def test_small_updates_without_lr_or_loss_still_judges():
    seq = [ratio_obs(16 * i, TINY, first=TINY, loss=None, lr=None) for i in range(10)]
    (f,) = run(SmallUpdates(), seq)
    assert f.step == 64 and "learning rate of" not in f.message


def test_small_updates_nonfinite_loss_is_not_converged():
    seq = small_run([TINY] * 10, [2.3] + [NAN] * 9)
    assert [f.step for f in run(SmallUpdates(), seq)] == [64]


def test_small_updates_all_zero_weights_give_no_ratio():
    seq = [
        make_obs(
            16 * i, loss=2.3, lr=1e-3, grads=GRAD_SHAPE, weights=np.zeros(4), updates=np.zeros(4)
        )
        for i in range(10)
    ]
    assert run(SmallUpdates(), seq) == []


def test_small_updates_state_round_trip_keeps_the_initial_loss_and_peak_lr():
    # the loss halves and the LR is annealed only relative to what came before the checkpoint
    seq = small_run([HEALTHY] * 5 + [TINY] * 10, [2.3] * 5 + [1.5] * 10, [1e-3] * 5 + [6e-4] * 10)
    for at in (3, 6, 9, 12):
        assert [f.step for f in assert_resumes(SmallUpdates, seq, at)] == [144]
    fresh = SmallUpdates()  # without the first 5 observations 1.5 is the initial loss
    assert [f.step for f in run(fresh, seq[5:])] == [144]
    seq = small_run([HEALTHY] * 5 + [TINY] * 10, [2.3] * 5 + [1.0] * 10)
    for at in (3, 6, 9):
        assert assert_resumes(SmallUpdates, seq, at) == []
    assert [f.step for f in run(SmallUpdates(), seq[5:])] == [144]  # fresh: fires


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"loss_fraction": 1.0}, "loss_fraction=1.0"),
        ({"loss_fraction": 0}, "loss_fraction=0"),
        ({"min_steps": 0}, "min_steps=0"),
        ({"far_threshold": 1e-4}, "far_threshold=0.0001"),
        ({"far_steps": 51}, "far_steps=51"),
        ({"far_steps": 0}, "far_steps=0"),
        ({"threshold": -1e-5}, "threshold=-1e-05"),
    ],
)
def test_small_updates_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        SmallUpdates(**kwargs)
    assert "small_updates" in str(info.value)


# -- frozen_weights -------------------------------------------------------------------------------
def frozen_obs(
    step: int,
    frozen: tuple[int, ...] = (),
    *,
    grads=GRAD_SHAPE,
    updates=None,
    unoptimized: tuple[str, ...] = (),
    lr: float | None = 1e-3,
) -> Observation:
    """Every parameter moves by 1e-3 of its norm except those at the indices ``frozen``."""
    upd = WEIGHTS * HEALTHY if updates is None else np.asarray(updates, float)
    upd = upd.copy()
    upd[list(frozen)] = 0.0
    obs = make_obs(step, lr=lr, grads=grads, weights=WEIGHTS, updates=upd)
    obs.unoptimized = unoptimized
    return obs


@pytest.mark.parametrize(
    ("frozen", "expected"),
    [
        pytest.param([(2,)] * 10, [(2, "layer1.weight", 1.0)], id="frozen-from-the-start-once"),
        pytest.param([()] * 5 + [(2,)] * 5, [(7, "layer1.weight", 1.0)], id="frozen-later"),
        pytest.param([(0, 1)] * 3, [(2, "layer0.weight", 2.0)], id="two-at-once-name-the-first"),
        pytest.param([(2,)] * 2 + [()] + [(2,)] * 2, [], id="streak-broken"),
        pytest.param([(2,)] * 2, [], id="below-patience"),
        pytest.param([(2,)], [], id="one-step"),
        pytest.param([(0, 1, 2, 3)] * 10, [], id="lr-0-for-everything"),
        pytest.param(
            [(0, 1, 2, 3)] * 5 + [()] * 5 + [(0, 1, 2, 3)] * 5, [], id="warm-up-start-schedule-end"
        ),
        pytest.param(
            [(2,)] * 3 + [(0, 1, 2, 3)] * 3 + [(0,)] * 3,
            [(2, "layer1.weight", 1.0), (8, "layer0.weight", 1.0)],
            id="all-still-steps-do-not-count",
        ),
        pytest.param([], [], id="empty"),
    ],
)
def test_frozen_weights_fires_at_the_expected_steps(frozen, expected):
    # a step where nothing moves runs at a learning rate of 0 (a warm-up's start, a
    # schedule's end, every group at 0): at 1e-3 it is the rule below's
    seq = [frozen_obs(t, fz, lr=0.0 if len(fz) == 4 else 1e-3) for t, fz in enumerate(frozen)]
    found = run(FrozenWeights(), seq)
    assert [(f.step, f.where, f.value) for f in found] == expected
    for f in found:
        assert (f.detector, f.severity.value) == ("frozen_weights", "warning")
        assert f.message.startswith(f"Parameter {f.where}")
        assert "learning rate of the first group: 0.001" in f.message
        assert_actionable(f, "param_groups", "scheduler")


def test_frozen_weights_counts_the_others_frozen_at_the_same_step():
    (f,) = run(FrozenWeights(), [frozen_obs(t, (0, 2)) for t in range(3)])
    assert "Parameter layer0.weight and 1 other parameter(s) did not change on 3 sampled" in (
        f.message
    )


def test_frozen_weights_a_starved_parameter_is_not_frozen():
    grads = GRAD_SHAPE.copy()
    grads[2] = 0.0  # no gradient reached it: all_zero's or dead_relu's finding
    assert run(FrozenWeights(), [frozen_obs(t, (2,), grads=grads) for t in range(10)]) == []


def test_frozen_weights_without_gradients_still_judges():
    obs = [frozen_obs(t, (2,)) for t in range(3)]
    for o in obs:
        o.grad_norm = None
    assert [f.step for f in run(FrozenWeights(), obs)] == [2]


def test_frozen_weights_an_unmeasured_update_neither_breaks_nor_extends_the_streak():
    # NaN: not measured this step (a large model's snapshots take turns through parameters)
    upd = WEIGHTS * HEALTHY
    nan = upd.copy()
    nan[2] = NAN
    seq = [frozen_obs(0, (2,)), frozen_obs(1, (2,)), frozen_obs(2, updates=nan)]
    assert run(FrozenWeights(), seq) == []
    found = run(FrozenWeights(), [*seq, frozen_obs(3, (2,))])
    assert [f.step for f in found] == [3]


@pytest.mark.parametrize(
    ("unoptimized", "expected"),
    [
        pytest.param([("head.weight",)], [(0, "head.weight", 1.0)], id="one-at-once"),
        pytest.param([("head.weight", "head.bias")] * 5, [(0, "head.weight", 2.0)], id="said-once"),
        pytest.param(
            [("head.weight",), ("head.weight",), ("head.weight", "extra.weight")],
            [(0, "head.weight", 1.0), (2, "extra.weight", 1.0)],
            id="a-new-one-later",
        ),
    ],
)
def test_frozen_weights_unoptimized_parameters_fire_once_at_once(unoptimized, expected):
    seq = [frozen_obs(t, unoptimized=u) for t, u in enumerate(unoptimized)]
    found = run(FrozenWeights(), seq)
    assert [(f.step, f.where, f.value) for f in found] == expected
    for f in found:
        assert (f.detector, f.severity.value) == ("frozen_weights", "warning")
        assert f"are in no optimizer ({f.value:.0f}: {f.where}" in f.message
        assert_sentence(f, "requires_grad=False", names=(f.where,))


def test_frozen_weights_unoptimized_fires_even_when_nothing_moves():
    (f,) = run(FrozenWeights(), [frozen_obs(0, (0, 1, 2, 3), unoptimized=("head.weight",))])
    assert f.where == "head.weight"


def test_frozen_weights_unoptimized_lists_five_and_counts_the_rest():
    names = tuple(f"block{i}.weight" for i in range(7))
    (f,) = run(FrozenWeights(), [frozen_obs(0, unoptimized=names)])
    assert (
        "(7: block0.weight, block1.weight, block2.weight, block3.weight, block4.weight and 2 more)"
        in (f.message)
    )


def test_frozen_weights_unoptimized_and_frozen_at_the_same_step():
    seq = [frozen_obs(t, (2,), unoptimized=("head.weight",) if t == 2 else ()) for t in range(3)]
    assert [(f.step, f.where) for f in run(FrozenWeights(), seq)] == [
        (2, "head.weight"),
        (2, "layer1.weight"),
    ]


def test_frozen_weights_state_round_trip_mid_streak():
    seq = [frozen_obs(0, unoptimized=("head.weight",))]
    seq += [frozen_obs(t, (2,)) for t in range(1, 6)] + [frozen_obs(t, (0,)) for t in range(6, 10)]
    for at in (1, 2, 3, 7):
        found = assert_resumes(FrozenWeights, seq, at)
        assert [(f.step, f.where) for f in found] == [
            (0, "head.weight"),
            (3, "layer1.weight"),
            (8, "layer0.weight"),
        ]


def test_frozen_weights_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("patience=0")) as info:
        FrozenWeights(patience=0)
    assert "frozen_weights" in str(info.value)


def stepped_nothing(
    step: int,
    *,
    idle: tuple[str, ...] = ("head.weight (requires_grad=False)",),
    unoptimized: tuple[str, ...] = ("backbone.weight", "backbone.bias"),
) -> Observation:
    """A step whose optimizer stepped no parameter with a gradient: no norm at all, what it
    holds instead (``idle``), and the parameters in no optimizer that got gradients."""
    empty = np.zeros(0)
    obs = Observation(step=step, lr=1e-3, loss=1.4, weight_norm=empty, update_norm=empty)
    obs.prev_weight_norm, obs.idle_held, obs.unoptimized = empty, idle, unoptimized
    return obs


def test_frozen_weights_nothing_trains_is_an_error_at_once_naming_both_sides():
    found = run(FrozenWeights(), [stepped_nothing(t) for t in range(5)])
    assert [(f.step, f.severity.value, f.where, f.value) for f in found] == [
        (0, "error", "backbone.weight", 2.0)
    ]  # once, and the parameters in no optimizer are not named again
    (f,) = found
    assert f.message.startswith("Nothing trains: the optimizer stepped no parameter")
    assert "it holds only head.weight (requires_grad=False), while the 2" in f.message
    assert "(backbone.weight, backbone.bias) are in no optimizer" in f.message
    assert_sentence(f, "filter(lambda p: p.requires_grad", names=("backbone.weight",))


@pytest.mark.parametrize(
    "obs",
    [
        pytest.param(stepped_nothing(0, unoptimized=()), id="nothing-gets-a-gradient-elsewhere"),
        pytest.param(stepped_nothing(0, idle=()), id="no-optimizer-stepped"),
    ],
)
def test_frozen_weights_nothing_trains_needs_both_sides(obs):
    found = run(FrozenWeights(), [obs])
    # a batch skipped on purpose (training_step returned None) gives no gradient anywhere
    assert [f.severity.value for f in found] == (["warning"] if obs.unoptimized else [])


def unmoved_obs(
    step: int,
    *,
    grads=GRAD_SHAPE,
    lr: float | None = 1e-2,
    loss: float = 1.4,
    dtypes: tuple[str, ...] = (),
) -> Observation:
    """Every parameter measured, none moved at all."""
    obs = make_obs(step, lr=lr, loss=loss, grads=grads, weights=WEIGHTS, updates=np.zeros(4))
    obs.dtypes = dtypes
    return obs


@pytest.mark.parametrize(
    ("kwargs", "adaptive", "said"),
    [
        pytest.param({"grads": np.zeros(4)}, False, "their gradients are exactly zero", id="zero"),
        pytest.param({}, False, "although their gradients are not zero", id="sgd-not-applied"),
        pytest.param({"lr": 1e-3}, True, "although their gradients", id="adam-not-applied"),
    ],
)
def test_frozen_weights_nothing_moving_at_a_learning_rate_is_not_a_small_one(
    kwargs, adaptive, said
):
    seq = [unmoved_obs(t, **kwargs) for t in range(6)]
    frozen, small = FrozenWeights(), SmallUpdates(far_steps=1, min_steps=1, patience=1)
    for d in (frozen, small):
        d.setup = TrainingSetup(framework="lightning", adaptive=adaptive)
    found = run(frozen, seq)
    assert [(f.step, f.severity.value, f.where) for f in found] == [(2, "warning", "layer0.weight")]
    assert said in found[0].message and "larger learning rate" not in found[0].message[:80]
    assert found[0].message.startswith("The optimizer moved none of the 4 parameters")
    assert run(small, seq) == []  # was: "raise the learning rate (try 10-100x)"


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"lr": 0.0}, id="lr-0"),
        pytest.param({"lr": None}, id="lr-unknown"),
        pytest.param({"lr": 1e-12}, id="so-small-that-float32-rounds-it-away"),
        pytest.param({"loss": 0.0}, id="a-loss-of-0"),
        pytest.param({"dtypes": ("bfloat16",) * 4}, id="16-bit-weights-round"),
    ],
)
def test_frozen_weights_nothing_moving_is_left_to_the_other_rules(kwargs):
    assert run(FrozenWeights(), [unmoved_obs(t, **kwargs) for t in range(6)]) == []


def test_small_updates_still_judges_a_learning_rate_float32_rounds_away():
    seq = [unmoved_obs(t, lr=1e-12) for t in range(12)]
    (f,) = run(SmallUpdates(), seq)
    assert "raise the learning rate" in f.message


@pytest.mark.parametrize("detector", [LargeUpdates, SmallUpdates])
def test_update_ratios_sit_out_a_line_search_and_say_why(detector):
    d = detector()
    assert d.applies() and d.not_applying_because() == ""
    d.setup = TrainingSetup(framework="lightning", line_search="LBFGS")
    assert not d.applies()
    assert d.not_applying_because().startswith("LBFGS takes each step as a search")


# -- poor_initialization --------------------------------------------------------------------------
#: A 784-256-256-10 MLP: weight matrices with their fan-in, biases with NaN.
INIT_NAMES = ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
FAN_IN = np.array([784, NAN, 256, NAN, 256, NAN])
FAN_OUT = np.array([256, NAN, 256, NAN, 10, NAN])
INIT_NUMEL = np.array([784 * 256, 256, 256 * 256, 256, 256 * 10, 10])
MATS = [0, 2, 4]

DEFAULT = [1 / 3] * 3  # PyTorch's kaiming_uniform_(a=√5): U(±1/√fan_in), var·fan_in = 1/3
HE = [2.0] * 3
GLOROT = list(2 * FAN_IN[MATS] / (FAN_IN[MATS] + FAN_OUT[MATS]))  # var = 2 / (fan_in + fan_out)
RAW_NORMAL = list(FAN_IN[MATS])  # N(0, 1): var·fan_in = fan_in


def init_obs(
    step: int = 0,
    scales=DEFAULT,
    *,
    rms=None,
    kinds=None,
    loss: float | None = None,
    fan_in: np.ndarray | None = FAN_IN,
) -> Observation:
    """The weights of the MLP with var(w)·fan_in = ``scales`` per matrix (biases 0.1), and the
    RMS of the outputs of layers ``rms`` (kinds ``"layer"`` unless given)."""
    norms = np.full(len(INIT_NAMES), 0.1)
    norms[MATS] = np.sqrt(INIT_NUMEL[MATS] * np.asarray(scales, float) / FAN_IN[MATS])
    rms = None if rms is None else np.asarray(rms, float)
    n = 0 if rms is None else len(rms)
    return Observation(
        step=step,
        loss=loss,
        names=INIT_NAMES,
        numel=INIT_NUMEL,
        is_matrix=np.array([True, False] * 3),
        weight_norm=norms,
        fan_in=fan_in,
        act_names=tuple(f"fc{i}" for i in range(n)),
        act_kinds=tuple(kinds or ["layer"] * n),
        act_rms=rms,
    )


@pytest.mark.parametrize(
    ("scales", "expected"),
    [
        pytest.param(DEFAULT, None, id="pytorch-default-1/3"),
        pytest.param(HE, None, id="he-2"),
        pytest.param(GLOROT, None, id="glorot"),
        pytest.param([784 * 1e-4, 256 * 1e-4, 256 * 1e-4], None, id="0.01-randn"),
        pytest.param([9.99, 1.01e-3, 1.0], None, id="just-within-the-bounds"),
        pytest.param([0.0, 1.0, 1.0], None, id="all-zero-left-to-all_zero"),
        pytest.param(RAW_NORMAL, ("fc0.weight", 784.0, 10.0), id="randn-fan-in-784"),
        pytest.param([1 / 3, 1 / 3, 256], ("fc2.weight", 256.0, 10.0), id="randn-last-layer"),
        pytest.param([784 * 1e-8, 1.0, 1.0], ("fc0.weight", 784e-8, 1e-3), id="std-1e-4"),
        pytest.param([20.0, 1e-5, 1.0], ("fc1.weight", 1e-5, 1e-3), id="most-extreme-named"),
    ],
)
def test_poor_initialization_weight_scale(scales, expected):
    found = run(PoorInitialization(), [init_obs(0, scales)])
    if expected is None:
        assert found == []
        return
    (f,) = found
    where, value, threshold = expected
    assert (f.step, f.detector, f.severity.value) == (0, "poor_initialization", "warning")
    assert (f.where, f.threshold) == (where, threshold)
    assert f.value == pytest.approx(value)
    i = INIT_NAMES.index(where)
    std = math.sqrt(value / FAN_IN[i])
    assert f"{where} starts with values of std {std:.3g} for a fan-in of {FAN_IN[i]:.0f}" in (
        f.message
    )
    assert ("above" if value > 10 else "below") in f.message
    assert_sentence(f, "kaiming_normal_", "xavier_normal_", names=(where,))


@pytest.mark.parametrize(
    ("rms", "kinds", "expected"),
    [
        # a default-init 4-layer MLP on standardised inputs: the RMS shrinks ~15x with depth
        pytest.param([1.0, 0.25, 0.1, 1 / 15], None, None, id="default-init-15x"),
        pytest.param([1.0, 10.0, 100.0, 1000.0], None, None, id="exactly-1000x"),
        pytest.param([1.0, 10.0, 100.0, 5000.0], None, ("fc3", 5000.0, "explode"), id="5000x"),
        pytest.param([1.0, 1e-2, 1e-4], None, ("fc2", 1e4, "die out"), id="dying-1e4x"),
        pytest.param(
            [1.0, 50.0, 1e-4, 0.5], None, ("fc2", 1e4, "die out"), id="most-extreme-named"
        ),
        pytest.param(
            [1.0, 1e5, 1.0], ["layer", "tanh", "layer"], None, id="tanh-inputs-not-judged"
        ),
        pytest.param([1.0, 0.0, NAN, 2.0], None, None, id="zero-and-nan-skipped"),
        pytest.param([1e-6], None, None, id="one-layer"),
        pytest.param([], None, None, id="no-layer"),
    ],
)
def test_poor_initialization_activation_ratio(rms, kinds, expected):
    found = run(PoorInitialization(), [init_obs(0, rms=rms, kinds=kinds)])
    if expected is None:
        assert found == []
        return
    (f,) = found
    where, value, word = expected
    assert (f.step, f.severity.value, f.where, f.threshold) == (0, "warning", where, 1000.0)
    assert f.value == pytest.approx(value)
    assert f"Activations {word} with depth at step 0" in f.message
    assert "against 1 in fc0" in f.message
    assert_actionable(f, "He for ReLU", "normalisation layers", "residual")


LN10 = math.log(10)


@pytest.mark.parametrize(
    ("num_classes", "losses", "expected"),
    [
        pytest.param(10, [2.3, 2.31, 2.29], None, id="chance-level"),
        pytest.param(10, [4.6, 4.6, 4.6], None, id="just-below-2-ln-k"),
        pytest.param(10, [20.0, 21.0, 19.0], (2, 20.0, 2 * LN10), id="confidently-wrong"),
        pytest.param(10, [20.0, 2.3, 2.3], None, id="median-of-three"),
        pytest.param(10, [NAN, 20.0, 21.0, 19.0], (3, 20.0, 2 * LN10), id="nan-skipped"),
        pytest.param(2, [1.8] * 3, (2, 1.8, math.log(2) + 1), id="binary-ln2+1"),
        pytest.param(2, [1.6] * 3, None, id="binary-below-ln2+1"),
        pytest.param(1000, [13.0] * 3, None, id="1000-classes-below-2-ln-k"),
        pytest.param(1000, [14.0] * 3, (2, 14.0, 2 * math.log(1000)), id="1000-classes"),
        pytest.param(None, [20.0, 21.0, 19.0], None, id="no-num-classes-no-loss-check"),
        pytest.param(10, [20.0, 21.0], None, id="two-losses-not-enough"),
        pytest.param(10, [2.3, 2.3, 2.3, 20.0, 20.0, 20.0], None, id="judged-once-on-the-first"),
        pytest.param(10, [2.3] * 8 + [20.0] * 5, None, id="after-steps-not-judged"),
    ],
)
def test_poor_initialization_initial_loss(num_classes, losses, expected):
    seq = [Observation(step=t, loss=x) for t, x in enumerate(losses)]
    found = run(PoorInitialization(num_classes=num_classes), seq)
    if expected is None:
        assert found == []
        return
    (f,) = found
    step, value, threshold = expected
    assert (f.step, f.severity.value, f.where) == (step, "warning", "loss")
    assert (f.value, f.threshold) == (pytest.approx(value), pytest.approx(threshold))
    assert f"far above chance level ln({num_classes}) = " in f.message
    assert_sentence(f, "initialise the last layer smaller", names=("loss",))


def test_poor_initialization_judges_nothing_after_steps():
    late = init_obs(10, RAW_NORMAL, rms=[1.0, 5000.0], loss=50.0)
    seq = [late, *(Observation(step=11 + t, loss=50.0) for t in range(3))]
    assert run(PoorInitialization(num_classes=10), seq) == []
    found = run(PoorInitialization(num_classes=10, steps=20), [late, *seq[1:]])
    assert [(f.step, f.where) for f in found] == [(10, "fc0.weight"), (10, "fc1"), (12, "loss")]


def test_poor_initialization_judges_each_check_once_on_its_first_observation():
    seq = [init_obs(0, DEFAULT, rms=[1.0, 0.5])] + [
        init_obs(t, RAW_NORMAL, rms=[1.0, 5000.0]) for t in range(1, 5)
    ]
    assert run(PoorInitialization(), seq) == []
    seq = [init_obs(t, RAW_NORMAL, rms=[1.0, 5000.0]) for t in range(5)]
    assert [f.step for f in run(PoorInitialization(), seq)] == [0, 0]


def test_poor_initialization_waits_for_the_probes_it_needs():
    # weights without fan-ins (no layer with units seen yet) and no activations: not judged yet
    seq = [init_obs(0, RAW_NORMAL, fan_in=None), init_obs(1, RAW_NORMAL, rms=[1.0, 5000.0])]
    assert [(f.step, f.where) for f in run(PoorInitialization(), seq)] == [
        (1, "fc0.weight"),
        (1, "fc1"),
    ]


def test_poor_initialization_state_round_trip_between_losses():
    seq = [init_obs(0, DEFAULT, loss=20.0), init_obs(1, DEFAULT, loss=21.0)]
    seq += [Observation(step=t, loss=19.0) for t in range(2, 6)]
    for at in (1, 2, 3):
        found = assert_resumes(PoorInitialization, seq, at, num_classes=10)
        assert [(f.step, f.where) for f in found] == [(2, "loss")]
    fresh = run(PoorInitialization(num_classes=10), seq[2:])  # fresh: needs three losses again
    assert [(f.step, f.where) for f in fresh] == [(4, "loss")]


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"num_classes": 1}, "num_classes=1"),
        ({"num_classes": 0}, "num_classes=0"),
        ({"num_classes": 10.0}, "num_classes=10.0"),
        ({"steps": 0}, "steps=0"),
        ({"min_scale": 0}, "min_scale=0"),
        ({"max_scale": -1}, "max_scale=-1"),
        ({"activation_ratio": 0}, "activation_ratio=0"),
        ({"activation_ratio": 1}, "activation_ratio=1"),
        ({"max_scale": 1e-3}, "max_scale=0.001"),
    ],
)
def test_poor_initialization_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        PoorInitialization(**kwargs)
    assert "poor_initialization" in str(info.value)


@pytest.mark.parametrize("kwargs", [{"activation_ratio": 1}, {"activation_ratio": 0.5}])
def test_poor_initialization_inconsistent_ratio_is_rejected(kwargs):
    with pytest.raises(ValueError, match=r"poor_initialization: .*activation_ratio"):
        PoorInitialization(**kwargs)


def test_poor_initialization_inconsistent_scales_are_rejected():
    with pytest.raises(ValueError, match=r"poor_initialization: max_scale=.* must be > min_scale="):
        PoorInitialization(min_scale=1.0, max_scale=0.5)


# -- all_zero -------------------------------------------------------------------------------------
def zero_obs(
    step: int,
    *,
    weights=WEIGHTS,
    grads=GRAD_SHAPE,
    loss: float | None = 2.3,
    act_max=None,
) -> Observation:
    """Weights and gradients of the four parameters, and the largest output of two layers and
    a tanh (``fc0``, ``act0``, ``fc1``) when ``act_max`` is given."""
    obs = make_obs(step, loss=loss, grads=grads, weights=weights)
    if act_max is not None:
        obs.act_names, obs.act_kinds = ("fc0", "act0", "fc1"), ("layer", "tanh", "layer")
        obs.act_max = np.asarray(act_max, float)
        obs.act_rms = obs.act_max / 2
    return obs


def _with(base: np.ndarray, **zeroed: float) -> np.ndarray:
    """``base`` with the parameters at the indices given (as ``p0``..``p3``) set."""
    out = np.array(base, float)
    for key, v in zeroed.items():
        out[int(key[1:])] = v
    return out


W_STUCK = _with(WEIGHTS, p2=0.0)  # layer1.weight all zero
G_STUCK = _with(GRAD_SHAPE, p2=0.0)  # and so is its gradient


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        pytest.param(
            [zero_obs(t, weights=W_STUCK, grads=G_STUCK) for t in range(10)],
            [(1, "error", "layer1.weight")],
            id="zero-weight-zero-grad-error-once",
        ),
        pytest.param(
            [zero_obs(t, grads=G_STUCK if t >= 3 else GRAD_SHAPE) for t in range(10)],
            [(4, "warning", "layer1.weight")],
            id="zero-grad-nonzero-weight-warning",
        ),
        pytest.param(
            [zero_obs(0, weights=W_STUCK), *(zero_obs(t) for t in range(1, 10))],
            [],
            id="lora-b-starts-at-zero-with-a-gradient",
        ),
        pytest.param(
            [zero_obs(0, weights=W_STUCK, grads=G_STUCK), *(zero_obs(t) for t in range(1, 10))],
            [],
            id="zero-init-moves-at-step-1",
        ),
        pytest.param(
            [
                zero_obs(t, weights=_with(WEIGHTS, p1=0.0), grads=_with(GRAD_SHAPE, p1=0.0))
                for t in range(10)
            ],
            [],
            id="zero-bias-not-a-matrix",
        ),
        pytest.param(
            [zero_obs(t, grads=G_STUCK if t % 2 else GRAD_SHAPE) for t in range(10)],
            [],
            id="zero-grad-every-other-step",
        ),
        pytest.param(
            [zero_obs(t, grads=G_STUCK, loss=0.0) for t in range(10)], [], id="loss-exactly-0"
        ),
        pytest.param(
            [zero_obs(t, grads=G_STUCK, loss=None) for t in range(3)],
            [(1, "warning", "layer1.weight")],
            id="loss-unknown",
        ),
        pytest.param(
            [zero_obs(t, grads=G_STUCK, loss=NAN) for t in range(3)],
            [(1, "warning", "layer1.weight")],
            id="loss-nan",
        ),
        pytest.param(
            [zero_obs(t, weights=W_STUCK, grads=None) for t in range(10)], [], id="no-gradients"
        ),
        pytest.param(
            [zero_obs(t, weights=_with(WEIGHTS, p2=NAN), grads=G_STUCK) for t in range(3)],
            [(1, "warning", "layer1.weight")],
            id="nan-weight-is-not-zero",
        ),
        pytest.param([zero_obs(0, weights=W_STUCK, grads=G_STUCK)], [], id="one-step"),
        pytest.param([], [], id="empty"),
    ],
)
def test_all_zero_fires_at_the_expected_steps(observations, expected):
    found = run(AllZero(), observations)
    assert [(f.step, f.severity.value, f.where) for f in found] == expected
    for f in found:
        assert (f.detector, f.value, f.threshold) == ("all_zero", 1.0, None)
        assert "(and" not in f.message
        if f.severity.value == "error":
            assert f.message.startswith("Weight layer1.weight is all zeros and so is its gradient")
            assert_actionable(f, "initialise it randomly")
        else:
            assert f.message.startswith("The gradient of layer1.weight has been all zeros on 2")
            assert_actionable(f, "check the layers after it", ".detach()")


def test_all_zero_one_finding_per_case_naming_the_first_and_counting_the_rest():
    stuck = [zero_obs(t, weights=np.zeros(4), grads=np.zeros(4)) for t in range(5)]
    (f,) = run(AllZero(), stuck)
    assert (f.step, f.severity.value, f.where, f.value) == (1, "error", "layer0.weight", 2.0)
    assert "Weight layer0.weight (and 1 more after it) is all zeros" in f.message


def test_all_zero_each_case_reports_at_the_same_step():
    w, g = _with(WEIGHTS, p0=0.0), _with(GRAD_SHAPE, p0=0.0, p2=0.0)
    seq = [zero_obs(t, weights=w, grads=g, act_max=[0.0, 0.0, 3.0]) for t in range(4)]
    found = run(AllZero(), seq)
    assert [(f.step, f.severity.value, f.where) for f in found] == [
        (1, "error", "layer0.weight"),
        (1, "warning", "layer1.weight"),
        (1, "warning", "fc0"),
    ]
    act = found[2]
    assert act.message.startswith("The output of fc0 has been all zeros on 2 sampled steps")
    assert_actionable(act, "check its weights and inputs")


def test_all_zero_outputs_of_layers_only():
    seq = [zero_obs(t, act_max=[1.0, 0.0, 2.0]) for t in range(5)]  # a tanh output of 0: ignored
    assert run(AllZero(), seq) == []
    seq = [zero_obs(t, act_max=[1.0, 0.5, 0.0 if t else 1.0]) for t in range(5)]
    assert [(f.step, f.where) for f in run(AllZero(), seq)] == [(2, "fc1")]


def test_all_zero_a_gradient_that_returns_and_vanishes_again_is_not_repeated():
    grads = [G_STUCK] * 3 + [GRAD_SHAPE] * 3 + [G_STUCK] * 3
    found = run(AllZero(), [zero_obs(t, grads=g) for t, g in enumerate(grads)])
    assert [f.step for f in found] == [1]


def test_all_zero_patience_1_fires_at_once():
    found = run(AllZero(patience=1), [zero_obs(0, weights=W_STUCK, grads=G_STUCK)])
    assert [(f.step, f.severity.value) for f in found] == [(0, "error")]


def test_all_zero_state_round_trip_mid_streak():
    seq = [zero_obs(t, grads=G_STUCK if t >= 2 else GRAD_SHAPE) for t in range(6)]
    seq += [
        zero_obs(t, weights=_with(WEIGHTS, p0=0.0), grads=_with(GRAD_SHAPE, p0=0.0))
        for t in range(6, 9)
    ]
    for at in (1, 2, 3, 5, 7):
        found = assert_resumes(AllZero, seq, at)
        assert [(f.step, f.where) for f in found] == [(3, "layer1.weight"), (7, "layer0.weight")]


def test_all_zero_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("patience=0")) as info:
        AllZero(patience=0)
    assert "all_zero" in str(info.value)
