"""``Recovery(replay=True)`` in a Keras train step: a step judged bad is computed once
more, from the same state with the same batch, before its update is skipped.

Why inside the train step. The callback never holds the batch (Keras hands it to the
train function, not to callbacks), and by the time the host hears of a bad step the
state may have moved on (with several steps per execution, the later steps of the
execution have run). Inside the step both are at hand: nothing was applied yet, and the
step's ``x``, ``y`` and ``sample_weight`` are the ones its ``compute_loss`` saw. So where
the gate's first verdict is bad, its ``cond`` runs the forward and backward passes once
more and judges them again: fine, it was a transient fault of the machine, and the
second computation's gradients are applied; bad again, it is the batch (or the
numerics), and the step is skipped. Only a step judged bad runs the branch.

The same state is more than the weights: the state the step assigned before its
verdict (a ``BatchNormalization``'s moving statistics, a ``Dropout``'s seed), which the
step's :class:`~stethoscope.callbacks._keras.step_start.StepWatch` kept. The replay runs
in a ``StatelessScope`` that reads those values (it draws the same dropout masks) and
collects its own assignments instead of making them; a step applied from its replay then
takes the replay's state, not that of the computation judged bad, and a skipped step
puts back the state from before it, as if it never saw the batch. The branch itself is
a call that TensorFlow skips whole on a healthy step (see ``gate._apart``). On torch,
whose train step runs eagerly, the same code runs in Python, with autograd for the tape.

The probe's wrappers do not see the replay (they are switched off while it is traced):
the step's loss, statistics and prints are those of the computation judged. Keras' loss
tracker and metrics do not count it either: the step's logs are the first computation's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.regime import Mode
from stethoscope.callbacks._keras.step_start import StepStart, here, set_generators
from stethoscope.callbacks._keras.switches import Switches

__all__ = ["REPRODUCES", "TRANSIENT", "Replayed", "StepReplay"]

#: What the replay of a step judged bad found, as the verdict hands it back (0: the step
#: was not replayed): fine, its update applied (a transient fault); bad again, skipped.
TRANSIENT, REPRODUCES = 1, 2


@dataclass
class Replayed:
    """A step computed again from its :class:`StepStart`: its loss (float32), its
    gradients, and for each state variable the value the replay left (None where it
    cannot be used here)."""

    start: StepStart
    loss: Any
    grads: list
    after: list[Any]

    def keep_state(self) -> None:
        """The replay is applied: the state it left replaces the first computation's (the
        generators are where the replay's draws left them, as the first's did)."""
        for (variable, _), value in zip(self.start.state, self.after, strict=True):
            if value is not None:
                type(variable).assign(variable, value)  # past the watch: not the step's own


class StepReplay:
    """What a replay needs from the step being traced (run, when eager), and the replay.

    Args:
        model: A compiled, built Keras model (Keras' own train step).
        switches: The probe's switches: off while the replay is traced, so that the
            probe's wrappers do not take it for the step.
    """

    def __init__(self, model: Any, switches: Switches) -> None:
        self.model, self.optimizer, self.switches = model, model.optimizer, switches

    def recompute(self, start: StepStart, tvars: list) -> Replayed:
        """The forward pass, the loss and the gradients of ``tvars`` once more, as Keras'
        train step computes them, from the state the step started from."""
        x, y, sample_weight = start.batch
        model = self.model
        if start.generators is not None:
            set_generators(start.generators)
        mode, self.switches.mode = self.switches.mode, Mode.OFF
        try:
            with _gradients() as tape:
                # the weights read inside the tape, which watches them (and a weight's
                # regularizer reads its value from the scope)
                mapping = [*start.state, *((v, v) for v in model.trainable_variables)]
                with keras.StatelessScope(mapping, collect_losses=True) as scope:
                    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
                    loss = model._compute_loss(
                        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                    )
                tape.loss = self.optimizer.scale_loss(loss)
            grads = tape.gradients(tvars)
        finally:
            self.switches.mode = mode
        after = [scope.get_current_value(v) for v, _ in start.state]
        after = [a if a is not None and here(a) else None for a in after]
        value = ops.cast(loss if kops.scalar(loss) else ops.reshape(loss, ()), "float32")
        return Replayed(start, value, grads, after)


class _Tape:
    """The backend's gradients of :attr:`loss` (set inside the ``with``)."""

    def __init__(self, tape: Any = None) -> None:
        self.tape, self.loss = tape, None

    def gradients(self, tvars: list) -> list:
        if self.tape is not None:
            return list(self.tape.gradient(self.loss, tvars))
        import torch  # the eager backend: the train step's update runs under no_grad

        params = [v.value for v in tvars]
        return list(torch.autograd.grad(self.loss, params, allow_unused=True))


@contextlib.contextmanager
def _gradients() -> Iterator[_Tape]:
    """Record the forward pass for its gradients: a ``GradientTape`` on TensorFlow;
    on torch, autograd, switched back on inside the optimizer's ``no_grad`` update."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            yield _Tape(tape)
        return
    import torch

    with torch.enable_grad():
        yield _Tape()
