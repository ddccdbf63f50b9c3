"""JSONLSink: one finding per line of strict JSON, on disk as soon as it is emitted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Severity
from stethoscope.sinks.base import Sink

if TYPE_CHECKING:
    from stethoscope.findings import Finding

__all__ = ["JSONLSink"]


class _FileSink(Sink):
    """What the file sinks share: path checks, whole-line appends, close, pickling.

    It lives here rather than in its own module only because this change was
    scoped to the sink modules; ``sinks/_file.py`` is its natural home.
    """

    _example_name = "findings.txt"  # suggested in the error when the path is a directory

    def __init__(self, path: str | os.PathLike[str], *, min_severity: Severity | str, append: bool):
        name = type(self).__name__
        self.path = _as_path(path, sink=name)
        self.min_severity = Severity.parse(min_severity, argument="min_severity")
        if not isinstance(append, bool):
            raise TypeError(f"{name}: append={append!r} must be True or False")
        self.append = append
        self._file: Any = None
        _check_path(self.path, sink=name, example=self._example_name)
        self._open(truncate=not append)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._file is None

    def emit(self, finding: Finding) -> None:
        """Append ``finding`` as one line if it is at or above ``min_severity``.

        After :meth:`close` (a callback reused for a second ``fit``), the file is reopened
        in append mode: a finding is never dropped, and the rows already written stay.
        """
        if finding.severity < self.min_severity:
            return
        if self._file is None:
            self._open(truncate=False)
        self._write(self._format(finding))

    def flush(self) -> None:
        """Nothing waits in memory: every emit is already written to the OS."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Close the file. Safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, "
            f"min_severity={self.min_severity.value!r}, append={self.append!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # An open file cannot cross processes; the path and the options can.
        return {"path": self.path, "min_severity": self.min_severity, "append": self.append}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.min_severity = state["min_severity"]
        self.append = state["append"]
        self._file = None
        # Never truncate here: the original sink (or another rank) may already have
        # written rows that this copy must keep.
        self._open(truncate=False)

    def _format(self, finding: Finding) -> str:
        """The finding as one line, newline included."""
        raise NotImplementedError

    def _start(self) -> None:
        """Called once the file is open; the CSV sink writes or checks its header here."""

    def _open(self, *, truncate: bool) -> None:
        """Open the file for appending, emptying it first when ``truncate``."""
        name = type(self).__name__
        try:
            if truncate:
                open(self.path, "wb").close()
            # O_APPEND and one unbuffered write per line: a line reaches the OS whole or
            # not at all, so a killed run leaves no half line, and (on a local file
            # system) lines appended by several processes to one file do not interleave.
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (open until close)
        except OSError as e:
            raise type(e)(
                f"{name} cannot open {str(self.path)!r} for writing: {e.strerror or e}"
            ) from e
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _write(self, text: str) -> None:
        """Write ``text`` to the OS now, looping over short writes."""
        # backslashreplace: one odd character in a layer name must not cost the whole row.
        view = memoryview(text.encode("utf-8", errors="backslashreplace"))
        while view:
            view = view[self._file.write(view) :]


class JSONLSink(_FileSink):
    """Writes each finding as one line of strict JSON (JSON Lines).

    Every line is a JSON object keyed by :data:`stethoscope.findings.FIELDS`. A
    non-finite ``value`` or ``threshold`` is written as ``null`` (the message still
    says NaN or Inf), so every line parses with any strict JSON reader. Each line is
    handed to the OS as soon as it is emitted: a run that is killed keeps every
    finding emitted before, and never a half line. Epoch summaries are not written.

    Args:
        path: The file to write. Its directory must exist: the sink does not create
            it, so a mistyped path fails here rather than scattering files.
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        append: Keep what the file holds and add to it (the default, so resumed runs
            extend one log); ``False`` empties it first.

    Raises:
        ValueError: ``min_severity`` is not a severity.
        TypeError: ``path`` is not a str or path, or ``append`` is not a bool.
        FileNotFoundError: The directory of ``path`` does not exist.
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
    ) -> None:
        super().__init__(path, min_severity=min_severity, append=append)

    def _format(self, finding: Finding) -> str:
        line = json.dumps(finding.to_dict(json_safe=True), allow_nan=False, default=_json_default)
        return line + "\n"


def _json_default(obj: Any) -> Any:
    """Turn integer scalars that json does not know (numpy's int64 step …) into int."""
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _as_path(path: Any, *, sink: str) -> Path:
    """``path`` as an absolute Path, so a pickled copy finds the file after a chdir."""
    try:
        return Path(path).expanduser().absolute()
    except TypeError:
        raise TypeError(f"{sink}: path={path!r} must be a str or os.PathLike") from None


def _check_path(path: Path, *, sink: str, example: str) -> None:
    """Raise the error a user can act on now, before any training time is spent."""
    shown = str(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"{sink}: path {shown!r} is a directory; give a file in it, "
            f"e.g. {str(path / example)!r}"
        )
    parent = path.parent
    if not parent.exists():
        raise FileNotFoundError(
            f"{sink} cannot write {shown!r}: its directory {str(parent)!r} does not exist. "
            f"The sink does not create directories (a mistyped path should fail, not "
            f"scatter files); create it first, e.g. os.makedirs({str(parent)!r}, exist_ok=True)"
        )
    if not parent.is_dir():
        raise NotADirectoryError(
            f"{sink} cannot write {shown!r}: {str(parent)!r} is a file, not a directory"
        )
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{sink} cannot write {shown!r}: the file is not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{sink} cannot write {shown!r}: its directory {str(parent)!r} is not writable"
        )
