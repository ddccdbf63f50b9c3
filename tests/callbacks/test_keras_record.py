"""KerasStethoscope(record=...) on a real fit: the record holds what the detectors saw,
the whole loss curve, the configuration and the distributions."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.record import RunRecord  # noqa: E402
from stethoscope.statistics import DISTRIBUTION_BINS  # noqa: E402
from stethoscope.testing import CapturingSink, RecordingDetector  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="these tests drive the TensorFlow backend"
)


def test_the_record_matches_what_the_detectors_saw(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 12)).astype("float32")
    y = np.argmax(x[:, :3], axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    spy = RecordingDetector({"grads", "weights"}, name="spy")
    loss_spy = RecordingDetector({"loss"}, name="loss_spy")
    callback = KerasStethoscope(
        detectors=[spy, loss_spy], sinks=[CapturingSink()], record=tmp_path / "run"
    )
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[callback])
    with RunRecord(tmp_path / "run") as record:
        losses = record.losses()
        assert list(losses.steps) == [o.step for o in loss_spy.seen] == list(range(24))
        np.testing.assert_allclose(losses.values, [o.loss for o in loss_spy.seen], rtol=1e-6)
        grads, weights = record.layers("grad_norm"), record.layers("weight_norm")
        assert grads.names == spy.seen[0].names
        for obs in spy.seen:
            i = list(grads.steps).index(obs.step)
            np.testing.assert_allclose(grads.values[i], obs.grad_norm, rtol=1e-6)
            np.testing.assert_allclose(weights.values[i], obs.weight_norm, rtol=1e-6)
        hist = record.layers("grad_hist")
        assert hist.values.shape[1:] == (len(grads.names), DISTRIBUTION_BINS)
        numel = [p["numel"] for p in record.config["model"]["parameters"]]
        np.testing.assert_array_equal(hist.values[-1].sum(axis=1), numel)
        assert len(record.layers("saturated").names) == 1  # the tanh
        assert record.config["optimizers"][0]["class"] == "SGD"
        assert [e["epoch"] for e in record.epochs()] == [0, 1, 2]
        assert record.finished
