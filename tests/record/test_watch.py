"""``stethoscope watch``: following a record that another process is writing, in a real
pseudo-terminal, and drawing one frame of a finished or unreadable record."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from stethoscope.cli import main
from stethoscope.record import RecordError, RunRecord
from stethoscope.record.watch import _Follower, _pick, _View, sparkline, watch

from ._records import NAMES, make_record

TESTS = Path(__file__).resolve().parents[1]
COLUMNS, LINES = 100, 30
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")

# A training run in another process: one step every 20 ms, flushed every 50 ms, silent.
WRITER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from record._records import synthetic_observation
from stethoscope import Monitor
from stethoscope.record import RunRecorder
from stethoscope.sinks.base import RunContext

monitor = Monitor(sinks=[RunRecorder(sys.argv[1], flush_seconds=0.05)], stop_on=None)
monitor.start(RunContext(framework="synthetic"))
for step in range(1500):
    monitor.observe(synthetic_observation(step, monitor.plan(step), loss=1 / (1 + step)))
    time.sleep(0.02)
monitor.close()
"""

# Become the session's controlling terminal (so that Ctrl-C typed into the pty reaches
# the watch as SIGINT), then be `python -m stethoscope.cli watch ...`.
LAUNCHER = """
import os, sys
os.close(os.open(os.ttyname(0), os.O_RDWR))
os.execv(sys.executable, [sys.executable, "-m", "stethoscope.cli", "watch", *sys.argv[1:]])
"""


def _text(raw: bytes) -> str:
    return ANSI.sub("", raw.decode("utf-8", "replace"))


def _shown_steps(raw: bytes) -> list[int]:
    return [int(s.replace(",", "")) for s in re.findall(r"step\s+([\d,]+) · epoch", _text(raw))]


def _latest_step(directory: Path) -> int:
    try:
        with RunRecord(directory) as record:
            steps = record.losses().steps
    except RecordError:
        return -1
    return int(steps[-1]) if len(steps) else -1


def _read_until(fd: int, out: bytearray, done, deadline: float) -> bool:
    """Drain the pty into ``out`` until ``done(out)`` or the deadline or EOF."""
    while time.monotonic() < deadline:
        if done(out):
            return True
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                return done(out)
            if not chunk:
                return done(out)
            out += chunk
    return done(out)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def test_watch_follows_a_live_run_in_a_terminal_and_leaves_on_ctrl_c(tmp_path):
    deadline = time.monotonic() + 25
    run = tmp_path / "run"
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(LINES)}
    env.pop("NO_COLOR", None)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run), str(TESTS)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    watcher = None
    master = -1
    try:
        while _latest_step(run) < 0:  # the record exists and holds a step
            assert writer.poll() is None, "the writer died"
            assert time.monotonic() < deadline, "the writer wrote no step"
            time.sleep(0.05)
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        watcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(run), "--every", "0.2"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        out = bytearray()
        assert _read_until(master, out, _shown_steps, deadline), _text(out)[-2000:]
        first = _shown_steps(out)[-1]
        # the writer goes on: wait until it is well past the first frame, then until
        # the watch shows at least where it was
        while (target := _latest_step(run)) < first + 10:
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert _read_until(master, out, lambda o: max(_shown_steps(o)) >= target, deadline), (
            f"the watch stayed at step {max(_shown_steps(out))}, the record is at {target}"
        )
        assert writer.poll() is None, "the record was still being written"
        text = _text(out)
        assert "running" in text and "gradient flow" in text and "0.weight" in text
        frames = re.findall(r"╭─ stethoscope watch.*?╯", text, re.S)
        assert frames and all(len(f.splitlines()) < LINES for f in frames)
        assert all(len(line) <= COLUMNS for f in frames for line in f.splitlines())

        os.write(master, b"\x03")  # Ctrl-C, typed into the terminal
        _read_until(master, out, lambda o: watcher.poll() is not None, deadline)  # or EOF
        rc = watcher.wait(timeout=max(deadline - time.monotonic(), 0.1))
        _read_until(master, out, lambda o: False, min(deadline, time.monotonic() + 0.3))
        assert rc == 0, _text(out)[-2000:]
        text = _text(out)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
        # rich hid the cursor while drawing and showed it again on the way out
        raw = bytes(out)
        assert raw.rfind(b"\x1b[?25h") > raw.rfind(b"\x1b[?25l") >= 0
    finally:
        if watcher is not None:
            _stop(watcher)
        _stop(writer)
        if master >= 0:
            os.close(master)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("watch") / "run"
    make_record(directory, steps=300, nan_at=200)
    return directory


def _frame(directory: Path, *, height: int | None = None, **kw) -> str:
    # on a terminal, its height limits the frame
    console = Console(
        file=io.StringIO(), width=COLUMNS, height=height or 25, force_terminal=height is not None
    )
    watch(directory, once=True, console=console, **kw)
    return _text(console.file.getvalue().encode())


