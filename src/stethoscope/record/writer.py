"""Writing the run record: a sink that also sees every observation.

The loss of every step is kept in memory and written in one row about once a second;
the per-layer statistics of a sampled step, every finding, each validation and each
epoch's summary go out in the same transaction. Nothing is written between flushes,
so an unsampled step costs two list appends.

The record stays bounded however long the run: past a cap on the sampled steps kept
for each group of statistics, every second one of the older half is deleted (the way
the sampler thins its reads), so old history grows sparser while recent steps and the
steps with findings stay whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sqlite3
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from stethoscope.findings import Finding, Severity
from stethoscope.number_formats import HALF
from stethoscope.observation import Observation, global_norm
from stethoscope.record.store import (
    FILE_NAME,
    FORMAT_VERSION,
    SKIPPED_COLUMNS,
    RecordError,
    connect_reader,
    connect_writer,
)
from stethoscope.recovery.skipped import SkippedBatch
from stethoscope.sinks.base import RunContext, Sink
from stethoscope.summary import EpochSummary

__all__ = ["DISTRIBUTION_KINDS", "LAYER_KINDS", "RunRecorder"]

#: The per-layer statistics a sampled step may record, by kind: what each is aligned with.
LAYER_KINDS: dict[str, str] = {
    "grad_norm": "parameters",
    "weight_norm": "parameters",
    "update_ratio": "parameters",
    "dead": "layers with units",
    "saturated": "tanh and sigmoid activations",
    "act_rms": "observed layers and activations",
    "update_lost": "parameters held in 16 bits (their share of updates rounded away)",
    "grad_subnormal": "parameters held in 16 bits (their gradient's subnormal share)",
    "loss_scale": "the loss scaler (one name: its scale)",
    "scale_skipped": "the loss scaler (one name: the share of steps it skipped since the last)",
    "fp8_weight_e4m3": "parameters (their weights' share lost to zero in e4m3)",
    "fp8_grad_e5m2": "parameters (their gradient's share lost to zero in e5m2)",
}
#: The per-parameter histograms (see ``statistics.DISTRIBUTION_EDGES``).
DISTRIBUTION_KINDS: tuple[str, ...] = ("weight_hist", "grad_hist")

_STATUS = "status"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunRecorder(Sink):
    """Keeps the run's statistics and findings in a SQLite file that ``stethoscope
    report`` and ``stethoscope watch`` read, during the run and after it.

    The callbacks make one from ``record="runs/NAME"``; it writes
    ``runs/NAME/record.sqlite``. A fresh run replaces a previous run's record there (kept
    once as ``record.previous.sqlite``); a run resumed from a checkpoint continues it.

    Args:
        directory: The record's directory (created, with its parents).
        every: Steps between the steps that measure the weight and gradient
            distributions for the record (the per-layer statistics come with the
            detectors' own sampled steps, at no extra cost). The sampler shortens it
            while something looks wrong, as it does the detectors' intervals.
        flush_seconds: How often buffered rows are written.
        max_layer_steps: Sampled steps whose per-layer statistics are kept whole; past
            it, older ones are thinned.
        max_distribution_steps: Likewise for the distributions (the largest rows).

    Raises:
        ValueError: A bad argument, or a directory that cannot be created.
    """

    #: What the record wants measured at its own cadence, beyond what the detectors ask
    #: (their sampled steps already bring every per-layer statistic it keeps): the
    #: distributions, and how each parameter would fit fp8 (a readiness report).
    wants = frozenset({"distributions", "fp8"})

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 512,
        flush_seconds: float = 1.0,
        max_layer_steps: int = 4096,
        max_distribution_steps: int = 512,
    ) -> None:
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(f"record={directory!r} must be a directory path such as 'runs/NAME'")
        for name, value, low in (
            ("every", every, 1),
            ("max_layer_steps", max_layer_steps, 2),
            ("max_distribution_steps", max_distribution_steps, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if not isinstance(flush_seconds, (int, float)) or not flush_seconds > 0:
            raise ValueError(f"flush_seconds={flush_seconds!r} must be a number of seconds > 0")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"record={str(directory)!r} cannot be created ({exc.strerror or exc}): "
                "choose a directory you can write to"
            ) from None
        self.wants_every = every
        self.flush_seconds = float(flush_seconds)
        self.max_layer_steps = max_layer_steps
        self.max_distribution_steps = max_distribution_steps
        #: Where the record is written: ``directory / "record.sqlite"``.
        self.path = self.directory / FILE_NAME
        self._con: sqlite3.Connection | None = None
        self._describe: Callable[[], dict[str, Any]] | None = None
        self._failed = False
        self._reset_buffers()
        self.skipped_ahead: list[SkippedBatch] = []  # see start

    def _reset_buffers(self) -> None:
        self._steps: list[int] = []
        self._epochs: list[int] = []
        self._losses: list[float] = []
        self._sampled: list[tuple] = []
        self._layers: list[tuple[int, str, tuple[str, ...], np.ndarray]] = []
        self._findings: list[tuple] = []
        self._skipped: list[tuple] = []
        self._validation: list[tuple] = []
        self._summaries: list[tuple[int, str]] = []
        self._next_flush = 0.0
        self._layout_ids: dict[tuple[str, ...], int] = {}
        # sampled steps in the file holding each group of kinds (a step written twice, by a
        # second look, counts twice: thinning then comes a little early, and recounts)
        self._kept: dict[tuple[str, ...], int] = {}

    # -- the run ------------------------------------------------------------------------
    def start(self, context: RunContext) -> None:
        """Open the record: a fresh run replaces a previous record, a resumed one
        continues it from its first step."""
        self.close()
        self._reset_buffers()
        first = context.first_step
        if first == 0 and self.path.exists():
            previous = self.directory / "record.previous.sqlite"
            for suffix in ("", "-wal", "-shm"):
                old = Path(f"{self.path}{suffix}")
                if old.exists():
                    old.replace(Path(f"{previous}{suffix}"))
        meta = {
            "format": str(FORMAT_VERSION),
            "framework": context.framework,
            "world_size": str(context.world_size),
            "started": _now(),
            "updated": _now(),
            _STATUS: "running",
            "python": platform.python_version(),
        }
        self._con = connect_writer(self.path, meta)
        #: The batches skipped past the step a resumed run starts from: it will meet them
        #: again (the rows stay: the record keeps every batch a run skipped).
        self.skipped_ahead = self._skipped_since(first) if first > 0 else []
        if first > 0:  # a resumed run: what the record holds past the checkpoint is replaced
            for table, column in (
                ("sampled", "step"),
                ("layers", "step"),
                ("findings", "step"),
                ("validation", "step"),
                ("losses", "first_step"),
            ):
                self._con.execute(f"DELETE FROM {table} WHERE {column} >= ?", (first,))
            self._con.execute("DELETE FROM epochs WHERE epoch >= ?", (context.first_epoch,))
        self._describe = context.describe
        self._write_config(context)

    def _write_config(self, context: RunContext) -> None:
        try:
            config = context.describe() if context.describe is not None else {}
        except Exception as exc:  # describing the model must never cost the run
            config = {"error": f"could not describe the run: {exc!r}"}
        self._execute_meta({"config": json.dumps(config, default=str)})

    def _execute_meta(self, items: dict[str, str]) -> None:
        if self._con is not None:
            self._con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", items.items())

    def observe(self, obs: Observation, interval: int) -> None:
        """Keep one step's observation (``interval``: how often the sampled detectors
        run at that step)."""
        step = obs.step
        if obs.loss is not None:
            if self._steps and self._steps[-1] == step:  # a second look at the same step
                self._losses[-1] = obs.loss
            else:
                self._steps.append(step)
                self._epochs.append(obs.epoch)
                self._losses.append(obs.loss)
        if obs.val_loss is not None:
            self._validation.append((step, obs.epoch, obs.val_loss, obs.train_loss))
        if (
            obs.grad_norm is not None
            or obs.weight_norm is not None
            or obs.act_rms is not None
            or obs.fp8_underflow is not None
            or obs.loss_scale is not None
        ):
            self._keep_layers(obs, interval)
        if time.monotonic() >= self._next_flush:
            self.flush()

    def _keep_layers(self, obs: Observation, interval: int) -> None:
        step, names = obs.step, tuple(obs.names)
        total = global_norm(obs.grad_norm) if obs.grad_norm is not None else None
        self._sampled.append((step, obs.epoch, obs.lr, interval, total))
        keep = self._layers.append
        if obs.grad_norm is not None:
            keep((step, "grad_norm", names, obs.grad_norm))
        if obs.weight_norm is not None:
            keep((step, "weight_norm", names, obs.weight_norm))
        if obs.update_norm is not None and obs.prev_weight_norm is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.asarray(obs.update_norm, np.float64) / obs.prev_weight_norm
            keep((step, "update_ratio", names, ratio))
        if obs.unit_zero is not None and obs.unit_names:
            dead = np.array([np.mean(z) if len(z) else np.nan for z in obs.unit_zero])
            keep((step, "dead", tuple(obs.unit_names), dead))
        if obs.act_rms is not None and obs.act_names:
            act_names = tuple(obs.act_names)
            keep((step, "act_rms", act_names, obs.act_rms))
            if obs.act_saturated is not None:
                activations = [i for i, k in enumerate(obs.act_kinds) if k != "layer"]
                if activations:
                    keep(
                        (
                            step,
                            "saturated",
                            tuple(act_names[i] for i in activations),
                            np.asarray(obs.act_saturated)[activations],
                        )
                    )
        self._keep_precision(obs, names)
        if obs.weight_hist is not None:
            keep((step, "weight_hist", names, obs.weight_hist))
        if obs.grad_hist is not None:
            keep((step, "grad_hist", names, obs.grad_hist))

    def _keep_precision(self, obs: Observation, names: tuple[str, ...]) -> None:
        """The precision statistics of a sampled step: what rounded away and underflowed
        in the parameters held in 16 bits, the loss scale, and the fp8 readiness."""
        keep, step = self._layers.append, obs.step
        half = [i for i, d in enumerate(obs.dtypes) if d in HALF]
        if half and obs.update_lost is not None:
            keep((step, "update_lost", tuple(names[i] for i in half), obs.update_lost[half]))
        if half and obs.grad_subnormal is not None:
            subnormal = np.asarray(obs.grad_subnormal)[half]
            keep((step, "grad_subnormal", tuple(names[i] for i in half), subnormal))
        if obs.loss_scale is not None:
            keep((step, "loss_scale", ("loss scale",), np.array([obs.loss_scale])))
            if obs.scale_steps:
                skipped = np.array([obs.scale_skipped / obs.scale_steps])
                keep((step, "scale_skipped", ("skipped steps",), skipped))
        if obs.fp8_underflow is not None:
            lost = np.asarray(obs.fp8_underflow).reshape(-1, 4)
            keep((step, "fp8_weight_e4m3", names, lost[:, 0]))
            keep((step, "fp8_grad_e5m2", names, lost[:, 3]))

    def emit(self, finding: Finding) -> None:
        f = finding
        self._findings.append(
            (
                f.step,
                f.epoch,
                f.detector,
                f.severity.value,
                f.message,
                f.value,  # SQLite keeps an infinity and stores NaN as NULL
                f.threshold,
                f.where,
                f.rank,
            )
        )
        if f.severity is Severity.ERROR:
            self.flush()  # what stops a run is on disk before anything else can happen

    def keep_skipped(self, skipped: SkippedBatch) -> None:
        """A batch the recovery ladder skipped, written at once: a skip is rare, and a run
        that dies soon after it (the reason to resume, and skip it again) must not lose
        it."""
        self._skipped.append(skipped.to_row())
        self.flush()

    def step_after_epoch(self, epoch: int) -> int | None:
        """The step after the last one of epoch ``epoch`` in the record this directory
        holds, where a run resumed at the next epoch continues; None: no record, no such
        epoch, or a file that cannot be read. (Keras resumes a fit at an epoch, with
        ``BackupAndRestore`` or ``initial_epoch``, and its optimizer counts only the steps
        it applied, not those the ladder skipped.) Asked before the run starts."""
        if not self.path.exists():
            return None
        try:
            con = connect_reader(self.path)
            try:
                row = con.execute("SELECT summary FROM epochs WHERE epoch = ?", (epoch,)).fetchone()
            finally:
                con.close()
        except (RecordError, sqlite3.DatabaseError):
            return None
        last = json.loads(row[0]).get("last_step") if row else None
        return None if last is None else int(last) + 1

    def _skipped_since(self, first: int) -> list[SkippedBatch]:
        rows = self._con.execute(
            f"SELECT {SKIPPED_COLUMNS} FROM skipped_batches WHERE step >= ? ORDER BY step",
            (first,),
        )
        return [SkippedBatch.from_row(row) for row in rows]

    def epoch_end(self, summary: EpochSummary) -> None:
        self._summaries.append((summary.epoch, json.dumps(summary.to_dict(), default=str)))

    # -- writing ------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what is buffered, in one transaction; thin old steps past the caps."""
        self._next_flush = time.monotonic() + self.flush_seconds
        con = self._con
        if con is None:
            return
        try:
            con.execute("BEGIN IMMEDIATE")
            self._write_buffers(con)
            con.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (_now(),))
            con.execute("COMMIT")
        except sqlite3.Error as exc:
            if con.in_transaction:
                con.execute("ROLLBACK")
            if not self._failed:
                self._failed = True
                warnings.warn(
                    f"stethoscope: could not write the run record {str(self.path)!r} ({exc}); "
                    "training goes on and the record retries at the next flush",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        self._clear_written()

    def _write_buffers(self, con: sqlite3.Connection) -> None:
        if self._steps:
            con.execute(
                "INSERT OR REPLACE INTO losses VALUES (?, ?, ?, ?, ?)",
                (
                    self._steps[0],
                    self._steps[-1],
                    np.asarray(self._steps, "<i8").tobytes(),
                    np.asarray(self._epochs, "<i4").tobytes(),
                    np.asarray(self._losses, "<f4").tobytes(),
                ),
            )
        con.executemany("INSERT OR REPLACE INTO sampled VALUES (?, ?, ?, ?, ?)", self._sampled)
        con.executemany(
            "INSERT OR REPLACE INTO layers VALUES (?, ?, ?, ?)",
            [
                (step, kind, self._layout(con, names), _blob(values))
                for step, kind, names, values in self._layers
            ],
        )
        con.executemany(
            "INSERT INTO findings (step, epoch, detector, severity, message, value, threshold, "
            '"where", rank) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)',
            self._findings,
        )
        con.executemany(
            "INSERT OR REPLACE INTO skipped_batches VALUES (?, ?, ?, ?, ?, ?)", self._skipped
        )
        con.executemany("INSERT OR REPLACE INTO validation VALUES (?, ?, ?, ?)", self._validation)
        con.executemany("INSERT OR REPLACE INTO epochs VALUES (?, ?)", self._summaries)
        for kinds, cap in (
            (tuple(LAYER_KINDS), self.max_layer_steps),
            (DISTRIBUTION_KINDS, self.max_distribution_steps),
        ):
            new = {step for step, kind, _, _ in self._layers if kind in kinds}
            if new:
                self._kept[kinds] = self._kept.get(kinds, 0) + len(new)
                if self._kept[kinds] > cap:
                    self._kept[kinds] = self._thin(con, kinds)

    def _clear_written(self) -> None:
        for buffer in (
            self._steps,
            self._epochs,
            self._losses,
            self._sampled,
            self._layers,
            self._findings,
            self._skipped,
            self._validation,
            self._summaries,
        ):
            buffer.clear()

    def _layout(self, con: sqlite3.Connection, names: tuple[str, ...]) -> int:
        known = self._layout_ids.get(names)
        if known is None:
            text = json.dumps(list(names))
            con.execute("INSERT OR IGNORE INTO layouts (names) VALUES (?)", (text,))
            (known,) = con.execute("SELECT id FROM layouts WHERE names = ?", (text,)).fetchone()
            self._layout_ids[names] = known
        return known

    def _thin(self, con: sqlite3.Connection, kinds: tuple[str, ...]) -> int:
        """Delete every second step holding ``kinds`` in the older half of the run, except
        steps with a warning or an error; return how many steps hold them now."""
        marks = ",".join("?" * len(kinds))
        steps = [
            s
            for (s,) in con.execute(
                f"SELECT DISTINCT step FROM layers WHERE kind IN ({marks}) ORDER BY step", kinds
            )
        ]
        kept = {s for (s,) in con.execute("SELECT step FROM findings WHERE severity != 'info'")}
        older = steps[: len(steps) // 2]
        drop = [(s,) for s in older[1::2] if s not in kept]
        con.executemany(
            f"DELETE FROM layers WHERE step = ? AND kind IN ({marks})",
            [(s, *kinds) for (s,) in drop],
        )
        return len(steps) - len(drop)

    def close(self) -> None:
        """Write what is left, mark the record finished, and close it. Idempotent."""
        con = self._con
        if con is None:
            return
        self.flush()
        try:
            self._execute_meta({_STATUS: "finished", "updated": _now()})
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass  # the flush above warned already; the record stays readable as it is
        # a finished record is one file: out of WAL mode, the log and its index are
        # removed, and a later reader (the report, read-only) makes no new ones. A reader
        # still open (a live view) keeps them; they go when a resumed run closes.
        with contextlib.suppress(sqlite3.Error):
            con.execute("PRAGMA journal_mode=DELETE")
        con.close()
        self._con = None


def _blob(values: Any) -> bytes:
    return np.asarray(values, "<f4").tobytes()
