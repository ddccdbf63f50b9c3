"""Layer 1: dead_relu and saturated_activation on synthetic per-unit flags and saturation."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _helpers import NAN, assert_actionable, assert_resumes, run, steps

from stethoscope.detectors import DeadRelu, SaturatedActivation
from stethoscope.observation import Observation

UNITS = 128
#: Units of a 128-unit layer that are dead in the faults below.
DEAD_80 = int(0.8 * UNITS)


# -- dead_relu ------------------------------------------------------------------------------------
def units_obs(step: int, *zero, names: tuple[str, ...] | None = None) -> Observation:
    """One observation of the per-unit zero-gradient-row flags of one or more layers."""
    names = names if names is not None else tuple(f"layer{i}" for i in range(len(zero)))
    return Observation(
        step=step, unit_names=names, unit_zero=tuple(np.asarray(z, dtype=bool) for z in zero)
    )


def idle_rows(n: int = 40, p: float = 0.05, seed: int = 0) -> np.ndarray:
    """Zero-row flags (steps x units) of a healthy ReLU layer: ~50% of its *values* are 0 on
    every batch, but a unit has an all-zero row only when no sample of the batch activated
    it, which happens to a few percent of the units."""
    return np.random.default_rng(seed).random((n, UNITS)) < p


def flags_obs(rows: np.ndarray) -> list[Observation]:
    return [units_obs(t, row) for t, row in enumerate(rows)]


def _dead(start: int, count: int, stop: int | None = None):
    def mutate(rows: np.ndarray) -> None:
        rows[start:stop, :count] = True

    return mutate


def _revive(at: int):
    def mutate(rows: np.ndarray) -> None:
        rows[at] = False

    return mutate


DEAD_CASES = [
    pytest.param([_dead(10, DEAD_80)], [(17, "warning")], id="80%-dead-from-10-warns-after-window"),
    pytest.param([_dead(10, UNITS)], [(17, "error")], id="all-dead-is-an-error-at-once"),
    pytest.param([_dead(0, UNITS)], [(7, "error")], id="all-dead-from-the-first-step"),
    pytest.param(
        [_dead(10, DEAD_80), _dead(30, UNITS)],
        [(17, "warning"), (37, "error")],
        id="warning-escalates-to-error",
    ),
    pytest.param(
        [_dead(10, DEAD_80, stop=25), _dead(30, DEAD_80)],
        [(17, "warning"), (37, "warning")],
        id="revived-then-dead-again-reports-again",
    ),
    pytest.param([_dead(10, int(0.4 * UNITS))], [], id="40%-dead-below-threshold"),
    pytest.param([_dead(10, UNITS // 2)], [], id="exactly-half-is-not-above"),
    pytest.param([_dead(10, UNITS, stop=17)], [], id="idle-7-steps-is-not-window"),
    pytest.param(
        [_dead(0, UNITS), *(_revive(t) for t in range(7, 40, 8))],
        [],
        id="idle-7-of-every-8-steps-never-dead",
    ),
    pytest.param([_dead(39, UNITS)], [], id="one-step-all-zero"),
]


@pytest.mark.parametrize(("faults", "expected"), DEAD_CASES)
def test_dead_relu_fires_at_the_expected_steps(faults, expected):
    rows = idle_rows()
    for mutate in faults:
        mutate(rows)
    found = run(DeadRelu(), flags_obs(rows))
    assert steps(found) == expected
    for f in found:
        assert f.detector == "dead_relu"
        assert f.where == "layer0"
        assert f.threshold == 0.5
        assert f.value == (1.0 if f.severity.value == "error" else DEAD_80 / UNITS)
        assert "layer0" in f.message and f"{UNITS} units" in f.message
        assert_actionable(f, "lower the LR", "LeakyReLU", "He")


def _sized(rows: np.ndarray, samples: int) -> list[Observation]:
    obs = flags_obs(rows)
    for o in obs:
        o.unit_samples = samples
    return obs


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        pytest.param(0, [(17, "error")], id="unknown-batch-size-8-steps"),
        pytest.param(128, [(17, "error")], id="batch-128-8-steps-hold-1024"),
        pytest.param(32, [(25, "error")], id="batch-32-needs-16-steps"),
        pytest.param(8, [(73, "error")], id="batch-8-needs-64-steps"),
        pytest.param(1, [], id="batch-1-needs-512-steps"),
    ],
)
def test_dead_relu_small_batches_look_further_back(samples, expected):
    rows = idle_rows(n=120)
    _dead(10, UNITS)(rows)
    found = run(DeadRelu(), _sized(rows, samples))
    assert steps(found) == expected
    for f in found:
        look = f.step - 10 + 1
        shown = f" ({look * samples} samples)" if samples else ""
        assert f"the last {look} sampled steps{shown} (step {f.step})" in f.message


def test_dead_relu_rarely_active_units_on_batch_8_are_not_dead():
    # 80% of the units fire on 1% of the samples: alive by SageMaker's rule; on batches of 8,
    # 8 zero rows in a row come often (52% per window), 64 in a row almost never
    rng = np.random.default_rng(0)
    active = rng.random((400, 8, UNITS)) < np.where(np.arange(UNITS) < DEAD_80, 0.01, 0.5)
    rows = ~active.any(axis=1)
    assert steps(run(DeadRelu(), flags_obs(rows)))  # batch size unknown: 8 steps, a false alarm
    assert run(DeadRelu(), _sized(rows, 8)) == []


def test_dead_relu_message_says_how_many_are_dead():
    rows = idle_rows()
    _dead(10, DEAD_80)(rows)
    (f,) = run(DeadRelu(), flags_obs(rows))
    assert f.message.startswith(f"In layer0, 80% of the {UNITS} units are dead: ")
    assert "the last 8 sampled steps (step 17)" in f.message
    rows[20:] = True
    (f,) = run(DeadRelu(), flags_obs(rows[20:]))
    assert f.message.startswith(f"All {UNITS} units of layer0 are dead: ")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.05, 0.5])
def test_dead_relu_quiet_on_healthy_layers_counting_units_not_values(p, seed):
    # p=0.05: the usual few idle units per batch; p=0.5: every unit idle on half the batches,
    # so some unit is idle 8 times in a row now and then, but never most of the layer at once
    d = DeadRelu()
    found = run(d, flags_obs(idle_rows(300, p, seed)))
    assert found == []


def test_dead_relu_suspects_a_mostly_idle_batch_before_the_window():
    d = DeadRelu()
    d.update(units_obs(0, np.arange(UNITS) < 0.6 * UNITS))
    assert d.suspect == "60% of the units of layer0 got no gradient"
    d.update(units_obs(1, np.zeros(UNITS)))
    assert d.suspect is None


def test_dead_relu_window_1_fires_on_a_single_step():
    (f,) = run(DeadRelu(window=1), [units_obs(0, np.ones(UNITS))])
    assert (f.step, f.severity.value) == (0, "error")


def test_dead_relu_reports_the_layer_nearest_the_input_first():
    rows = idle_rows()
    _dead(10, UNITS)(rows)
    both = [units_obs(t, r, r) for t, r in enumerate(rows)]
    found = run(DeadRelu(), both)
    assert [(f.step, f.where) for f in found if f.step == 17] == [(17, "layer0")]
    wheres = [f.where for f in found]
    assert len(wheres) == len(set(wheres))  # no layer said twice


def test_dead_relu_counts_each_layer_separately():
    rows = idle_rows()
    _dead(10, DEAD_80)(rows)
    healthy = idle_rows(seed=1)
    found = run(
        DeadRelu(), [units_obs(t, h, r) for t, (h, r) in enumerate(zip(healthy, rows, strict=True))]
    )
    assert [(f.step, f.where) for f in found] == [(17, "layer1")]


@pytest.mark.parametrize(
    "observations",
    [
        pytest.param([], id="no-observation"),
        pytest.param([units_obs(t, np.zeros(0, bool)) for t in range(20)], id="empty-layer"),
        pytest.param([Observation(step=t, unit_zero=()) for t in range(20)], id="no-layer"),
    ],
)
def test_dead_relu_quiet_edge_cases(observations):
    assert run(DeadRelu(), observations) == []


def test_dead_relu_a_resized_layer_starts_its_streaks_over():
    seq = [units_obs(t, np.ones(UNITS)) for t in range(7)]
    seq += [units_obs(7 + t, np.ones(UNITS // 2)) for t in range(8)]
    assert steps(run(DeadRelu(), seq)) == [(14, "error")]


def test_dead_relu_state_round_trip_mid_streak():
    rows = idle_rows(60)
    _dead(10, DEAD_80)(rows)
    _dead(30, UNITS)(rows)
    for at in (5, 14, 20, 33):
        found = assert_resumes(DeadRelu, flags_obs(rows), at)
        assert steps(found) == [(17, "warning"), (37, "error")]


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"threshold": 1.0}, "threshold=1.0"),
        ({"threshold": 1.5}, "threshold=1.5"),
        ({"threshold": 0.0}, "threshold=0.0"),
        ({"window": 0}, "window=0"),
        ({"window": 2.5}, "window=2.5"),
        ({"window": True}, "window=True"),
    ],
)
def test_dead_relu_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        DeadRelu(**kwargs)
    assert "dead_relu" in str(info.value)


# -- saturated_activation -------------------------------------------------------------------------
ACT_NAMES = ("fc0", "act0", "fc1", "act1")
ACT_KINDS = ("layer", "tanh", "layer", "sigmoid")


def act_obs(step: int, tanh: float, sigmoid: float = 0.01, layer: float = NAN) -> Observation:
    """One observation of a fc → tanh → fc → sigmoid stack's saturated fractions."""
    return Observation(
        step=step,
        act_names=ACT_NAMES,
        act_kinds=ACT_KINDS,
        act_saturated=np.array([layer, tanh, layer, sigmoid]),
        act_rms=np.array([1.0, 0.7, 1.0, 0.5]),
        act_max=np.array([4.0, 1.0, 3.0, 1.0]),
    )


