"""The training losses a validation is judged against (``overfitting`` compares the two)."""

from __future__ import annotations

import math

from stethoscope.observation import Observation

__all__ = ["LossesSinceValidation"]


class LossesSinceValidation:
    """The finite training losses a validation is judged against: their sum and count
    since the last validation, and the run's first one (where the task started)."""

    def __init__(self) -> None:
        self.sum, self.n = 0.0, 0
        self.start: float | None = None

    def saw(self, obs: Observation) -> None:
        """Count a step's loss; a validation closes the window."""
        loss = obs.loss
        if obs.val_loss is not None:
            self.sum, self.n = 0.0, 0
        elif loss is not None and math.isfinite(loss):
            self.sum += loss
            self.n += 1
            if self.start is None:
                self.start = loss

    def saw_losses(self, losses: list[float]) -> None:
        """Count finite losses (quiet steps'), oldest first."""
        if not losses:
            return
        total = self.sum
        for loss in losses:  # in order, one by one: the same sum as step by step
            total += loss
        self.sum, self.n = total, self.n + len(losses)
        if self.start is None:
            self.start = losses[0]

    def mean(self) -> float | None:
        """The mean since the last validation (None: no loss seen since)."""
        return self.sum / self.n if self.n else None

    def shared(self) -> dict[str, tuple[float, float]]:
        """What a rank pools with the others' at a validation: each a (sum, count) pair."""
        start = self.start
        return {
            "train_loss": (self.sum, float(self.n)),
            "start_loss": (start if start is not None else 0.0, float(start is not None)),
        }
