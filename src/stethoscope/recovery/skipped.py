"""The batches a run skipped, kept for good: which batch each was (its epoch, its index in
the epoch and a fingerprint of its samples), when, and why. They go into the checkpoint
and into the run's record (``stethoscope report`` lists them); a run resumed from an
earlier checkpoint reads those past it from the record, and skips them again when they
come back where they were. Framework-free: the adapters name the batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BatchName", "SkippedBatch", "SkippedData"]


@dataclass(frozen=True)
class BatchName:
    """Which batch a step trained on: its epoch, its index in the epoch, and a fingerprint
    of its samples (None where the adapter could not take one without waiting)."""

    epoch: int
    index: int
    fingerprint: str | None = None

    def __str__(self) -> str:
        named = f"batch {self.index} of epoch {self.epoch}"
        return named + (f", fingerprint {self.fingerprint}" if self.fingerprint else "")


@dataclass(frozen=True)
class SkippedBatch:
    """One batch a step skipped: the step, the batch, why, and what a replay of the step
    found (``"reproduces"``, or None when it was not replayed)."""

    step: int
    batch: BatchName
    why: str
    replay: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "batch": asdict(self.batch)}

    def to_row(self) -> tuple:
        """As a row of the record's ``skipped_batches`` table (its columns in order)."""
        b = self.batch
        return (self.step, b.epoch, b.index, b.fingerprint, self.why, self.replay)

    @classmethod
    def from_row(cls, row: tuple) -> SkippedBatch:
        step, epoch, index, printed, why, replay = row
        return cls(step, BatchName(epoch, index, printed), why, replay)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> SkippedBatch:
        return cls(
            int(state["step"]),
            BatchName(**state["batch"]),
            str(state["why"]),
            state.get("replay"),
        )


class SkippedData:
    """The skipped batches of a run, in the order they were skipped, and a way to know a
    batch that comes back where one skipped by the run this one resumes was (by epoch and
    index: no fingerprint is taken on a healthy step).

    Args:
        on_add: Called with each batch skipped from now (the run's record keeps them).
    """

    def __init__(self, on_add: Callable[[SkippedBatch], None] | None = None) -> None:
        self.batches: list[SkippedBatch] = []
        # the batches skipped past the checkpoint by the run this one resumes, by place
        self._again: dict[tuple[int, int], SkippedBatch] = {}
        self._on_add = on_add

    def add(self, skipped: SkippedBatch) -> None:
        self.batches.append(skipped)
        if self._on_add is not None:
            self._on_add(skipped)

    def remember(self, batches: Iterable[SkippedBatch]) -> None:
        """Batches the run this one resumes skipped past its checkpoint (read back from its
        record): kept, not reported again, and skipped again where they come back."""
        for skipped in batches:
            place = (skipped.batch.epoch, skipped.batch.index)
            if place not in self._again:
                self._again[place] = skipped
                self.batches.append(skipped)

    @property
    def remembered(self) -> bool:
        """Whether batches of the run this one resumes wait to come back."""
        return bool(self._again)

    def at(self, epoch: int, index: int) -> SkippedBatch | None:
        """The batch the run this one resumes skipped at batch ``index`` of epoch
        ``epoch``, or None. Only those come back: this run's own skips, and those its
        checkpoint holds, lie behind it (a second Keras ``fit`` in a row starts its
        epochs from 0 again, on new steps of the same run, judged as such)."""
        return self._again.get((epoch, index)) if self._again else None

    def state_dict(self) -> list[dict[str, Any]]:
        return [b.to_dict() for b in self.batches]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.batches = [SkippedBatch.from_dict(entry) for entry in state]
