"""A sink never costs a run and never loses a finding quietly: real failures, real files.

A full disk is ``/dev/full`` (every write fails with ENOSPC), a path that stops
existing is a directory removed mid-run, a short write is a real pipe that fills up,
and a server that is down is a port nobody listens on.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from _sinkkit import free_port, tb_scalars
from stethoscope.engine.monitor import Monitor
from stethoscope.findings import Finding
from stethoscope.sinks import CSVSink, JSONLSink, MLflowSink, Sink, TensorBoardSink
from stethoscope.sinks._buffer import _Background
from stethoscope.testing import CapturingSink

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def finding(step: int, severity: str = "warning", **changes: Any) -> Finding:
    fields: dict[str, Any] = {
        "epoch": 0,
        "detector": "exploding_gradients",
        "message": f"Gradient norm at step {step} exceeds 10; clip gradients.",
        "value": 12.5,
        "threshold": 10.0,
        "where": "layer1.weight",
    }
    fields.update(changes)
    return Finding(step=step, severity=severity, **fields)


def stethoscope_warnings(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in record if text in str(w.message)]


# --- a full disk --------------------------------------------------------------------


@needs_dev_full
@pytest.mark.parametrize("cls", [CSVSink, JSONLSink], ids=["csv", "jsonl"])
def test_full_disk_never_raises_keeps_a_bounded_buffer_and_counts_what_it_drops(
    cls: type,
) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sink = cls("/dev/full", max_buffer=4)
        for step in range(10):
            sink.emit(finding(step))  # ENOSPC on every write: never raised
        assert sink.pending == 4  # bounded: the CSV header waits too, at the head
        assert isinstance(sink.last_error, OSError) and sink.last_error.errno == errno.ENOSPC
        held = 3 if cls is CSVSink else 4
        assert sink.dropped == 10 - held  # the newest are dropped, the first ones kept
        sink.flush()  # retries, fails again, still does not raise
        assert sink.pending == 4
        sink.close()
        sink.close()
    assert sink.dropped == 10  # what still waited at close is lost, and counted
    assert sink.pending == 0
    [failed] = stethoscope_warnings(record, "training goes on")  # once, with the cause
    assert "No space left on device" in failed and "retries at the next flush" in failed
    assert len(stethoscope_warnings(record, "now drops new ones")) == 1
    assert len(stethoscope_warnings(record, "before closing")) == 1


@needs_dev_full
def test_full_disk_is_reported_in_the_epoch_summary() -> None:
    good = CapturingSink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = JSONLSink("/dev/full", max_buffer=2)
        monitor = Monitor(
            detectors=[], repeat_after=0, sinks=[full, good, JSONLSink("/dev/full", max_buffer=0)]
        )
        monitor.submit([finding(step) for step in range(5)])
        summary = monitor.end_epoch(0)
    assert [f.step for f in good.findings] == [0, 1, 2, 3, 4]  # the other sinks go on
    assert summary.dropped == {"JSONLSink[0]": 3, "JSONLSink[2]": 5}
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(summary)
    text = " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]
    assert "Sinks dropped findings they could not write: JSONLSink[0] 3, JSONLSink[2] 5." in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor.close()


def test_summary_lists_no_drops_when_nothing_was_dropped(tmp_path: Path) -> None:
    monitor = Monitor(detectors=[], repeat_after=0, sinks=[JSONLSink(tmp_path / "f.jsonl")])
    monitor.submit([finding(1)])
    summary = monitor.end_epoch(0)
    assert summary.dropped == {}
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(summary)
    assert "dropped" not in console.file.getvalue()  # type: ignore[attr-defined]
    monitor.close()


def test_a_sink_whose_dropped_count_raises_does_not_cost_the_summary() -> None:
    class Odd(Sink):
        @property
        def dropped(self) -> int:
            raise RuntimeError("broken counter")

    monitor = Monitor(detectors=[], repeat_after=0, sinks=[Odd()])
    monitor.submit([finding(1)])
    assert monitor.end_epoch(0).dropped == {}


# --- a path that goes away, and comes back --------------------------------------------


@pytest.mark.parametrize("cls", [CSVSink, JSONLSink], ids=["csv", "jsonl"])
def test_a_path_that_went_away_is_retried_at_flush_in_order(cls: type, tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    sink = cls(folder / "findings.out")
    sink.emit(finding(1))
    sink.close()  # between two fits
    shutil.rmtree(folder)  # and someone cleans up the run directory
    with pytest.warns(RuntimeWarning, match="could not write to"):
        sink.emit(finding(2))
    sink.emit(finding(3))
    assert sink.pending == 2
    assert isinstance(sink.last_error, FileNotFoundError)
    folder.mkdir()
    sink.flush()
    assert sink.pending == 0 and sink.dropped == 0
    sink.close()
    text = (folder / "findings.out").read_text()
    lines = text.splitlines()
    if cls is CSVSink:
        assert lines[0].startswith("step,epoch")  # a fresh file gets its header first
        lines = lines[1:]
        assert [line.split(",")[0] for line in lines] == ["2", "3"]
    else:
        assert [json.loads(line)["step"] for line in lines] == [2, 3]


def test_tensorboard_log_dir_that_cannot_be_made_is_retried_at_flush(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "blocked" / "tb")
    (tmp_path / "blocked").write_text("a file where the log dir should go")
    with pytest.warns(RuntimeWarning, match="could not write to"):
        sink.emit(finding(1))
    sink.emit(finding(2))
    assert sink.pending == 2 and sink.file is None
    (tmp_path / "blocked").unlink()
    sink.flush()
    assert sink.pending == 0
    sink.close()
    assert [
        s for s, _ in tb_scalars(tmp_path / "blocked" / "tb", "stethoscope/exploding_gradients")
    ] == [1, 2]


# --- a write cut short ------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="needs a named pipe")
def test_a_line_cut_short_is_completed_not_repeated(tmp_path: Path) -> None:
    # A pipe that nobody reads fills up at 64 KiB; with the write end non-blocking, a
    # line longer than PIPE_BUF goes out in part, the way a disk filling up cuts a write.
    fifo = tmp_path / "findings.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        sink = JSONLSink(fifo)
        os.set_blocking(sink._file.fileno(), False)  # the one private touch: the OS's knob
        long_message = "x" * 10_000
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            step = 0
            while sink.pending == 0:
                sink.emit(finding(step, message=long_message))
                step += 1
                assert step < 100, "the pipe never filled"
            for extra in range(step, step + 3):
                sink.emit(finding(extra, message=long_message))
            assert isinstance(sink.last_error, BlockingIOError)
            received = b""
            while sink.pending:  # drain the pipe, then retry, until everything is through
                received += _read_all(reader)
                sink.flush()
            received += _read_all(reader)
        sink.close()
    finally:
        os.close(reader)
    lines = received.decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(step + 3))


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


# --- a sink that raises on every call ------------------------------------------------


class Raising(Sink):
    """A user's sink with a bug in every method."""

    def emit(self, finding: Finding) -> None:
        raise ValueError("bug in emit")

    def epoch_end(self, summary: Any) -> None:
        raise ValueError("bug in epoch_end")

    def flush(self) -> None:
        raise ValueError("bug in flush")

    def close(self) -> None:
        raise ValueError("bug in close")

    @property
    def dropped(self) -> int:
        raise ValueError("bug in dropped")


