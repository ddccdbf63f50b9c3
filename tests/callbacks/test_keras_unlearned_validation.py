"""unlearned_validation in a Keras fit: batch norms whose moving statistics lag the
batches (momentum 0.999) make the model validate as an untrained one; the twin, momentum
0.9, validates as it trains."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
pytest.importorskip("sklearn")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402


def digits(*, standardised: bool = False):
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x = d.images[order, ..., None]
    x = (x - x.mean()) / x.std() if standardised else x / 16.0
    return x.astype("float32"), d.target[order]


def fit(momentum: float, *, flatten: bool = False):
    """The CNN: a global average at the head, or (``flatten``) a max-pool and a flatten
    on standardised pixels, which learns some of it into its validation."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, padding="same"),
            layers.BatchNormalization(momentum=momentum, name="bn0"),
            layers.ReLU(),
            layers.Conv2D(32, 3, padding="same"),
            layers.BatchNormalization(momentum=momentum, name="bn1"),
            layers.ReLU(),
            *(
                [layers.MaxPooling2D(2), layers.Flatten()]
                if flatten
                else [layers.GlobalAveragePooling2D()]
            ),
            layers.Dense(10),
        ]
    )
    model.compile(
        keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = digits(standardised=flatten)
    sink = CapturingSink()
    history = model.fit(
        x,
        y,
        epochs=6,
        batch_size=64,
        validation_split=0.2,
        shuffle=False,
        verbose=0,
        callbacks=[KerasStethoscope(sinks=[sink])],
    )
    escalated = [f for f in sink.findings if "unlearned_validation warning" in f.message]
    assert escalated == []  # a validation's finding: no step after it shows more
    return history.history, [f for f in sink.findings if f.detector == "unlearned_validation"]


def test_lagging_batch_norm_statistics_are_named():
    history, found = fit(0.999)
    assert history["loss"][-1] < 0.5 * history["loss"][0]  # it trains...
    assert min(history["val_loss"]) > 0.9 * history["loss"][0]  # ...and validates untrained
    (f,) = found
    assert f.severity.value == "warning" and f.where in ("bn0", "bn1")
    assert "momentum=0.999" in f.message and "lower the momentum (momentum=0.9" in f.message


def test_the_twin_whose_statistics_follow_the_batches_is_quiet():
    history, found = fit(0.9)
    assert history["val_loss"][-1] < 0.5 * history["val_loss"][0]
    assert found == []


def test_statistics_that_lag_in_part_are_named_by_their_error():
    # the validation learns some of it, so it is better than the start: the error of the
    # running statistics, read from the variables, names it
    history, found = fit(0.999, flatten=True)
    assert min(history["val_loss"]) < 0.9 * np.log(10)  # the first loss: ln 10 classes
    assert history["val_loss"][-1] > 5 * history["loss"][-1]
    (f,) = found
    assert f.where in ("bn0", "bn1") and f.value >= 0.1
    assert "standard deviations (RMS)" in f.message and "momentum=0.999" in f.message
