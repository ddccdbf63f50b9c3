"""Layer 2: tiny real Lightning models with an injected fault, and healthy twins."""

from __future__ import annotations

import pytest
import torch
from _models import TinyMLP, fit, loader, problems

# (fault, model kwargs, steps, detector, first step window, severity, where)
FAULTS = [
    pytest.param("nan_input", {}, 80, "nonfinite_loss", (40, 40), "error", "loss", id="nan-input"),
    pytest.param(
        "nan_input",
        {"onset": 300},
        340,
        "nonfinite_loss",
        (300, 300),
        "error",
        "loss",
        id="nan-input-after-calibration",
    ),
    pytest.param(
        "nan_grad", {}, 80, "nonfinite_gradients", (40, 40), "error", "net.2.weight", id="nan-grad"
    ),
    pytest.param(
        "nan_grad",
        {"onset": 300},
        340,
        "nonfinite_gradients",
        (300, 316),
        "error",
        "net.2.weight",
        id="nan-grad-after-calibration",
    ),
    pytest.param(
        "nan_weight",
        {},
        80,
        "nonfinite_weights",
        (40, 40),
        "error",
        "net.0.weight",
        id="nan-weight",
    ),
    pytest.param(
        "lr_jump",
        {"optimizer": "sgd", "lr": 0.05, "onset": 300},
        400,
        "exploding_gradients",
        (300, 316),
        None,
        None,
        id="lr-jump-explodes",
    ),
    pytest.param(
        "spike", {"onset": 300}, 320, "loss_spike", (300, 300), "warning", "loss", id="spike"
    ),
    pytest.param(
        "none",
        {"depth": 8, "activation": "sigmoid", "init_scale": 0.05},
        120,
        "vanishing_gradients",
        (0, 20),
        "warning",
        "net.0.weight",
        id="vanishing",
    ),
    pytest.param(
        "none",
        {"lr": 1e-7},
        260,
        "loss_not_decreasing",
        (200, 250),
        "warning",
        "loss",
        id="lr-too-small",
    ),
    pytest.param(
        "lr_jump",
        {"lr": 1e-2, "onset": 300, "activation": "sigmoid"},
        480,
        "unstable_loss",
        (300, 420),
        None,
        "loss",
        id="lr-jump-unstable",
    ),
    pytest.param(  # the same jump with ReLUs kills them: every unit of the first layer dies
        "lr_jump",
        {"lr": 1e-2, "onset": 300},
        480,
        "dead_relu",
        (300, 330),
        "warning",
        None,
        id="lr-jump-kills-relus",
    ),
]


@pytest.mark.parametrize(
    ("fault", "kw", "steps", "detector", "window", "severity", "where"), FAULTS
)
def test_fault_is_caught(fault, kw, steps, detector, window, severity, where):
    torch.manual_seed(0)
    trainer, sink = fit(TinyMLP(fault=fault, **kw), steps=steps)
    found = sink.by_detector(detector)
    assert found, f"{detector} never fired; got {[(f.detector, f.step) for f in problems(sink)]}"
    first = found[0]
    lo, hi = window
    assert lo <= first.step <= hi, f"{detector} first fired at step {first.step}, not in {window}"
    if severity is not None:
        assert first.severity == severity
    if where is not None:
        assert first.where == where
    assert str(first.step) in first.message
    if any(f.severity == "error" for f in sink.findings):
        assert trainer.should_stop, "an error must stop training gracefully"


HEALTHY = [
    pytest.param({}, {"steps": 300}, {}, id="standardized-inputs"),
    pytest.param({"lr": 3e-2}, {"steps": 1200}, {}, id="converges-to-0.005"),
    pytest.param(
        {"optimizer": "sgd", "lr": 0.1, "warmup_steps": 150},
        {"steps": 600, "gradient_clip_val": 0.5},
        {},
        id="warmup-from-0-with-clipping",
    ),
    pytest.param(
        {"optimizer": "sgd", "lr": 0.05},
        {"steps": 1500, "batch_size": 8},
        {"label_noise": 0.2},
        id="noisy-batch-8-label-noise",
    ),
]


@pytest.mark.parametrize(("model_kw", "fit_kw", "data_kw"), HEALTHY)
def test_healthy_twin_is_quiet(model_kw, fit_kw, data_kw):
    torch.manual_seed(0)
    batch_size = fit_kw.pop("batch_size", 32)
    steps = fit_kw.pop("steps")
    trainer, sink = fit(
        TinyMLP(**model_kw),
        steps=steps,
        data=loader(batch_size, **data_kw),
        **fit_kw,
    )
    assert trainer.global_step == steps, "a healthy run must not be stopped"
    assert problems(sink) == [], [(f.detector, f.step, f.message) for f in problems(sink)]


def test_converged_run_really_converges():
    """The 0.005 trap is only a trap if the loss gets there: check the healthy twin does."""
    torch.manual_seed(0)
    model = TinyMLP(lr=3e-2)
    fit(model, steps=1200)
    x, y = loader(512).dataset.tensors
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x), y).item()
    assert loss < 0.02
