"""Layer 2 for the detectors of activations, weights, data and validation: a tiny real
Lightning model with the fault injected, and healthy twins that must stay quiet."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from _models import CLASSES, FEATURES, TinyMLP, dataset, fit, loader, problems
from torch.utils.data import DataLoader, Subset, TensorDataset

from stethoscope import LightningStethoscope
from stethoscope.detectors import default_detectors
from stethoscope.testing import CapturingSink, RecordingDetector

# (model kwargs, data kwargs, steps, detector, first-step window, severity, where)
FAULTS = [
    pytest.param(
        {"fault": "dead_bias", "onset": 300},
        {},
        360,
        "dead_relu",
        (300, 316),
        "error",
        "net.0",
        id="biases-to-minus-100-kill-every-relu",
    ),
    pytest.param(
        {"activation": "tanh", "init_scale": 20.0},
        {},
        100,
        "saturated_activation",
        (0, 8),
        "warning",
        "net.1",
        id="tanh-weights-x20-saturate",
    ),
    pytest.param(
        {"lr": 1e-9}, {}, 200, "small_updates", (10, 20), "warning", None, id="adam-lr-1e-9"
    ),
    pytest.param({"lr": 1.0}, {}, 60, "large_updates", (0, 2), "error", None, id="adam-lr-1"),
    pytest.param(
        {"exclude": "net.0"},
        {},
        60,
        "frozen_weights",
        (0, 0),
        "warning",
        "net.0.weight",
        id="layer-left-out-of-the-optimizer",
    ),
    pytest.param(
        {"zero_lr": "net.2"},
        {},
        100,
        "frozen_weights",
        (0, 10),
        "warning",
        "net.2.weight",
        id="param-group-with-lr-0",
    ),
    pytest.param(
        {"init": "normal"},
        {},
        60,
        "poor_initialization",
        (0, 0),
        "warning",
        None,
        id="weights-drawn-from-N(0,1)",
    ),
    pytest.param(
        {"init": "zero_hidden"},
        {},
        60,
        "all_zero",
        (0, 4),
        "error",
        "net.2.weight",
        id="zero-initialised-hidden-layer",
    ),
    pytest.param(
        {},
        {"majority": 0.95},
        60,
        "class_imbalance",
        (0, 32),
        "warning",
        "labels",
        id="95%-one-class",
    ),
    pytest.param(
        {}, {"scale": 100.0}, 60, "unnormalized_input", (0, 16), "warning", None, id="inputs-x100"
    ),
]


@pytest.mark.parametrize(
    ("model_kw", "data_kw", "steps", "detector", "window", "severity", "where"), FAULTS
)
def test_fault_is_caught(model_kw, data_kw, steps, detector, window, severity, where):
    torch.manual_seed(0)
    trainer, sink = fit(TinyMLP(**model_kw), steps=steps, data=loader(32, **data_kw))
    found = sink.by_detector(detector)
    assert found, f"{detector} never fired; got {[(f.detector, f.step) for f in problems(sink)]}"
    first = found[0]
    lo, hi = window
    assert lo <= first.step <= hi, f"{detector} first fired at step {first.step}, not in {window}"
    assert first.severity == severity
    if where is not None:
        assert first.where == where
    assert first.message[0].isupper() and first.message.endswith(".")
    if any(f.severity == "error" for f in sink.findings):
        assert trainer.should_stop, "an error must stop training gracefully"


HEALTHY = [
    pytest.param({"frozen": "net.0"}, 300, id="requires-grad-false-layer"),
    pytest.param({"schedule": "cosine", "max_steps": 600, "lr": 3e-2}, 600, id="cosine-to-0"),
    pytest.param({"norm": True}, 300, id="batchnorm-and-dropout"),
    pytest.param({"activation": "tanh"}, 300, id="tanh-default-init"),
]


@pytest.mark.parametrize(("model_kw", "steps"), HEALTHY)
def test_healthy_twin_is_quiet(model_kw, steps):
    torch.manual_seed(0)
    trainer, sink = fit(TinyMLP(**model_kw), steps=steps)
    assert trainer.global_step == steps, "a healthy run must not be stopped"
    assert problems(sink) == [], [(f.detector, f.step, f.message) for f in problems(sink)]


def _fit_with_validation(train_n: int, label_noise: float, epochs: int) -> CapturingSink:
    torch.manual_seed(0)
    data = dataset(train_n + 256, seed=0, label_noise=label_noise)  # one teacher for both
    train = DataLoader(
        Subset(data, range(train_n)),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    val = DataLoader(Subset(data, range(train_n, train_n + 256)), batch_size=256)
    sink = CapturingSink()
    trainer = L.Trainer(
        callbacks=[LightningStethoscope(sinks=[sink])],
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyMLP(lr=1e-2), train, val)
    return sink


def test_overfitting_on_a_tiny_noisy_training_set():
    sink = _fit_with_validation(train_n=64, label_noise=0.3, epochs=30)
    (f,) = sink.by_detector("overfitting")
    assert f.severity == "warning" and f.where == "validation"
    assert "epoch(s) ago" in f.message and f.epoch <= 10
    assert f.value > f.threshold


def test_no_overfitting_warning_on_a_negligible_rise_after_a_near_perfect_fit():
    """Well-separated classes: the validation loss falls from 1.1 to 0.0029 within 27
    epochs, then creeps up by 0.0003 over the next 18: a rise of 10% of its best, and
    of 0.03% of the task. Before the floor this warned at epoch 45."""

    def separable(n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, CLASSES, (n,), generator=g)
        x = 0.5 * torch.randn(n, FEATURES, generator=g)
        x[torch.arange(n), y] += 3.0
        return TensorDataset(x, y)

    torch.manual_seed(0)
    train_set, val_set = separable(512, 0), separable(256, 1)
    train = DataLoader(
        train_set, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    sink = CapturingSink()
    trainer = L.Trainer(
        callbacks=[LightningStethoscope(sinks=[sink], stop_on=None)],
        max_epochs=48,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyMLP(lr=1e-2), train, DataLoader(val_set, batch_size=256))
    assert trainer.callback_metrics["val_loss"] < 0.005  # the near-perfect fit it is
    assert sink.by_detector("overfitting") == []


def test_a_classifier_that_falls_from_a_confident_start_to_chance_has_learned_nothing():
    """Labels drawn at random, weights initialised 4x too large: the loss falls from its
    confident start to ln K and stays. loss_not_decreasing counts the fall as progress;
    loss_at_chance says the model learned nothing."""
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], stop_on=None)
    data = loader(batch_size=32, n=8192, label_noise=1.0)
    fit(TinyMLP(lr=1e-2, init_scale=4.0), steps=800, data=data, callback=callback)
    (f,) = sink.by_detector("loss_at_chance")
    assert f.threshold == pytest.approx(math.log(CLASSES), rel=0.02)
    assert sink.by_detector("loss_not_decreasing") == []


def test_no_overfitting_on_enough_clean_data():
    sink = _fit_with_validation(train_n=1024, label_noise=0.0, epochs=6)
    assert problems(sink) == [], [(f.detector, f.step, f.message) for f in problems(sink)]


@pytest.mark.parametrize("fault", ["nan_weight", "nan_input"])
def test_nonfinite_loss_traces_the_first_bad_module_when_training_goes_on(fault):
    torch.manual_seed(0)
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink], stop_on=None)
    fit(TinyMLP(fault=fault, onset=100), steps=110, callback=cb)
    first, traced = sink.by_detector("nonfinite_loss")[:2]
    assert first.where == "loss"
    assert traced.step == first.step + 1
    assert traced.where == "net.0"  # poisoned weights: the first layer's output is NaN
    assert "first module whose output is non-finite is net.0" in traced.message
    # the advice leads with the batch and the weights, not the learning rate or clipping
    assert "check the data pipeline" in traced.message and "nonfinite_weights" in traced.message
    assert first.message.index("Check that batch first") < first.message.index("learning rate")
    assert "clip" not in first.message


def test_the_detectors_know_an_adam_run_is_adaptive():
    """Adam normalises each step, so a single gradient spike is no error there."""
    cb = LightningStethoscope(sinks=[])
    fit(TinyMLP(), steps=5, callback=cb)
    assert all(d.setup.adaptive for d in cb.monitor.detectors)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_exploding_gradients_advice_knows_whether_the_run_clips(clip):
    torch.manual_seed(0)
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink], stop_on=None)
    model = TinyMLP(fault="lr_jump", optimizer="sgd", lr=0.05, onset=300)
    fit(model, steps=400, callback=cb, gradient_clip_val=clip)
    found = sink.by_detector("exploding_gradients")
    assert found, [(f.detector, f.step) for f in sink.findings]
    assert not cb.monitor.detectors[0].setup.adaptive  # SGD: one huge gradient, one huge step
    message = found[0].message
    rows = [r for summary in cb.summaries for r in summary.rows]
    row = next(r for r in rows if r.detector == "exploding_gradients")
    if clip is None:
        assert "clip gradients (e.g. Trainer(gradient_clip_val=1.0))" in message
        assert row.verdict.endswith("add warm-up or clip gradients")
    else:  # told what it does already, and that the norm is measured before the clipping
        assert "clipped already (gradient_clip_val=1.0)" in message
        assert "clip gradients (e.g." not in message
        assert row.verdict.endswith("(gradients are clipped already)")  # the summary too


def test_a_one_off_nan_is_traced_as_one_off():
    """A NaN loss from the loss function alone (weights untouched): the next step is clean."""

    class OneBadLoss(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * torch.nan if self.global_step == 100 else loss

    torch.manual_seed(0)
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink], stop_on=None)
    model = OneBadLoss()  # drop the bad batch's NaN gradients, as a GradScaler would
    model.on_before_optimizer_step = lambda opt: (
        opt.zero_grad() if model.global_step == 100 else None
    )
    fit(model, steps=110, callback=cb)
    traced = [f for f in sink.by_detector("nonfinite_loss") if f.message.startswith("Traced")]
    assert traced and traced[0].severity == "info", [f.message for f in traced]
    assert "came from that batch" in traced[0].message


def test_forward_hooks_never_outlive_the_fit():
    torch.manual_seed(0)
    model = TinyMLP(activation="tanh")
    fit(model, steps=40)
    for m in model.modules():
        assert not m._forward_hooks, m


@pytest.mark.parametrize("onset", [150, 305])  # both between samples of the weight detectors
def test_a_nonfinite_loss_names_the_parameter_on_the_same_step(onset):
    """The NaN weight makes the next loss NaN on an unsampled step: the weights are read at
    once, so the finding that names the parameter comes with the loss, not a sample later."""
    torch.manual_seed(0)
    sink = CapturingSink()
    fit(
        TinyMLP(fault="nan_weight", onset=onset),
        steps=onset + 20,
        callback=LightningStethoscope(sinks=[sink], stop_on=None),
    )
    loss, weights = sink.by_detector("nonfinite_loss")[0], sink.by_detector("nonfinite_weights")[0]
    assert weights.step <= loss.step
    assert weights.where == "net.0.weight"


@pytest.mark.parametrize(
    "settings",
    [
        {"escalate": False},  # the gradient detectors are due every 16 steps only
        {"intervals": {"exploding_gradients": 5}},
        {"extra": RecordingDetector({"distributions"})},  # a sampled step without gradients
    ],
    ids=["fixed-intervals", "custom-interval", "sampled-without-gradients"],
)
def test_a_nan_batch_names_the_bad_gradient_and_weight_on_its_step(settings):
    """Whatever the schedule, a non-finite loss on a step whose gradients were not measured
    makes the adapter read them at once and every detector that reads them judge them."""
    settings = dict(settings)
    extra = [settings.pop("extra")] if "extra" in settings else []
    torch.manual_seed(0)
    sink = CapturingSink()
    cb = LightningStethoscope(
        detectors=[*default_detectors(), *extra], sinks=[sink], stop_on=None, **settings
    )
    fit(TinyMLP(fault="nan_input", onset=150), steps=160, callback=cb)
    for name in ("nonfinite_loss", "nonfinite_gradients", "nonfinite_weights"):
        found = sink.by_detector(name)
        assert found and found[0].step == 150, (name, [(f.step, f.where) for f in found])