def test_a_sink_that_raises_on_every_call_costs_nothing_and_is_warned_about_once() -> None:
    good = CapturingSink()
    monitor = Monitor(detectors=[], repeat_after=0, sinks=[Raising(), good])
    with pytest.warns(RuntimeWarning) as record:
        monitor.submit([finding(1), finding(2)])
        summary = monitor.end_epoch(0)
        monitor.close()
    assert [str(w.message) for w in record if "Raising" in str(w.message)] == [
        "stethoscope: Raising.emit() failed with ValueError('bug in emit'); training goes on "
        "and the other sinks still receive findings"
    ]
    assert [f.step for f in good.findings] == [1, 2]
    assert good.summaries == [summary] and good.closed


# --- a server that is down ------------------------------------------------------------


@pytest.fixture
def quick_mlflow_http(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MLflow's client retries a dead server for minutes by default; tests cannot wait."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    # A sink that could not upload keeps its local copy of the findings for the user;
    # in a test, that copy belongs in the test's own directory.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_mlflow_server_down_bounds_the_buffer_and_the_summary_counts_drops(
    quick_mlflow_http: None,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    sink = MLflowSink(tracking_uri=dead, experiment="x", max_buffer=5, close_timeout=10)
    monitor = Monitor(detectors=[], repeat_after=0, sinks=[sink])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        monitor.submit([finding(step) for step in range(20)])
        summary = monitor.end_epoch(0)
        assert summary.dropped == {"MLflowSink": 15}  # the 5 first wait, the rest are counted
        monitor.close()
    assert sink.dropped == 20  # nothing reached the server, and the count says so
    lost = stethoscope_warnings(record, "before closing")
    assert len(lost) == 1 and "every finding is still in" in lost[0]
    spool = Path(lost[0].split("every finding is still in ")[1].strip("'"))
    assert [json.loads(line)["step"] for line in spool.read_text().splitlines()] == list(range(20))
    assert stethoscope_warnings(record, "could not write to MLflow run")


# --- the background worker on its own ----------------------------------------------


class Gate(_Background):
    """A background sink whose destination is a list behind a gate the test opens."""

    def __init__(self, **kw: Any) -> None:
        self._init_background(**{"max_buffer": 100, "flush_timeout": 5, "close_timeout": 5, **kw})
        self.open = threading.Event()
        self.fail = False
        self.sent: list[int] = []

    def emit(self, finding: Finding) -> None:
        self._deliver(finding.step)

    def flush(self) -> None:
        self._flush_background()

    def close(self) -> None:
        self._close_background()

    def _send(self, items: list[int]) -> None:
        self.open.wait()
        if self.fail:
            raise ConnectionError("down")
        self.sent.extend(items)


def test_emit_never_waits_for_a_slow_destination() -> None:
    sink = Gate(flush_timeout=0.2, close_timeout=0.2)
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="holds 100 findings not yet written"):
        for step in range(1000):
            sink.emit(finding(step))
    assert time.perf_counter() - start < 2.0  # a lock and an append each, never a send
    start = time.perf_counter()
    sink.flush()
    assert 0.15 < time.perf_counter() - start < 2.0  # waits flush_timeout, not longer
    with pytest.warns(RuntimeWarning, match="still sending after close_timeout=0.2s"):
        sink.close()
    assert sink.dropped == 1000
    sink.open.set()  # the worker's send in flight finishes; the worker then stops