def sat_obs(fractions, **kw) -> list[Observation]:
    return [act_obs(t, x, **kw) for t, x in enumerate(fractions)]


@pytest.mark.parametrize(
    ("fractions", "expected"),
    [
        pytest.param([0.05] * 5 + [0.9] * 10, [7], id="persistent-90%-after-patience"),
        pytest.param([0.9] * 3, [2], id="from-the-first-step"),
        pytest.param([0.9, 0.9, 0.1] * 5, [], id="never-3-in-a-row"),
        pytest.param([0.9, 0.9, NAN, 0.9], [3], id="nan-skipped-not-a-break"),
        pytest.param([0.9] * 3 + [0.1] + [0.9] * 3, [2, 6], id="recovers-then-again"),
        pytest.param([0.9] * 3 + [NAN] * 3 + [0.9] * 3, [2], id="nan-is-not-a-recovery"),
        pytest.param([0.5] * 10, [], id="exactly-the-threshold"),
        pytest.param([0.3] * 10, [], id="healthy-30%"),
        pytest.param([1.0], [], id="one-step"),
        pytest.param([], [], id="empty"),
    ],
)
def test_saturated_activation_fires_at_the_expected_steps(fractions, expected):
    found = run(SaturatedActivation(), sat_obs(fractions))
    assert [f.step for f in found] == expected
    for f in found:
        assert (f.detector, f.severity.value, f.where) == (
            "saturated_activation",
            "warning",
            "act0",
        )
        assert (f.value, f.threshold) == (fractions[f.step], 0.5)
        assert f"Saturated tanh: {fractions[f.step]:.0%} of the inputs of act0" in f.message
        assert "beyond ±5 " in f.message
        assert_actionable(f, "Xavier/Glorot", "normalise the inputs", "ReLU")


