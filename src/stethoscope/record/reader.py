"""Reading a run record, during the run or after it, as numpy arrays and findings."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from stethoscope.findings import Finding
from stethoscope.record.store import SKIPPED_COLUMNS, RecordError, connect_reader, record_file
from stethoscope.record.writer import DISTRIBUTION_KINDS, LAYER_KINDS
from stethoscope.recovery.skipped import SkippedBatch
from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES

__all__ = ["Curve", "LayerSeries", "RunRecord", "Sampled"]


@dataclass(frozen=True)
class Curve:
    """A value per step: the loss, or the validation loss."""

    steps: np.ndarray  # int64
    values: np.ndarray  # float64
    epochs: np.ndarray  # int64


@dataclass(frozen=True)
class Sampled:
    """What each sampled step recorded beside its per-layer statistics."""

    steps: np.ndarray  # int64
    epochs: np.ndarray  # int64
    lr: np.ndarray  # float64, NaN where unknown
    interval: np.ndarray  # int64: how often the sampled detectors ran there
    grad_norm: np.ndarray  # float64: the global gradient norm, NaN where not measured


@dataclass(frozen=True)
class LayerSeries:
    """One per-layer statistic over the sampled steps that measured it.

    ``values[i, j]`` is the statistic of ``names[j]`` at ``steps[i]`` (NaN where that
    step did not measure that name); a distribution adds a last axis of
    ``DISTRIBUTION_BINS`` counts.
    """

    kind: str
    names: tuple[str, ...]
    steps: np.ndarray
    values: np.ndarray

    def latest(self) -> np.ndarray:
        """The last step's values (an empty array when nothing was recorded)."""
        return self.values[-1] if len(self.steps) else np.empty((len(self.names),))


