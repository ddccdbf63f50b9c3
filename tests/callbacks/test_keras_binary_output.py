"""A binary classifier's one output column fed to Keras' ``BinaryCrossentropy``: a sigmoid
last with ``from_logits=True`` is named by ``logits_mismatch``, once its outputs have
stayed within [0, 1] for ``one_column_span`` steps; its twin, which outputs logits, is
quiet, however its first logits lie."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.detectors import LogitsMismatch  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

STEPS = 320  # 5 epochs of 64 batches


def fit(activation: str | None, bias: float = 0.0) -> CapturingSink:
    """``activation`` on the one output; ``bias``: its initial bias, which puts every
    first output of the twin (small weights) within [0, 1] at 0.5."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 32, 10)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("float32")[:, None]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(
                1,
                activation=activation,
                kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3),
                bias_initializer=keras.initializers.Constant(bias),
            ),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.BinaryCrossentropy(from_logits=True))
    sink = CapturingSink()
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=STEPS // 64,
        verbose=0,
        callbacks=[KerasStethoscope(sinks=[sink], stop_on=None)],
    )
    return sink


def named(sink: CapturingSink) -> list[int]:
    return [f.step for f in sink.findings if f.detector == "logits_mismatch"]


@pytest.mark.filterwarnings("ignore:.*produced by a Sigmoid activation:UserWarning")
def test_a_sigmoid_fed_to_a_loss_that_takes_logits_is_named_after_its_span():
    [step] = named(fit("sigmoid"))
    assert LogitsMismatch.one_column_span <= step <= LogitsMismatch.one_column_span + 16


def test_logits_that_start_within_0_and_1_are_not_taken_for_probabilities():
    assert named(fit(None, bias=0.5)) == []