def test_once_draws_a_finished_run(finished):
    frame = _frame(finished)
    assert "finished" in frame
    assert "299 · epoch 2" in frame
    assert "nonfinite_loss" in frame and "sampler" in frame
    assert "1 non-finite step" in frame
    assert "!" in frame  # the NaN's bin in the sparkline
    assert any(block in frame for block in "▁▂▃▄▅▆▇█")
    # not a terminal: every parameter listed, the module path they share said once
    assert "under net." in frame and "│ 4.weight" in frame and "net.4.weight " not in frame
    assert max(len(line) for line in frame.splitlines()) <= COLUMNS
    # newest finding first
    assert frame.index("200 error   nonfinite_loss") < frame.index("  6 info    sampler")


def test_the_calibration_at_the_start_is_warming_up_not_an_escalation(tmp_path):
    make_record(tmp_path / "run", steps=5, nan_at=None)  # the synthetic escalation is at 6
    frame = _frame(tmp_path / "run")
    assert "every step (warming up)" in frame and "escalated" not in frame
    assert "findings · none" in frame and "none yet" not in frame  # a finished run


def test_once_through_the_command(finished, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["watch", str(finished), "--once"]) == 0
    out = capsys.readouterr()
    assert "finished" in out.out and "nonfinite_loss" in out.out and out.err == ""


def test_a_short_terminal_lists_fewer_gradients(finished):
    frame = _frame(finished, height=14)
    assert len(frame.splitlines()) <= 14
    listed = re.findall(r"│ \d\.(?:weight|bias) ", frame)
    more = re.search(r"… (\d+) more", frame)
    assert more is not None and listed
    assert len(listed) + int(more.group(1)) == len(NAMES)


def test_a_silent_running_record_is_shown_stale(tmp_path):
    monitor = make_record(tmp_path / "run", steps=20, nan_at=None, close=False)
    try:
        frame = _frame(tmp_path / "run", stale_after=-1)
    finally:
        monitor.close()
    assert "no update for" in frame and "finished" not in frame


def test_a_record_that_becomes_unreadable_is_shown_not_raised(tmp_path):
    make_record(tmp_path / "run", steps=50, nan_at=None)
    follower = _Follower(tmp_path / "run")
    try:
        follower.read()
        view = _View(follower, every=1.0, stale_after=20.0)
        (tmp_path / "run" / "record.sqlite").write_bytes(b"not a database " * 100)
        follower.refresh()
        assert follower.error and "damaged" in follower.error
        console = Console(file=io.StringIO(), width=COLUMNS)
        console.print(view.render(COLUMNS, None, live=True))
        frame = console.file.getvalue()
        assert "unreadable" in frame and "49 · epoch 0" in frame  # the last state read
        (tmp_path / "run" / "record.sqlite").unlink()
        follower.refresh()
        assert "holds no run record" in follower.error
    finally:
        follower.close()


def test_a_replaced_record_is_read_afresh(tmp_path):
    make_record(tmp_path / "run", steps=50, nan_at=None)
    follower = _Follower(tmp_path / "run")
    try:
        follower.read()
        assert follower.loss.n == 50
        make_record(tmp_path / "run", steps=20, nan_at=None)  # a fresh run replaces it
        follower.refresh()
        assert follower.error is None
        assert follower.loss.n == 20 and int(follower.loss.steps[-1]) == 19
    finally:
        follower.close()


def _write(directory: Path, data: bytes) -> Path:
    (directory / "record.sqlite").write_bytes(data)
    return directory


def _newer(tmp_path: Path) -> Path:
    make_record(tmp_path / "newer", steps=5, nan_at=None)
    with sqlite3.connect(tmp_path / "newer" / "record.sqlite") as con:
        con.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    con.close()
    return tmp_path / "newer"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "missing", "no such file or directory"),
        (lambda p: p, "holds no run record"),
        (lambda p: _write(p, b""), "is empty"),
        (lambda p: _write(p, b"garbage " * 512), "damaged"),
        (_newer, "newer stethoscope"),
    ],
    ids=["missing", "empty-dir", "empty-file", "garbage", "newer"],
)
def test_an_unreadable_record_is_one_sentence_and_exit_2(tmp_path, capsys, make, says):
    path = make(tmp_path)
    assert main(["watch", str(path), "--once"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stethoscope: ") and says in lines[0]
    assert "Traceback" not in out.err


def test_sparkline():
    assert str(sparkline(np.arange(8.0), 8)) == "▁▂▃▄▅▆▇█"
    assert str(sparkline(np.array([1.0, np.nan, np.inf, 2.0]), 10)) == "▁!!█"
    assert len(sparkline(np.linspace(0, 1, 1000), 37)) == 37
    assert set(str(sparkline(np.ones(5), 5))) == {"▅"}
    assert "no loss" in str(sparkline(np.empty(0), 10))


def test_pick_keeps_every_unusual_gradient_and_spreads_the_rest():
    values = np.full(100, 1e-3)
    values[[37, 61]] = [1e-9, np.nan]
    keep, more = _pick(values, 8)
    assert len(keep) == 7 and more == 93 and {37, 61} <= set(keep)
    assert 0 in keep and 99 in keep and keep == sorted(keep)
    assert _pick(values, None) == (list(range(100)), 0)
