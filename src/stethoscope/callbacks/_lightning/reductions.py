"""The Lightning adapter's reduction of each statistic: what the hooks measure on the
device, and how the host's copy becomes observation fields, side by side.

Each :class:`Reduction` serves a statistic of :mod:`stethoscope.statistics` (the forward
hooks serve three at once). It measures at the hooks it needs, on the steps whose plan
names its statistic, and hands the tensors to the step's :class:`StepMeasures`:

- :meth:`~Reduction.at_start`: the step's first batch, before its forward pass;
- :meth:`~Reduction.micro_batch`: each later micro-batch of the step (accumulation);
- :meth:`~Reduction.before_step`: before an optimizer steps the watched parameters
  ``indices`` (their gradients complete);
- :meth:`~Reduction.at_end`: after a batch, and so after the optimizer step on the
  step's last micro-batch.

:meth:`~Reduction.decode` turns the statistic's numbers back into fields; per-parameter
arrays follow ``measures.params``, the parameters the optimizers stepped, in order.

The statistics gathered from every rank where the ranks meet are not per step: their
reductions (:class:`ReplicaChecksums`, :class:`RankTiming`) hand the meeting this rank's
values instead (``shared``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from stethoscope.callbacks._lightning.batch import (
    BatchParts,
    class_labels,
    input_moments,
    loader_order,
    sample_prints,
)
from stethoscope.callbacks._lightning.forward import ForwardProbe
from stethoscope.callbacks._lightning.loss_graph import broadcast_in_loss
from stethoscope.callbacks._lightning.measures import Reading, StepMeasures
from stethoscope.callbacks._lightning.parameters import (
    ParameterProbe,
    checksums,
    magnitude_histograms,
    zero_rows,
)
from stethoscope.callbacks._lightning.predictions import output_tensor, probability_rows
from stethoscope.observation import Observation
from stethoscope.statistics import DISTRIBUTION_BINS, join_prints

__all__ = [
    "ClassLabels",
    "Distributions",
    "ForwardStatistics",
    "GradNorms",
    "InputScale",
    "Loss",
    "LossGraph",
    "Predictions",
    "RankTiming",
    "Reduction",
    "ReductionSet",
    "ReplicaChecksums",
    "SamplePrints",
    "UnitRows",
    "UpdateNorms",
    "WeightNorms",
    "make_reductions",
]


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

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        """Before an optimizer steps the watched parameters ``indices``."""

    def at_end(self, measures: StepMeasures) -> None:
        """After a batch (after the optimizer step, on the step's last micro-batch)."""

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        """Fill ``obs`` from this statistic's numbers and the contexts of its parts."""
        raise NotImplementedError

    def close(self) -> None:
        """The fit is over: take off anything left on the user's model."""


class Loss(Reduction):
    """The batch's training loss, every step (the callback measures it at batch end)."""

    statistics = frozenset({"loss"})
    name = "loss"

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.loss = float(values[0])


class GradNorms(Reduction):
    """Each gradient's L2 norm, in one fused kernel per optimizer."""

    statistics = frozenset({"grads"})
    name = "grads"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        norms = self.probe.grad_norms(indices)
        if measures.grad_scale is not None:
            norms = norms / measures.grad_scale
        measures.add("grads", norms)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.grad_norm = values


class StaleGrads(Reduction):
    """How many parameters still hold a non-zero gradient when the step's first backward
    pass begins: one fused norm kernel, counted on the device."""

    statistics = frozenset({"stale_grads"})
    name = "stale_grads"

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        params = self.probe.params
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            measures.add("stale_grads", torch.zeros(1, device=params[0].device))
            return
        norms = torch.stack(torch._foreach_norm(grads))
        measures.add("stale_grads", (norms > 0).sum().float())

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.stale_grads = float(values[0])


class WeightNorms(Reduction):
    """Each parameter's L2 norm after the optimizer step."""

    statistics = frozenset({"weights"})
    name = "weights"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def at_end(self, measures: StepMeasures) -> None:
        if measures.params:
            measures.add("weights", self.probe.weight_norms(measures.params))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.weight_norm = values


class UpdateNorms(Reduction):
    """How far the optimizer step moved each parameter: a snapshot before it (bounded by
    the probe's budget: large models take turns), the norm of the difference after."""

    statistics = frozenset({"updates"})
    name = "updates"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        chosen = self.probe.choose(indices)
        measures.snapshots.extend(self.probe.snapshot(chosen))
        measures.snapped.extend(chosen)

    def at_end(self, measures: StepMeasures) -> None:
        if not measures.snapshots:
            return
        updates, previous = self.probe.update_norms(measures.snapshots, measures.snapped)
        where = {i: k for k, i in enumerate(measures.params)}
        positions = tuple(where[i] for i in measures.snapped)
        measures.add("updates", torch.cat([updates, previous]), (len(measures.params), positions))
        measures.snapshots, measures.snapped = [], []

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        ((size, positions),) = contexts
        updates, previous = np.split(values, 2)
        obs.update_norm = np.full(size, np.nan)  # measured on a subset: NaN for the others
        obs.update_norm[list(positions)] = updates
        obs.prev_weight_norm = np.full(size, np.nan)
        obs.prev_weight_norm[list(positions)] = previous


class UnitRows(Reduction):
    """Which output units of each dense or convolution layer got an exactly-zero
    gradient row, and the samples behind those gradients.

    Args:
        probe: The watched parameters.
        layers: ``(name, index of its weight, module)`` of each layer with units.
        samples: ``batch -> samples in it`` on every rank (0: unknown).
    """

    statistics = frozenset({"units"})
    name = "units"
    per_parameter = True

    def __init__(
        self,
        probe: ParameterProbe,
        layers: Sequence[tuple[str, int, Any]],
        samples: Callable[[Any], int],
    ) -> None:
        self.probe, self.layers, self.samples = probe, layers, samples

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        measures.samples = self.samples(batch)

    def micro_batch(self, measures: StepMeasures, batch: Any) -> None:
        measures.samples += self.samples(batch)  # the gradient rows hold every micro-batch

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        chosen = set(indices)
        layers = [(name, i) for name, i, _ in self.layers if i in chosen]
        if layers:
            grads = [self.probe.params[i].grad for _, i in layers]
            units = tuple((name, g.shape[0]) for (name, _), g in zip(layers, grads, strict=True))
            # every micro-batch of the step has started by now: the samples are complete
            measures.add("units", zero_rows(grads), (units, measures.samples))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        layers = [layer for units, _ in contexts for layer in units]
        obs.unit_samples = contexts[-1][1]
        obs.unit_names = tuple(name for name, _ in layers)
        cuts = np.cumsum([units for _, units in layers])[:-1]
        obs.unit_zero = tuple(part.astype(bool) for part in np.split(values, cuts))


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
        if not np.isnan(values[1]):
            obs.loss_as_logits, obs.loss_as_log_probs, obs.loss_as_probs = values[1:4].tolist()


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
            if isinstance(m, torch.nn.modules.dropout._DropoutNd)
            or (
                isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                and any(p.requires_grad for p in m.parameters(recurse=False))
            )
        ]

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        off = ["<model>"] if not self.model.training else []
        off += [name for name, m in self.watched if not m.training]
        measures.note("train_mode", tuple(off))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.eval_modules = contexts[0]


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
            measures.add("forward", values, (tuple(names), tuple(kinds)))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        ((names, kinds),) = contexts
        acts = [i for i, k in enumerate(kinds) if k != "trace"]
        offsets = np.cumsum([0] + [1 if k == "trace" else 3 for k in kinds])
        if acts:
            rows = np.stack([values[offsets[i] : offsets[i] + 3] for i in acts])
            obs.act_names = tuple(names[i] for i in acts)
            obs.act_kinds = tuple(kinds[i] for i in acts)
            obs.act_saturated, obs.act_rms, obs.act_max = rows[:, 0], rows[:, 1], rows[:, 2]
        traced = [i for i, k in enumerate(kinds) if k == "trace"]
        if traced:
            obs.trace_names = tuple(names[i] for i in traced)
            obs.trace_finite = np.array([values[offsets[i]] for i in traced]) == 1.0


