"""KerasStethoscope on real Keras 3 fits (TensorFlow backend): what the graph measures,
what it leaves behind, and how it behaves across fits, executions and model styles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from stethoscope import KerasStethoscope, TrainingProblem  # noqa: E402
from stethoscope.detectors import Detector  # noqa: E402
from stethoscope.statistics import DISTRIBUTION_EDGES  # noqa: E402
from stethoscope.testing import CapturingSink, RecordingDetector  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="these tests drive the TensorFlow backend"
)

N, FEATURES, CLASSES, BATCH = 256, 12, 3, 32


Spy = RecordingDetector  # keeps every observation it is shown; finds nothing


def data(seed: int = 0, n: int = N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (np.argmax(x[:, :CLASSES], axis=1)).astype("int64")
    return x, y


def relu_hiding_nan(h):
    """A ReLU that maps NaN to 0, the same on every CPU. TensorFlow's fused
    MatMul+BiasAdd+Relu kernel does so on some CPUs and passes the NaN on on others; here
    the forward pass is finite, while the gradient still reaches the NaN: no gradient
    flows to a NaN pre-activation, but the kernel's gradient x^T·delta has NaN·0 = NaN in
    the NaN input's row."""
    return keras.ops.where(keras.ops.isnan(h), 0.0, keras.ops.relu(h))


def mlp(seed: int = 0, *, lr: float = 0.05, spe: int = 1, activation: Any = "relu"):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,), name="x"),
            keras.layers.Dense(16, activation=activation, name="hidden"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="mlp",
    )
    model.compile(
        keras.optimizers.SGD(lr, name="sgd"),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=spe,
    )
    return model


def watch(*detectors, sink=None, **kw) -> KerasStethoscope:
    return KerasStethoscope(
        detectors=list(detectors) or None, sinks=[sink or CapturingSink()], **kw
    )


def fit(model, cb, x=None, y=None, **kw):
    if x is None:
        x, y = data()
    kw.setdefault("epochs", 1)
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("shuffle", False)
    return model.fit(x, y, callbacks=[cb], verbose=0, **kw)


def assert_clean(model) -> None:
    assert "compute_loss" not in vars(model) and "train_step" not in vars(model)
    assert "apply" not in vars(model.optimizer)
    for layer in model.layers:
        assert "call" not in vars(layer)
    for metric in model.metrics:
        assert "update_state" not in vars(metric) and "result" not in vars(metric)
    assert model.train_function is None


# -- construction -----------------------------------------------------------------------
def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="stop_on"):
        KerasStethoscope(stop_on="sometimes")
    with pytest.raises(ValueError, match="intervals"):
        KerasStethoscope(intervals={"no_such_detector": 3})


def test_an_unsupported_backend_fails_at_construction_naming_it(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match=r"KERAS_BACKEND='jax'.*tensorflow.*torch"):
        KerasStethoscope()


@pytest.mark.parametrize("spe", [1, 4], ids=["one-step", "steps_per_execution=4"])
def test_a_loss_scale_optimizer_is_watched_with_its_scale_divided_out(spe):
    """Its gradients carry a scale of 2**15: the statistics are of the gradients it
    applies, so plain SGD's update is still exactly lr x the gradient."""
    model = mlp(spe=spe)
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=spe,
    )
    spy = Spy({"grads", "updates", "distributions"})
    fit(model, watch(spy, intervals={"recorder": 2}), *data())
    assert spy.seen
    for obs in spy.seen:
        np.testing.assert_allclose(obs.update_norm, 0.05 * obs.grad_norm, rtol=1e-4)
        assert np.all(obs.grad_norm < 10.0)
        # no gradient element above 10, where the scaled ones lie
        above_ten = 2 + int(np.searchsorted(DISTRIBUTION_EDGES, 10.0))
        assert obs.grad_hist[:, above_ten:].sum() == 0 and obs.grad_hist.sum() > 0
    assert_clean(model)


