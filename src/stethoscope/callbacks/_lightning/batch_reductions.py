"""The Lightning adapter's reductions of what a step's batch and the model's forward pass
say: the loss, the inputs' scale and prints, the class labels, the model's output and what
the loss made of it, the modules' mode, and the forward hooks' rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.batch import (
    class_labels,
    input_moments,
    loader_order,
    sample_prints,
)
from stethoscope.callbacks._lightning.forward import ForwardProbe
from stethoscope.callbacks._lightning.loss_graph import broadcast_in_loss
from stethoscope.callbacks._lightning.measures import StepMeasures
from stethoscope.callbacks._lightning.predictions import output_tensor, probability_rows
from stethoscope.callbacks._lightning.reduction import Reduction
from stethoscope.callbacks._lightning.train_override import bypassed_train
from stethoscope.observation import Observation
from stethoscope.prints import join_prints

__all__ = [
    "ClassLabels",
    "ForwardStatistics",
    "InputScale",
    "Loss",
    "LossGraph",
    "Predictions",
    "SamplePrints",
    "TrainMode",
]


class Loss(Reduction):
    """The batch's training loss, every step (the callback measures it at batch end)."""

    statistics = frozenset({"loss"})
    name = "loss"

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.loss = float(values[0])


class InputScale(Reduction):
    """The per-feature mean square of the step's first batch of inputs."""

    statistics = frozenset({"inputs"})
    name = "inputs"

    def __init__(self, inputs_of: Callable[[Any], Any]) -> None:
        self.inputs_of = inputs_of

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        moments = input_moments(self.inputs_of(batch))
        if moments is not None:
            measures.add("inputs", moments[0], moments[1])

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.input_sq, obs.input_count = values, contexts[0]


class SamplePrints(Reduction):
    """A fingerprint of each sample of the step's first batch of inputs, with the order
    the training loader was asked for (a fact of the host)."""

    statistics = frozenset({"prints"})
    name = "prints"

    def __init__(self, inputs_of: Callable[[Any], Any], trainer_of: Callable[[], Any]) -> None:
        self.inputs_of, self.trainer_of = inputs_of, trainer_of

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        prints = sample_prints(self.inputs_of(batch))
        if prints is not None:
            measures.add("prints", prints, loader_order(self.trainer_of()))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.sample_prints = join_prints(values)
        obs.data_order = contexts[0]


class ClassLabels(Reduction):
    """The step's first batch of class labels, with a validity flag decided on the device
    (a float target that is not rows of probabilities holds no class labels)."""

    statistics = frozenset({"labels"})
    name = "labels"

    def __init__(self, labels_of: Callable[[Any], Any]) -> None:
        self.labels_of = labels_of

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        labels = class_labels(self.labels_of(batch))
        if labels is not None:
            measures.add("labels", labels)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        if values[-1] == 1.0:  # the validity flag: class labels after all
            obs.labels = values[:-1].astype(np.int64)


class Predictions(Reduction):
    """Whether the rows the model outputs are probabilities, and what the loss would be
    for each way of taking them (see :func:`probability_rows`). Forward hooks on the model
    and on its direct children keep the last float tensor of at least one dimension that
    one of them returned (the model's own output when the training step calls it, else
    its head's: a loss or metric module called after returns a scalar); it is judged on
    the device, with the batch's labels, just before the backward pass."""

    statistics = frozenset({"predictions"})
    name = "predictions"

    def __init__(self, model: torch.nn.Module, labels_of: Callable[[Any], Any]) -> None:
        self.modules = [model, *model.children()]
        self.labels_of = labels_of
        self._hooks: list[Any] = []
        self._last: torch.Tensor | None = None
        self._labels: Any = None

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        self.close()
        self._labels = self.labels_of(batch)

        def seen(module: torch.nn.Module, args: Any, output: Any) -> None:
            t = output_tensor(output)
            if t is not None and t.dim() >= 1 and t.is_floating_point():
                self._last = t

        self._hooks = [m.register_forward_hook(seen) for m in self.modules]

    def before_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        last, labels = self._last, self._labels
        self.close()
        rows = probability_rows(last, labels) if last is not None else None
        if rows is not None:
            measures.add("predictions", rows[0], rows[1])

    def at_end(self, measures: StepMeasures) -> None:
        self.close()  # never left on the model past its step

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._last, self._labels = [], None, None

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.output_probs, obs.output_width = float(values[0]), contexts[0]
        obs.read_ways(values[1:])