class RunRecord:
    """A run record opened for reading (see :class:`~stethoscope.record.RunRecorder`).

    Every query reads the file afresh, so a record that training is still writing shows
    its latest committed state.

    Args:
        path: The record's directory (``record=`` of the callback) or its file.

    Raises:
        RecordError: Missing, empty, damaged, or written by a newer stethoscope; the
            message is one sentence.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = record_file(path)
        self._con = connect_reader(path)

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._con.close()

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._con.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise RecordError(
                f"{str(self.path)!r} could not be read ({exc}): the file is damaged."
            ) from None

    # -- the run ------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, str]:
        """The record's header: ``format``, ``framework``, ``status`` (``running`` or
        ``finished``), ``started`` and ``updated`` (ISO times), ``config`` (JSON)."""
        return dict(self._query("SELECT key, value FROM meta"))

    @property
    def config(self) -> dict[str, Any]:
        """The run's configuration: model, optimizer, detectors and their thresholds."""
        text = self.meta.get("config")
        return json.loads(text) if text else {}

    @property
    def finished(self) -> bool:
        """Whether the run closed its record (a killed run never does)."""
        return self.meta.get("status") == "finished"

    def seconds_since_update(self) -> float:
        """Seconds since the writer last committed (a stalled or killed run grows it)."""
        updated = self.meta.get("updated")
        if not updated:
            return float("inf")
        return (datetime.now(timezone.utc) - datetime.fromisoformat(updated)).total_seconds()

    # -- curves -------------------------------------------------------------------------
    def losses(self, since: int = -1) -> Curve:
        """The loss of every step after ``since``, in step order."""
        rows = self._query(
            "SELECT steps, epochs, losses FROM losses WHERE last_step > ? ORDER BY first_step",
            (since,),
        )
        steps = _join(rows, 0, "<i8", np.int64)
        epochs = _join(rows, 1, "<i4", np.int64)
        values = _join(rows, 2, "<f4", np.float64)
        keep = steps > since
        return Curve(steps[keep], values[keep], epochs[keep])

    def validation(self) -> Curve:
        """Each validation loss, at the step it followed."""
        rows = self._query("SELECT step, epoch, val_loss FROM validation ORDER BY step")
        return Curve(
            np.array([r[0] for r in rows], np.int64),
            np.array([np.nan if r[2] is None else r[2] for r in rows], np.float64),
            np.array([r[1] for r in rows], np.int64),
        )

    def sampled(self, since: int = -1) -> Sampled:
        """Every sampled step after ``since``, in order."""
        rows = self._query(
            "SELECT step, epoch, lr, interval, grad_norm FROM sampled WHERE step > ? ORDER BY step",
            (since,),
        )
        col = list(zip(*rows, strict=True)) if rows else [(), (), (), (), ()]
        return Sampled(
            np.array(col[0], np.int64),
            np.array(col[1], np.int64),
            _floats(col[2]),
            np.array([1 if v is None else v for v in col[3]], np.int64),
            _floats(col[4]),
        )

    # -- per layer ----------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """The per-layer statistics this record holds."""
        known = list(LAYER_KINDS) + list(DISTRIBUTION_KINDS)
        have = {k for (k,) in self._query("SELECT DISTINCT kind FROM layers")}
        return [k for k in known if k in have]

    def layers(self, kind: str, since: int = -1) -> LayerSeries:
        """The per-layer statistic ``kind`` (one of :data:`LAYER_KINDS` or
        :data:`DISTRIBUTION_KINDS`) over the steps after ``since`` that recorded it.

        Raises:
            ValueError: ``kind`` is not one of those.
        """
        if kind not in LAYER_KINDS and kind not in DISTRIBUTION_KINDS:
            raise ValueError(
                f"kind={kind!r} is not a recorded statistic; choose one of "
                f"{[*LAYER_KINDS, *DISTRIBUTION_KINDS]!r}"
            )
        layouts = {i: tuple(json.loads(n)) for i, n in self._query("SELECT id, names FROM layouts")}
        rows = self._query(
            "SELECT step, layout, data FROM layers WHERE kind = ? AND step > ? ORDER BY step",
            (kind, since),
        )
        names: dict[str, int] = {}
        for _, layout, _ in rows:
            for n in layouts[layout]:
                names.setdefault(n, len(names))
        width = DISTRIBUTION_BINS if kind in DISTRIBUTION_KINDS else None
        shape = (len(rows), len(names)) + ((width,) if width else ())
        values = np.full(shape, np.nan)
        for i, (_, layout, data) in enumerate(rows):
            columns = [names[n] for n in layouts[layout]]
            row = np.frombuffer(data, "<f4").astype(np.float64)
            values[i, columns] = row.reshape(len(columns), width) if width else row
        steps = np.array([r[0] for r in rows], np.int64)
        return LayerSeries(kind, tuple(names), steps, values)

    @staticmethod
    def distribution_edges() -> tuple[float, ...]:
        """The magnitude edges of the distributions' bins (see ``DISTRIBUTION_EDGES``)."""
        return DISTRIBUTION_EDGES

    # -- findings and epochs ------------------------------------------------------------
    def findings(self, since_id: int = 0) -> list[Finding]:
        """Every finding written, in the order they happened."""
        rows = self._query(
            'SELECT step, epoch, detector, severity, message, value, threshold, "where", rank '
            "FROM findings WHERE id > ? ORDER BY id",
            (since_id,),
        )
        return [
            Finding(
                step=r[0],
                epoch=r[1],
                detector=r[2],
                severity=r[3],
                message=r[4],
                value=r[5],
                threshold=r[6],
                where=r[7],
                rank=r[8],
            )
            for r in rows
        ]

    def skipped_batches(self) -> list[SkippedBatch]:
        """Every batch the recovery ladder skipped, by step (none in a record written
        before the record kept them)."""
        known = self._query(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'skipped_batches'"
        )
        if not known:
            return []
        rows = self._query(f"SELECT {SKIPPED_COLUMNS} FROM skipped_batches ORDER BY step")
        return [SkippedBatch.from_row(row) for row in rows]

    def epochs(self) -> list[dict[str, Any]]:
        """Each finished epoch's summary, as written (``EpochSummary.to_dict``)."""
        return [json.loads(s) for (s,) in self._query("SELECT summary FROM epochs ORDER BY epoch")]


def _join(rows: list[tuple], column: int, dtype: str, out: type) -> np.ndarray:
    if not rows:
        return np.empty(0, out)
    return np.concatenate([np.frombuffer(r[column], dtype) for r in rows]).astype(out)


def _floats(values: tuple) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], np.float64)
