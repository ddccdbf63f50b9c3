"""Layer 2: tiny real Keras models (TensorFlow backend) with an injected fault, and healthy twins.

The models, data and faults are the fault suite's (``benchmarks/faults/keras_suite.py``):
each test trains one scenario of ``benchmarks.faults.scenarios`` under the default
(adaptive) KerasStethoscope, cut short after the scenario's detection window, and
asserts that one of the scenario's expected detectors warns within the window; each
healthy twin asserts that nothing warns at all.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")
if keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on the environment
    pytest.skip("the Keras fault suite injects through TensorFlow", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed: import it from the checkout
    sys.path.insert(0, str(ROOT))

from benchmarks.faults import select  # noqa: E402
from benchmarks.faults.keras_suite import _Fit, _same_fit, quiet, run_scenario  # noqa: E402

ALARM = ("warning", "error")

# Keras' Variable.__array__ takes no copy keyword: numpy 2 warns on every variable read
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    quiet()


def _short(name: str, steps: int | None = None):
    """Scenario ``name``, cut after its detection window (or after ``steps``)."""
    sc = select([name])[0]
    if steps is None:
        steps = sc.onset + sc.window + 1 if isinstance(sc.onset, int) else sc.train.max_steps
    steps = min(steps, sc.train.max_steps)
    return dataclasses.replace(sc, train=dataclasses.replace(sc.train, max_steps=steps))


def _alarms(run) -> list[tuple[str, int, str | None]]:
    return [
        (f["detector"], f["step"], f["where"])
        for f in run.findings["adaptive"]
        if f["severity"] in ALARM
    ]


# each is cut after onset + window; nan_input has a test of its own below
FAULTS = [
    pytest.param("corrupt_labels_batch", id="spike-corrupt-labels"),
    pytest.param("lr_jump_sgd", id="lr-jump-exploding-gradients"),
    pytest.param("dead_units", id="dead-relu-killed-units"),
    pytest.param("saturated_tanh", id="saturated-tanh"),
    pytest.param("layer_not_in_optimizer", id="layer-left-out-of-optimizer"),
    pytest.param("zero_lr_group", id="zero-learning-rate-for-a-layer"),
    pytest.param("class_imbalance_95", id="class-imbalance"),
    pytest.param("features_x100", id="unnormalized-input"),
    pytest.param("init_std_1", id="poor-init"),
    pytest.param("overfitting", id="overfitting", marks=pytest.mark.slow),
    pytest.param("random_labels_confident", id="loss-at-chance-after-a-confident-start"),
    pytest.param("labels_sorted", id="unshuffled-sorted-labels"),
    pytest.param("lr_decay_per_batch", id="per-epoch-decay-stepped-per-batch"),
    pytest.param("batch_served_again", id="a-loader-stuck-on-one-batch"),
    pytest.param("same_order_every_epoch", id="the-same-order-every-epoch"),
    pytest.param("validation_leak", id="validation-data-from-the-training-set"),
    pytest.param("softmax_then_cross_entropy", id="softmax-output-from-logits-true"),
    pytest.param("logits_as_probabilities", id="logits-output-from-logits-false"),
    pytest.param("softmax_in_own_loss", id="softmax-in-a-loss-function-of-the-users-own"),
]


@pytest.mark.parametrize("name", FAULTS)
def test_fault_is_caught_within_its_window(name):
    sc = _short(name)
    run = run_scenario(sc, 0, baselines=False)
    assert run.error is None, run.error
    assert run.steps == sc.train.max_steps  # stop_on=None: the run goes on after errors
    onset = run.onset
    assert onset is not None, "no validation ran: the onset of overfitting is unknown"
    hits = [
        (d, step)
        for d, step, _ in _alarms(run)
        if d in sc.expect and onset <= step <= onset + sc.window
    ]
    assert hits, (
        f"none of {sc.expect} warned in [{onset}, {onset + sc.window}]; got {_alarms(run)[:12]}"
    )


def test_nan_input_is_caught_at_its_onset_step():
    """The batch fault lands exactly on the onset step, an unsampled one. The scenario's
    ReLUs turn the NaN into 0 (built explicitly, as TensorFlow's fused MatMul+BiasAdd+Relu
    behaves on some CPUs), so the loss stays finite (TerminateOnNaN sees nothing) while the
    first kernel's gradient is NaN: the light train function's gradient sentinel takes that
    step's record, and the kernel is named on step 150 itself."""
    sc = _short("nan_input", 152)
    run = run_scenario(sc, 0, baselines=False)
    first = next(f for f in run.findings["adaptive"] if f["severity"] == "error")
    assert (first["step"], first["detector"]) == (150, "nonfinite_gradients")
    assert first["where"] == "sequential/dense/kernel"
    named = {f["detector"] for f in run.findings["adaptive"] if f["step"] == 150}
    assert "nonfinite_weights" in named
    assert not any(
        f["detector"] == "nonfinite_loss" and f["step"] == 150 for f in run.findings["adaptive"]
    )


# (scenario, steps): the controls that set the traps the faults above must not trip
HEALTHY = [
    pytest.param("healthy_standardized", 200, id="standardized-inputs"),
    pytest.param("healthy_tanh", 200, id="tanh-default-init"),
    pytest.param("healthy_frozen_layer", 200, id="trainable-false-layer"),
    pytest.param("healthy_digits_validated", 200, id="digits-validated-each-epoch"),
    pytest.param("healthy_near_perfect_fit", 1536, id="near-perfect-fit-wobbling"),
    pytest.param("healthy_gan", 1200, id="gan-own-train-step-two-optimizers"),
    pytest.param("healthy_skewed_labels", 300, id="skewed-labels-shuffled"),
    pytest.param("healthy_step_decay", 400, id="step-decay-at-its-cadence"),
    pytest.param("healthy_full_batch", 300, id="full-batch-the-same-batch-by-design"),
    pytest.param("healthy_softmax_output", 300, id="softmax-output-from-logits-false"),
    pytest.param("healthy_own_loss", 300, id="logits-to-a-loss-function-of-the-users-own"),
]


@pytest.mark.parametrize(("name", "steps"), HEALTHY)
def test_healthy_twin_is_quiet(name, steps):
    sc = _short(name, steps)
    run = run_scenario(sc, 0, baselines=False)
    assert run.error is None, run.error
    assert run.steps == steps
    assert _alarms(run) == []


def test_fits_that_differ_are_told_apart():
    """The suite's check that one fit per setting trained the same run each time."""
    a = _Fit(steps=3, losses=np.array([1.0, 0.5, np.nan]), weights="w")
    assert _same_fit(a, dataclasses.replace(a)) is None
    b = dataclasses.replace(a, losses=np.array([1.0, 0.4, np.nan]))
    assert _same_fit(a, b) == "losses differ from step 1"
    assert _same_fit(a, dataclasses.replace(a, weights="v")) == "final weights differ"
    assert _same_fit(a, dataclasses.replace(a, steps=2)) == "3 vs 2 steps"
