"""The README's demo: a real training run that stethoscope stops, with its summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_digits.py"


def test_make_demo_catches_the_learning_rate_and_stops_early(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--fault", "lr", "--record", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    assert "stethoscope stopped training at step" in out
    step = int(out.split("stethoscope stopped training at step ")[1].split(":")[0])
    assert step < 14, "the loss of this run becomes NaN at step 14: stop before it"
    assert "stethoscope · epoch 0" in out  # the summary table
    assert "lower the LR" in out  # a message that says what to do
    report = tmp_path / "demo" / "report.html"  # the demo's report, and where it is
    assert f"The run's report: {report}" in out.replace("\n", "")
    assert "exploding_gradients" in report.read_text(encoding="utf-8")


KERAS_EXAMPLE = EXAMPLE.with_name("keras_digits.py")


def _run_keras_example(*args: str) -> str:
    pytest.importorskip("keras")
    return subprocess.run(
        [sys.executable, str(KERAS_EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3"},
        check=True,
    ).stdout


def test_the_keras_twin_stops_the_learning_rate_in_its_first_epoch(tmp_path):
    out = _run_keras_example("--fault", "lr", "--record", str(tmp_path / "demo"))
    step = int(out.split("stethoscope stopped training at step ")[1].split(":")[0])
    assert step < 57, "stopped inside the first epoch"
    assert "stethoscope · epoch 0" in out
    assert "lower the LR" in out
    assert f"The run's report: {tmp_path / 'demo' / 'report.html'}" in out


def test_the_keras_twin_finds_the_nan_batch_that_relu_hides_from_the_loss():
    # Where TensorFlow's fused MatMul+BiasAdd+Relu maps the NaN to 0 (some CPUs), the loss
    # stays finite and nonfinite_gradients stops the run at step 150; where it passes the
    # NaN on, nonfinite_loss does, at the same step: this holds on either.
    out = _run_keras_example("--fault", "nan", "--epochs", "3")
    assert "stethoscope stopped training at step" in out
    step = int(out.split("stethoscope stopped training at step ")[1].split(":")[0])
    assert 150 <= step <= 153
    assert "NaN" in out
