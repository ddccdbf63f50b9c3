"""Precision health under Keras 3 (TensorFlow backend): each fault of low-precision
training caught and named with its dtype, its twin (the remedy applied) silent, and the
statistics behind them measured exactly, on real fits under Keras' dtype policies.

Each situation is built explicitly (a loss weighted down, an Inf put in a gradient by an
op of the model's own, inputs scaled up), so nothing depends on how a CPU's kernels
round or treat a NaN, on denormal flushing or on the thread count.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from _observed import PRECISION, Observed, named  # noqa: E402

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.callbacks._keras.precision import (  # noqa: E402
    FP8_FLOORS,
    fp8_shares,
    gradient_shares,
    rounded_away,
)
from stethoscope.callbacks._keras.predictions import probability_rows  # noqa: E402
from stethoscope.detectors import default_detectors  # noqa: E402
from stethoscope.record import RunRecord  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="these tests drive the TensorFlow backend"
)

tf = pytest.importorskip("tensorflow")

N, FEATURES, CLASSES, BATCH = 512, 12, 3, 16  # 32 steps an epoch


class InfGradient(keras.layers.Layer):
    """The identity, whose gradient holds +Inf in its first element at the training steps
    ``steps`` (it counts its training calls itself, one a step): an op that overflows in
    the backward pass, at exactly those steps however many run in one execution."""

    def __init__(self, steps: Any = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = tuple(steps) or (-1,)

    def build(self, input_shape: Any) -> None:
        self.calls = self.add_weight(
            shape=(), initializer="zeros", dtype="int64", trainable=False, autocast=False
        )

    def call(self, h: Any, training: bool | None = None) -> Any:
        if not training:
            return h
        step = tf.convert_to_tensor(self.calls.value)
        armed = tf.reduce_any(tf.equal(step, tf.constant(self.steps, tf.int64)))
        self.calls.assign_add(1)

        @tf.custom_gradient
        def identity(t: Any) -> Any:
            def grad(dy: Any) -> Any:
                first = tf.reshape(tf.range(tf.size(dy)) == 0, tf.shape(dy))
                return tf.where(first & armed, tf.constant(math.inf, dy.dtype), dy)

            return tf.identity(t), grad

        return identity(h)


class ScaleLog(keras.callbacks.Callback):
    """The loss scale after every step: a ``LossScaleOptimizer``'s own (one step an
    execution)."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.scales.append(float(keras.ops.convert_to_numpy(self.model.optimizer.dynamic_scale)))


def data(scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    return x * scale, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


def mlp(
    policy: str,
    optimizer: Any,
    *,
    loss_weight: float = 1.0,
    inf_at: Any = None,
    spe: int = 1,
    head: str | None = None,
) -> Any:
    """A small MLP built under the dtype ``policy`` (the global policy restored after),
    its loss computed in float32 and multiplied by ``loss_weight``; with ``inf_at``, an
    :class:`InfGradient` after the hidden layer, poisoning those steps; ``head``: the
    output layer's own policy."""
    keras.utils.set_random_seed(0)
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        layers = [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
        ]
        layers += [InfGradient(inf_at, name="poison")] if inf_at is not None else []
        model = keras.Sequential(
            [*layers, keras.layers.Dense(CLASSES, name="head", dtype=head)], name="mlp"
        )
        cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(
            optimizer,
            lambda y, p: loss_weight * cross_entropy(y, p),
            steps_per_execution=spe,
        )
    finally:
        keras.config.set_dtype_policy(before)
    return model


def run(
    model: Any, statistic: str = "precision", *, epochs: int = 2, scale: float = 1.0, **kw: Any
) -> Observed:
    """Fit ``model`` (with ``callbacks`` of the test's own) and a stethoscope that stops
    nothing (the other keywords); its sink."""
    sink = Observed(statistic)
    callbacks = kw.pop("callbacks", [])
    cb = KerasStethoscope(sinks=[sink], stop_on=None, **kw)
    x, y = data(scale)
    model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb, *callbacks]
    )
    return sink


# -- the statistics' kernels ---------------------------------------------------------------------


