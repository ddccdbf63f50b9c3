"""The precision detectors on sequences of numbers: each rule, its patience, its silence
in float32 and after it has spoken (a suspicion then would keep the sampler hot)."""

from __future__ import annotations

import numpy as np
import pytest

from stethoscope.advice import DEEPSPEED_SCALER, TrainingSetup, small_epsilon
from stethoscope.detectors import (
    EpsilonUnderflow,
    Fp8Readiness,
    GradientUnderflow,
    LossScaleCollapse,
    OverflowRisk,
    RoundedUpdates,
    default_detectors,
)
from stethoscope.observation import Observation

NAMES = ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias")
MATRIX = np.array([True, False, True, False])


def obs(step: int, *, dtype: str = "bfloat16", **fields) -> Observation:
    return Observation(step=step, names=NAMES, is_matrix=MATRIX, dtypes=(dtype,) * 4, **fields)


def feed(detector, observations):
    found, suspects = [], []
    for o in observations:
        found += detector.update(o)
        suspects.append(detector.suspect)
    return found, suspects


def low(detector, **setup):
    detector.setup = TrainingSetup(framework="lightning", low_precision=True, **setup)
    return detector


# -- rounded_updates -------------------------------------------------------------------------------
def test_updates_rounded_away_for_patience_steps_make_one_warning_naming_the_dtype():
    d = low(RoundedUpdates())
    lost = [obs(s, update_lost=np.array([0.1, 0.9, 0.7, 0.0])) for s in range(6)]
    found, suspects = feed(d, lost)
    [f] = found
    assert (f.step, f.where, f.value) == (2, "layer1.weight", 0.7)  # matrices only
    assert "bfloat16" in f.message and "0.39%" in f.message and "bf16-mixed" in f.message
    assert suspects[:3] == ["70% of layer1.weight's updates rounded away"] * 3
    assert suspects[3:] == [None] * 3  # said: the sampler is not kept hot


def test_float32_weights_and_skipped_updates_are_not_judged():
    d = low(RoundedUpdates(patience=1))
    assert feed(d, [obs(0, dtype="float32", update_lost=np.full(4, 1.0))])[0] == []
    assert feed(d, [obs(1, update_lost=None, grad_subnormal=np.zeros(4))])[0] == []


def test_rounded_updates_apply_only_to_a_run_in_16_bits():
    d = RoundedUpdates()
    assert not d.applies() and d.finished(0)
    assert low(d).applies() and not d.finished(0)
    # float32 master copies (DeepSpeed's optimizers) keep what the 16-bit weights round
    assert not low(RoundedUpdates(), master_weights=True).applies()


# -- gradient_underflow ----------------------------------------------------------------------------
def test_subnormal_gradients_warn_with_the_zero_share_beside_them():
    d = low(GradientUnderflow())
    sub = np.array([0.01, 0.3, 0.04, 0.0])
    zero = np.array([0.0, 0.5, 0.0, 0.0])
    found, _ = feed(
        d, [obs(s, dtype="float16", grad_subnormal=sub, grad_zero=zero) for s in (0, 1)]
    )
    [f] = found
    assert f.where == "layer0.bias" and "30%" in f.message and "50% are exactly zero" in f.message
    assert "6.1e-05" in f.message and "16-mixed" in f.message


def test_float32_gradients_computed_in_float16_are_judged_as_float16s():
    """Under torch.autocast(float16) in the training step, a float32 weight's gradient is
    float16's, cast up: named as float16's, with where it is held; the same shares of a
    float32 run's gradients (none computed in 16 bits) are not judged."""
    sub, zero = np.array([0.01, 0.3, 0.04, 0.0]), np.array([0.0, 0.5, 0.0, 0.0])
    steps = [obs(s, dtype="float32", grad_subnormal=sub, grad_zero=zero) for s in (0, 1)]
    [f] = feed(low(GradientUnderflow(), computes_in="float16"), steps)[0]
    assert f.where == "layer0.bias" and "The float16 gradient of layer0.bias" in f.message
    assert "computed under autocast, held in float32" in f.message
    assert feed(low(GradientUnderflow()), steps)[0] == []
    flush = dict(dtype="float32", grad_subnormal=np.zeros(4), grad_zero=np.ones(4), loss=0.7)
    d = low(GradientUnderflow(patience=1), computes_in="float16")
    [f] = feed(d, [obs(0, **flush)])[0]
    assert "every element of all 4 float16 gradients" in f.message


@pytest.mark.parametrize(
    ("scaler", "said"),
    [
        (None, 'scale the loss (precision="16-mixed"'),
        ("GradScaler", "the loss is already scaled (GradScaler): a larger scale keeps more"),
        (DEEPSPEED_SCALER, "(DeepSpeed's loss scaler): a larger scale keeps more of them "),
    ],
)
def test_an_underflow_under_a_loss_scaler_asks_for_a_larger_scale_not_for_one(scaler, said):
    # DeepSpeed's fp16 keeps float16 gradients, scaled by its loss scaler: too small even
    # so, the remedy is a larger scale, through DeepSpeedStrategy's own arguments
    d = low(GradientUnderflow(patience=1), loss_scaler=scaler)
    [f] = feed(d, [obs(0, dtype="float16", grad_subnormal=np.full(4, 0.2), grad_zero=np.zeros(4))])[
        0
    ]
    assert said in f.message
    assert ("initial_scale_power" in f.message) == (scaler == DEEPSPEED_SCALER)


