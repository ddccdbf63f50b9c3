"""The recovery ladder's skip inside a Keras train step: the step's verdict, and the
``cond`` that applies the optimizer's update or skips it.

The verdict compares the step's loss and its gradients' global norm with the bars the
host last wrote to the probe's ``recovery`` variable (``loss_spike``'s, then
``exploding_gradients``', then the cool-down's factor on the learning rate and the
learning rate it scales at most, after a roll back the snapshot's), and the host's
``forced`` mark on the step (a batch skipped before, or one of ``skip_ahead``'s). A
skipped step leaves the weights, the optimizer's slots and its ``iterations`` as they
were, puts back the state its forward pass assigned (see
:mod:`~stethoscope.callbacks._keras.step_start`), and counts itself in the probe's
``skipped`` variable (see ``ops.step_index``). With ``Recovery(replay=True)`` a step
judged bad is computed once more before it is skipped (see
:mod:`~stethoscope.callbacks._keras.replay`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.patches import Patches
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.replay import REPRODUCES, TRANSIENT, StepReplay
from stethoscope.callbacks._keras.step_start import StepStart, StepWatch
from stethoscope.callbacks._keras.variables import ProbeVariables
from stethoscope.recovery.settings import (
    FORCED_SKIP,
    GRADIENT_PAST_BAR,
    LOSS_PAST_BAR,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
)

__all__ = ["BAD_DATA", "ELSEWHERE", "UpdateGate", "verdict_rows"]

#: What a step's verdict says in place of its replay's finding (there is none under a
#: strategy) where another worker judged the step bad and this one did not: the workers
#: of a ``MultiWorkerMirroredStrategy`` run take the worst of their verdicts.
ELSEWHERE = 3
#: Added to a skipped step's finding (its replay's, or 0) where the batch's own inputs
#: hold NaN or Inf: the data explains the step, whatever the weights. Looked at in the
#: skip's branch alone, so a healthy step never reads its inputs for it; not under a
#: strategy, whose replicas decide together on the summed gradients.
BAD_DATA = 4


class UpdateGate:
    """Judges each step before its update, and applies the update or skips it.

    Args:
        optimizer: The model's optimizer.
        regime: How the train step runs.
        variables: The probe's variables (``recovery``, ``skipped``, and ``verdicts``
            where the step cannot hand its verdict back itself).
        position: Each trainable variable's position, by id.
        strategy: The model's ``MirroredStrategy``, or None.
        watch: What keeps the state each step starts from, which a skip puts back (not
            under a strategy: see :meth:`_across_replicas`).
        replay: What computes a step judged bad once more (``Recovery(replay=True)``;
            never under a strategy), or None: such a step is skipped.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        regime: Regime,
        variables: ProbeVariables,
        position: dict[int, int],
        strategy: Any,
        watch: StepWatch,
        replay: StepReplay | None = None,
    ) -> None:
        self.optimizer, self.regime, self.variables = optimizer, regime, variables
        self.position, self.strategy = position, strategy
        self.watch, self.replay = watch, replay
        #: The update is being traced: its reads of the learning rate are scaled.
        self.cooling = False
        #: ... with gradients summed across replicas already (the optimizer's all-reduce
        #: hands them on as they are).
        self.summed = False

    def install(self, patches: Patches) -> None:
        """Wrap the optimizer's learning rate (see :meth:`learning_rate`), and watch the
        state each step assigns."""
        current = self.optimizer._get_current_learning_rate
        patches.put(self.optimizer, "_get_current_learning_rate", self.learning_rate(current))
        if self.strategy is None:
            self.watch.install(patches)

    def update(
        self, original: Any, grads: list, tvars: list, loss: list, squares: dict[int, Any]
    ) -> Any:
        """The optimizer's update (``original``), in a ``cond`` on the step's verdict:
        applied, at the cooled learning rate while the ladder cools, or skipped, the state
        the step assigned put back (with a replay: computed again first). Returns the
        verdict for the step to hand back with its logs (its code, and what its replay
        found), or None where it is kept in ``verdicts`` instead. ``squares``: the
        gradients' half sums of squares by position, when the step has them already (the
        direct ring)."""
        if self.strategy is not None:
            self._across_replicas(original, grads, tvars, loss)
            return None
        direct = self.regime.direct
        if not direct:
            squares = kops.squares_by_position(grads, tvars, self.position)
        slot = 0 if direct else self._slot()  # the step's, read before its update
        code, norm = self._verdict(loss, squares, slot)
        start = self.watch.take()

        def applied() -> Any:
            self._apply(original, grads, tvars)
            return ops.convert_to_tensor(np.int32(0))

        def judged_bad() -> Any:
            return self._judged_bad(original, tvars, loss, code, start)

        if self.replay is not None:  # a branch of its own (see _apart)
            found = ops.cond(ops.equal(code, 0), applied, lambda: _apart(judged_bad))
        else:
            found = ops.cond(ops.equal(code, 0), applied, judged_bad)
        if direct:
            return ops.stack([code, found])
        self._keep(slot, code, norm, found)
        return None

    def _judged_bad(
        self, original: Any, tvars: list, loss: list, code: Any, start: StepStart
    ) -> Any:
        """The step was judged bad (``code``): skipped, the state it assigned put back;
        with a replay, unless the host forced the skip, computed again first. Returns
        what the replay found (0: none)."""

        def skipped() -> Any:
            start.undo_state()
            self._skip()
            return _data_explains(start, np.int32(0))

        if self.replay is None or start.batch is None:  # no compute_loss: nothing to replay
            return skipped()
        return ops.cond(
            ops.equal(code, FORCED_SKIP),
            skipped,
            lambda: self._replayed(original, tvars, loss, start),
        )

    def _replayed(self, original: Any, tvars: list, loss: list, start: StepStart) -> Any:
        """The step was judged bad: compute it again and judge that. Fine, its gradients
        are applied (and its state kept); bad again, the step is skipped (and its state
        put back). Returns :data:`TRANSIENT` or :data:`REPRODUCES`."""
        again = self.replay.recompute(start, tvars)
        squares = kops.squares_by_position(again.grads, tvars, self.position)
        code, _ = self._verdict([again.loss] if loss else [], squares, None)

        def transient() -> Any:
            again.keep_state()
            self._apply(original, again.grads, tvars)
            return ops.convert_to_tensor(np.int32(TRANSIENT))

        def reproduces() -> Any:
            start.undo_state()
            self._skip()
            return _data_explains(start, np.int32(REPRODUCES))

        return ops.cond(ops.equal(code, 0), transient, reproduces)

    def _apply(self, original: Any, grads: list, tvars: list) -> None:
        """The optimizer's update, its learning rate cooled (see :meth:`learning_rate`)."""
        self.cooling = True
        try:
            original(grads, tvars)
        finally:
            self.cooling = False

    def _skip(self) -> None:
        self.variables["skipped"].assign_add(np.int64(1))

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

    def _slot(self) -> Any:
        """Where this step keeps its verdict in ``verdicts`` (several steps per
        execution, or replicas)."""
        return ops.mod(kops.step_index(self.optimizer, self.variables), self.regime.steps)

    def _keep(self, slot: Any, code: Any, norm: Any, found: Any = 0) -> None:
        """Every step keeps its own verdict: its code, the gradient norm it was judged on,
        and what its replay found (0: none; :data:`ELSEWHERE`: judged bad on another
        worker)."""
        row = ops.stack([ops.cast(code, "float32"), norm, ops.cast(found, "float32")])
        kops.put(self.variables["verdicts"], slot, row)

    def _across_replicas(self, original: Any, grads: list, tvars: list, loss: list) -> None:
        """Under ``MirroredStrategy``. Every replica must take the same decision, from
        what the optimizer applies: the gradients summed across replicas, and the global
        loss. So the gradients are all-reduced here, through the optimizer's own
        all-reduce (which measures the sampled step's statistics; inside the update it
        then hands them on as they are), and the loss with them. The ``cond`` itself runs
        in the cross-replica context (a ``merge_call``), as Keras' ``LossScaleOptimizer``
        does: the strategy refuses a replica's ``cond`` whose branch calls ``merge_call``,
        as the update does. A skip here leaves the state the forward pass assigned (a
        ``BatchNormalization``'s moving statistics) as the step left it: each replica
        assigned its own copy, in its replica context, before the replicas decided.
        Under ``MultiWorkerMirroredStrategy`` the replicas span every worker, and take
        the worst of their verdicts (see :meth:`_worst`)."""
        import tensorflow as tf  # the only backend with a strategy

        pairs = self.optimizer._all_reduce_sum_gradients(list(zip(grads, tvars, strict=True)))
        summed = [g for g, _ in pairs]
        context = tf.distribute.get_replica_context()
        total = [context.all_reduce(tf.distribute.ReduceOp.SUM, loss[0])] if loss else []
        squares = kops.squares_by_position(summed, tvars, self.position)
        slot = self._slot()
        code, norm = self._verdict(total, squares, slot)
        if self.regime.workers > 1:
            mine, code = code, self._worst(context, code)
            self._keep(slot, code, norm, ops.where(ops.equal(code, mine), 0, ELSEWHERE))
        else:
            self._keep(slot, code, norm)

        def across(distribution: Any, code: Any) -> None:
            decided = distribution.experimental_local_results(code)[0]  # the same on each

            def applied() -> None:
                self.cooling = self.summed = True
                try:
                    distribution.extended.call_for_each_replica(original, args=(summed, tvars))
                finally:
                    self.cooling = self.summed = False

            def skipped() -> None:
                distribution.extended.call_for_each_replica(self._skip)

            ops.cond(ops.equal(decided, 0), applied, skipped)

        context.merge_call(across, args=(code,))

    @staticmethod
    def _worst(context: Any, code: Any) -> Any:
        """The worst of every replica's verdict ``code``, on every worker: under
        ``MultiWorkerMirroredStrategy`` each worker judges the same summed gradients and
        loss, but against the bars its own host wrote (from its own losses), so two
        workers could differ on a step, and one skip a step another applies. The
        strategy's all-reduce has no maximum: each replica sends its code as a one-hot
        row, the rows are summed, and the worst code any replica sent wins, as the
        Lightning ranks' all-reduce ``MAX`` does."""
        import tensorflow as tf

        seen = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.one_hot(code, FORCED_SKIP + 1, dtype=tf.float32)
        )
        codes = tf.range(FORCED_SKIP + 1, dtype=tf.int32)
        return tf.reduce_max(tf.where(seen > 0, codes, tf.zeros_like(codes)))

    def _verdict(self, loss: list, squares: dict[int, Any], slot: Any) -> tuple[Any, Any]:
        """Why this step must not be applied, as a code of
        :data:`~stethoscope.recovery.REASONS` (0: apply), from its loss and its gradients'
        sums of squares against the bars: the loss past ``loss_spike``'s, the global norm
        past ``exploding_gradients``' (squared, so no root is taken; a square past
        float32's range reads as non-finite, as the detectors' norms do); whatever they
        are, :data:`FORCED_SKIP` where the host marked the step's ``slot`` in ``forced``
        (None: a replay's verdict, never forced). Returns the code and the global
        gradient norm."""
        bars = kops.value(self.variables["recovery"])
        total = ops.multiply(ops.sum(ops.stack(list(squares.values()))), 2.0) if squares else 0.0
        code = ops.where(ops.greater(total, ops.square(bars[1])), GRADIENT_PAST_BAR, 0)
        code = ops.where(ops.isfinite(total), code, NONFINITE_GRADIENT)
        if loss:
            value = loss[0]
            code = ops.where(ops.greater(value, bars[0]), ops.maximum(code, LOSS_PAST_BAR), code)
            code = ops.where(ops.isfinite(value), code, NONFINITE_LOSS)
        if slot is not None:
            forced = ops.take(kops.value(self.variables["forced"]), slot)
            code = ops.where(ops.greater(forced, 0.0), FORCED_SKIP, code)
        return ops.cast(code, "int32"), ops.sqrt(ops.cast(total, "float32"))


