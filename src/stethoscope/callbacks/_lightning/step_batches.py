"""The batches of the last training steps, as the recovery ladder asks of them: what a
skipped batch is called, whether a batch is the one a resumed run skipped before, and
whether its inputs hold NaN or Inf (which explains its skip whatever the weights)."""

from __future__ import annotations

from typing import Any

from stethoscope.callbacks._lightning.batch import fingerprint, inputs_finite
from stethoscope.recovery.skipped import BatchName

__all__ = ["StepBatches"]


class StepBatches:
    """The batch of the step in progress and of the two before it, by step: a verdict
    decided on the device lands up to ``max_lag`` (2) steps late, and its skip looks at
    its batch. References only: the batches stay where they are.

    Every read of a batch's numbers waits for an accelerator: on a skipped step alone.
    """

    def __init__(self) -> None:
        self.step = -1  # the step in progress
        self._held: dict[int, Any] = {}
        self._epoch, self._index = 0, 0  # the step in progress's place in its epoch
        #: One batch per step (no gradient accumulation): a skipped batch is printed.
        self.fingerprints = True
        #: The ranks: under DDP each has a shard of its own, and a rank's batch says
        #: nothing every rank agrees on.
        self.ranks = 1

    def begin(self, step: int, epoch: int, index: int, batch: Any) -> None:
        """Step ``step`` begins on ``batch``, batch ``index`` of epoch ``epoch`` (its
        first micro-batch's)."""
        self._held = {s: b for s, b in self._held.items() if s >= step - 2}
        self._held[step] = batch
        self.step, self._epoch, self._index = step, epoch, index

    def name(self, step: int) -> BatchName | None:
        """The batch of ``step``, when it is the step in progress (its position is known
        for that step only)."""
        batch = self._held.get(step)
        if step != self.step or batch is None:
            return None
        printed = fingerprint(batch) if self.fingerprints else None
        return BatchName(self._epoch, self._index, printed)

    def is_printed(self, printed: str | None) -> bool:
        """Whether the batch in progress is the one printed ``printed`` before. Under DDP,
        where each rank has its own shard and the checkpoint holds rank 0's prints, the
        position alone decides, alike on every rank."""
        if printed is None or self.ranks > 1 or not self.fingerprints:
            return True
        return fingerprint(self._held[self.step]) == printed

    def inputs_nonfinite(self, step: int) -> bool:
        """Whether the batch of ``step`` holds a NaN or an Inf among its inputs. False
        where it is no longer at hand, and under DDP (see :attr:`ranks`): every rank's
        ladder must climb alike."""
        batch = self._held.get(step)
        return self.ranks == 1 and batch is not None and not inputs_finite(batch)
