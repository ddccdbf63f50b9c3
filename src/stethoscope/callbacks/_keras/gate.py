"""The recovery ladder's skip inside a Keras train step: the step's verdict, and the
``cond`` that applies the optimizer's update or skips it.

The verdict compares the step's loss and its gradients' global norm with the bars the
host last wrote to the probe's ``recovery`` variable (``loss_spike``'s, then
``exploding_gradients``', then the cool-down's factor on the learning rate and the
learning rate it scales at most, after a roll back the snapshot's). A skipped
step leaves the weights, the optimizer's slots and its ``iterations`` as they were, and
counts itself in the probe's ``skipped`` variable (see ``ops.step_index``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import ProbeVariables
from stethoscope.recovery.settings import (
    GRADIENT_PAST_BAR,
    LOSS_PAST_BAR,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
)

__all__ = ["UpdateGate"]


class UpdateGate:
    """Judges each step before its update, and applies the update or skips it.

    Args:
        optimizer: The model's optimizer.
        regime: How the train step runs.
        variables: The probe's variables (``recovery``, ``skipped``, and ``verdicts``
            where the step cannot hand its verdict back itself).
        position: Each trainable variable's position, by id.
        strategy: The model's ``MirroredStrategy``, or None.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        regime: Regime,
        variables: ProbeVariables,
        position: dict[int, int],
        strategy: Any,
    ) -> None:
        self.optimizer, self.regime, self.variables = optimizer, regime, variables
        self.position, self.strategy = position, strategy
        #: The update is being traced: its reads of the learning rate are scaled.
        self.cooling = False
        #: ... with gradients summed across replicas already (the optimizer's all-reduce
        #: hands them on as they are).
        self.summed = False

    def update(
        self, original: Any, grads: list, tvars: list, loss: list, squares: dict[int, Any]
    ) -> Any:
        """The optimizer's update (``original``), in a ``cond`` on the step's verdict:
        applied, at the cooled learning rate while the ladder cools, or skipped. Returns
        the verdict for the step to hand back with its logs, or None where it is kept in
        ``verdicts`` instead. ``squares``: the gradients' half sums of squares by
        position, when the step has them already (the direct ring)."""
        if self.strategy is not None:
            self._across_replicas(original, grads, tvars, loss)
            return None
        if not self.regime.direct:
            squares = kops.squares_by_position(grads, tvars, self.position)
        code, norm = self._verdict(loss, squares)
        if not self.regime.direct:
            self._keep(code, norm)

        def applied() -> None:
            self.cooling = True
            try:
                original(grads, tvars)
            finally:
                self.cooling = False

        def skipped() -> None:
            self.variables["skipped"].assign_add(np.int64(1))

        ops.cond(ops.equal(code, 0), applied, skipped)
        return code if self.regime.direct else None

    def learning_rate(self, original: Any) -> Any:
        """The optimizer's learning rate, scaled by the cool-down's factor inside the
        update alone (after a roll back, from the snapshot's learning rate at most):
        whatever else reads it (a callback such as ``ReduceLROnPlateau``, the host) sees
        the schedule's own."""

        @functools.wraps(original)
        def current():
            lr = original()
            if not self.cooling:
                return lr
            bars = kops.value(self.variables["recovery"])
            return ops.multiply(ops.minimum(ops.cast(lr, "float32"), bars[3]), bars[2])

        return current

    def _keep(self, code: Any, norm: Any) -> None:
        """Several steps per execution, or replicas: every step keeps its own verdict."""
        row = ops.stack([ops.cast(code, "float32"), norm])
        slot = ops.mod(kops.step_index(self.optimizer, self.variables), self.regime.steps)
        kops.put(self.variables["verdicts"], slot, row)

    def _across_replicas(self, original: Any, grads: list, tvars: list, loss: list) -> None:
        """Under ``MirroredStrategy``. Every replica must take the same decision, from
        what the optimizer applies: the gradients summed across replicas, and the global
        loss. So the gradients are all-reduced here, through the optimizer's own
        all-reduce (which measures the sampled step's statistics; inside the update it
        then hands them on as they are), and the loss with them. The ``cond`` itself runs
        in the cross-replica context (a ``merge_call``), as Keras' ``LossScaleOptimizer``
        does: the strategy refuses a replica's ``cond`` whose branch calls ``merge_call``,
        as the update does."""
        import tensorflow as tf  # the only backend with a strategy

        pairs = self.optimizer._all_reduce_sum_gradients(list(zip(grads, tvars, strict=True)))
        summed = [g for g, _ in pairs]
        context = tf.distribute.get_replica_context()
        total = [context.all_reduce(tf.distribute.ReduceOp.SUM, loss[0])] if loss else []
        squares = kops.squares_by_position(summed, tvars, self.position)
        code, norm = self._verdict(total, squares)
        self._keep(code, norm)

        def across(distribution: Any, code: Any) -> None:
            decided = distribution.experimental_local_results(code)[0]  # the same on each

            def applied() -> None:
                self.cooling = self.summed = True
                try:
                    distribution.extended.call_for_each_replica(original, args=(summed, tvars))
                finally:
                    self.cooling = self.summed = False

            def skipped() -> None:
                distribution.extended.call_for_each_replica(
                    lambda: self.variables["skipped"].assign_add(np.int64(1))
                )

            ops.cond(ops.equal(decided, 0), applied, skipped)

        context.merge_call(across, args=(code,))

    def _verdict(self, loss: list, squares: dict[int, Any]) -> tuple[Any, Any]:
        """Why this step must not be applied, as a code of
        :data:`~stethoscope.recovery.REASONS` (0: apply), from its loss and its gradients'
        sums of squares against the bars: the loss past ``loss_spike``'s, the global norm
        past ``exploding_gradients``' (squared, so no root is taken; a square past
        float32's range reads as non-finite, as the detectors' norms do). Returns the code
        and the global gradient norm."""
        bars = kops.value(self.variables["recovery"])
        total = ops.multiply(ops.sum(ops.stack(list(squares.values()))), 2.0) if squares else 0.0
        code = ops.where(ops.greater(total, ops.square(bars[1])), GRADIENT_PAST_BAR, 0)
        code = ops.where(ops.isfinite(total), code, NONFINITE_GRADIENT)
        if loss:
            value = loss[0]
            code = ops.where(ops.greater(value, bars[0]), ops.maximum(code, LOSS_PAST_BAR), code)
            code = ops.where(ops.isfinite(value), code, NONFINITE_LOSS)
        return ops.cast(code, "int32"), ops.sqrt(ops.cast(total, "float32"))
