"""LightningStethoscope(record=...) on real training: the record holds what the detectors
saw, the whole loss curve, the configuration, and the distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _models import TinyMLP, fit

from stethoscope import LightningStethoscope
from stethoscope.detectors import default_detectors
from stethoscope.record import RunRecord
from stethoscope.statistics import DISTRIBUTION_BINS
from stethoscope.testing import CapturingSink, RecordingDetector


def test_the_record_matches_what_the_detectors_saw(tmp_path):
    spy = RecordingDetector({"grads", "weights", "updates"}, name="spy")
    loss_spy = RecordingDetector({"loss"}, name="loss_spy")
    callback = LightningStethoscope(
        detectors=[spy, loss_spy], sinks=[CapturingSink()], record=tmp_path / "run"
    )
    torch.manual_seed(0)
    fit(TinyMLP(), steps=40, callback=callback)
    assert callback.record == tmp_path / "run"
    with RunRecord(tmp_path / "run") as record:
        losses = record.losses()
        assert list(losses.steps) == [obs.step for obs in loss_spy.seen]
        np.testing.assert_allclose(losses.values, [o.loss for o in loss_spy.seen], rtol=1e-6)
        grads, weights = record.layers("grad_norm"), record.layers("weight_norm")
        ratios = record.layers("update_ratio")
        assert grads.names == spy.seen[0].names
        for obs in spy.seen:
            i = list(grads.steps).index(obs.step)
            np.testing.assert_allclose(grads.values[i], obs.grad_norm, rtol=1e-6)
            np.testing.assert_allclose(weights.values[i], obs.weight_norm, rtol=1e-6)
            np.testing.assert_allclose(
                ratios.values[i], obs.update_norm / obs.prev_weight_norm, rtol=1e-5
            )
        hist = record.layers("weight_hist")
        assert hist.values.shape[1:] == (len(grads.names), DISTRIBUTION_BINS)
        numel = [p["numel"] for p in record.config["model"]["parameters"]]
        np.testing.assert_array_equal(hist.values[-1].sum(axis=1), numel)  # every weight once
        sampled = record.sampled()
        assert sampled.interval[0] == 1  # training starts hot
        np.testing.assert_allclose(sampled.lr[~np.isnan(sampled.lr)], 1e-2)
        config = record.config
        assert config["optimizers"][0]["class"] == "Adam"
        assert config["detectors"]["spy"]["every"] == 1
        assert record.finished


def test_tensorboard_shows_each_parameters_histograms_at_the_recorded_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stethoscope.sinks import TensorBoardSink

    callback = LightningStethoscope(
        sinks=[TensorBoardSink(tmp_path / "tb", histogram_every=8)], record=tmp_path / "run"
    )
    torch.manual_seed(0)
    fit(TinyMLP(), steps=80, callback=callback)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    with RunRecord(tmp_path / "run") as record:
        weights, grads = record.layers("weight_hist"), record.layers("grad_hist")
    tags = acc.Tags()["histograms"]
    assert sorted(tags) == sorted(
        [f"stethoscope/weights/{n}" for n in weights.names]
        + [f"stethoscope/gradients/{n}" for n in grads.names]
    )
    for j, name in enumerate(weights.names):
        events = acc.Histograms(f"stethoscope/weights/{name}")
        steps = [e.step for e in events]
        assert steps == list(weights.steps)  # the record's cadence (8 once calibrated)
        assert 72 in steps and 73 not in steps
        for e, counts in zip(events, weights.values[:, j], strict=True):
            np.testing.assert_array_equal(e.histogram_value.bucket, counts[:-1])
            assert e.histogram_value.num == counts.sum()  # every weight of the parameter


def test_the_report_of_a_real_run_draws_what_the_detectors_saw(tmp_path):
    """Train until a NaN stops the run, write its report, open it in Chromium: the
    gradient-flow chart and the loss chart hold what the detectors were given."""
    from _browser import assert_not_blank, chart_data, open_in_chromium
    from stethoscope.record.report import write_report

    pytest.importorskip("plotly")
    spy = RecordingDetector({"grads"}, name="spy")
    loss_spy = RecordingDetector({"loss"}, name="loss_spy")
    callback = LightningStethoscope(
        detectors=[*default_detectors(), spy, loss_spy],
        sinks=[CapturingSink()],
        record=tmp_path / "run",
    )
    torch.manual_seed(0)
    fit(TinyMLP(fault="nan_input", onset=30), steps=60, callback=callback)
    [page] = write_report(tmp_path / "run")

    def read_charts(tab):
        flow = chart_data(tab, "gradient_flow", 0, "customdata")
        steps = chart_data(tab, "gradient_flow", 0, "x")
        names = tab.evaluate("document.getElementById('fig-gradient_flow').data[0].y")
        loss = tab.evaluate(
            "document.getElementById('fig-loss').data.findIndex(t => t.name === 'training loss')"
        )
        return flow, steps, names, chart_data(tab, "loss", loss, "y")

    errors, (flow, steps, names, loss) = open_in_chromium(page, tmp_path / "shot.png", read_charts)
    assert errors == []
    assert_not_blank(tmp_path / "shot.png")
    assert names == list(spy.seen[0].names)
    seen = {obs.step: obs.grad_norm for obs in spy.seen}
    assert set(steps.astype(int)) <= set(seen) and len(steps) >= 10
    for column, step in enumerate(steps.astype(int)):
        np.testing.assert_allclose(flow[:, column], seen[step], rtol=1e-6)
    expected = np.array([o.loss for o in loss_spy.seen], dtype=float)
    assert len(loss) == len(expected) and np.isnan(expected[-1])  # stopped at the NaN
    np.testing.assert_allclose(loss, expected, rtol=1e-6)  # NaN where the loss was NaN
