"""The README's demo: a real training run that stethoscope stops, with its summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_digits.py"


def test_make_demo_catches_the_learning_rate_and_stops_early():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--fault", "lr"],
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
