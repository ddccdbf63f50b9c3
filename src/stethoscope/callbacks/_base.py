"""What both callbacks share: the monitor they build, and how a decision becomes an act."""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stethoscope.engine import Decision, Monitor, Settings
from stethoscope.findings import Finding, TrainingProblem
from stethoscope.record.writer import RunRecorder
from stethoscope.recovery import Recoverer, Recovery, parse_recover
from stethoscope.summary import EpochSummary

__all__ = ["StepClock", "StethoscopeBase"]


class StepClock:
    """Times each step from its start to the next one's, for the overhead budget (see
    :meth:`Monitor.clock`). What lies between epochs (validation, checkpoints) is no
    step's time: :meth:`pause` ends the step in progress where it is, and :meth:`drop`
    forgets it, for a framework that can only tell once the pause is over."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._paused: float | None = None
        self._sampled = False
        self._steps = 1

    def start(self, monitor: Monitor, *, sampled: bool, steps: int = 1) -> None:
        """A step starts (``steps``: an execution of that many): the last one's time goes
        to ``monitor`` (with no budget to measure for, nothing is clocked)."""
        if monitor.budget is None:
            return
        now = time.perf_counter()
        if self._start is not None:
            end = now if self._paused is None else self._paused
            monitor.clock(end - self._start, sampled=self._sampled, steps=self._steps)
        self._start, self._sampled, self._steps, self._paused = now, sampled, steps, None

    def pause(self) -> None:
        """The step in progress ends now: what follows until the next one starts (a
        validation, an epoch's end) is not its time. In a full-batch run every step is
        followed by one, and a clock that forgot those steps would measure none."""
        if self._start is not None and self._paused is None:
            self._paused = time.perf_counter()

    def drop(self) -> None:
        """Forget the step in progress: its time held what was no step's."""
        self._start = self._paused = None


class StethoscopeBase:
    """The framework-free half of a stethoscope callback (a mixin before the framework's
    ``Callback``): it builds the :class:`Monitor`, keeps the epoch summaries, and acts
    on decisions through the two framework acts a subclass provides,
    :meth:`_stop_training` and :meth:`_before_raise`."""

    monitor: Monitor
    summaries: list[EpochSummary]

    def _build_monitor(
        self,
        settings: Settings,
        *,
        record: str | os.PathLike[str] | None,
        recover: bool | Recovery = False,
    ) -> None:
        """Make the monitor of ``settings``; with ``record``, a :class:`RunRecorder`
        first among the sinks; with ``recover``, the recovery ladder that answers the
        errors it can mend instead of stopping."""
        ladder = parse_recover(recover)
        #: Writes the run's record (``record=``), or ``None``.
        self.recorder = RunRecorder(record) if record is not None else None
        if self.recorder is not None:
            settings = replace(settings, sinks=(self.recorder, *settings.sinks))
        self.monitor = Monitor(settings)
        self.summaries = []
        #: The recovery ladder (``recover=``), or ``None``.
        keep = self.recorder.keep_skipped if self.recorder is not None else None
        self.recoverer = Recoverer(self.monitor, ladder, keep) if ladder is not None else None

    def _remember_skipped(self, share: Callable[[Any], Any] | None = None) -> None:
        """A run resumed from a checkpoint, into the record of the run it continues: the
        batches that run skipped past the checkpoint are skipped again where they come
        back (PaLM's rewind-and-skip), besides those the checkpoint holds. ``share``:
        hands rank zero's (who reads the record) to every rank, which must skip alike."""
        if self.recorder is not None and self.recoverer is not None:
            ahead = self.recorder.skipped_ahead
            self.recoverer.remember(share(ahead) if share is not None else ahead)

    def _describe(self, framework: dict[str, Any]) -> dict[str, Any]:
        """The run's configuration for its record: ``framework``'s description of the
        model, optimizer and trainer, and the detectors with their thresholds."""
        return {**framework, **self.monitor.describe()}

    @property
    def _report_writer(self) -> Callable[[Path], None] | None:
        """Writes the report of the run's record into a folder (the sinks' way to it,
        see ``RunContext.report``), or ``None`` without a record."""
        return self._report_into if self.recorder is not None else None

    def _report_into(self, folder: Path) -> None:
        """The record's report into ``folder``: ``report.html`` and ``figures/``. The
        record is closed first (closing is idempotent), so that the report is complete
        whichever sink asks, and whenever."""
        from stethoscope.record.report import write_report

        recorder = self.recorder
        assert recorder is not None
        recorder.close()
        write_report(recorder.directory, output=folder / "report.html", png_dir=folder / "figures")

    @property
    def record(self) -> Path | None:
        """The directory of the run's record (``record=``), or ``None``."""
        return self.recorder.directory if self.recorder is not None else None

    def _checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the callback: the monitor's state, the ladder's."""
        state = {"version": 1, "monitor": self.monitor.state_dict()}
        if self.recoverer is not None:
            state["recovery"] = self.recoverer.state_dict()
        return state

    def _load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state.get("monitor", {}))
        if self.recoverer is not None and "recovery" in state:
            self.recoverer.load_state_dict(state["recovery"])

    @property
    def stopped_by(self) -> Finding | None:
        """The finding that stopped (or raised in) the run, if any."""
        return self.monitor.stopped_by

    def _act(self, decision: Decision) -> None:
        """Do what ``decision`` says: raise :class:`TrainingProblem`, or stop gracefully
        (what the recovery ladder answers, it answers first)."""
        if decision.spared and self.recoverer is not None:
            decision = self.recoverer.review(decision)
        if decision.raise_:
            self._before_raise()
            raise TrainingProblem(decision.reason)
        if decision.stop:
            self._stop_training()

    def _stop_training(self) -> None:
        """Ask the framework to stop after this step."""
        raise NotImplementedError

    def _before_raise(self) -> None:
        """Tidy up before :class:`TrainingProblem` leaves the framework's loop."""

    def _end_epoch(self, epoch: int) -> EpochSummary:
        """Close the monitor's epoch; keep and return its summary."""
        summary = self.monitor.end_epoch(epoch)
        self.summaries.append(summary)
        return summary

    def _stop_message(self) -> str | None:
        """What stopped training, for the end of the run, wrapped to the terminal's width;
        None if nothing did."""
        f = self.monitor.stopped_by
        if f is None:
            return None
        text = (
            f"stethoscope stopped training at step {f.step}: {f.detector} ({f.severity}) — "
            f"{f.message}"
        )
        width = max(shutil.get_terminal_size().columns, 40)
        return textwrap.fill(text, width=width, break_on_hyphens=False)