def test_mixed_bfloat16_trains_and_is_watched():
    """Under a mixed policy, layers autocast float32 variables when they read them; the
    probe's own variables keep their dtype (the forward rows are written inside calls)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = mlp()
        spy = Spy({"grads", "outputs"})
        x, y = data()
        fit(model, watch(spy), x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert spy.seen and all(np.isfinite(o.grad_norm).all() for o in spy.seen)
    assert all(np.isfinite(o.act_rms).all() for o in spy.seen if o.act_rms is not None)
    assert_clean(model)


def test_an_uncompiled_model_is_refused_with_advice():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    cb = watch()
    cb.set_model(model)
    with pytest.raises(ValueError, match="compile"):
        cb.on_train_begin()


# -- what the graph measures ----------------------------------------------------------------
def test_sampled_steps_carry_the_true_gradients_updates_inputs_and_labels():
    x, y = data()
    model = mlp(lr=0.05)
    spy = Spy({"loss", "grads", "updates", "units", "inputs", "labels", "outputs"})
    cb = watch(spy, intervals={"recorder": 3}, escalate=False)
    fit(model, cb, x, y)
    steps = [o.step for o in spy.seen]
    assert steps == list(range(0, N // BATCH, 3))
    for obs in spy.seen:
        # plain SGD: the update is exactly lr x the gradient, layer by layer
        np.testing.assert_allclose(obs.update_norm, 0.05 * obs.grad_norm, rtol=1e-4)
        assert obs.names == (
            "mlp/hidden/kernel",
            "mlp/hidden/bias",
            "mlp/head/kernel",
            "mlp/head/bias",
        )
        batch = slice(obs.step * BATCH, (obs.step + 1) * BATCH)
        np.testing.assert_allclose(obs.input_sq, np.mean(x[batch] ** 2, axis=0), rtol=1e-5)
        assert obs.input_count == BATCH
        assert np.array_equal(np.bincount(obs.labels), np.bincount(y[batch]))
        assert obs.unit_names == ("hidden", "head")
        assert [len(u) for u in obs.unit_zero] == [16, CLASSES]
        assert obs.unit_samples == BATCH  # dead_relu's look back counts samples
        assert obs.act_kinds == ("layer", "layer")
    first = spy.seen[0]
    assert first.prev_weight_norm[1] == 0.0  # the bias starts at zero
    np.testing.assert_allclose(first.fan_in[[0, 2]], [FEATURES, 16])


def test_the_loss_is_judged_on_every_step_and_matches_the_batch_loss():
    x, y = data()
    model = mlp()
    spy = Spy({"loss"})
    fit(model, watch(spy), x, y)
    assert [o.step for o in spy.seen] == list(range(N // BATCH))
    losses = [o.loss for o in spy.seen]
    assert all(np.isfinite(losses)) and losses[0] > losses[-1] * 0.5


def test_a_nan_batch_is_caught_on_its_own_step_and_stops_training():
    x, y = data()
    x[5 * BATCH + 3, 2] = np.nan  # the batch of step 5
    model = mlp(activation="tanh")
    sink = CapturingSink()
    cb = watch(sink=sink)
    history = fit(model, cb, x, y, epochs=3)
    assert cb.stopped_by is not None and cb.stopped_by.step == 5
    assert len(history.history["loss"]) == 1  # stopped in the first epoch
    at5 = {f.detector for f in sink.findings if f.step == 5}
    # the NaN step's own gradients and weights were reduced, in the graph, at once
    assert {"nonfinite_loss", "nonfinite_gradients", "nonfinite_weights"} <= at5
    assert_clean(model)


@pytest.mark.parametrize("spe", [1, 4], ids=["one-step", "steps_per_execution=4"])
def test_a_nan_that_relu_hides_from_the_loss_is_caught_in_the_gradients(spe):
    # A ReLU that maps NaN to 0 (as TensorFlow's fused one does on some CPUs; here built
    # explicitly, so on every CPU): the loss stays finite (TerminateOnNaN sees nothing)
    # while the NaN input's weight row turns NaN through the gradient. One step an
    # execution, the host tests each gradient's sum of squares; with several, the graph
    # tests their sum and records the bad step's gradient norms, and the weights are read
    # after the execution (steps 4-7): at its last step.
    x, y = data()
    x[5 * BATCH + 3, 2] = np.nan
    plain = mlp(spe=spe, activation=relu_hiding_nan)
    history = fit(plain, keras.callbacks.TerminateOnNaN(), x, y, epochs=2)
    assert np.all(np.isfinite(history.history["loss"]))
    kernel = plain.layers[0].kernel.numpy()
    assert np.isnan(kernel[2]).all() and np.isfinite(np.delete(kernel, 2, axis=0)).all()
    model = mlp(spe=spe, activation=relu_hiding_nan)
    sink = CapturingSink()
    cb = watch(sink=sink)
    fit(model, cb, x, y, epochs=2)
    assert cb.stopped_by is not None and cb.stopped_by.step == 5
    assert cb.stopped_by.detector == "nonfinite_gradients"
    assert cb.stopped_by.where == "mlp/hidden/kernel"
    weights = sink.by_detector("nonfinite_weights")
    assert [(f.step, f.where) for f in weights] == [(5 if spe == 1 else 7, "mlp/hidden/kernel")]


def test_tanh_saturation_is_seen_through_the_layer_outputs():
    x, y = data()
    model = mlp(activation="tanh")
    dense = model.layers[0]
    dense.kernel.assign(dense.kernel.numpy() * 40.0)
    spy = Spy({"activations"})
    fit(model, watch(spy, intervals={"recorder": 2}, escalate=False), x, y)
    obs = spy.seen[0]
    assert obs.act_names == ("hidden/tanh",) and obs.act_kinds == ("tanh",)
    h = np.tanh(x[:BATCH] @ dense.kernel.numpy() + dense.bias.numpy())
    assert obs.act_saturated[0] > 0.5
    assert abs(obs.act_saturated[0] - np.mean(np.abs(h) >= np.tanh(5.0))) < 0.1


# -- what it leaves behind ------------------------------------------------------------------
def _config_of(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("config.json"))


def test_save_and_load_round_trip_holds_nothing_of_stethoscope(tmp_path):
    x, y = data()
    watched, plain = mlp(seed=1), mlp(seed=1)
    fit(watched, watch(), x, y)
    fit(plain, keras.callbacks.TerminateOnNaN(), x, y)
    watched.save(tmp_path / "watched.keras")
    plain.save(tmp_path / "plain.keras")
    assert _config_of(tmp_path / "watched.keras") == _config_of(tmp_path / "plain.keras")
    with zipfile.ZipFile(tmp_path / "watched.keras") as z:
        assert not any(b"stethoscope" in z.read(n) for n in z.namelist())
    loaded = keras.models.load_model(tmp_path / "watched.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), watched.predict(x, verbose=0))
    assert len(loaded.weights) == len(plain.weights)


def test_a_checkpoint_saved_during_fit_holds_nothing_of_stethoscope(tmp_path):
    x, y = data()
    model = mlp()
    ckpt = keras.callbacks.ModelCheckpoint(tmp_path / "mid.keras")
    model.fit(x, y, epochs=2, batch_size=BATCH, verbose=0, callbacks=[watch(), ckpt])
    loaded = keras.models.load_model(tmp_path / "mid.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    with zipfile.ZipFile(tmp_path / "mid.keras") as z:
        assert not any(b"stethoscope" in z.read(n) for n in z.namelist())


def test_after_fit_the_model_trains_without_the_probe():
    x, y = data()
    model = mlp()
    cb = watch()
    fit(model, cb, x, y)
    assert_clean(model)
    losses = cb._probe.variables["losses"]
    before = losses.numpy().copy()
    fit(model, keras.callbacks.TerminateOnNaN(), x, y)  # retraced with no wrapper in it
    np.testing.assert_array_equal(losses.numpy(), before)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)


@pytest.mark.parametrize("separate", [False, True], ids=["dense-relu", "dense-then-activation"])
def test_a_watched_fit_trains_bit_for_bit_as_an_unwatched_one(separate):
    """Steps the sampler skips run the light train function, which does not touch the
    layers' outputs: TensorFlow fuses MatMul+BiasAdd+Relu as it does without the probe,
    and the weights after every step are those of the unwatched fit, to the bit. That is
    behaviour, not only speed: the last batch (an unsampled step) holds a NaN, and where
    the fused kernel turns a NaN into 0 (on some CPUs; others pass it on, fused or not),
    reading the Dense output on that step would unfuse the ReLU and send the NaN on to
    the head's weights. (On a sampled step the heavy function does read it: the README
    says so.) Nothing here depends on what the CPU does with the NaN: the two fits run
    on the same one, and NaNs compare equal where both have them."""
    x, y = data()
    x, y = np.concatenate([x] * 3), np.concatenate([y] * 3)
    x[-1, 0] = np.nan

    def trained(callbacks):
        keras.utils.set_random_seed(3)
        hidden = (
            [keras.layers.Dense(16), keras.layers.Activation("relu")]
            if separate
            else [keras.layers.Dense(16, activation="relu")]
        )
        model = keras.Sequential([keras.Input((FEATURES,)), *hidden, keras.layers.Dense(CLASSES)])
        model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        steps: list[list[np.ndarray]] = []  # the weights after each step
        keep = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: steps.append(model.get_weights())
        )
        model.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[*callbacks, keep]
        )
        return steps

    spy = Spy({"grads", "outputs"})
    watched = trained([watch(spy, escalate=False, stop_on=None, intervals={"recorder": 16})])
    assert [o.step for o in spy.seen] == [0, 16]  # the heavy function ran, reading outputs
    plain = trained([])
    assert len(plain) == len(watched) == len(x) // BATCH
    assert all(np.isfinite(w).all() for w in plain[-2])  # every step but the last: finite
    assert np.isnan(plain[-1][0]).any()  # the fault reached the first kernel, unwatched
    for step, (a_step, b_step) in enumerate(zip(plain, watched, strict=True)):
        for a, b in zip(a_step, b_step, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"the weights after step {step}")


def test_the_loss_ring_never_reaches_the_logs():
    """The train step hands the probe its loss ring with the logs; the dispatcher takes it
    out before fit, the other callbacks or the History see them."""
    seen: list[set] = []

    class Logs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(set(logs or {}))

    x, y = data()
    model = mlp()
    spy = Spy({"loss"})
    grads = Spy({"grads", "inputs", "outputs"})  # sampled steps: the heavy function's logs
    grads.name = "sampled"
    cb = watch(spy, grads, intervals={"sampled": 4})
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[cb, Logs()])
    assert grads.seen and all(o.grad_norm is not None for o in grads.seen)
    assert seen and all(keys == {"loss"} for keys in seen)
    assert set(history.history) == {"loss"}
    logged = history.history["loss"]
    assert len(spy.seen) == 2 * N // BATCH and all(np.isfinite(o.loss) for o in spy.seen)
    assert np.mean([o.loss for o in spy.seen[-N // BATCH :]]) == pytest.approx(logged[-1], 1e-5)


def test_what_a_sampled_step_hands_back_is_that_steps_own_numbers():
    """The heavy step returns its measurements with its logs (no variable written or
    read), and the gradient norms come with the loss: they are the numbers of that very
    step. Plain SGD's update is the step's learning rate times its gradient, the input
    statistics are those of its batch, and the learning rate is the one a schedule gives
    the step."""
    x, y = data()
    model = mlp()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5)
    model.compile(
        keras.optimizers.SGD(schedule), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    spy = Spy({"grads", "weights", "updates", "inputs", "outputs"})
    cb = watch(spy, escalate=False, intervals={"recorder": 3})
    steps = N // BATCH
    fit(model, cb, x, y, steps_per_epoch=steps - 1)  # the last step is not sampled
    assert [o.step for o in spy.seen] == list(range(0, steps - 1, 3))
    for o in spy.seen:  # the rate the step's update was taken at (after it: the next one's)
        assert o.lr == pytest.approx(float(schedule(o.step)), rel=1e-6)
        np.testing.assert_allclose(o.update_norm, o.lr * o.grad_norm, rtol=1e-4)
        batch = x[o.step * BATCH : (o.step + 1) * BATCH]
        np.testing.assert_allclose(o.input_sq, np.mean(batch**2, axis=0), rtol=1e-5)
        assert np.isfinite(o.act_rms).all()


def test_a_step_that_plans_the_gradient_norms_alone_runs_the_light_function():
    """The light step's ring carries every gradient's sum of squares (one step an
    execution, in a graph): a step planning the gradient norms alone (a gradient norm's
    suspicion raises its readers only) takes them from it, traces no heavy function, and
    they are that step's true gradient norms."""
    import tensorflow as tf

    x, y = data()
    model = mlp()
    grads = Spy({"grads"})
    cb = watch(grads, escalate=False, intervals={"recorder": 2})
    before: dict[int, list[np.ndarray]] = {}

    class Weights(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            before[batch] = [np.array(v) for v in model.get_weights()]

    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Weights(), cb])
    assert cb._probe.functions.made() == ["light"]
    assert [o.step for o in grads.seen] == list(range(0, N // BATCH, 2))
    twin = mlp()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for o in grads.seen:
        twin.set_weights(before[o.step])
        batch = slice(o.step * BATCH, (o.step + 1) * BATCH)
        with tf.GradientTape() as tape:
            value = loss(y[batch], twin(x[batch], training=True))
        true = [np.linalg.norm(g) for g in tape.gradient(value, twin.trainable_variables)]
        np.testing.assert_allclose(o.grad_norm, true, rtol=1e-5, err_msg=f"step {o.step}")


def weights_every_2_inputs_every_4():
    """Two spies, one planning the weight norms every 2 steps and one the inputs every 4,
    and a callback with only them, at fixed intervals."""
    weights = Spy({"weights"})
    weights.name = "w"
    inputs = Spy({"inputs"})
    inputs.name = "i"
    return weights, inputs, watch(weights, inputs, escalate=False, intervals={"w": 2, "i": 4})


def test_one_heavy_function_serves_every_step_whose_probes_it_measures():
    """The first sampled step (the weights and the inputs) traces the one heavy
    function; the steps that plan the weights alone run it too (a trace of the whole
    step costs seconds, its extra reductions little), and each spy still sees only its
    own steps, with that step's weight norms."""
    x, y = data()
    model = mlp()
    weights, inputs, cb = weights_every_2_inputs_every_4()
    fit(model, cb, x, y)
    probe = cb._probe
    handed: dict[int, set[str]] = {}
    real = probe.dispatch

    def dispatch(*args, **kwargs):
        logs = real(*args, **kwargs)
        if probe.heavy:
            handed[probe.sampled_at()] = set(probe.variables._returned)
        return logs

    probe.dispatch = dispatch
    fit(model, cb, x, y)
    steps = N // BATCH
    assert sorted(handed) == list(range(steps, 2 * steps, 2))
    for step, names in handed.items():
        assert names - {"sampled_at", "input_sq", "input_shape", "weight_norm"} == set(), step
    assert [o.step for o in weights.seen] == list(range(0, 2 * steps, 2))
    assert all(np.isfinite(o.weight_norm).all() for o in weights.seen)
    assert [o.step for o in inputs.seen] == list(range(0, 2 * steps, 4))
    assert all(o.input_sq is not None for o in inputs.seen)
    made = {k for k in probe.functions.made() if k != "light"}
    assert made == {frozenset({"weights", "inputs"})}


def test_a_set_no_traced_function_measures_traces_one_for_it_and_all_before():
    """A step planning a statistic no traced heavy function measures traces one for it
    and every statistic traced before, so the next set inside them traces nothing."""
    x, y = data()
    model = mlp()
    *_, cb = weights_every_2_inputs_every_4()
    fit(model, cb, x, y)
    probe = cb._probe
    first = frozenset({"weights", "inputs"})
    functions = probe.functions
    assert functions.whole_key(frozenset({"weights"})) == first
    assert functions.whole_key(frozenset({"units"})) == first | {"units"}
    functions.get(first | {"units"})  # made as dispatch makes it (traced on its first call)
    assert functions.whole_key(frozenset({"inputs", "units"})) == first | {"units"}
    assert functions.whole_key(first) == first  # the smallest that measures them


# -- fits, executions, model styles ---------------------------------------------------------
def test_fits_in_a_row_continue_the_step_count():
    x, y = data()
    model = mlp()
    spy = Spy({"loss"})
    traces = []

    def counted(y_true, y_pred):  # runs in Python only when a train step is traced
        traces.append(1)
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    model.compile(keras.optimizers.SGD(0.05), counted)
    cb = watch(spy)
    fit(model, cb, x, y)
    assert len(traces) == 1  # the light train function (the loss alone samples nothing)
    probe = cb._probe
    fit(model, cb, x, y, epochs=2)
    steps = [o.step for o in spy.seen]
    assert steps == list(range(3 * N // BATCH))
    assert len(cb.summaries) == 3
    assert_clean(model)
    # the second fit reused the probe and its traced function
    assert cb._probe is probe and len(traces) == 1
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    fit(model, cb, x, y)  # a new optimizer: a new probe
    assert cb._probe is not probe
    assert_clean(model)


def test_steps_per_execution_judges_every_step_and_samples_at_most_one_per_execution():
    x, y = data(n=10 * BATCH)
    x[6 * BATCH, 0] = np.inf  # step 6: inside the second execution of 4 steps
    model = mlp(spe=4)
    spy = Spy({"loss"})
    grads = Spy({"grads"})
    grads.name = "grads_spy"  # type: ignore[misc]
    sink = CapturingSink()
    cb = KerasStethoscope(
        detectors=[spy, grads, *_defaults("nonfinite_loss")],
        sinks=[sink],
        intervals={"grads_spy": 1},
        stop_on=None,
    )
    fit(model, cb, x, y, epochs=1)
    assert [o.step for o in spy.seen] == list(range(10))  # 4 + 4 + 2 steps
    sampled = [o.step for o in grads.seen]
    assert sampled == [0, 4, 6, 8]  # one per execution, and the non-finite step itself
    nan = [f for f in sink.findings if f.detector == "nonfinite_loss"]
    assert nan[0].step == 6


def test_validation_losses_reach_the_monitor():
    x, y = data()
    model = mlp()
    spy = Spy({"val"})
    history = fit(model, watch(spy), x, y, epochs=2, validation_data=data(seed=3, n=64))
    assert [o.val_loss for o in spy.seen] == pytest.approx(history.history["val_loss"])
    assert all(o.train_loss is not None for o in spy.seen)


def test_functional_and_subclassed_models_are_probed_alike():
    x, y = data()
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, activation="sigmoid", name="hidden")(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="sigmoid", name="hidden")
            self.head = keras.layers.Dense(CLASSES, name="head")

        def call(self, x):
            return self.head(self.hidden(x))

    for model in (functional, Sub()):
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model(x[:1])
        spy = Spy({"units", "activations", "outputs"})
        fit(model, watch(spy, intervals={"recorder": 4}, escalate=False), x, y)
        obs = spy.seen[0]
        assert obs.unit_names == ("hidden", "head")
        assert obs.act_names == ("hidden", "hidden/sigmoid", "head")
        assert obs.act_kinds == ("layer", "sigmoid", "layer")
        assert_clean(model)


def test_raise_on_raises_and_leaves_the_model_clean():
    x, y = data()
    x[2 * BATCH, 0] = np.nan
    model = mlp()
    cb = watch(raise_on="error", stop_on=None)
    with pytest.raises(TrainingProblem, match="at step 2"):
        fit(model, cb, x, y)
    assert_clean(model)


def test_a_custom_train_step_that_returns_no_loss_warns_once():
    """Its own train step never calls compute_loss and logs its loss under another key
    (a loss it returns as ``loss`` is found: ``test_keras_own_loss.py``)."""
    import tensorflow as tf

    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(CLASSES)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                logits = self(x, training=True)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                )
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"xent": loss}

    x, y = data()
    model = Custom()
    model.compile("sgd")
    spy = Spy({"grads"})
    callback = watch(spy, intervals={"recorder": 2}, escalate=False)
    with pytest.warns(RuntimeWarning, match="neither called model.compute_loss nor returned"):
        fit(model, callback, x, y)
    assert spy.seen and all(np.all(np.isfinite(o.grad_norm)) for o in spy.seen)
    # and the epoch summary does not claim a loss it never saw
    verdict = callback.summaries[-1].verdict
    assert "no loss seen" in verdict and "loss checked every step" not in verdict, verdict


def _defaults(*names: str) -> list[Detector]:
    from stethoscope.detectors import default_detectors

    return [d for d in default_detectors() if d.name in names]


# -- the torch backend ----------------------------------------------------------------------
TORCH_SCRIPT = textwrap.dedent(
    """
    import numpy as np, keras
    from stethoscope import KerasStethoscope
    from stethoscope.testing import CapturingSink
    assert keras.backend.backend() == "torch"
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 12)).astype("float32")
    y = np.argmax(x[:, :3], axis=1).astype("int64")
    x[5 * 32, 0] = np.nan
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink])
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.stopped_by.detector == "nonfinite_loss" and cb.stopped_by.step == 5, cb.stopped_by
    assert "compute_loss" not in vars(model) and "apply" not in vars(model.optimizer)
    print("OK", sorted({f.detector for f in sink.findings}))
    """
)


def test_the_torch_backend_works_in_its_own_process():
    pytest.importorskip("torch")
    env = dict(os.environ, KERAS_BACKEND="torch")
    out = subprocess.run(
        [sys.executable, "-c", TORCH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout and "nonfinite_loss" in out.stdout


@pytest.mark.parametrize("mode", ["run_eagerly", "jit_compile"])
def test_eager_and_xla_train_steps_are_probed_alike(mode):
    x, y = data()
    model = mlp(activation="tanh")
    model.compile(
        keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **{mode: True},
    )
    spy = Spy({"loss", "grads", "updates", "outputs"})
    x[4 * BATCH, 0] = np.nan
    sink = CapturingSink()
    cb = KerasStethoscope(
        detectors=[spy, *_defaults("nonfinite_loss", "nonfinite_gradients")],
        sinks=[sink],
        stop_on=None,
    )
    fit(model, cb, x, y)
    assert spy.seen[0].step == 0
    np.testing.assert_allclose(spy.seen[0].update_norm, 0.05 * spy.seen[0].grad_norm, rtol=1e-4)
    assert spy.seen[0].act_kinds == ("layer", "layer")
    assert any(f.detector == "nonfinite_gradients" and f.step == 4 for f in sink.findings), [
        (f.step, f.detector) for f in sink.findings
    ]
    assert_clean(model)


def test_unit_rows_keep_their_batch_size_after_the_inputs_stop_being_probed():
    from stethoscope.detectors import default_detectors

    spy = Spy({"units"})
    model = mlp()
    fit(model, watch(*default_detectors(), spy), epochs=3)
    assert len(spy.seen) == 3 * N // BATCH  # the start: every step sampled
    # past unnormalized_input's 256 samples the inputs are no longer probed
    assert any(o.input_count == 0 for o in spy.seen)
    assert {o.unit_samples for o in spy.seen} == {BATCH}


def test_a_recurrent_cell_inside_its_loop_is_probed():
    """A GRU's cell runs inside a while loop, where a tensor cannot leave the loop's body:
    its forward row goes through the probe's variable and is read back after the loop,
    in the same sampled step as the other layers' rows."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6, 3)).astype("float32")
    y = (x[:, -1, 0] > 0).astype("int64")
    model = keras.Sequential(
        [keras.Input((6, 3)), keras.layers.GRU(8, name="gru"), keras.layers.Dense(2, name="head")]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    spy = Spy({"grads", "outputs", "trace"})
    cb = watch(spy, escalate=False, intervals={"recorder": 2})
    fit(model, cb, x, y, epochs=2)
    assert spy.seen and cb._probe.regime.direct
    for obs in spy.seen:
        assert "gru_cell" in " ".join(obs.trace_names)
        assert obs.trace_finite.all() and np.isfinite(obs.grad_norm).all()
    assert_clean(model)


# -- a statistic added through the registry, and the run's context ------------------------------
def test_distributions_are_the_histograms_of_the_steps_weights_and_gradients():
    import tensorflow as tf
    from _histograms import magnitude_histogram

    x, y = data()
    model = mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    spy = Spy({"distributions"})
    fit(model, watch(spy), x[:BATCH], y[:BATCH])  # one step
    (obs,) = spy.seen
    twin = mlp()
    twin.set_weights(before)
    with tf.GradientTape() as tape:
        loss = twin.compute_loss(y=y[:BATCH], y_pred=twin(x[:BATCH], training=True))
    grads = tape.gradient(loss, twin.trainable_variables)
    assert obs.names == tuple(v.path for v in model.trainable_variables)
    for v, g, weights, grad_hist in zip(
        model.trainable_variables, grads, obs.weight_hist, obs.grad_hist, strict=True
    ):
        assert weights.tolist() == magnitude_histogram(v.numpy()).tolist(), v.path
        # the twin's gradient is computed again, eagerly: equal up to float rounding, which
        # may move an element across a bin edge
        assert np.abs(grad_hist - magnitude_histogram(g.numpy())).sum() <= 2, v.path
        assert grad_hist.sum() == np.prod(v.shape)


def test_keras_sinks_receive_the_runs_context():
    sink = CapturingSink()
    fit(mlp(), watch(sink=sink))
    context = sink.context
    assert (context.framework, context.rank, context.world_size) == ("keras", 0, 1)
    assert context.printer is None  # verbose=0: nothing to print around


def test_a_nan_batch_names_the_bad_gradient_and_weight_on_its_step_whatever_was_planned():
    """A step planned for another statistic (here the distributions, every step) with a
    NaN batch: the norms the graph recorded for the non-finite step are judged there by
    every detector that reads them, due or not."""
    from stethoscope.detectors import default_detectors

    x, y = data()
    x[5 * BATCH, 0] = np.nan
    sink = CapturingSink()
    detectors = [*default_detectors(), Spy({"distributions"})]
    cb = KerasStethoscope(detectors=detectors, sinks=[sink], stop_on=None, escalate=False)
    fit(mlp(activation="tanh"), cb, x, y)  # no fused ReLU to turn the NaN into 0
    for name in ("nonfinite_loss", "nonfinite_gradients", "nonfinite_weights"):
        found = sink.by_detector(name)
        assert found and found[0].step == 5, (name, [(f.step, f.where) for f in found])


def test_the_detectors_know_an_adam_fit_is_adaptive():
    x, y = data()
    model = mlp()
    model.compile(
        keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    callback = KerasStethoscope(sinks=[])
    fit(model, callback, x, y)
    assert all(d.setup.adaptive for d in callback.monitor.detectors)


def test_the_detectors_advice_knows_the_optimizers_clipping_and_schedule():
    """A Keras fit with clipnorm and a schedule: the exploding-gradients advice says the run
    clips already (and does not tell it to), and looks at the schedule's warm-up."""
    x, y = data()
    model = mlp()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 100, 0.9)
    model.compile(
        keras.optimizers.SGD(schedule, clipnorm=1.0),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callback = KerasStethoscope(sinks=[])
    fit(model, callback, x, y)
    explode = next(d for d in callback.monitor.detectors if d.name == "exploding_gradients")
    setup = explode.setup
    assert (setup.framework, setup.clipping, setup.scheduler) == ("keras", "clipnorm=1.0", True)
    assert setup.precision is None and not setup.adaptive  # SGD: a huge gradient, a huge step
    from stethoscope.advice import clipping_advice, warmup_advice

    assert "clipped already (clipnorm=1.0)" in clipping_advice(setup)
    assert warmup_advice(setup) == "check your schedule's warm-up"
    # and the summary table's few words do not tell it to clip either
    by_name = {d.name: d for d in callback.monitor.detectors}
    assert explode.current_advice() == "lower the LR or add warm-up (gradients are clipped already)"
    assert by_name["nonfinite_loss"].current_advice() == "check the batch; lower the LR"
    assert by_name["loss_spike"].current_advice() == "inspect that batch"


def test_a_classifier_sure_of_every_sample_has_no_dead_units():
    # A softmax head so sure of the (single) class that its output is exactly one-hot in
    # float32: the loss passes back no gradient, and every weight's gradient is zero, in
    # the live ReLU layer and the head alike. That is no dead unit (it was an error).
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(
                CLASSES,
                activation="softmax",
                bias_initializer=keras.initializers.Constant([200.0, 0.0, 0.0]),
                name="head",
            ),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    x, _ = data()
    sink = CapturingSink()
    fit(model, watch(sink=sink, stop_on=None), x, np.zeros(N, "int64"), epochs=4)
    assert sink.by_detector("dead_relu") == []
    assert sink.by_detector("vanishing_gradients")  # what is wrong is said, once


@pytest.mark.parametrize("nested", [False, True], ids=["first-layers", "inside-a-base-model"])
def test_inputs_the_model_rescales_itself_are_judged_as_its_first_layer_sees_them(nested):
    # keras.applications' MobileNet and EfficientNet take pixels in 0..255 and rescale
    # them with their own first layer: no unnormalized_input there, as without the layer
    from stethoscope.detectors import UnnormalizedInput

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(N, 8, 8, 3)).astype("float32")
    y = rng.integers(0, CLASSES, N).astype("int64")

    def model(rescale: bool) -> Any:
        keras.utils.set_random_seed(0)
        first = [keras.layers.Rescaling(1 / 127.5, offset=-1)] if rescale else []
        body = [*first, keras.layers.Conv2D(4, 3), keras.layers.Flatten()]
        if nested:  # a base model, as keras.applications builds one, under a head
            inputs = keras.Input((8, 8, 3))
            h = inputs
            for layer in body:
                h = layer(h)
            body = [keras.Model(inputs, h)]
        m = keras.Sequential([keras.Input((8, 8, 3)), *body, keras.layers.Dense(CLASSES)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    warned = {}
    for rescale in (False, True):
        sink = CapturingSink()
        fit(model(rescale), watch(UnnormalizedInput(), sink=sink), x, y)
        warned[rescale] = [f.message for f in sink.by_detector("unnormalized_input")]
    assert warned[False] and "RMS of" in warned[False][0]  # raw pixels, measured
    assert warned[True] == []


# -- a language model's targets ---------------------------------------------------------------
VOCAB, WINDOW = 40, 8


def next_words(n: int = 1024, seed: int = 0):
    """Windows of ``WINDOW`` token ids of a Zipfian text and the token after each (the
    rarest of 40 words has 1/40 of the commonest's share)."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, VOCAB + 1)
    words = rng.choice(VOCAB, size=n + WINDOW, p=p / p.sum())
    x = np.stack([words[i : i + WINDOW] for i in range(n)]).astype("int32")
    return x, words[WINDOW:].astype("int64")


def word_model():
    """An embedding of the vocabulary, pooled over the window, and a decoder over the
    vocabulary: the model predicts the tokens it reads."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((WINDOW,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 16),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(VOCAB),
        ]
    )
    model.compile(
        keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def test_a_language_models_next_words_are_no_classes():
    """Word frequencies are Zipfian: class_imbalance called them imbalanced labels, and
    told the user to weight the loss by class. A classifier's imbalanced labels it still
    names: test_keras_faults' class-imbalance."""
    sink = CapturingSink()
    x, y = next_words()
    with pytest.warns(RuntimeWarning, match="same 40 tokens, as a language model does"):
        fit(word_model(), watch(sink=sink), x, y, epochs=1)
    assert sink.at_least("warning") == []


# -- the optimizer built before the first trace -----------------------------------------------
class _BuiltAtBegin(keras.callbacks.Callback):
    """Whether the optimizer was built before the first step ran (its batch's start,
    after the callbacks before this one)."""

    built = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.built is None:
            self.built = self.model.optimizer.built


def test_keras_own_train_step_has_its_optimizer_built_as_keras_would_before_the_first_trace():
    """A tf.function that creates variables is traced twice: the callback builds the
    optimizer first, on the model's trainable variables and in its name scope, so its
    slots are the very ones (names and values) a plain fit builds in its first step."""
    x, y = data()
    plain = mlp()
    plain.fit(x, y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    model, seen = mlp(), _BuiltAtBegin()
    model.fit(x, y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch(), seen])
    assert seen.built is True
    paths = [v.path for v in model.optimizer.variables]
    assert paths == [
        v.path.replace(plain.optimizer.name, model.optimizer.name, 1)
        for v in plain.optimizer.variables
    ]
    for a, b in zip(model.optimizer.variables, plain.optimizer.variables, strict=True):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


class OwnStep(keras.Model):
    """A train_step of the user's, which may apply its optimizer to some variables only."""

    def __init__(self):
        super().__init__(name="own_step")
        self.body, self.head = keras.layers.Dense(8), keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.head(self.body(x))

    def train_step(self, data):
        x, y = data
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, self(x), True))
        head = self.head.trainable_weights
        self.optimizer.apply_gradients(zip(tape.gradient(loss, head), head, strict=True))
        return {"loss": loss}


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a GradientTape step")
def test_a_train_step_of_the_users_builds_its_optimizer_itself():
    """Its optimizer is left to the user's step: built on the head alone, as without the
    callback, not on every trainable variable."""
    x, y = data()
    model, seen = OwnStep(), _BuiltAtBegin()
    model(x[:1])
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(x, y, epochs=1, batch_size=BATCH, verbose=0, callbacks=[watch(), seen])
    assert seen.built is False
    assert len(model.optimizer.variables) == 2 + 2 * len(model.head.trainable_weights)