def test_saturated_activation_sigmoid_uses_its_own_bound():
    (f,) = run(SaturatedActivation(), sat_obs([0.01] * 5, sigmoid=0.8))
    assert (f.step, f.where, f.value) == (2, "act1", 0.8)
    assert "Saturated sigmoid" in f.message and "beyond ±10 " in f.message


def test_saturated_activation_ignores_layers_and_unknown_kinds():
    obs = [
        Observation(
            step=t,
            act_names=("fc0", "relu0"),
            act_kinds=("layer", "relu"),
            act_saturated=np.array([0.9, 0.9]),  # never set for these kinds; ignored if it were
            act_rms=np.ones(2),
        )
        for t in range(10)
    ]
    assert run(SaturatedActivation(), obs) == []


def test_saturated_activation_reports_one_per_step_nearest_the_input_first():
    found = run(SaturatedActivation(), sat_obs([0.9] * 5, sigmoid=0.9))
    assert [(f.step, f.where) for f in found] == [(2, "act0"), (3, "act1")]


def test_saturated_activation_suspects_before_patience():
    d = SaturatedActivation()
    d.update(act_obs(0, 0.9))
    assert d.suspect == "90% of the inputs of act0 (tanh) are saturated"
    d.update(act_obs(1, 0.1))
    assert d.suspect is None


def test_saturated_activation_patience_1_fires_at_once():
    assert [f.step for f in run(SaturatedActivation(patience=1), sat_obs([0.9]))] == [0]


