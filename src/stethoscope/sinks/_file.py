"""What the file sinks share: path checks, whole-line appends, retries, close, pickling."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Severity
from stethoscope.sinks._buffer import MAX_BUFFER, _Buffered, _write_all

if TYPE_CHECKING:
    from stethoscope.findings import Finding

__all__: list[str] = []


class _FileSink(_Buffered):
    """A sink that appends one line per finding to a file.

    Every line goes to the OS in one unbuffered ``O_APPEND`` write as it is emitted. A
    write that fails (a full disk, a file that cannot be reopened) does not raise: the
    line waits in the retry queue of :class:`~stethoscope.sinks._buffer._Buffered` and
    is written at the next flush, in order; a line cut short by a failing write is
    completed, not repeated.
    """

    _example_name = "findings.txt"  # suggested in the error when the path is a directory

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        min_severity: Severity | str,
        append: bool,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        name = type(self).__name__
        self.path = _as_path(path, sink=name)
        super().__init__(min_severity=min_severity)
        if not isinstance(append, bool):
            raise TypeError(f"{name}: append={append!r} must be True or False")
        self.append = append
        self._init_buffer(max_buffer=max_buffer)
        self._file: Any = None
        self._owed = b""  # a header the file still needs before the next line
        _check_path(self.path, sink=name, example=self._example_name)
        # Opening here, not lazily, so that a bad path fails before training starts.
        self._open(truncate=not append)
        if self._owed:  # the header, now: a run that finds nothing still leaves a file
            self._deliver(b"", finding=False)

    @property
    def closed(self) -> bool:
        """Whether the file is closed (after :meth:`close`, until the next emit)."""
        return self._file is None

    def emit(self, finding: Finding) -> None:
        """Append ``finding`` as one line if it is at or above ``min_severity``.

        After :meth:`close` (a callback reused for a second ``fit``), the file is reopened
        in append mode: a finding is never dropped, and the rows already written stay.
        If the write fails, the line waits in memory (up to ``max_buffer`` findings) and
        is retried at the next :meth:`flush`.
        """
        if not self.accepts(finding):
            return
        self._deliver(self._format(finding).encode("utf-8", errors="backslashreplace"))

    def flush(self) -> None:
        """Write the lines that failed before, in order; the rest is on disk already."""
        self._retry()

    def close(self) -> None:
        """Retry what waits once more, then close the file. Safe to call more than once.

        Lines that still cannot be written are counted in :attr:`dropped`, with a warning.
        """
        if self._pending:
            self._retry()
            self._give_up()
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, "
            f"min_severity={self.min_severity.value!r}, append={self.append!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # An open file cannot cross processes; the path and the options can. Lines that
        # wait for a retry stay with the original, which writes them at its next flush.
        return {
            "path": self.path,
            "min_severity": self.min_severity,
            "append": self.append,
            "max_buffer": self.max_buffer,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.min_severity = state["min_severity"]
        self.append = state["append"]
        self._init_buffer(max_buffer=state.get("max_buffer", MAX_BUFFER))
        self._file = None
        self._owed = b""
        # Never truncate here: the original sink (or another rank) may already have
        # written rows that this copy must keep. A file that cannot be opened in this
        # process is not an error yet: the first emit retries, and buffers if it fails.
        try:
            self._open(truncate=False)
        except OSError as exc:
            self._last_error = exc

    def _destination(self) -> str:
        return repr(str(self.path))

    def _format(self, finding: Finding) -> str:
        """The finding as one line, newline included."""
        raise NotImplementedError

    def _header(self) -> bytes:
        """What an empty file starts with; the CSV sink's column names."""
        return b""

    def _check_existing(self) -> None:
        """Called when appending to a file that is not empty; CSV checks its header."""

    def _open(self, *, truncate: bool) -> None:
        """Open the file for appending, emptying it first when ``truncate``."""
        name = type(self).__name__
        try:
            if truncate:
                open(self.path, "wb").close()
            # O_APPEND and one unbuffered write per line: a line reaches the OS whole or
            # not at all, so a killed run leaves no half line, and (on a local file
            # system) lines appended by several processes to one file do not interleave.
            file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (open until close)
        except OSError as e:
            raise type(e)(
                f"{name} cannot open {str(self.path)!r} for writing: {e.strerror or e}"
            ) from e
        try:
            empty = os.fstat(file.fileno()).st_size == 0
            if not empty:
                self._check_existing()
        except BaseException:
            file.close()
            raise
        self._file = file
        self._owed = self._header() if empty else b""

    def _send(self, items: list[bytes]) -> None:
        (line,) = items
        if self._file is None:
            self._open(truncate=False)
        owed, self._owed = self._owed, b""
        try:
            _write_all(self._file, owed + line)
        except OSError:
            self._owed = owed  # nothing went out: the header is still owed
            raise


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
        # as Lightning's loggers and MLflow's file store do: runs/ need not exist yet
        blocker = next((a for a in parent.parents if a.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise NotADirectoryError(
                f"{sink} cannot write {shown!r}: {str(blocker)!r} is a file, not a directory"
            )
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise type(exc)(
                f"{sink} cannot write {shown!r}: its directory {str(parent)!r} cannot be "
                f"created ({exc.strerror or exc})"
            ) from None
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
