"""LightningStethoscope(record=...) on real training: the record holds what the detectors
saw, the whole loss curve, the configuration, and the distributions."""

from __future__ import annotations

import numpy as np
import torch
from _models import TinyMLP, fit

from stethoscope import LightningStethoscope
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