class LossGraph(Reduction):
    """Whether the loss's last operations broadcast a prediction against a target of
    another shape, read from its autograd graph on the host (see
    :func:`broadcast_in_loss`): no device work."""

    statistics = frozenset({"loss_graph"})
    name = "loss_graph"

    def before_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        found = broadcast_in_loss(loss)
        if found is not None:
            measures.note("loss_graph", found)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.loss_broadcast = contexts[0]


class TrainMode(Reduction):
    """The modules in eval mode at a training step's start, seen on the host: the model
    itself, its dropout modules, and its batch norms whose scale and shift still train
    (one frozen on purpose, the usual way to keep its statistics, is not listed)."""

    statistics = frozenset({"train_mode"})
    name = "train_mode"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.watched = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, (torch.nn.modules.dropout._DropoutNd, _BatchNorm))
        ]

        self._overrides_seen = False

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        off = ["<model>"] if not self.model.training else []
        # a batch norm frozen on purpose is judged as it is now: a hook that freezes it
        # (a train() called in on_train_start) runs after this reduction is built
        off += [name for name, m in self.watched if not m.training and not _frozen_norm(m)]
        # once, at the first measured step: after every on_train_start hook has run
        bypassed = None if self._overrides_seen else bypassed_train(self.model)
        self._overrides_seen = True
        measures.note("train_mode", (tuple(off), bypassed))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.eval_modules, obs.bypassed_train = contexts[0]


_BatchNorm = torch.nn.modules.batchnorm._BatchNorm


def _frozen_norm(module: torch.nn.Module) -> bool:
    """A batch norm whose scale and shift do not train: kept in eval mode on purpose, the
    usual way to keep its statistics while fine-tuning."""
    return isinstance(module, _BatchNorm) and not any(
        p.requires_grad for p in module.parameters(recurse=False)
    )


class ForwardStatistics(Reduction):
    """Forward hooks for one step: the inputs of tanh and sigmoid activations
    (``activations``), the outputs of layers with units (``outputs``), and whether each
    module's output was finite, in the order they ran (``trace``)."""

    statistics = frozenset({"activations", "outputs", "trace"})
    name = "forward"

    def __init__(self, forward: ForwardProbe) -> None:
        self.forward = forward

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        plan = measures.plan
        self.forward.attach(
            activations="activations" in plan, outputs="outputs" in plan, trace="trace" in plan
        )
        measures.forward = True

    def at_end(self, measures: StepMeasures) -> None:
        if not measures.forward:
            return
        measures.forward = False
        names, kinds, values = self.forward.collect()
        if values is not None:
            dtypes = tuple(self.forward.dtypes)  # those of the activations and outputs
            measures.add("forward", values, (tuple(names), tuple(kinds), dtypes))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        ((names, kinds, dtypes),) = contexts
        acts = [i for i, k in enumerate(kinds) if k != "trace"]
        offsets = np.cumsum([0] + [1 if k == "trace" else 3 for k in kinds])
        if acts:
            rows = np.stack([values[offsets[i] : offsets[i] + 3] for i in acts])
            obs.act_names = tuple(names[i] for i in acts)
            obs.act_kinds = tuple(kinds[i] for i in acts)
            obs.act_dtypes = dtypes
            obs.act_saturated, obs.act_rms, obs.act_max = rows[:, 0], rows[:, 1], rows[:, 2]
        traced = [i for i, k in enumerate(kinds) if k == "trace"]
        if traced:
            obs.trace_names = tuple(names[i] for i in traced)
            obs.trace_finite = np.array([values[offsets[i]] for i in traced]) == 1.0