def test_gradient_shares_count_subnormals_zeros_and_the_peak_in_the_gradients_dtype():
    tiny16 = float(np.finfo(np.float16).tiny)
    values = [0.0, 0.0, tiny16 / 4, -tiny16 / 2, tiny16, -3.0, 1e-3, 2.0]
    g16 = keras.ops.convert_to_tensor(np.array(values, np.float16))
    g32 = keras.ops.convert_to_tensor(np.array(values, np.float32))  # not judged, not measured
    shares16 = keras.ops.convert_to_numpy(gradient_shares(g16, 2.0))
    shares32 = keras.ops.convert_to_numpy(gradient_shares(g32, None))
    assert shares16 == pytest.approx([2 / 8, 2 / 8, 1.5])  # 2 subnormal, 2 zero, 3/2
    assert np.isnan(shares32).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_nan_value_or_gradient_is_no_update_that_rounded_away(dtype):
    nan, inf = math.nan, math.inf
    before = keras.ops.convert_to_tensor([nan, 2.0, 3.0, 4.0, -inf, 6.0], dtype)
    after = keras.ops.convert_to_tensor([nan, 2.0, 3.0, 4.0, -inf, 7.0], dtype)
    grad = keras.ops.convert_to_tensor([1.0, nan, -inf, 1.0, 1.0, 1.0], dtype)
    # 0: a NaN value; 1, 2: a gradient that is no number; 4: an infinite value. 3 and 5
    # were pushed, and 3 stayed
    assert float(rounded_away(before, after, grad)) == pytest.approx(1 / 2)


def test_rounded_away_is_the_share_of_pushed_elements_left_as_they_were():
    bf16 = "bfloat16"
    before = keras.ops.convert_to_tensor([1.0, 2.0, 3.0, 4.0, 5.0], bf16)
    after = keras.ops.convert_to_tensor([2.0, 2.0, 3.0, 4.0, 5.0], bf16)  # 0 moved
    grad = keras.ops.convert_to_tensor([1.0, 1.0, 1.0, 0.0, 0.0], bf16)
    # pushed: 0, 1, 2; of those 1 and 2 stayed. 3 and 4 had no gradient: not counted
    share = rounded_away(keras.ops.cast(before, "float32"), after, grad)  # a float32 snapshot
    assert float(share) == pytest.approx(2 / 3)
    assert math.isnan(float(rounded_away(before, after, keras.ops.zeros((5,), bf16))))
    wide = [keras.ops.cast(t, "float32") for t in (before, after, grad)]
    assert math.isnan(float(rounded_away(*wide)))


def test_fp8_shares_count_what_per_tensor_scaling_flushes_to_zero():
    amax = 448.0
    t = np.array([amax, -1.0, 0.0, amax * FP8_FLOORS[0] / 2, amax * FP8_FLOORS[1] / 2], np.float32)
    # e4m3 loses the last two of the four non-zero elements; e5m2, with its wider range,
    # the last one only
    shares = keras.ops.convert_to_numpy(fp8_shares(keras.ops.convert_to_tensor(t), 4.0))
    assert shares == pytest.approx([2 / 4, 1 / 4, amax / 4])


# -- bfloat16 variables: updates that round away ---------------------------------------------------


def test_bfloat16_updates_that_round_away_are_named_with_their_dtype():
    """SGD 1e-3 on bfloat16 weights: the updates are under half a bfloat16 ulp of most
    weights (2**-9 of them) and round away."""
    sink = run(mlp("bfloat16", keras.optimizers.SGD(1e-3)))
    found = [f for f in sink.at_least("warning") if f.detector == "rounded_updates"]
    assert found, named(sink)
    assert "bfloat16" in found[0].message and "mixed_bfloat16" in found[0].message
    assert found[0].where.endswith("kernel") and found[0].value >= 0.5
    assert "frozen_weights" not in named(sink)
    lost = [np.nanmedian(o.update_lost[o.is_matrix]) for o in sink.observations]
    assert np.median(lost) > 0.5
    assert set(sink.observations[-1].dtypes) == {"bfloat16"}


def test_the_same_fit_with_float32_variables_is_silent():
    sink = run(mlp("mixed_bfloat16", keras.optimizers.SGD(1e-3)))
    assert not named(sink) & PRECISION
    assert sink.observations and all(set(o.dtypes) == {"float32"} for o in sink.observations)
    # float32 variables: nothing of theirs is measured (a float32 update rounds away only
    # where it is ~1e-7 of its weight)
    assert all(np.isnan(o.update_lost).all() for o in sink.observations)
    assert all(np.isnan(o.grad_subnormal).all() for o in sink.observations)


def test_in_float32_nothing_of_precision_is_measured_or_judged():
    for statistic in ("precision", "loss_scale"):
        sink = run(mlp("float32", keras.optimizers.SGD(1e-3)), statistic, epochs=1)
        assert sink.observations == []  # the statistic was never planned
        assert not named(sink) & PRECISION


# -- float16 variables: gradients that underflow ---------------------------------------------------


def test_float16_gradients_that_underflow_are_named():
    """float16 variables and gradients with no loss scaling (the ``"float16"`` policy),
    the loss weighted by 1e-3: the gradients are subnormal or zero in float16."""
    model = mlp("float16", keras.optimizers.SGD(10.0), loss_weight=1e-3)
    sink = run(model, epochs=1)
    found = [f for f in sink.at_least("warning") if f.detector == "gradient_underflow"]
    assert found, named(sink)
    assert "float16" in found[0].message and "mixed_float16" in found[0].message
    assert found[0].step <= 3


