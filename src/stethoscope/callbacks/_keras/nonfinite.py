"""Catching a non-finite step inside the graph, where the ring is a variable.

In the direct regime the ring itself carries every gradient's sum of squares, and the
host tests them. Elsewhere one sum of the loss and every gradient's sum of squares tells
the step whether it went bad, and opens one ``cond`` that records the step and its
norms; the record waits for the host (the first one since the host last looked is kept).
"""

from __future__ import annotations

from typing import Any

from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.reductions import Layout
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.switches import cond
from stethoscope.callbacks._keras.variables import ProbeVariables

__all__ = ["NonfiniteRecord"]


class NonfiniteRecord:
    """The graph's record of a step whose loss or gradient is not finite.

    Args:
        optimizer: The model's optimizer (its step count).
        regime: How the train step runs.
        layout: What the probe watches.
        variables: The probe's variables (``bad_at``, ``bad_grad_norm`` and the flag at
            the end of ``losses``).
        position: Each trainable variable's position, by id.
        strategy: The model's ``MirroredStrategy``, or None (then the gradient norms are
            taken where the optimizer all-reduces the gradients).
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        regime: Regime,
        layout: Layout,
        variables: ProbeVariables,
        position: dict[int, int],
        strategy: Any,
    ) -> None:
        self.optimizer, self.regime, self.layout = optimizer, regime, layout
        self.variables, self.position, self.strategy = variables, position, strategy

    def predicate(self, loss: list[Any], squares: list[Any]) -> Any:
        """Whether this step's loss or a gradient is not finite: a bool tensor, or ``False``
        where the graph does not test (the direct regime tests on the host; an eager step
        would pay a device sync). ``squares``: each gradient's half sum of squares, taken
        before the optimizer reads it (:func:`~stethoscope.callbacks._keras.ops.checked`),
        so the update still works in place; one past float32's range (a norm over 1.8e19)
        counts as non-finite, as the norms of a sampled step would say."""
        if self.regime.direct or self.regime.eager:
            return False
        parts = loss + squares
        if not parts:
            return False
        import tensorflow as tf  # not eager: TensorFlow's graph, where add_n is one op

        return ops.logical_not(ops.isfinite(tf.add_n(parts)))

    def when_first(self, bad: Any, record: Any) -> None:
        """Run ``record`` at a step that went ``bad`` (see :meth:`predicate`) when no earlier
        record waits for the host. The healthy step pays for the outer ``cond`` alone."""
        if bad is False:
            return
        cond(bad, lambda: cond(ops.less(self.variables["bad_at"], 0), record))

    def gradients(self, grads: list, tvars: list) -> None:
        """Record the norms of the gradients summed across replicas (no loss scale)."""
        by_pos = kops.by_position(grads, tvars, self.position)
        self._store({p: kops.half_square(g) for p, g in by_pos.items()}, None)

    def _store(self, squares: dict[int, Any], scale: Any) -> None:
        norms = kops.norms(squares, self.layout.count)
        if scale is not None:
            norms = norms / ops.cast(scale, "float32")
        self.variables["bad_grad_norm"].assign(norms)

    def record(self, squares: dict[int, Any], scale: Any = None) -> None:
        """At the bad step: the gradient norms from ``squares``, each gradient's half sum of
        squares by position, those the predicate summed, with ``scale`` (the loss scale the
        gradients carry) divided out (under a strategy the all-reduce took the norms),
        the step, and the flag the host reads with the losses. The branch
        holds no gradient and no weight: a buffer it held would wait for the branch, so
        the optimizer could no longer update in place, and its reads of the weights would
        order it after every update; on a healthy step that cost ~4% of the execution.
        The host reads the weights after the execution instead."""
        if self.strategy is None:
            self._store(squares, scale)
        self.variables["bad_at"].assign(kops.step_index(self.optimizer, self.variables) - 1)
        flag = ops.convert_to_tensor(1.0, "float32")
        kops.put(self.variables["losses"], self.regime.steps, flag)