class Distributions(Reduction):
    """A magnitude histogram of each gradient (before the optimizer step) and of each
    parameter (after it), on the bins of ``DISTRIBUTION_EDGES``."""

    statistics = frozenset({"distributions"})
    name = "distributions"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        grads = [self.probe.params[i].grad for i in indices]
        hist = magnitude_histograms(grads, scale=measures.grad_scale)
        measures.add("distributions", hist, ("grads", len(indices)))

    def at_end(self, measures: StepMeasures) -> None:
        if measures.params:
            weights = [self.probe.params[i] for i in measures.params]
            hist = magnitude_histograms(weights)
            measures.add("distributions", hist, ("weights", len(measures.params)))

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        rows = values.reshape(-1, DISTRIBUTION_BINS)
        parts: dict[str, list[np.ndarray]] = {"grads": [], "weights": []}
        at = 0
        for kind, n in contexts:  # gradients per optimizer, then the weights
            parts[kind].append(rows[at : at + n])
            at += n
        if parts["grads"]:
            obs.grad_hist = np.concatenate(parts["grads"])
        if parts["weights"]:
            obs.weight_hist = np.concatenate(parts["weights"])


class ReplicaChecksums:
    """Under DDP: an exact checksum of every replica's parameters (and of the buffers DDP
    does not re-broadcast), for the meeting to compare across ranks."""

    statistics = frozenset({"replicas"})

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], buffers: int) -> None:
        self.tensors = [t for _, t in named]
        self.names = tuple(n for n, _ in named)
        self.buffer = np.array([False] * (len(named) - buffers) + [True] * buffers)

    @classmethod
    def of(cls, model: Any, module: torch.nn.Module) -> ReplicaChecksums | None:
        """What ``module``'s replicas compare under ``model`` (the strategy's wrapped model):
        under DDP, every parameter, and the buffers DDP does not overwrite from rank zero at
        each forward pass. None for strategies that shard the parameters (FSDP, DeepSpeed):
        they hold no whole replicas to compare."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        buffers = [] if model.broadcast_buffers else list(module.named_buffers())
        return cls(list(module.named_parameters()) + buffers, len(buffers))

    def shared(self) -> dict[str, Any]:
        return {
            "replica_sums": checksums(self.tensors).cpu().numpy(),
            "replica_names": self.names,
            "replica_buffer": self.buffer,
        }


class RankTiming:
    """Under DDP: how long this rank spent alone per batch (data loading and the forward
    pass, which no collective waits in) since the ranks last compared."""

    statistics = frozenset({"ranks"})

    def __init__(self) -> None:
        self.mark: float | None = None  # when this rank last finished a batch
        self.busy, self.batches = 0.0, 0

    def batch_done(self) -> None:
        self.mark = time.perf_counter()

    def before_backward(self) -> None:
        if self.mark is not None:
            self.busy += time.perf_counter() - self.mark
            self.batches += 1

    def pause(self) -> None:
        """The next batch comes after an epoch start or a validation: not timed."""
        self.mark = None

    def shared(self) -> dict[str, Any]:
        busy = self.busy / self.batches if self.batches else math.nan
        self.busy, self.batches = 0.0, 0
        return {"rank_busy": busy}


class ReductionSet:
    """Every reduction of a run: those each plan runs, and the decoding of a reading.

    Args:
        reductions: Every reduction, in the order the hooks run them.
        probe: The watched parameters (to name them in an observation).
    """

    def __init__(self, reductions: Sequence[Reduction], probe: ParameterProbe) -> None:
        self.all = tuple(reductions)
        self.probe = probe
        self._by_name = {r.name: r for r in self.all}
        # per plan: the reductions it runs, and those of them that need the parameters an
        # optimizer steps (a handful of plans per run)
        self._by_plan: dict[frozenset[str], tuple[tuple[Reduction, ...], tuple]] = {}

    def close(self) -> None:
        """The fit is over (or failed): every reduction takes its hooks off the model."""
        for r in self.all:
            r.close()

    def run(self, plan: frozenset[str]) -> tuple[Reduction, ...]:
        """The reductions that serve a statistic of ``plan``, in order."""
        return self._split(plan)[0]

    def stepping(self, plan: frozenset[str]) -> tuple[Reduction, ...]:
        """Those of them that measure the parameters an optimizer steps."""
        return self._split(plan)[1]

    def _split(self, plan: frozenset[str]) -> tuple[tuple[Reduction, ...], tuple]:
        hit = self._by_plan.get(plan)
        if hit is None:
            run = tuple(r for r in self.all if not r.statistics.isdisjoint(plan))
            hit = self._by_plan[plan] = (run, tuple(r for r in run if r.per_parameter))
        return hit

    def before_step(
        self,
        measures: StepMeasures,
        optimizer: torch.optim.Optimizer,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """Before ``optimizer`` steps: measure the parameters it steps that have a
        gradient, for the statistics of ``measures``' plan that need them (the gradients
        divided by ``grad_scale``, a loss scale they still carry, unless None)."""
        stepping = self.stepping(measures.plan)
        if not stepping:
            return
        indices = self.probe.with_grad(self.probe.indices_of(optimizer))
        if not indices:
            return
        measures.grad_scale = grad_scale
        for r in stepping:
            r.before_step(measures, indices)
        measures.params.extend(indices)

    def observation(self, reading: Reading, values: np.ndarray, rank: int) -> Observation:
        """The observation a reading holds: each part decoded by the reduction that made
        it, the parameters named."""
        obs = Observation(step=reading.step, epoch=reading.epoch, rank=rank, lr=reading.lr)
        at = 0
        for name, n, contexts in reading.layout:
            chunk = np.asarray(values[at : at + n], dtype=np.float64)
            self._by_name[name].decode(obs, chunk, contexts)
            at += n
        if reading.params:
            self.probe.describe(obs, list(reading.params))
        return obs

    def gradients_and_weights_now(self, step: int, epoch: int, lr: float | None) -> Reading | None:
        """The gradient and weight norms of every parameter that has a gradient, measured
        now (None: none has): a step's second look, off the healthy path."""
        indices = [i for i, p in enumerate(self.probe.params) if p.grad is not None]
        if not indices:
            return None
        measures = StepMeasures(step, epoch, frozenset({"grads", "weights"}))
        self._by_name["grads"].before_step(measures, indices)
        measures.params.extend(indices)
        self._by_name["weights"].at_end(measures)
        return measures.take(lr)


def make_reductions(
    model: torch.nn.Module,
    probe: ParameterProbe,
    layers: Sequence[tuple[str, int, Any]],
    forward: ForwardProbe,
    batch: BatchParts,
) -> ReductionSet:
    """Every reduction of a Lightning run, in the order each hook runs them.

    Args:
        model: The LightningModule.
        probe: The watched parameters.
        layers: ``(name, index of its weight, module)`` of each layer with units.
        forward: The forward hooks.
        batch: The parts of a batch (inputs, labels, samples).
    """
    reductions = (
        Loss(),
        InputScale(batch.inputs),
        ClassLabels(batch.labels),
        SamplePrints(batch.inputs, lambda: model.trainer),
        Predictions(model, batch.labels),
        LossGraph(),
        TrainMode(model),
        ForwardStatistics(forward),
        StaleGrads(probe),
        GradNorms(probe),
        UnitRows(probe, layers, batch.samples),
        UpdateNorms(probe),
        Distributions(probe),
        WeightNorms(probe),
    )
    return ReductionSet(reductions, probe)