def test_the_same_loss_under_a_loss_scale_optimizer_is_silent():
    model = mlp("mixed_float16", keras.optimizers.SGD(10.0), loss_weight=1e-3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    sink = run(model, epochs=1)
    assert not named(sink) & PRECISION
    # float32 variables: their gradients (as the optimizer is handed them, scaled) are
    # float32, never judged for underflow, and nothing of theirs is measured
    assert sink.observations and all(set(o.dtypes) == {"float32"} for o in sink.observations)
    assert all(np.isnan(o.grad_subnormal).all() for o in sink.observations)


# -- float16 variables: an Adam epsilon float16 cannot hold ---------------------------------------


def fit_with_a_dead_feature(optimizer: Any, policy: str = "float16") -> Observed:
    """Fit the MLP on data whose first feature is always zero: the hidden kernel's first
    row gets no gradient, so Adam's moments there are exactly zero and its step there is
    0 / (0 + epsilon), whatever the CPU's kernels."""
    x, y = data()
    x[:, 0] = 0.0
    sink = Observed("precision")
    cb = KerasStethoscope(sinks=[sink], stop_on=None)
    model = mlp(policy, optimizer)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return sink


def test_an_adam_epsilon_that_is_zero_in_float16_is_named_and_the_nan_blamed_on_it():
    sink = fit_with_a_dead_feature(keras.optimizers.Adam(1e-3, epsilon=1e-8))
    (said,) = sink.by_detector("epsilon_underflow")
    assert (said.step, said.severity, said.where) == (0, "warning", "Adam")
    assert "Adam's epsilon=1e-08 is 0 in float16" in said.message and "epsilon=1e-4" in said.message
    nan = sink.by_detector("nonfinite_weights")[0]  # 0 / 0 in the dead row
    assert nan.step == 0 and nan.where.startswith("mlp/hidden/kernel")
    assert "is 0 in float16" in nan.message and "learning rate" not in nan.message


def test_an_epsilon_float16_bounds_a_step_with_is_silent():
    sink = fit_with_a_dead_feature(keras.optimizers.Adam(1e-3, epsilon=1e-4))
    assert not named(sink) & {"epsilon_underflow", "nonfinite_weights", "large_updates"}


# -- a LossScaleOptimizer: its scale and the steps it skipped -------------------------------------


@pytest.mark.parametrize("spe", [1, 4], ids=["one-step", "steps_per_execution=4"])
def test_the_steps_a_loss_scale_optimizer_skipped_are_counted_exactly_and_their_updates_dropped(
    spe,
):
    """An Inf in a gradient at steps 5, 6, 7 and 20: the optimizer skips exactly those
    steps (its iteration count stands still), halving its scale each time. Measured at
    the first step of every execution, the skips and the scale agree with the
    optimizer's own, and the step numbers count every batch."""
    bad = (5, 6, 7, 20)
    model = mlp("mixed_float16", keras.optimizers.Adam(1e-3), inf_at=bad, spe=spe)
    log = ScaleLog()
    every = {"loss_scale_collapse": 1, "rounded_updates": 1}
    sink = run(model, "loss_scale", epochs=1, intervals=every, callbacks=[log])
    by_step = {o.step: o for o in sink.observations}
    steps = N // BATCH
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == steps - len(bad)
    assert sorted(by_step) == list(range(0, steps, spe))
    # each measurement counts the skips since the last one
    skipped = {s: o.scale_skipped for s, o in by_step.items() if o.scale_skipped}
    assert skipped == ({5: 1, 6: 1, 7: 1, 20: 1} if spe == 1 else {8: 3, 20: 1})
    assert sum(o.scale_steps for o in by_step.values()) == steps - (spe - 1)
    expected = [2.0**15 / 2 ** sum(b <= s for b in bad) for s in sorted(by_step)]
    assert [by_step[s].loss_scale for s in sorted(by_step)] == expected
    if spe == 1:  # one execution a step: the optimizer's own scale after each
        assert expected == log.scales
    for step in (s for s in bad if s in by_step):  # a skipped step moved nothing
        assert by_step[step].update_norm is None and by_step[step].update_lost is None
    # an applied step's update is measured (its float32 variables are not judged for
    # rounding: NaN)
    assert by_step[8].update_norm is not None and np.isnan(by_step[8].update_lost).all()


def test_a_collapsing_loss_scale_is_named_with_its_path():
    model = mlp("mixed_float16", keras.optimizers.Adam(1e-3), inf_at=range(20, 64))
    sink = run(model, "loss_scale")
    found = [f for f in sink.at_least("warning") if f.detector == "loss_scale_collapse"]
    assert found, named(sink)
    assert found[0].step <= 20 + 32  # halved past the floor or skipping half its window
    assert "32768" in found[0].message and "skipped" in found[0].message


def test_a_loss_scale_finding_itself_at_the_start_is_silent():
    """A scale far too high at first overflows a few steps, as it is meant to."""
    model = mlp("mixed_float16", keras.optimizers.Adam(1e-3), inf_at=range(4))
    log = ScaleLog()
    sink = run(model, "loss_scale", epochs=3, callbacks=[log])
    assert "loss_scale_collapse" not in named(sink)
    assert not sink.at_least("error")
    assert log.scales[3] == 2.0**11  # four skips: 2**15 halved four times


def test_recovery_under_a_loss_scale_optimizer_is_refused_with_the_remedy():
    model = mlp("mixed_float16", keras.optimizers.SGD(0.01))
    x, y = data()
    cb = KerasStethoscope(sinks=[CapturingSink()], recover=True)
    with pytest.raises(ValueError, match=r"LossScaleOptimizer.*recover=False.*mixed_bfloat16"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[cb])
    assert "compute_loss" not in vars(model) and "apply" not in vars(model.optimizer)


# -- headroom ------------------------------------------------------------------------------------


def test_float16_activations_nearing_the_maximum_are_warned_of():
    """Inputs 2000 times their scale: the hidden layer's float16 outputs reach a tenth of
    65504. The head computes in float32, as Keras' mixed-precision guide has it, and its
    larger outputs are none of float16's business."""
    model = mlp("mixed_float16", keras.optimizers.Adam(1e-3), head="float32")
    sink = run(model, "outputs", epochs=1, scale=2000.0)
    found = [f for f in sink.at_least("warning") if f.detector == "overflow_risk"]
    assert found, named(sink)
    assert "float16" in found[0].message and "65504" in found[0].message
    assert found[0].where == "hidden" and "more tensors" not in found[0].message
    assert sink.observations[0].act_dtypes == ("float16", "float32")


def test_the_same_inputs_in_bfloat16_have_float32s_range():
    sink = run(mlp("mixed_bfloat16", keras.optimizers.Adam(1e-3)), epochs=1, scale=2000.0)
    assert "overflow_risk" not in named(sink)


# -- fp8 readiness ---------------------------------------------------------------------------------


def test_fp8_readiness_reads_the_weights_after_the_step_and_the_unscaled_gradients():
    """Asked for, the fp8 statistic is measured under any policy: its weight amax is that
    of the weights after the step, its gradient amax that of the unscaled gradient."""
    model = mlp("mixed_float16", keras.optimizers.SGD(0.1))
    sink = Observed("fp8")
    cb = KerasStethoscope(
        detectors=default_detectors(fp8_readiness={}),
        sinks=[sink],
        stop_on=None,
        intervals={"fp8_readiness": 1},
    )
    x, y = data()
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, callbacks=[cb])
    (obs,) = sink.observations
    weights = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    np.testing.assert_allclose(obs.fp8_amax[:, 0], [np.abs(w).max() for w in weights])
    assert obs.fp8_underflow.shape == (4, 4)
    assert np.all(obs.fp8_amax[:, 1] < 10.0)  # the scale of 32768 divided out


