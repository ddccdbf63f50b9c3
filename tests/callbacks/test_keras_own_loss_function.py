"""A loss function of the user's own, ``compile(loss=fn)``: Keras cannot say what it takes,
so ``logits_mismatch`` sets its value against each way of taking the output (as for a
loss a Lightning training step computes). A softmax or sigmoid applied twice is named
wherever it is written, in the model or in the function, against sparse labels or
one-hot targets; each twin, written right, is quiet."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from keras import ops  # noqa: E402

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.callbacks._keras.predictions import way_losses  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
    pytest.mark.filterwarnings("ignore:.*does not represent logits:UserWarning"),
]

CLASSES, STEPS = 4, 48
kl = keras.losses


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 16, 10)).astype("float32")
    return x, x[:, :CLASSES].argmax(-1).astype("int64")


def warned(activation, loss, targets, x) -> list:
    """The warnings of ``logits_mismatch`` over a fit of an MLP ending in a dense layer
    of ``activation``, compiled with ``loss``, the detector at every step."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(x.shape[1:]),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(CLASSES, activation=activation),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss)
    sink = CapturingSink()
    steth = KerasStethoscope(sinks=[sink], stop_on=None, intervals={"logits_mismatch": 1})
    model.fit(x, targets, batch_size=16, epochs=1, verbose=0, callbacks=[steth])
    return [f for f in sink.findings if f.detector == "logits_mismatch" and f.severity != "info"]


def softmax(p):
    """A softmax written out by hand: Keras cannot see it (on TensorFlow, a cross-entropy
    with ``from_logits=True`` takes the logits back from a softmax op or activation, and
    warns)."""
    e = ops.exp(p - ops.max(p, axis=-1, keepdims=True))
    return e / ops.sum(e, axis=-1, keepdims=True)


def softmax_then_sparse(y, p):  # a softmax in the function, before one of from_logits
    return kl.sparse_categorical_crossentropy(y, softmax(p), from_logits=True)


def sigmoid_then_binary(y, p):
    return kl.binary_crossentropy(y, 1.0 / (1.0 + ops.exp(-p)), from_logits=True)


def sparse_of_logits(y, p):
    return kl.sparse_categorical_crossentropy(y, p, from_logits=True)


def categorical_of_logits(y, p):
    return kl.categorical_crossentropy(y, p, from_logits=True)


def binary_of_logits(y, p):
    return kl.binary_crossentropy(y, p, from_logits=True)


def test_a_softmax_in_the_loss_function_is_named_in_keras_words():
    x, y = data()
    found = warned(None, softmax_then_sparse, y, x)
    assert found
    assert "softmax written in the loss function" in found[0].message
    assert "from_logits=True" in found[0].message and "nll_loss" not in found[0].message
    assert warned(None, sparse_of_logits, y, x) == []  # the twin: the logits to it


def test_a_softmax_in_the_loss_function_is_named_with_one_hot_targets():
    x, y = data()
    onehot = np.eye(CLASSES, dtype="float32")[y]

    def softmax_then_categorical(y, p):
        return kl.categorical_crossentropy(y, softmax(p), from_logits=True)

    assert warned(None, softmax_then_categorical, onehot, x)
    assert warned(None, categorical_of_logits, onehot, x) == []


def test_a_sigmoid_in_a_binary_loss_function_is_named():
    x, y = data()
    multi = np.eye(CLASSES, dtype="float32")[y]
    found = warned(None, sigmoid_then_binary, multi, x)
    assert found and "binary_crossentropy(from_logits=True)" in found[0].message
    assert "a sigmoid in the loss function" in found[0].message
    assert warned(None, binary_of_logits, multi, x) == []


def test_a_softmax_output_to_a_loss_function_of_logits_is_judged_by_what_keras_computes():
    """A softmax activation fed to a cross-entropy with ``from_logits=True``: on
    TensorFlow Keras takes the logits back from the activation (and warns), so the loss
    is the logits' own and nothing is wrong with the training; elsewhere the softmax is
    applied twice, and named."""
    x, y = data()
    onehot = np.eye(CLASSES, dtype="float32")[y]
    found = warned("softmax", categorical_of_logits, onehot, x)
    if keras.backend.backend() == "tensorflow":
        assert found == []
    else:
        assert found and "drop the softmax activation" in found[0].message


def test_a_loss_of_keras_own_computes_no_ways():
    """Keras' own cross-entropies say what they take (``from_logits``): nothing to set
    their value against, and nothing measured for it."""
    from stethoscope.callbacks._keras.describe import loss_form

    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(CLASSES)])
    model.compile("adam", kl.SparseCategoricalCrossentropy(from_logits=True))
    assert not loss_form(model).own
    model.compile("adam", sparse_of_logits)
    assert loss_form(model).own


def test_the_ways_are_keras_own_losses():
    rng = np.random.default_rng(1)
    t = ops.convert_to_tensor
    logits = t(rng.normal(size=(6, CLASSES)).astype("float32"))
    labels = rng.integers(0, CLASSES, 6)
    y = t(labels)

    def ways(targets, output) -> np.ndarray:
        return ops.convert_to_numpy(way_losses(t(targets), output))

    def mean(v) -> float:
        return float(ops.convert_to_numpy(ops.mean(v)))

    for targets in (labels, np.eye(CLASSES, dtype="float32")[labels]):
        of_logits = ways(targets, logits)
        assert of_logits[0] == pytest.approx(mean(sparse_of_logits(y, logits)), rel=1e-5)
        assert of_logits[3] == pytest.approx(mean(softmax_then_sparse(y, logits)), rel=1e-5)
        assert of_logits[11] == 6.0
        probs = ops.convert_to_numpy(softmax(logits))
        expected = -np.log(probs[np.arange(6), labels]).mean()
        assert ways(targets, t(probs))[2] == pytest.approx(expected, rel=1e-5)
    multi = (rng.random((6, CLASSES)) > 0.5).astype("float32")
    of_logits = ways(multi, logits)
    assert np.isnan(of_logits[:7]).all()  # no distributions: the binary ways, over 24 terms
    assert of_logits[8] == pytest.approx(mean(binary_of_logits(t(multi), logits)), rel=1e-5)
    assert of_logits[11] == 6 * CLASSES
