"""TensorBoardSink, read back by TensorBoard's own event reader."""

from __future__ import annotations

import math
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from _sinkkit import tb_scalars, tb_texts
from stethoscope.findings import Finding
from stethoscope.sinks import TensorBoardSink


def finding(step: int, detector: str = "loss_spike", **changes: Any) -> Finding:
    fields: dict[str, Any] = {
        "epoch": 0,
        "severity": "warning",
        "message": f"The loss jumped at step {step}; check the batch.",
        "value": 4.0 + step,
        "where": "loss",
    }
    fields.update(changes)
    return Finding(step=step, detector=detector, **fields)


def test_scalars_by_step_and_messages_as_text(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.emit(finding(3))
    sink.emit(finding(5, value=None))  # no value: 1.0 marks the step
    sink.emit(finding(6, "nonfinite_loss", severity="error", value=math.nan, where=None))
    sink.close()
    assert tb_scalars(tmp_path, "stethoscope/loss_spike") == [(3, 7.0), (5, 1.0)]
    [(step, value)] = tb_scalars(tmp_path, "stethoscope/nonfinite_loss")
    assert step == 6 and math.isnan(value)
    assert tb_texts(tmp_path, "stethoscope/loss_spike/message") == [
        (3, "**WARNING** at `loss`: The loss jumped at step 3; check the batch."),
        (5, "**WARNING** at `loss`: The loss jumped at step 5; check the batch."),
    ]
    assert tb_texts(tmp_path, "stethoscope/nonfinite_loss/message")[0][1].startswith("**ERROR**:")
    [name] = os.listdir(tmp_path)
    assert "tfevents" in name and name.endswith(".stethoscope")


def test_every_finding_is_on_disk_without_flush(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.emit(finding(1))
    assert tb_scalars(sink.file, "stethoscope/loss_spike") == [(1, 5.0)]  # no flush, no close
    sink.close()


def test_no_log_dir_writes_to_runs_stethoscope_lazily(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sink = TensorBoardSink()
    assert sink.follows_logger and sink.file is None
    assert not (tmp_path / "runs").exists()  # nothing is created before the first finding
    sink.emit(finding(1))
    sink.close()
    assert tb_scalars(tmp_path / "runs" / "stethoscope", "stethoscope/loss_spike") == [(1, 5.0)]


def test_use_log_dir_moves_to_a_new_directory(tmp_path: Path) -> None:
    sink = TensorBoardSink()
    sink.use_log_dir(tmp_path / "a")
    sink.emit(finding(1))
    sink.use_log_dir(tmp_path / "b")
    sink.emit(finding(2))
    sink.close()
    assert tb_scalars(tmp_path / "a", "stethoscope/loss_spike") == [(1, 5.0)]
    assert tb_scalars(tmp_path / "b", "stethoscope/loss_spike") == [(2, 6.0)]


def test_an_explicit_log_dir_does_not_follow_a_logger(tmp_path: Path) -> None:
    assert not TensorBoardSink(tmp_path).follows_logger


def test_a_log_dir_that_is_a_file_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match=re.escape(repr(str(tmp_path / "f")))):
        TensorBoardSink(tmp_path / "f")


def test_a_copy_writes_its_own_file_in_the_same_dir(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path, min_severity="warning")
    sink.emit(finding(1))
    clone = pickle.loads(pickle.dumps(sink))
    clone.emit(finding(2))
    clone.close()
    sink.close()
    assert len(os.listdir(tmp_path)) == 2
    assert tb_scalars(tmp_path, "stethoscope/loss_spike") == [(1, 5.0), (2, 6.0)]


def test_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'stethoscope\[tensorboard\]'"):
        TensorBoardSink()


def test_writing_imports_neither_torch_nor_tensorflow(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from stethoscope.findings import Finding
        from stethoscope.sinks import TensorBoardSink
        sink = TensorBoardSink({str(tmp_path)!r})
        sink.emit(Finding(step=1, epoch=0, detector="x", severity="info", message="m."))
        sink.close()
        print([m for m in ("torch", "tensorflow") if m in sys.modules])
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