def test_a_bfloat16_softmax_is_probabilities_within_its_own_rounding():
    """MobileNetV3Small under mixed_bfloat16 was told its softmax output was logits: a
    bfloat16 softmax sums to 1 within a few 1e-3 only, not float32's 1e-3."""
    logits = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    probs = keras.ops.softmax(keras.ops.cast(logits, "bfloat16"), axis=-1)
    sums = keras.ops.convert_to_numpy(keras.ops.sum(keras.ops.cast(probs, "float32"), axis=-1))
    assert np.abs(sums - 1).max() > 1e-3  # the situation, built
    assert keras.ops.convert_to_numpy(probability_rows(probs))[0] == 1.0
    off = keras.ops.cast(probs, "float32") * 1.01
    assert keras.ops.convert_to_numpy(probability_rows(off))[0] == 0.0


def test_the_record_keeps_the_precision_statistics_and_the_loss_scale(tmp_path):
    model = mlp("mixed_float16", keras.optimizers.Adam(1e-3), inf_at=(3, 4))
    run(model, "loss_scale", epochs=1, record=tmp_path / "r")
    with RunRecord(tmp_path / "r") as record:
        assert {"loss_scale", "fp8_weight_e4m3", "fp8_grad_e5m2"} <= set(record.kinds())
        scale = record.layers("loss_scale")
        assert scale.names == ("loss scale",) and scale.values[-1, 0] < 2.0**15
    run(mlp("bfloat16", keras.optimizers.SGD(1e-3)), epochs=1, record=tmp_path / "b")
    with RunRecord(tmp_path / "b") as record:
        lost = record.layers("update_lost")
        assert "mlp/hidden/kernel" in lost.names and np.nanmax(lost.values) > 0.5
