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


def _data_and_model(samples: int = 256, nan_at: int | None = None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 12)).astype("float32")
    y = np.argmax(x[:, :3], axis=1)
    if nan_at is not None:
        x[nan_at, 0] = np.nan
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
    return x, y, model


def test_the_record_matches_what_the_detectors_saw(tmp_path):
    x, y, model = _data_and_model()
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
        # the record measures no more than the detectors ask (and distributions): no
        # detector here looks at activations, so no saturation was measured
        assert "saturated" not in record.kinds()
        assert record.config["optimizers"][0]["class"] == "SGD"
        assert [e["epoch"] for e in record.epochs()] == [0, 1, 2]
        assert record.finished


def test_the_report_of_a_real_fit_draws_what_the_detectors_saw(tmp_path):
    """A NaN sample stops the fit at step 20; its report, opened in Chromium, draws the
    gradient norms and losses the detectors were given."""
    pytest.importorskip("plotly")
    from _browser import assert_not_blank, chart_data, open_in_chromium
    from stethoscope.detectors import default_detectors
    from stethoscope.record.report import write_report

    x, y, model = _data_and_model(samples=1024, nan_at=32 * 20)  # the batch of step 20
    spy = RecordingDetector({"grads"}, name="spy")
    loss_spy = RecordingDetector({"loss"}, name="loss_spy")
    callback = KerasStethoscope(
        detectors=[*default_detectors(), spy, loss_spy],
        sinks=[CapturingSink()],
        record=tmp_path / "run",
    )
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    [page] = write_report(tmp_path / "run")

    def read_charts(tab):
        loss = tab.evaluate(
            "document.getElementById('fig-loss').data.findIndex(t => t.name === 'training loss')"
        )
        return (
            chart_data(tab, "gradient_flow", 0, "customdata"),
            chart_data(tab, "gradient_flow", 0, "x"),
            chart_data(tab, "loss", loss, "y"),
        )

    errors, (flow, steps, loss) = open_in_chromium(page, tmp_path / "shot.png", read_charts)
    assert errors == []
    assert_not_blank(tmp_path / "shot.png")
    seen = {obs.step: obs.grad_norm for obs in spy.seen}
    assert set(steps.astype(int)) <= set(seen) and len(steps) >= 5
    for column, step in enumerate(steps.astype(int)):
        np.testing.assert_allclose(flow[:, column], seen[step], rtol=1e-6)
    expected = np.array([o.loss for o in loss_spy.seen], dtype=float)
    assert np.isnan(expected[20]) and not np.isnan(expected[:20]).any()
    assert len(expected) < 40  # the NaN stopped the fit
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
