"""JSONLSink: one finding per line of strict JSON, on disk as soon as it is emitted."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Severity
from stethoscope.sinks._buffer import MAX_BUFFER
from stethoscope.sinks._file import _FileSink

if TYPE_CHECKING:
    from stethoscope.findings import Finding

__all__ = ["JSONLSink"]


class JSONLSink(_FileSink):
    """Writes each finding as one line of strict JSON (JSON Lines).

    Every line is a JSON object keyed by :data:`stethoscope.findings.FIELDS`. A
    non-finite ``value`` or ``threshold`` is written as ``null`` (the message still
    says NaN or Inf), so every line parses with any strict JSON reader. Each line is
    handed to the OS as soon as it is emitted: a run that is killed keeps every
    finding emitted before, and never a half line. Epoch summaries are not written.

    Args:
        path: The file to write. Its directory is created if missing (as Lightning's
            loggers do); a path that cannot be created fails here, before training.
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        append: Keep what the file holds and add to it (the default, so resumed runs
            extend one log); ``False`` empties it first.
        max_buffer: How many findings to keep in memory while writes fail (a full
            disk); they are retried at the next flush, and past this bound new ones are
            dropped and counted in :attr:`dropped` and the epoch summary.

    Raises:
        ValueError: ``min_severity`` is not a severity, or ``max_buffer`` is not an
            integer >= 0.
        TypeError: ``path`` is not a str or path, or ``append`` is not a bool.
        OSError: The directory of ``path`` cannot be created (a file in the way:
            ``NotADirectoryError``; no permission: ``PermissionError``).
        IsADirectoryError: ``path`` is a directory.
        PermissionError: ``path`` or its directory is not writable.

    Example:
        >>> sink = JSONLSink("runs/findings.jsonl", min_severity="warning")  # doctest: +SKIP
        >>> LightningStethoscope(sinks=[ConsoleSink(), sink])  # doctest: +SKIP

        Pickling (e.g. for spawned processes) carries the path and options; the copy
        reopens the file in append mode.
    """

    _example_name = "findings.jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        min_severity: Severity | str = "info",
        append: bool = True,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        super().__init__(path, min_severity=min_severity, append=append, max_buffer=max_buffer)

    def _format(self, finding: Finding) -> str:
        return _json_line(finding)


def _json_line(finding: Finding) -> str:
    """``finding`` as one line of strict JSON, newline included."""
    line = json.dumps(finding.to_dict(json_safe=True), allow_nan=False, default=_json_default)
    return line + "\n"


def _json_default(obj: Any) -> Any:
    """Turn integer scalars that json does not know (numpy's int64 step …) into int."""
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
