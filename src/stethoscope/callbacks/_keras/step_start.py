"""What a Keras train step started from, kept while it runs: its batch, and the state it
assigns before the recovery ladder's verdict.

A training forward pass moves more than the weights: a ``BatchNormalization``'s moving
statistics and a ``Dropout``'s seed generator are assigned before the optimizer's update,
so before the gate judges the step, and so is the mean loss Keras shows. A step the gate
skips must put them back, or a NaN batch leaves NaN moving statistics (every later
evaluation is NaN), a skipped step still moves the dropout masks of the steps after it,
and the progress bar shows ``loss: nan`` to the epoch's end. A replay
(``Recovery(replay=True)``) must start from them, and computes with the step's own batch.

So each variable of the model's that is not trained keeps its value from before the
step's first assignment to it (a read of a variable the step writes anyway), and the
batch is the one the step's ``compute_loss`` saw. What it costs a healthy step: one read
of each such variable the step assigns, and of the mean loss's two scalars. On torch,
whose train step runs eagerly and assigns in place, the values are copied, and each step
keeps torch's own random generators' state as well (a ``Dropout`` without a seed draws
from them, not from a variable of the model's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import keras
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.patches import Patches
from stethoscope.callbacks._keras.switches import Switches

__all__ = ["StepStart", "StepWatch", "set_generators"]


@dataclass
class StepStart:
    """What a step started from: its batch ``(x, y, sample_weight)`` (None: it never
    called ``compute_loss``), each state variable it assigned with its value from
    before, and on torch the state of torch's random generators (None on TensorFlow,
    whose layers draw from seed variables)."""

    batch: tuple | None
    state: list[tuple[Any, Any]]
    generators: Any = None

    def undo_state(self) -> None:
        """The step is skipped: the state goes back to what it was before the step."""
        for variable, value in self.state:
            type(variable).assign(variable, value)  # past the watch: not the step's own
        if self.generators is not None:
            set_generators(self.generators)


class StepWatch:
    """Keeps what the step being traced (run, when eager) started from.

    Args:
        model: A compiled, built Keras model (Keras' own train step).
        switches: The probe's switches: a step computed while they are off (a replay)
            is not the step, and its assignments are not watched.
    """

    def __init__(self, model: Any, switches: Switches) -> None:
        self.model, self.switches = model, switches
        #: The step's ``(x, y, sample_weight)``, from its ``compute_loss``.
        self.batch: tuple | None = None
        # each state variable the step assigned, by id: (variable, its value before)
        self._before: dict[int, tuple[Any, Any]] = {}
        self._generators: Any = None  # torch: its generators' state before the step

    def install(self, patches: Patches) -> None:
        """Watch the assignments to the model's variables that are not trained, and the
        additions to the mean loss Keras shows (its ``loss`` metric adds each step's loss
        in ``compute_loss``, before any verdict: a skipped NaN step would show ``loss:
        nan`` for the rest of the epoch, where the step was never trained on); on torch,
        keep the state of its random generators at the start of each step."""
        watched = {id(v): v for v in self.model.non_trainable_variables}  # each once
        for variable in watched.values():
            patches.put(variable, "assign", self._watch(variable, variable.assign))
        tracker = getattr(self.model, "_loss_tracker", None)  # Keras' own Mean, if any
        for variable in tracker.variables if tracker is not None else ():
            patches.put(variable, "assign_add", self._watch(variable, variable.assign_add))
        if keras.backend.backend() == "torch":
            patches.put(self.model, "train_step", self._keep_generators(self.model.train_step))

    def _watch(self, variable: Any, original: Any) -> Any:
        @functools.wraps(original)
        def assign(value):
            if not self.switches.off and id(variable) not in self._before:
                self._before[id(variable)] = (variable, _kept(variable))
            return original(value)

        return assign

    def _keep_generators(self, original: Any) -> Any:
        @functools.wraps(original)
        def train_step(*args, **kwargs):
            if not self.switches.off:
                self._generators = _generators()
            return original(*args, **kwargs)

        return train_step

    def take(self) -> StepStart:
        """What the step being traced started from, for the gate's ``cond``; the next step
        starts afresh. A value read in a control-flow body (a recurrent layer's loop)
        cannot leave it: such a variable is left as the step left it."""
        batch, before, generators = self.batch, list(self._before.values()), self._generators
        self.batch, self._before, self._generators = None, {}, None
        return StepStart(batch, [(v, value) for v, value in before if here(value)], generators)


def _generators() -> tuple[Any, Any]:
    """torch's random generators' state: the CPU's, and the current GPU's once used."""
    import torch

    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), torch.cuda.get_rng_state() if gpu else None


def set_generators(state: tuple[Any, Any]) -> None:
    """Put torch's random generators back to ``state`` (see :class:`StepStart`)."""
    import torch

    cpu, gpu = state
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu)


def _kept(variable: Any) -> Any:
    """A state variable's value now, kept from the assignment to come. A TensorFlow read
    is one already (an assignment gives the variable a new buffer); torch assigns in
    place, so its value is copied."""
    value = kops.value(variable)
    return ops.copy(value) if keras.backend.backend() == "torch" else value


def here(value: Any) -> bool:
    """Whether ``value`` can be used in the graph being built (always, when eager): a
    tensor made in a control-flow body cannot leave it."""
    graph = kops.graph()
    return graph is None or getattr(value, "graph", graph) is graph
