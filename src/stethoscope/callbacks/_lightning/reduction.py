"""What every reduction of the Lightning adapter is: the measuring and decoding of one
statistic, at the hooks it needs.

Each :class:`Reduction` serves a statistic of :mod:`stethoscope.statistics` (the forward
hooks serve three at once). It measures at the hooks it needs, on the steps whose plan
names its statistic, and hands the tensors to the step's :class:`StepMeasures`:

- :meth:`~Reduction.at_start`: the step's first batch, before its forward pass;
- :meth:`~Reduction.micro_batch`: each later micro-batch of the step (accumulation);
- :meth:`~Reduction.before_backward`: just before the step's first backward pass, with
  the loss;
- :meth:`~Reduction.each_backward`: just before each backward pass of the step (the
  first one after ``before_backward``): a step may run several (a game's players, a
  closure optimizer's calls, micro-batches);
- :meth:`~Reduction.before_step`: before an optimizer steps the watched parameters
  ``indices`` (their gradients complete);
- :meth:`~Reduction.at_end`: after a batch, and so after the optimizer step on the
  step's last micro-batch.

:meth:`~Reduction.decode` turns the statistic's numbers back into fields; per-parameter
arrays follow ``measures.params``, the parameters the optimizers stepped, in order.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from stethoscope.callbacks._lightning.measures import StepMeasures
from stethoscope.observation import Observation

__all__ = ["Reduction"]


class Reduction:
    """The measuring and decoding of one statistic (or a few that share a probe)."""

    #: The statistics it serves.
    statistics: ClassVar[frozenset[str]] = frozenset()
    #: The name its parts carry in a step's measures (its statistic's, or its probe's).
    name: ClassVar[str] = ""
    #: Whether it measures the parameters an optimizer steps (the callback then tells the
    #: measures which ones, in :meth:`before_step`'s order).
    per_parameter: ClassVar[bool] = False

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        """The step's first batch, before its forward pass."""

    def micro_batch(self, measures: StepMeasures, batch: Any) -> None:
        """A later micro-batch of the same step."""

    def before_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        """Before the step's first backward pass of ``loss``."""

    def each_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        """Before each backward pass of the step, of ``loss``."""

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        """Before an optimizer steps the watched parameters ``indices`` (once per
        optimizer and step: see ``ReductionSet.before_step``)."""

    def at_end(self, measures: StepMeasures) -> None:
        """After a batch (after the optimizer step, on the step's last micro-batch)."""

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        """Fill ``obs`` from this statistic's numbers and the contexts of its parts."""
        raise NotImplementedError

    def computes_in(self, dtype: torch.dtype) -> None:
        """The backward pass was seen computing the float32 gradients in the 16-bit
        ``dtype`` (see ``TrainingSetup.computes_in``): a reduction that measures a
        gradient against its format measures them in it from now on."""

    def close(self) -> None:
        """The fit is over: take off anything left on the user's model."""