def test_saturated_activation_state_round_trip_mid_streak():
    fractions = [0.05] * 5 + [0.9] * 4 + [0.1] + [0.9] * 5
    for at in (3, 6, 8, 11):
        found = assert_resumes(SaturatedActivation, sat_obs(fractions), at)
        assert [f.step for f in found] == [7, 12]


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"threshold": 1.0}, "threshold=1.0"),
        ({"threshold": 2}, "threshold=2"),
        ({"patience": 0}, "patience=0"),
        ({"patience": 1.5}, "patience=1.5"),
    ],
)
def test_saturated_activation_bad_arguments(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        SaturatedActivation(**kwargs)
    assert "saturated_activation" in str(info.value)


def test_dead_relu_skips_a_step_whose_whole_gradient_is_zero():
    # a classifier sure of every sample of its batch passes back no gradient: every row of
    # every layer is zero, the linear head's too, and no unit is shown to be dead by it
    def all_zero_rows(step: int, head_bias: float) -> Observation:
        obs = units_obs(step, np.ones(UNITS), np.ones(10), names=("hidden", "head"))
        obs.grad_norm = np.array([0.0, 0.0, 0.0, head_bias])  # weights and biases
        return obs

    assert run(DeadRelu(), [all_zero_rows(t, 0.0) for t in range(40)]) == []
    # the same rows with a gradient somewhere (the head's bias): a dead network, at the
    # window's eighth step
    (found,) = run(DeadRelu(), [all_zero_rows(t, 0.5) for t in range(8)])
    assert (found.step, found.severity, found.where) == (7, "error", "hidden")
    # steps with no gradient between them neither count nor break the streak
    mixed = [all_zero_rows(t, 0.0 if t % 2 else 0.5) for t in range(16)]
    assert [f.step for f in run(DeadRelu(), mixed)] == [14]


# -- an agent's visited states --------------------------------------------------------------------
def agent_units(losses) -> list[Observation]:
    """An actor-critic's first layer on a cart-pole, as measured: 58% of its 128 units
    silent on the states its agent visits (those of the first steps excited them all), its
    loss (-log_prob x advantage plus the critic's) of either sign."""
    rows = idle_rows(len(losses))
    rows[10:, : int(0.58 * UNITS)] = True
    found = flags_obs(rows)
    for o, loss in zip(found, losses, strict=True):
        o.loss = float(loss)
    return found


def test_dead_relu_leaves_an_agents_unvisited_units_alone():
    losses = np.r_[2.5, 3.1, 1.8, 4.0, -1.2, np.linspace(3, 12, 35)]  # as measured: one < 0
    found = run(DeadRelu(), agent_units(losses))
    (said,) = found
    assert said.severity == "info" and said.step == 4 and "unvisited, not dead" in said.message
    assert DeadRelu().finished(0) is False


def test_dead_relu_still_names_units_dead_under_a_loss_of_one_sign():
    found = run(DeadRelu(), agent_units(np.linspace(3, 12, 40)))
    assert steps(found) == [(17, "warning")]
    # a loss that goes below zero only past the first SIGN_STEPS (a Gaussian NLL that
    # learns) does not excuse it
    late = run(DeadRelu(), agent_units(np.r_[np.linspace(3, 12, 139), -1.0]))
    assert steps(late) == [(17, "warning")]


@pytest.mark.parametrize(
    ("loss", "in_unit", "warned"),
    [
        pytest.param(0.05, 1.0, False, id="its-likelihood: a confident classifier"),
        pytest.param(0.31, 1.0, True, id="another-loss: BCE with logits of probabilities"),
        pytest.param(0.05, 0.0, True, id="an-output-outside-0-1"),
    ],
)
def test_an_output_sigmoid_under_its_own_likelihood_is_not_saturated(loss, in_unit, warned):
    """The output's sigmoid fed to binary_cross_entropy of its probabilities: the gradient
    through both is p - y, which its tails do not shrink (a healthy multi-label classifier
    was warned as it grew confident). Fed to a loss that takes logits, it saturates."""
    det = SaturatedActivation()
    found = []
    for step in range(5):
        obs = act_obs(step, tanh=0.01, sigmoid=0.9)
        obs.loss, obs.bce_as_probs, obs.output_in_unit = loss, 0.05, in_unit
        found += det.update(obs)
    assert [f.where for f in found] == (["act1"] if warned else [])