def test_a_failed_send_waits_for_the_next_flush_and_keeps_the_order() -> None:
    sink = Gate()
    sink.fail = True
    sink.open.set()
    with pytest.warns(RuntimeWarning, match="ConnectionError"):
        for step in range(3):
            sink.emit(finding(step))
        sink._wait_idle(5)
    assert sink.pending == 3 and sink.sent == []
    sink.emit(finding(3))
    sink.fail = False
    start = time.perf_counter()
    sink.flush()  # the last send failed: the flush asks for a retry and does not wait
    assert time.perf_counter() - start < 2.0
    sink.close()  # close waits for the retry
    assert sink.sent == [0, 1, 2, 3]
    assert sink.dropped == 0


def test_close_is_once_and_a_later_emit_starts_a_new_worker() -> None:
    sink = Gate()
    sink.open.set()
    sink.emit(finding(1))
    sink.close()
    sink.close()
    assert not any(t.name == "stethoscope-Gate" and t.is_alive() for t in _threads())
    sink.emit(finding(2))
    sink.close()
    assert sink.sent == [1, 2]


def _threads() -> list[threading.Thread]:
    time.sleep(0.05)  # a stopped worker needs a moment to leave its loop
    return threading.enumerate()


def test_a_copy_that_cannot_open_its_file_buffers_instead_of_failing(tmp_path: Path) -> None:
    # Pickled copies of a file sink never truncate, even where the file cannot be opened:
    # the copy buffers its first finding instead of failing to unpickle.
    import pickle

    path = tmp_path / "f.jsonl"
    sink = JSONLSink(path)
    blob = pickle.dumps(sink)
    sink.close()
    path.unlink()
    path.mkdir()  # now a directory: the copy cannot open it
    copy = pickle.loads(blob)
    assert copy.closed and isinstance(copy.last_error, IsADirectoryError)
    with pytest.warns(RuntimeWarning, match="could not write to"):
        copy.emit(finding(1))
    assert copy.pending == 1
    path.rmdir()
    copy.flush()
    copy.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
    assert stat.S_ISREG(path.stat().st_mode)