def test_zeros_without_subnormals_are_a_dead_units_not_an_underflow():
    d = low(GradientUnderflow(patience=1))
    zero = [obs(0, dtype="float16", grad_subnormal=np.zeros(4), grad_zero=np.full(4, 0.9))]
    assert feed(d, zero)[0] == []


def test_a_float16_backward_pass_flushed_whole_unscaled_is_an_underflow():
    """No subnormal is left where every gradient fell below float16's smallest one: every
    element of every 16-bit gradient, the output layer's too, exactly zero for a loss
    above zero and no loss scaling."""
    flush = dict(dtype="float16", grad_subnormal=np.zeros(4), grad_zero=np.ones(4))
    [f] = feed(low(GradientUnderflow()), [obs(s, loss=1.4e-6, **flush) for s in (0, 1)])[0]
    assert f.step == 1 and f.value == 1.0 and "underflow to zero" in f.message
    assert "every element of all 4 float16 gradients" in f.message and "16-mixed" in f.message
    # not under a loss scaler, for a loss of zero or none, nor with one gradient standing
    scaled = low(GradientUnderflow(patience=1), loss_scaler="GradScaler")
    assert feed(scaled, [obs(0, loss=1.4e-6, **flush)])[0] == []
    for loss in (0.0, None, float("nan")):
        assert feed(low(GradientUnderflow(patience=1)), [obs(0, loss=loss, **flush)])[0] == []
    standing = {**flush, "grad_zero": np.array([1.0, 1.0, 1.0, 0.0])}
    assert feed(low(GradientUnderflow(patience=1)), [obs(0, loss=1.4e-6, **standing)])[0] == []


def test_a_streak_broken_starts_again():
    d = low(GradientUnderflow(patience=2))
    bad, good = np.full(4, 0.2), np.zeros(4)
    seq = [
        obs(s, dtype="float16", grad_subnormal=g, grad_zero=good)
        for s, g in enumerate((bad, good, bad, good))
    ]
    assert feed(d, seq)[0] == []


# -- loss_scale_collapse ---------------------------------------------------------------------------
def scale(step, value, skipped=0, steps=1):
    return Observation(step=step, loss_scale=value, scale_skipped=skipped, scale_steps=steps)


def test_a_scale_falling_below_the_floor_is_named_with_its_path():
    d = LossScaleCollapse()
    d.setup = TrainingSetup(loss_scaler="GradScaler", low_precision=True)
    seq = [scale(s, 2.0 ** (16 - s), skipped=int(s > 0)) for s in range(20)]
    found, _ = feed(d, seq)
    [f] = found
    assert f.step == 17 and f.value == 0.5
    assert "65536" in f.message and "2^-1" in f.message and "17 of the last 18" in f.message


def test_a_scaler_finding_its_scale_is_silent_and_persistent_skipping_is_not():
    d = LossScaleCollapse(window=32)
    start = [scale(s, 2.0 ** (16 - min(s, 6)), skipped=int(0 < s <= 6)) for s in range(40)]
    assert feed(d, start)[0] == []
    # then an overflow every other step for 32 steps, the scale held up by the growth
    skipping = [scale(40 + 4 * k, 1024.0, skipped=2, steps=4) for k in range(8)]
    [f] = feed(d, skipping)[0]
    assert "skipped 16 of the last 32 steps" in f.message


def test_without_a_loss_scaler_the_rule_does_not_apply():
    d = LossScaleCollapse()
    d.setup = TrainingSetup(low_precision=True)
    assert not d.applies()


# -- overflow_risk ---------------------------------------------------------------------------------
def test_a_float16_output_near_65504_warns_once_per_tensor():
    d = low(OverflowRisk())
    acts = dict(
        act_names=("layer0", "layer1"),
        act_kinds=("layer", "layer"),
        act_dtypes=("float16", "bfloat16"),
    )
    near = [obs(s, act_max=np.array([5000.0, 1e30]), **acts) for s in range(3)]
    found, _ = feed(d, near)
    [f] = found  # bfloat16's 1e30 is far from its maximum; the float16 one said once
    assert f.where == "layer0" and "float16" in f.message and "3.7 more doublings" in f.message


def test_a_float16_gradient_near_its_maximum_is_named():
    d = low(OverflowRisk())
    [f] = d.update(obs(0, dtype="float16", grad_peak=np.array([1.0, 1.0, 20000.0, 1.0])))
    assert f.where == "layer1.weight" and "gradient" in f.message


