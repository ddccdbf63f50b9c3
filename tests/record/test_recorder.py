"""The run record: what the recorder writes, what the reader gives back, and how the
record survives a killed run, a locked file and a long run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from stethoscope import Monitor
from stethoscope.detectors import default_detectors
from stethoscope.record import RecordError, RunRecord, RunRecorder
from stethoscope.sinks import Sink
from stethoscope.sinks.base import RunContext
from stethoscope.testing import RecordingDetector

from ._records import NAMES, make_record, synthetic_observation

ROOT = Path(__file__).resolve().parents[2]


def test_the_record_keeps_every_loss_and_what_the_detectors_saw(tmp_path):
    spy = RecordingDetector({"grads"}, name="spy")
    recorder = RunRecorder(tmp_path / "run", flush_seconds=0.01)
    monitor = Monitor(detectors=[spy], sinks=[recorder], stop_on=None)
    monitor.start(RunContext(framework="synthetic"))
    for step in range(120):
        monitor.observe(synthetic_observation(step, monitor.plan(step), loss=1.0 / (1 + step)))
    monitor.close()
    with RunRecord(tmp_path / "run") as record:
        losses = record.losses()
        assert list(losses.steps) == list(range(120))
        np.testing.assert_allclose(losses.values, 1.0 / (1 + np.arange(120)), rtol=1e-6)
        grads = record.layers("grad_norm")
        assert grads.names == NAMES
        seen = {obs.step: obs.grad_norm for obs in spy.seen}
        assert set(seen) <= set(grads.steps)  # every step a detector judged is recorded
        for i, step in enumerate(grads.steps):
            if step in seen:
                np.testing.assert_allclose(grads.values[i], seen[step], rtol=1e-6)
        assert record.finished


def test_the_record_wants_its_statistics_at_its_own_cadence_capped_when_hot(tmp_path):
    steady = Monitor(sinks=[RunRecorder(tmp_path / "a", every=8)], escalate=False)
    without = Monitor(escalate=False)
    plans = {step: steady.plan(step) for step in range(1, 33)}
    assert [s for s, p in plans.items() if "distributions" in p] == [8, 16, 24, 32]
    # the per-layer statistics ride on the detectors' sampled steps: the record asks
    # for its distributions and the fp8 readiness, and nothing more
    for step, plan in plans.items():
        assert plan - without.plan(step) <= {"distributions", "fp8"}, step
        assert ("fp8" in plan) == ("distributions" in plan)
    hot = Monitor(sinks=[RunRecorder(tmp_path / "b", every=8)])  # starts hot (calibrating)
    assert all("distributions" in hot.plan(s) for s in range(10))
    # the default cadence shortens 16x at most while hot: histograms are the costliest read
    default = Monitor(sinks=[RunRecorder(tmp_path / "c")])
    hot_steps = [s for s in range(64) if "distributions" in default.plan(s)]
    assert default.sampler.cap(0) == 1 and hot_steps == [0, 32]


def test_off_rank_zero_nothing_is_measured_for_the_record(tmp_path):
    monitor = Monitor(sinks=[RunRecorder(tmp_path / "r", every=1)])
    monitor.distribute(rank=1, world_size=2)
    assert "distributions" not in monitor.plan(64)
    monitor.distribute(rank=0, world_size=2)
    assert "distributions" in monitor.plan(64)


def test_a_sink_that_wants_an_unknown_statistic_is_refused_by_name():
    class Greedy(Sink):
        wants = frozenset({"gradz"})
        wants_every = 4

    with pytest.raises(ValueError, match=r"Greedy.wants names \['gradz'\].*'grads'"):
        Monitor(sinks=[Greedy()])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every=0 must be an integer >= 1"),
        ({"flush_seconds": -1}, "flush_seconds=-1"),
        ({"max_layer_steps": 1}, "max_layer_steps=1 must be an integer >= 2"),
    ],
)
def test_bad_arguments_are_refused_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunRecorder(tmp_path / "r", **kwargs)


def test_a_directory_that_cannot_be_created_is_one_sentence(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"record='.*file/run' cannot be created"):
        RunRecorder(blocker / "run")


def test_a_long_run_is_thinned_but_keeps_recent_steps_and_the_steps_with_findings(tmp_path):
    recorder = RunRecorder(
        tmp_path / "r", every=1, flush_seconds=0.0001, max_layer_steps=40,
        max_distribution_steps=10,
    )  # fmt: skip
    every_step = RecordingDetector({"grads", "weights"}, name="every_step")
    detectors = [*default_detectors(), every_step]
    monitor = Monitor(detectors=detectors, sinks=[recorder], stop_on=None, escalate=False)
    monitor.start(RunContext())
    for step in range(400):
        loss = float("nan") if step == 50 else 1.0
        monitor.observe(synthetic_observation(step, monitor.plan(step), loss=loss))
    monitor.close()
    with RunRecord(tmp_path / "r") as record:
        kept = record.layers("grad_norm").steps
        assert len(kept) <= 40 + 40 // 2  # thinned whenever it passes the cap
        assert 50 in kept  # a step with an error is never thinned
        assert list(kept[-10:]) == list(range(390, 400))  # the recent steps are whole
        assert np.all(np.diff(kept[:10]) > 1)  # the old ones are sparse
        assert len(record.layers("weight_hist").steps) <= 10 + 10 // 2 + 1
        assert len(record.losses().steps) == 400  # the loss is never thinned


def test_a_fresh_run_replaces_the_record_and_a_resumed_one_continues_it(tmp_path):
    make_record(tmp_path / "r", steps=150, nan_at=None)
    recorder = RunRecorder(tmp_path / "r", flush_seconds=0.01)
    monitor = Monitor(sinks=[recorder], stop_on=None)
    monitor.start(RunContext(first_step=100, first_epoch=1))
    for step in range(100, 130):
        monitor.observe(synthetic_observation(step, monitor.plan(step), loss=5.0))
    monitor.close()
    with RunRecord(tmp_path / "r") as record:
        losses = record.losses()
        assert list(losses.steps) == list(range(130))  # 0-99 kept, 100-129 from the resume
        assert set(losses.values[100:]) == {5.0}
    make_record(tmp_path / "r", steps=20, nan_at=None)  # a fresh run
    with RunRecord(tmp_path / "r") as record:
        assert len(record.losses().steps) == 20
    with RunRecord(tmp_path / "r" / "record.previous.sqlite") as previous:
        assert len(previous.losses().steps) == 130


def test_a_locked_record_warns_once_and_loses_nothing(tmp_path):
    recorder = RunRecorder(tmp_path / "r", flush_seconds=0.01)
    monitor = Monitor(sinks=[recorder], stop_on=None)
    monitor.start(RunContext())
    other = sqlite3.connect(recorder.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            monitor.observe(synthetic_observation(step, frozenset(), loss=1.0))
            time.sleep(0.02)
    other.execute("ROLLBACK")
    other.close()
    mine = [w for w in caught if "could not write the run record" in str(w.message)]
    assert len(mine) == 1
    monitor.observe(synthetic_observation(3, frozenset(), loss=1.0))
    monitor.close()
    with RunRecord(tmp_path / "r") as record:
        assert list(record.losses().steps) == [0, 1, 2, 3]


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path[:0] = [{root!r}, {src!r}]
    from stethoscope import Monitor
    from stethoscope.record import RunRecorder
    from stethoscope.sinks.base import RunContext
    from tests.record._records import synthetic_observation
    monitor = Monitor(sinks=[RunRecorder(Path(sys.argv[1]), flush_seconds=0.01)])
    monitor.start(RunContext(framework="synthetic"))
    for step in range(100000):
        monitor.observe(synthetic_observation(step, monitor.plan(step), loss=1.0))
        if step == 50:
            print("written", flush=True)
        time.sleep(0.002)
    """
)


