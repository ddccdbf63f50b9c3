"""overhead_budget on real fits, in both frameworks: the sampled detectors' intervals
stretch to fit a budget, the summary says what it bought, and a NaN is still caught at
once."""

from __future__ import annotations

import os

import pytest
import torch
from _models import TinyMLP, fit

from stethoscope import LightningStethoscope
from stethoscope.engine.budget import LONGEST
from stethoscope.testing import CapturingSink


def test_a_lightning_fit_stretches_its_sampled_detectors_to_a_tiny_budget():
    """On a ~1 ms step a sampled step costs far more than 0.1% of training: the sampled
    detectors go to every 256 steps; the loss is still judged every step."""
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], overhead_budget=0.001)
    fit(TinyMLP(fault="nan_input", onset=1500), steps=1600, callback=callback)
    sampler = callback.monitor.sampler
    assert sampler.stretch > 1
    assert sampler.base["exploding_gradients"] == min(16 * sampler.stretch, LONGEST)
    assert sampler.base["nonfinite_loss"] == 1
    verdicts = " ".join(s.verdict for s in callback.summaries[:-1])
    assert "(overhead budget 0.1%, " in verdicts, verdicts
    first = sink.at_least("error")[0]  # the NaN batch: caught on its own step
    assert (first.detector, first.step) == ("nonfinite_loss", 1500)


def test_the_callbacks_keep_to_a_1_percent_budget_unless_told_otherwise():
    assert LightningStethoscope().monitor.budget.fraction == 0.01
    assert LightningStethoscope(overhead_budget=None).monitor.budget is None
    keras = pytest.importorskip("keras")
    if keras.backend.backend() == "tensorflow":
        from stethoscope import KerasStethoscope

        assert KerasStethoscope().monitor.budget.fraction == 0.01
        assert KerasStethoscope(overhead_budget=None).monitor.budget is None


def test_lightning_refuses_a_bad_budget_at_construction():
    with pytest.raises(ValueError, match="overhead_budget=5"):
        LightningStethoscope(overhead_budget=5)


def test_a_keras_fit_stretches_its_sampled_detectors_to_a_tiny_budget():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow backend")
    import numpy as np

    from stethoscope import KerasStethoscope

    with pytest.raises(ValueError, match="overhead_budget=-1"):
        KerasStethoscope(overhead_budget=-1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 12)).astype("float32")
    y = np.argmax(x[:, :3], axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = KerasStethoscope(sinks=[CapturingSink()], overhead_budget=0.001)
    model.fit(x, y, batch_size=16, epochs=20, verbose=0, callbacks=[callback])
    assert callback.monitor.sampler.stretch > 1
    assert "(overhead budget 0.1%, " in " ".join(s.verdict for s in callback.summaries)


def test_a_run_of_one_batch_per_epoch_is_clocked_and_stretched():
    """Full-batch training (a graph network's): every step is an epoch, and each epoch's
    start pauses the clock. A clock that forgot the step in progress there timed no step
    at all, and the budget never acted; it now ends the step where the pause begins."""
    torch.manual_seed(0)
    callback = LightningStethoscope(sinks=[CapturingSink()], overhead_budget=0.001)
    fit(TinyMLP(), steps=1200, callback=callback, limit_train_batches=1)
    budget = callback.monitor.budget
    assert budget.measured is not None
    assert callback.monitor.sampler.stretch > 1
