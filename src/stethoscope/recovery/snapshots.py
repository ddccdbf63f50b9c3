"""Where the recovery ladder keeps the last healthy states of a run: in host memory, or
on disk for a large one, bounded in number. Framework-free: an adapter hands it a state
already copied to the host, and how to write and read one on disk."""

from __future__ import annotations

import contextlib
import pickle
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stethoscope.recovery.settings import Recovery

__all__ = ["Snapshot", "SnapshotStore"]


@dataclass
class Snapshot:
    """One kept state: in memory (``state``) or on disk (``path``)."""

    step: int
    state: dict[str, Any] | None  # in memory, or None when on disk
    path: Path | None
    nbytes: int
    seconds: float  # what taking it cost, copy and write included
    first: bool = False  # the run's first: its state before any update of this run


def _pickle_save(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def _pickle_load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


class SnapshotStore:
    """The last ``keep_snapshots`` states, in memory or on disk as ``snapshot_in`` says.

    Args:
        settings: How many to keep, and where.
        save: Writes a state to a path (default: pickle).
        load: Reads one back.
        suffix: The files' suffix.
    """

    def __init__(
        self,
        settings: Recovery,
        *,
        save: Callable[[dict[str, Any], Path], None] = _pickle_save,
        load: Callable[[Path], dict[str, Any]] = _pickle_load,
        suffix: str = ".pkl",
    ) -> None:
        self.settings = settings
        self.kept: deque[Snapshot] = deque()
        self._save, self._load, self._suffix = save, load, suffix
        self._dir: Path | None = None
        self._taken = 0
        #: In a run of several processes, this one's rank: it names the files, so that
        #: ranks sharing a ``snapshot_dir`` (one machine, or a shared file system across
        #: nodes) keep their own states (sharded ones differ), never each other's.
        self.rank: int | None = None

    def keep(self, step: int, state: dict[str, Any], nbytes: int, began: float) -> Snapshot:
        """Keep ``state`` (``nbytes`` of arrays, copied since ``began``, a
        ``perf_counter`` time) as the snapshot of ``step``; drop the oldest past the bound."""
        path = None
        if self._on_disk(nbytes):
            rank = "" if self.rank is None else f"-rank{self.rank}"
            path = self._directory() / f"snapshot-{step}{rank}{self._suffix}"
            self._save(state, path)
            state = None
        snap = Snapshot(step, state, path, nbytes, time.perf_counter() - began, self._taken == 0)
        self._taken += 1
        self.kept.append(snap)
        while len(self.kept) > self.settings.keep_snapshots:
            self._drop(self.kept.popleft())
        return snap

    def newest(self) -> tuple[Snapshot, dict[str, Any]] | None:
        """The newest snapshot and its state (read from disk if need be), or None."""
        if not self.kept:
            return None
        snap = self.kept[-1]
        return snap, snap.state if snap.state is not None else self._load(snap.path)

    def discard_newest(self) -> None:
        """Forget the newest snapshot (one a roll back found wanting)."""
        if self.kept:
            self._drop(self.kept.pop())

    def close(self) -> None:
        for snap in self.kept:
            self._drop(snap)
        self.kept.clear()
        if self._dir is not None and self.settings.snapshot_dir is None:
            with contextlib.suppress(OSError):  # not empty: something of the user's
                self._dir.rmdir()

    def _drop(self, snap: Snapshot) -> None:
        if snap.path is not None:
            snap.path.unlink(missing_ok=True)
        self._released(snap)

    def _released(self, snap: Snapshot) -> None:
        """A snapshot is dropped (an adapter that lends its state memory takes it back)."""

    def _on_disk(self, nbytes: int) -> bool:
        where = self.settings.snapshot_in
        return where == "disk" or (where == "auto" and nbytes > self.settings.memory_limit_bytes)

    def _directory(self) -> Path:
        if self._dir is None:
            chosen = self.settings.snapshot_dir
            if chosen is not None:
                self._dir = Path(chosen)
                self._dir.mkdir(parents=True, exist_ok=True)
            else:
                self._dir = Path(tempfile.mkdtemp(prefix="stethoscope-snapshots-"))
        return self._dir