@pytest.mark.parametrize("margin", [1, 0.5])
def test_a_margin_of_one_or_less_is_refused(margin):
    with pytest.raises(ValueError, match=f"margin={margin!r}"):
        OverflowRisk(margin=margin)


# -- fp8_readiness ---------------------------------------------------------------------------------
def fp8(step, lost_weight=0.0, lost_grad=0.0, grad_amax=0.1):
    under = np.zeros((4, 4))
    under[0, 0], under[0, 3] = lost_weight, lost_grad
    amax = np.tile([1.0, grad_amax], (4, 1))
    return obs(step, dtype="float32", fp8_underflow=under, fp8_amax=amax)


def test_fp8_readiness_is_asked_for_not_given():
    assert "fp8_readiness" not in {d.name for d in default_detectors()}
    assert "fp8_readiness" in {d.name for d in default_detectors(fp8_readiness={})}
    assert Fp8Readiness().applies()  # any precision: a run not in fp8 yet


def test_layers_that_would_lose_values_in_fp8_are_named():
    found, _ = feed(Fp8Readiness(), [fp8(s, lost_weight=0.2, lost_grad=0.03) for s in range(3)])
    [f] = found
    assert f.step == 1 and f.where == "layer0.weight"
    assert "20.0% of its weights in e4m3" in f.message and "3.0% of its gradient" in f.message


def test_a_gradient_that_outgrows_its_scale_saturates_under_delayed_scaling():
    found, _ = feed(Fp8Readiness(), [fp8(0), fp8(1, grad_amax=5.0)])
    [f] = found
    assert "grew 50x" in f.message and "saturate" in f.message


def test_when_nothing_moved_at_all_the_optimizers_own_arithmetic_is_named():
    """Keras' Adam under the bfloat16 policy: beta_2 = 0.999 rounds to 1.0, and no update
    is applied at all: more than rounding."""
    d = low(RoundedUpdates(patience=1))
    [f] = d.update(obs(0, update_lost=np.array([1.0, 0.5, 1.0, 0.0])))
    assert "No element of any bfloat16 matrix moved at all" in f.message and "beta_2" in f.message
    d = low(RoundedUpdates(patience=1))
    [f] = d.update(obs(0, update_lost=np.array([0.9, 0.5, 1.0, 0.0])))
    assert "beta_2" not in f.message


# -- epsilon_underflow ----------------------------------------------------------------------------


def with_epsilon(detector, eps: float, framework: str = "lightning"):
    risk = small_epsilon("AdamW", "eps", eps, ["float16"])
    detector.setup = TrainingSetup(framework=framework, low_precision=True, small_epsilon=risk)
    return detector


def test_an_epsilon_that_is_zero_in_float16_is_said_once_at_the_first_gradients():
    detector = with_epsilon(EpsilonUnderflow(), 1e-8)
    assert detector.applies() and not detector.finished(0)
    steps = [obs(0)] + [obs(t, grad_norm=np.ones(4)) for t in (16, 32)]
    (f,), suspects = feed(detector, steps)
    assert suspects == [None] * 3
    assert (f.severity, f.step, f.value, f.where) == ("warning", 16, 1e-8, "AdamW")
    assert "AdamW's eps=1e-08 is 0 in float16" in f.message
    assert f.message.endswith('(precision="16-mixed").') and detector.finished(32)


@pytest.mark.parametrize("eps", [1e-7, 1e-4])  # small but not zero; not small
def test_an_epsilon_that_is_not_zero_is_no_finding_of_its_own(eps):
    detector = with_epsilon(EpsilonUnderflow(), eps)
    assert not detector.applies() and detector.finished(0)
    assert EpsilonUnderflow().finished(0)  # float32, or no adaptive optimizer


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ({"framework": "lightning"}, "scale the loss (16-mixed) or train in bf16"),
        ({"framework": "keras"}, "scale the loss (mixed_float16) or mixed_bfloat16"),
        ({"framework": "lightning", "loss_scaler": "GradScaler"}, "a larger loss scale, or bf16"),
    ],
)
def test_gradient_underflows_summary_advice_is_in_the_frameworks_words(setup, said):
    detector = GradientUnderflow()
    detector.setup = TrainingSetup(low_precision=True, **setup)
    assert detector.current_advice() == said


def test_a_layers_float16_output_over_float32_weights_is_a_float16_forward_pass():
    from stethoscope.observation import computes_in

    def seen(out: str, held: str, kind: str = "layer") -> str | None:
        return computes_in(obs(0, dtype=held, act_kinds=(kind, kind), act_dtypes=("float32", out)))

    assert seen("float16", "float32") == "float16"  # autocast written in the step
    assert seen("bfloat16", "float32") is None  # bfloat16 keeps float32's range
    assert seen("float16", "float16") is None  # held in it: the run says so already
    assert seen("float16", "float32", kind="tanh") is None  # an activation's input
    assert computes_in(obs(0, dtype="float32")) is None  # no output seen
