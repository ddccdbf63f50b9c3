"""The Keras forms of the loss fed the wrong kind of output, beyond one softmax output and
one sparse label: ``logits_mismatch`` reads the output as the compiled loss reads it.

A binary cross-entropy takes each element as a probability of its own (a multi-label
sigmoid's, whose rows do not sum to 1); a categorical one takes each slice along its
``axis`` as a distribution (``axis=1``: a channels-first sequence, classes before the
steps). Each fault is named, and each twin, written right, is quiet."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from keras import ops  # noqa: E402

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
    # Keras' own warning of a softmax or sigmoid output fed to from_logits=True
    pytest.mark.filterwarnings("ignore:.*does not represent logits:UserWarning"),
]

CLASSES, STEPS, T = 4, 48, 6


def data(seq: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (STEPS * 16, T, 3) if seq else (STEPS * 16, 10)
    x = rng.normal(size=shape).astype("float32")
    y = x[..., :CLASSES].argmax(-1) if not seq else x[:, :, :3].sum(1).argmax(-1)
    return x, y.astype("int64")


class InStep(keras.Sequential):
    """A train step that applies ``self.in_step`` to the model's output before the
    compiled loss (as a user writes a softmax there)."""

    in_step = None

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.in_step(self(x, training=True))
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        tvars = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, tvars), tvars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


def fit(head: list, loss, targets, x, *, in_step=None, detector="logits_mismatch") -> list[int]:
    """The steps at which ``detector`` warned, over a fit of :data:`STEPS` steps of an
    MLP (or, for a sequence ``x``, a GRU scoring every step) ending in ``head``, the
    logits and saturation detectors at every step."""
    keras.utils.set_random_seed(0)
    body = (
        [keras.layers.GRU(16, return_sequences=True)]
        if x.ndim == 3
        else [keras.layers.Dense(32, activation="relu")]
    )
    cls = InStep if in_step is not None else keras.Sequential
    model = cls([keras.Input(x.shape[1:]), *body, *head])
    if in_step is not None:
        model.in_step = in_step
    model.compile(keras.optimizers.Adam(1e-2), loss)
    sink = CapturingSink()
    every = {"logits_mismatch": 1, "saturated_activation": 1}
    steth = KerasStethoscope(sinks=[sink], stop_on=None, intervals=every)
    model.fit(x, targets, batch_size=16, epochs=1, verbose=0, callbacks=[steth])
    return [f.step for f in sink.findings if f.detector == detector and f.severity != "info"]


def dense(activation=None):
    return keras.layers.Dense(CLASSES, activation=activation)


losses = keras.losses


def test_a_multi_label_sigmoid_fed_to_binary_cross_entropy_from_logits_is_named():
    x, y = data()
    multi = np.eye(CLASSES, dtype="float32")[y]
    assert fit([dense("sigmoid")], losses.BinaryCrossentropy(from_logits=True), multi, x)


def test_a_multi_label_sigmoid_fed_to_binary_cross_entropy_of_probabilities_is_quiet():
    x, y = data()
    multi = np.eye(CLASSES, dtype="float32")[y]
    assert fit([dense("sigmoid")], losses.BinaryCrossentropy(), multi, x) == []
    assert fit([dense()], losses.BinaryCrossentropy(from_logits=True), multi, x) == []


def test_a_confident_output_sigmoid_under_its_own_likelihood_is_not_saturated():
    """Its tails lose nothing: binary cross-entropy of a sigmoid's probabilities has the
    gradient ``p - y``. (Most of this head's inputs lie past ±10 from its first step.)"""
    x, y = data()
    multi = np.eye(CLASSES, dtype="float32")[y]
    wide = keras.initializers.RandomNormal(stddev=12.0)
    head = [keras.layers.Dense(CLASSES, activation="sigmoid", kernel_initializer=wide)]
    bce = losses.BinaryCrossentropy()
    assert fit(head, bce, multi, x, detector="saturated_activation") == []
    assert fit(head, bce, multi, x) == []


def test_a_sigmoid_in_the_train_step_before_a_loss_that_takes_logits_is_named():
    x, y = data()
    multi = np.eye(CLASSES, dtype="float32")[y]
    bce = losses.BinaryCrossentropy(from_logits=True)
    assert fit([dense()], bce, multi, x, in_step=ops.sigmoid)


def test_a_softmax_over_the_classes_on_axis_1_fed_to_a_loss_that_takes_logits_is_named():
    """(N, C, T) scores, ``CategoricalCrossentropy(axis=1)``: each (N, T) slice of the
    softmax's sums to 1 over axis 1, none of its rows over the steps."""
    x, y = data(seq=True)
    targets = np.eye(CLASSES, dtype="float32")[np.repeat(y[:, None], T, 1)].transpose(0, 2, 1)
    head = [dense(), keras.layers.Permute((2, 1))]
    cce = losses.CategoricalCrossentropy(from_logits=True, axis=1)
    assert fit([*head, keras.layers.Softmax(axis=1)], cce, targets, x)
    assert fit(head, cce, targets, x) == []


def test_a_label_smoothed_loss_fed_a_softmax_is_named_and_its_logits_twin_is_quiet():
    x, y = data()
    onehot = np.eye(CLASSES, dtype="float32")[y]
    smoothed = losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    assert fit([dense("softmax")], smoothed, onehot, x)
    assert fit([dense()], smoothed, onehot, x) == []
    probs = losses.CategoricalCrossentropy(label_smoothing=0.1)
    assert fit([dense("softmax")], probs, onehot, x) == []


def test_a_softmax_in_the_train_step_is_named_and_a_log_softmax_there_is_quiet():
    x, y = data()
    sparse = losses.SparseCategoricalCrossentropy(from_logits=True)
    assert fit([dense()], sparse, y, x, in_step=ops.softmax)
    assert fit([dense()], sparse, y, x, in_step=ops.log_softmax) == []
