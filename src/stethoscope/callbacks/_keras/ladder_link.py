"""The recovery ladder's variables in a Keras probe, as the host sees them: what it
writes for the steps to come (the bars, the cool-down, the steps skipped whatever they
hold) and what it reads back (each step's verdict, the count of steps).

Every write is a change worth one: a bar moves a little every step, and a write costs
an op, so a healthy run writes the bars every few steps and never writes the marks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stethoscope.callbacks._keras.gate import verdict_rows
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import ProbeVariables, Slot

__all__ = ["LadderLink"]


class LadderLink:
    """Writes and reads the ladder's variables of a probe.

    Args:
        regime: How the train step runs.
        variables: The probe's variables, with :meth:`slots`' among them.
        optimizer: The model's optimizer (its ``iterations``).
    """

    def __init__(self, regime: Regime, variables: ProbeVariables, optimizer: Any) -> None:
        self.regime, self.variables, self.optimizer = regime, variables, optimizer
        self._handed: Any = None  # the last execution's verdict, not yet read
        self._bars = (math.inf, math.inf, 1.0, math.inf)  # what the host last wrote
        self._forced: tuple[int, ...] = ()  # ... and the ring slots it last marked

    @staticmethod
    def slots(regime: Regime) -> list[Slot]:
        """Host to graph: the bars a step is judged against, the learning rate's factor
        and its ceiling; the steps skipped so far (see ``ops.step_index``); the steps the
        host skips whatever they hold, by ring slot; and with several steps per
        execution, each step's verdict, gradient norm and what its replay found (a direct
        step hands its own back)."""
        slots = [
            Slot(
                "recovery",
                (4,),
                np.array([np.inf, np.inf, 1.0, np.inf]),
                combine="first",
                returned=False,
            ),
            Slot("skipped", (), 0, "int64", combine="first", returned=False),
            Slot("forced", (regime.steps,), 0.0, combine="first", returned=False),
        ]
        if not regime.direct:
            slots.append(Slot("verdicts", (regime.steps, 3), 0.0, combine="first", returned=False))
        return slots

    def hand(self, verdict: Any) -> None:
        """What the last execution handed back with its logs (None: nothing)."""
        self._handed = verdict

    def verdicts(self, ring: np.ndarray) -> np.ndarray:
        """The last execution's verdicts, a row per ring slot (see ``gate.verdict_rows``)."""
        handed, self._handed = self._handed, None
        return verdict_rows(self.regime, handed, ring, self.variables)

    @property
    def bars(self) -> tuple[float, float, float, float]:
        """What the steps judge themselves against: the loss bar, the gradient-norm bar,
        the learning rate's factor and its ceiling (as last written)."""
        return self._bars

    def set_bars(
        self, loss_bar: float, grad_bar: float, lr_scale: float, lr_ceiling: float = math.inf
    ) -> None:
        """Write the bars (``math.inf``: none), the factor on the learning rate for the
        next steps and the learning rate it applies to at most (``math.inf``: none); only
        a change worth it is written (1% of a bar is nothing against a spike)."""
        old, new = self._bars, (loss_bar, grad_bar, lr_scale, lr_ceiling)
        if new[2:] == old[2:] and _close(loss_bar, old[0]) and _close(grad_bar, old[1]):
            return
        self._bars = new
        self.variables.write("recovery", np.array(new, dtype=np.float32))

    def force(self, slots: tuple[int, ...]) -> None:
        """Skip the next execution's steps in ring ``slots`` whatever they hold (their
        step modulo the steps per execution); written only when it changes, so a run
        that forces nothing never writes it."""
        if slots == self._forced:
            return
        self._forced = slots
        mask = np.zeros(self.regime.steps, dtype=np.float32)
        mask[list(slots)] = 1.0
        self.variables.write("forced", mask)

    def step_index(self) -> int:
        """The host's count of the steps taken (the optimizer's, plus those skipped)."""
        applied = int(self.variables.read_variable(self.optimizer.iterations))
        return applied + int(self.variables.read("skipped"))

    def continue_from(self, step: int) -> None:
        """The optimizer's count went back (a roll back), or never counted the steps of a
        run this fit resumes: count on from ``step``."""
        applied = int(self.variables.read_variable(self.optimizer.iterations))
        self.variables.write("skipped", np.int64(step - applied))


def _close(a: float, b: float) -> bool:
    """Whether two bars are within 1% (two infinities are; a bar and none are not)."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= 0.01 * max(abs(a), abs(b))