def test_a_killed_run_leaves_a_readable_record(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(root=str(ROOT), src=str(ROOT / "src")))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "r")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "written"
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with RunRecord(tmp_path / "r") as record:
        assert not record.finished  # it never closed
        steps = record.losses().steps
        assert len(steps) > 50 and list(steps) == list(range(len(steps)))
    pytest.importorskip("plotly")
    from stethoscope.cli import main

    assert main(["report", str(tmp_path / "r")]) == 0  # and it reports
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    assert "stopped without closing its record" in page and 'id="fig-gradient_flow"' in page


def test_what_cannot_be_read_is_one_sentence(tmp_path):
    with pytest.raises(RecordError, match="There is no run record at"):
        RunRecord(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="holds no run record"):
        RunRecord(tmp_path / "empty")
    make_record(tmp_path / "r", steps=50)
    data = (tmp_path / "r" / "record.sqlite").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "record.sqlite").write_bytes(data[:100])
    with pytest.raises(RecordError, match="is not a readable run record"):
        RunRecord(tmp_path / "cut")
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "record.sqlite").write_bytes(b"")
    with pytest.raises(RecordError, match="is empty"):
        RunRecord(tmp_path / "zero")
    con = sqlite3.connect(tmp_path / "r" / "record.sqlite")
    con.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    con.commit()
    con.close()
    with pytest.raises(RecordError, match=r"newer stethoscope \(record format 99"):
        RunRecord(tmp_path / "r")
    with pytest.raises(ValueError, match="kind='grads' is not a recorded statistic"):
        make_record(tmp_path / "ok", steps=5)
        RunRecord(tmp_path / "ok").layers("grads")
