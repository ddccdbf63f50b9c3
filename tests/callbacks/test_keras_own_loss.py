"""A train step of the user's own that never calls ``compute_loss`` (keras.io's VAE, its
"customizing fit" guides): the loss it returns in its logs feeds the loss detectors,
however it is written, and "the loss detectors are skipped" only when there is none."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from keras import ops  # noqa: E402

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.testing import CapturingSink, RecordingDetector  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the train steps use tf.GradientTape"
)

N, FEATURES, CLASSES, BATCH = 256, 12, 3, 32
STEPS = N // BATCH


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


class OwnStep(keras.Model):
    """A classifier whose own ``train_step`` computes a cross-entropy under a
    ``tf.GradientTape`` and returns it in one of the ways users write it (``style``):

    - ``own``: ``{"loss": loss, "acc": ...}``, the step's own tensor;
    - ``metrics``: ``{m.name: m.result() for m in self.metrics}``, a ``Mean`` named
      ``loss`` among them (keras.io, "Customizing what happens in fit");
    - ``named``: ``{"loss": tracker.result(), ...}`` of a ``Mean`` named ``total_loss``
      (keras.io's VAE);
    - ``per_sample``: the tracker takes the per-sample losses, a vector;
    - ``no_key``: a ``Mean`` named ``loss`` updated, logged under another key;
    - ``none``: no loss in the logs, no tracker updated;
    - ``sum``: ``{"loss": total.result()}`` of a ``keras.metrics.Sum``, a running value.
    """

    def __init__(self, style: str, nan_at: int = -1) -> None:
        super().__init__()
        self.nan_at = nan_at
        keras.utils.set_random_seed(0)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(CLASSES)
        self.style = style
        name = "total_loss" if style == "named" else "loss"
        self.tracker = (keras.metrics.Sum if style == "sum" else keras.metrics.Mean)(name=name)
        self.acc = keras.metrics.SparseCategoricalAccuracy(name="acc")

    def call(self, x):
        return self.head(self.hidden(x))

    @property
    def metrics(self):
        return [self.tracker, self.acc]

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            per_sample = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = ops.mean(per_sample)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.acc.update_state(y, logits)
        if self.nan_at >= 0:  # a NaN in the loss it logs, from that step on (counted after apply)
            early = ops.cast(self.optimizer.iterations <= self.nan_at, "float32")
            loss = loss + ops.stop_gradient(early / early - 1.0)  # 0/0 from there on, else 0
        style = self.style
        if style == "own":
            return {"loss": loss, "acc": self.acc.result()}
        if style == "none":
            return {"acc": self.acc.result()}
        self.tracker.update_state(per_sample if style == "per_sample" else loss)
        if style == "metrics":
            return {m.name: m.result() for m in self.metrics}
        if style == "no_key":
            return {"cost": self.tracker.result(), "acc": self.acc.result()}
        return {"loss": self.tracker.result(), "acc": self.acc.result()}


def _fit(style: str, x=None, y=None, *, epochs: int = 1, **compile_kw):
    if x is None:
        x, y = data()
    model = OwnStep(style)
    model(x[:1])
    model.compile(keras.optimizers.SGD(0.1), **compile_kw)
    spy, sink = RecordingDetector({"loss"}), CapturingSink()
    callback = KerasStethoscope(detectors=[spy], sinks=[sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback]
        )
    ours = [str(w.message) for w in caught if str(w.message).startswith("stethoscope:")]
    return model, spy, callback, history, ours


def _first_loss(x, y) -> float:
    """The cross-entropy of the first batch under the initial weights."""
    model = OwnStep("own")
    logits = model(x[:BATCH])
    loss = keras.losses.sparse_categorical_crossentropy(y[:BATCH], logits, from_logits=True)
    return float(ops.convert_to_numpy(ops.mean(loss)))


@pytest.fixture(scope="module")
def reference():
    """The step losses of the ``own`` style, the step's own tensor, as judged."""
    _, spy, _, _, ours = _fit("own")
    assert ours == []
    return np.array([o.loss for o in spy.seen])


@pytest.mark.parametrize("style", ["own", "metrics", "named", "per_sample", "no_key"])
def test_the_loss_a_train_step_of_its_own_returns_is_judged_every_step(style, reference):
    """Before: "the train step never called model.compute_loss, so the loss detectors are
    skipped", and no step carried a loss. The step's loss, not the tracker's running mean
    of the epoch: the first is the first batch's cross-entropy."""
    x, y = data()
    model, spy, callback, _, ours = _fit(style, x, y)
    assert ours == []
    assert [o.step for o in spy.seen] == list(range(STEPS))
    losses = np.array([o.loss for o in spy.seen])
    assert losses[0] == pytest.approx(_first_loss(x, y), rel=1e-6)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert "loss checked every step" in callback.summaries[-1].verdict
    for metric in model.metrics:  # the tracker's wrappers are off again
        assert "update_state" not in vars(metric) and "result" not in vars(metric)
    assert "train_step" not in vars(model) and model.train_function is None


@pytest.mark.parametrize(
    "compile_kw",
    [{"steps_per_execution": 4}, {"run_eagerly": True}, {"jit_compile": True}],
    ids=["steps_per_execution=4", "run_eagerly", "jit_compile"],
)
@pytest.mark.parametrize("style", ["own", "named"])
def test_every_execution_regime_finds_it(style, compile_kw, reference):
    """A ring variable (several steps per execution), an eager step, an XLA one."""
    _, spy, _, _, ours = _fit(style, **compile_kw)
    assert ours == []
    np.testing.assert_allclose([o.loss for o in spy.seen], reference, rtol=1e-5)


def test_the_tracker_keeps_the_loss_it_logs_bit_for_bit():
    """The step's loss is read off the tracker's variables, not taken from the tensor it
    was handed: a second reader of the user's loss let TensorFlow round the tracker's sum
    otherwise, and the epoch's logged loss drifted from an unwatched fit's by an ulp."""
    x, y = data()
    model, _, _, watched, _ = _fit("named", x, y, epochs=3)
    plain_model = OwnStep("named")
    plain_model(x[:1])
    plain_model.compile(keras.optimizers.SGD(0.1))
    plain = plain_model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    assert watched.history == plain.history
    for a, b in zip(model.weights, plain_model.weights, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))


