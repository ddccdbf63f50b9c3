"""CSVSink: one finding per row, columns named as the Finding fields."""

from __future__ import annotations

import csv
import io
import os
from typing import TYPE_CHECKING

from stethoscope.findings import FIELDS, Severity
from stethoscope.sinks._buffer import MAX_BUFFER
from stethoscope.sinks._file import _FileSink

if TYPE_CHECKING:
    from collections.abc import Iterable

    from stethoscope.findings import Finding

__all__ = ["CSVSink"]


class CSVSink(_FileSink):
    """Writes each finding as one CSV row, with a header row of :data:`FIELDS`.

    Columns are exactly :data:`stethoscope.findings.FIELDS`, in that order. An absent
    ``value``, ``threshold`` or ``where`` is an empty cell; a non-finite number is
    written as Python spells it (``nan``, ``inf``, ``-inf``), which ``float()`` and
    pandas parse back. Each row is handed to the OS as soon as it is emitted: a run
    that is killed keeps every row emitted before, and never a half row. Epoch
    summaries are not written.

    Args:
        path: The file to write. Its directory is created if missing (as Lightning's
            loggers do); a path that cannot be created fails here, before training.
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        append: Add rows to an existing file instead of emptying it first. The header
            is written only when the file is empty, and an existing header must
            match :data:`FIELDS`.
        max_buffer: How many findings to keep in memory while writes fail (a full
            disk); they are retried at the next flush, and past this bound new ones are
            dropped and counted in :attr:`dropped` and the epoch summary.

    Raises:
        ValueError: ``min_severity`` is not a severity, ``max_buffer`` is not an
            integer >= 0, or ``append=True`` and the file's header is not :data:`FIELDS`.
        TypeError: ``path`` is not a str or path, or ``append`` is not a bool.
        OSError: The directory of ``path`` cannot be created (a file in the way:
            ``NotADirectoryError``; no permission: ``PermissionError``).
        IsADirectoryError: ``path`` is a directory.
        PermissionError: ``path`` or its directory is not writable.

    Example:
        >>> sink = CSVSink("runs/findings.csv", min_severity="warning")  # doctest: +SKIP
        >>> LightningStethoscope(sinks=[ConsoleSink(), sink])  # doctest: +SKIP
        >>> pandas.read_csv("runs/findings.csv")  # doctest: +SKIP

        Pickling (e.g. for spawned processes) carries the path and options; the copy
        reopens the file in append mode.
    """

    _example_name = "findings.csv"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        min_severity: Severity | str = "info",
        append: bool = False,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        super().__init__(path, min_severity=min_severity, append=append, max_buffer=max_buffer)

    def _header(self) -> bytes:
        return _row(FIELDS).encode("utf-8")

    def _check_existing(self) -> None:
        # Appending rows under another header would misalign every column silently.
        with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f), [])
        if header != list(FIELDS):
            raise ValueError(
                f"CSVSink cannot append to {str(self.path)!r}: its header {header!r} is not "
                f"the finding columns {list(FIELDS)!r}; write to a new file or pass append=False"
            )

    def _format(self, finding: Finding) -> str:
        d = finding.to_dict()
        return _row([d[name] for name in FIELDS])


def _row(cells: Iterable[object]) -> str:
    """One CSV row, quoted as needed, line ending included."""
    buffer = io.StringIO()
    # csv writes None as an empty cell and a float as repr(), so nan stays "nan".
    csv.writer(buffer).writerow(cells)
    return buffer.getvalue()
