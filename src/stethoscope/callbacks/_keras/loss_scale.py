"""A ``LossScaleOptimizer`` in a Keras fit: the scale its gradients carry, the steps it
skipped, counted inside the graph, and the ``loss_scale`` statistic.

Keras' ``LossScaleOptimizer`` (which a ``mixed_float16`` policy wraps the optimizer in)
multiplies the loss by its ``dynamic_scale`` before the backward pass and divides the
gradients by it in ``apply``. A step whose scaled gradients hold an Inf or a NaN it
skips: it leaves the weights and its inner optimizer's ``iterations`` as they were and
halves the scale; after ``dynamic_growth_steps`` finite steps in a row it doubles it.
So a step was skipped exactly when the scale after it is lower than before it: each
step compares the two (a few scalar ops) and counts the skips in the probe's
``scale_skips`` variable, which the step index adds back (see ``ops.step_index``) as
the ladder's ``skipped`` does, so that the host's step numbers count every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.reductions import KerasReduction, Layout, ReadBack, Store
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import ProbeVariables, Slot
from stethoscope.observation import Observation

__all__ = ["LossScale", "ScaleSkips", "ScaleStep", "carried_scale", "loss_scaler"]


def loss_scaler(optimizer: Any) -> Any | None:
    """``optimizer`` when it is a ``keras.optimizers.LossScaleOptimizer``, else None."""
    return optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def carried_scale(optimizer: Any, skips: ScaleSkips | None) -> Any:
    """The loss scale the gradients handed to ``optimizer.apply`` carry: a
    ``LossScaleOptimizer``'s (``skips``: its count), read before its update lowers it, or
    the optimizer's fixed ``loss_scale_factor``; None: none."""
    if skips is not None:
        return skips.carried()
    return getattr(optimizer, "loss_scale_factor", None)


@dataclass(frozen=True)
class ScaleStep:
    """A step's loss scale, as tensors of the step being traced.

    Args:
        carried: The scale its gradients carry (read before the update).
        after: The scale after the update.
        skipped: Whether the optimizer skipped the step (bool).
    """

    carried: Any
    after: Any
    skipped: Any


class ScaleSkips:
    """Counts, inside the graph, the steps a ``LossScaleOptimizer`` skipped.

    Args:
        optimizer: The model's ``LossScaleOptimizer``, built (its scale is read before
            the first step's update, where Keras would build it).
        variables: The probe's variables, with :meth:`slots`' among them.
    """

    def __init__(self, optimizer: Any, variables: ProbeVariables) -> None:
        self.optimizer, self.variables = optimizer, variables

    @staticmethod
    def slots() -> list[Slot]:
        """The steps the optimizer skipped since the probe was made (read by the host
        only with the optimizer's ``iterations``: see :meth:`total`)."""
        return [Slot("scale_skips", (), 0, "int64", combine="first", returned=False)]

    def carried(self) -> Any:
        """The scale the step's gradients carry: read before its update, which lowers it
        on a skip (a copy on the torch backend, whose variables are updated in place)."""
        scale = kops.value(self.optimizer.dynamic_scale)
        return ops.copy(scale) if keras.backend.backend() == "torch" else scale

    def after_update(self, carried: Any) -> ScaleStep:
        """After the optimizer's update: whether it skipped the step (its scale fell),
        counted in ``scale_skips``."""
        after = kops.value(self.optimizer.dynamic_scale)
        skipped = ops.less(after, carried)
        self.variables["scale_skips"].assign_add(ops.cast(skipped, "int64"))
        return ScaleStep(carried, after, skipped)

    def total(self) -> int:
        """The steps skipped so far, on the host."""
        return int(self.variables.read("scale_skips"))


class LossScale(KerasReduction):
    """The ``loss_scale`` statistic: the ``LossScaleOptimizer``'s scale after the step,
    the steps it skipped since the scale was last measured, and the steps since then.

    The graph hands back the scale, the running count of skips and whether this very
    step was skipped; the host keeps the count and the step it last measured at. The
    callback measures it with every step's update under a ``LossScaleOptimizer``: the
    update of a step it skipped is all zeros, which says nothing of the layers (and would
    read as updates too small to learn, or rounded away), so its update statistics are
    dropped here, after theirs were decoded. Without a ``LossScaleOptimizer`` it measures
    nothing.

    Args:
        scaled: Whether the model's optimizer is a ``LossScaleOptimizer``.
    """

    statistics = frozenset({"loss_scale"})
    group = "loss_scale"
    hooks = frozenset({"update"})

    def __init__(self, scaled: bool) -> None:
        self.scaled = scaled
        self._since = 0  # the first step not yet counted in a measurement
        self._skips = 0  # the running count of skips at the last measurement

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [Slot("loss_scale", (3,), np.nan)] if self.scaled else []

    def start(self, step: int, skips: int) -> None:
        """A fit starts at ``step`` with ``skips`` counted so far."""
        self._since, self._skips = step, skips

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        scale = store.loss_scale()
        if scale is None:
            return
        total = kops.value(store.variable("scale_skips"))
        store.put(
            "loss_scale",
            ops.stack(
                [
                    ops.cast(scale.after, "float32"),
                    ops.cast(total, "float32"),
                    ops.cast(scale.skipped, "float32"),
                ]
            ),
        )

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        if not self.scaled:
            return
        scale, total, skipped = src.read("loss_scale").tolist()
        if not np.isfinite(scale):  # not measured yet
            return
        total = int(total)
        obs.loss_scale, obs.scale_skipped = float(scale), total - self._skips
        obs.scale_steps = obs.step + 1 - self._since
        self._since, self._skips = obs.step + 1, total
        if skipped:  # the optimizer skipped this very step: its update was not applied
            obs.drop_update()