def test_a_nan_loss_in_the_logs_stops_at_its_step():
    """The loss detectors judge it: the loss it logs turns NaN at step 5 (its gradients
    stay finite, so nonfinite_loss alone can tell)."""
    x, y = data()
    model = OwnStep("named", nan_at=5)
    model(x[:1])
    model.compile(keras.optimizers.SGD(0.1))
    sink = CapturingSink()
    callback = KerasStethoscope(sinks=[sink])
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.stopped_by is not None
    assert (callback.stopped_by.detector, callback.stopped_by.step) == ("nonfinite_loss", 5)


@pytest.mark.parametrize(
    ("style", "why"),
    [
        ("none", "returned no 'loss' in its logs and updated no Mean metric named 'loss'"),
        ("sum", "the result of the metric 'loss' (Sum), a value over the epoch"),
    ],
)
def test_a_train_step_with_no_loss_says_so_once(style, why):
    _, spy, callback, _, ours = _fit(style, epochs=2)
    assert spy.seen == []
    assert len(ours) == 1 and "the loss detectors are skipped" in ours[0], ours
    assert why in ours[0], ours[0]
    assert "no loss seen" in callback.summaries[-1].verdict


TORCH_SCRIPT = textwrap.dedent(
    """
    import warnings
    import numpy as np, keras, torch
    from keras import ops
    from stethoscope import KerasStethoscope
    from stethoscope.testing import CapturingSink, RecordingDetector
    assert keras.backend.backend() == "torch"

    class OwnStep(keras.Model):
        # keras.io, "Customizing what happens in fit() with PyTorch"
        def __init__(self, style):
            super().__init__()
            keras.utils.set_random_seed(0)
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.head = keras.layers.Dense(3)
            self.style = style
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def call(self, x):
            return self.head(self.hidden(x))

        @property
        def metrics(self):
            return [self.loss_tracker]

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            logits = self(x, training=True)
            xent = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = ops.mean(xent)
            loss.backward()
            weights = list(self.trainable_weights)
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights], weights)
            if self.style == "own":
                return {"loss": loss}
            self.loss_tracker.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 12)).astype("float32")
    y = np.argmax(x[:, :3], axis=1).astype("int64")
    seen = {}
    for style in ("own", "metrics"):
        model = OwnStep(style)
        model(x[:1])
        model.compile(keras.optimizers.SGD(0.1))
        spy = RecordingDetector({"loss"})
        cb = KerasStethoscope(detectors=[spy], sinks=[CapturingSink()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[cb])
        ours = [str(w.message) for w in caught if str(w.message).startswith("stethoscope:")]
        assert ours == [], ours
        assert [o.step for o in spy.seen] == list(range(8)), [o.step for o in spy.seen]
        seen[style] = np.array([o.loss for o in spy.seen])
        assert "update_state" not in vars(model.loss_tracker)
    np.testing.assert_allclose(seen["metrics"], seen["own"], rtol=1e-5)
    assert seen["own"][0] > seen["own"][-1]
    print("OK")
    """
)


def test_the_torch_backend_finds_it_too():
    pytest.importorskip("torch")
    env = dict(os.environ, KERAS_BACKEND="torch")
    out = subprocess.run(
        [sys.executable, "-c", TORCH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
