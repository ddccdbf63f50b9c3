"""The learning rate a step's update is taken at, as findings and the record give it.

It is the first optimizer's first parameter group's, read as a number (a tensor rate is
left out: reading it would wait for the device), and cooled by the recovery ladder as
its gate cools the update. When it is read matters:

- Lightning steps a per-step scheduler after the update and before the batch's end, so
  it is read when the step begins, not at its end.
- A warm-up written in ``optimizer_step`` (Lightning's own recipe), or in the module's
  ``on_train_batch_start`` (which Lightning calls after the callbacks'), sets the rate
  after the step began: where the callback's ``on_before_optimizer_step`` runs (sampled
  steps, and every step under a recovery ladder) it is read again there, just before the
  update and before the ladder's gate cools it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stethoscope.recovery import Recoverer

__all__ = ["TakenRate"]


class TakenRate:
    """The learning rate each step's update is taken at.

    Args:
        optimizers: The Trainer's optimizers (their first one's first group is read: the
            dict stays the same object while schedulers change its ``"lr"``).
        recoverer: The recovery ladder that cools the updates, or None.
    """

    def __init__(self, optimizers: Sequence[Any] = (), recoverer: Recoverer | None = None) -> None:
        self._group: dict[str, Any] | None = optimizers[0].param_groups[0] if optimizers else None
        self._recoverer = recoverer

    def at(self, step: int) -> float | None:
        """The rate the update of ``step`` takes, as it stands now; None without one."""
        lr = self._group.get("lr") if self._group is not None else None
        lr = float(lr) if isinstance(lr, (int, float)) else None  # a tensor lr: no sync
        return self._recoverer.rate_taken(step, lr) if self._recoverer is not None else lr