def _data_explains(start: StepStart, found: np.int32) -> Any:
    """A skipped step's ``found`` (0, or what its replay found), plus :data:`BAD_DATA`
    where its batch has a non-finite input."""
    if start.batch is None:  # no compute_loss: no batch to look at
        return ops.convert_to_tensor(found)
    finite = kops.inputs_finite(start.batch[0])
    return ops.where(finite, found, np.int32(found + BAD_DATA))


def _apart(fn: Any) -> Any:
    """``fn()``, traced as a function of its own where a graph is being built. TensorFlow
    inlines a ``cond``'s branches, and on a step that takes the other branch passes over
    each of their ops (some 50 ns each): a replay's branch, a forward and a backward pass
    and an update, would cost every healthy step that much. A call it does not inline
    is passed over as one op."""
    if kops.graph() is None:  # eager (torch, or run_eagerly): only the branch taken runs
        return fn()
    import tensorflow as tf

    return tf.function(fn, autograph=False, experimental_attributes={"_noinline": True})()


def verdict_rows(regime: Regime, handed: Any, ring: np.ndarray, variables: ProbeVariables) -> Any:
    """The verdicts of an execution, a row per ring slot: the code (of
    :data:`~stethoscope.recovery.REASONS`; 0: the update was applied), the global gradient
    norm it was judged on and what the step's replay found (0: not replayed,
    :data:`TRANSIENT`, :data:`REPRODUCES`, :data:`ELSEWHERE`: judged bad on another
    worker), plus :data:`BAD_DATA` where a skip's batch has a non-finite input.
    ``handed``: what the step handed back with its logs (a direct step: its code, and
    with a replay what it found; its norm is the ``ring``'s), else None where
    ``verdicts`` must be read."""
    if not regime.direct:
        rows = handed if handed is not None else variables.read("verdicts")
        return np.asarray(rows, dtype=np.float64).reshape(regime.steps, 3)
    if handed is None:
        return np.zeros((1, 3))
    code, *found = np.asarray(handed).reshape(-1).tolist()
    norm = math.sqrt(2.0 * float(np.sum(ring[1:], dtype=np.float64)))
    return np.array([[code, norm, found[0] if found else 0]], dtype=np.float64)
