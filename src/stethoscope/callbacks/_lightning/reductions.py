"""The Lightning adapter's reductions of the parameters (gradient, weight and update
norms, unit rows, histograms), the set of every reduction of a run, and how a step's
reading becomes an observation.

The reductions of a step's batch and forward pass are in
:mod:`~stethoscope.callbacks._lightning.batch_reductions`; what a reduction is, in
:mod:`~stethoscope.callbacks._lightning.reduction`. The statistics gathered from every
rank where the ranks meet are not per step: their reductions hand the meeting this
rank's values instead (:mod:`~stethoscope.callbacks._lightning.rank_reductions`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.batch import BatchParts
from stethoscope.callbacks._lightning.batch_reductions import (
    ClassLabels,
    ForwardStatistics,
    InputScale,
    Loss,
    LossGraph,
    Predictions,
    SamplePrints,
    TrainMode,
)
from stethoscope.callbacks._lightning.forward import ForwardProbe
from stethoscope.callbacks._lightning.loss_scale import (
    EngineScaleSkips,
    LossScale,
    ScaleSkips,
    scale_skips,
)
from stethoscope.callbacks._lightning.measures import Reading, StepMeasures
from stethoscope.callbacks._lightning.parameters import (
    ParameterProbe,
    magnitude_histograms,
    unit_layers,
)
from stethoscope.callbacks._lightning.precision import Fp8Fit, GradientPrecision
from stethoscope.callbacks._lightning.reduction import Reduction
from stethoscope.callbacks._lightning.shards import (
    flat_slices,
)
from stethoscope.callbacks._lightning.zero import zero_slices
from stethoscope.observation import Observation
from stethoscope.statistics import DISTRIBUTION_BINS

__all__ = [
    "Distributions",
    "GradNorms",
    "GradientSamples",
    "ReductionSet",
    "StaleGrads",
    "UnitRows",
    "UpdateNorms",
    "WeightNorms",
    "make_reductions",
    "watch_parameters",
]


class GradientSamples(Reduction):
    """The samples behind a step's gradients, every micro-batch's (``measures.samples``),
    counted once for the statistics that carry them (the gradient norms, the units).

    Args:
        samples: ``batch -> samples in it`` on every rank (0: unknown).
    """

    statistics = frozenset({"grads", "units"})
    name = "samples"

    def __init__(self, samples: Callable[[Any], int]) -> None:
        self.samples = samples

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        measures.samples = self.samples(batch)

    def micro_batch(self, measures: StepMeasures, batch: Any) -> None:
        measures.samples += self.samples(batch)  # the gradients hold every micro-batch


class GradNorms(Reduction):
    """Each gradient's L2 norm, in one fused kernel per optimizer, and the samples behind
    them (counted by :class:`GradientSamples`).

    Under sharded parameters, the first sampled step also takes the strategy's own norm of
    each whole gradient (a collective per tensor, once) as a reference for the norms combined
    from the ranks' shards: a disagreement is said once (:func:`check_combined`).
    """

    statistics = frozenset({"grads"})
    name = "grads"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe
        # until the first sampled step under FSDP2 or ZeRO, whose whole gradients the
        # strategy can give
        self._check = probe.checkable

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        parts = [("norms", self.probe.grad_norms(indices), "norm")]
        if self._check and measures.combiner is not None:
            self._check = False  # every rank's first sampled step: agreed, as collectives need
            parts.append(("reference", self.probe.whole_grad_norms(indices), None))
        for kind, norms, combine in parts:
            if measures.grad_scale is not None:
                norms = norms / measures.grad_scale
            # every micro-batch of the step has started by now: the samples are complete
            measures.add("grads", norms, (kind, len(indices), measures.samples), combine=combine)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        parts: dict[str, list[np.ndarray]] = {"norms": [], "reference": []}
        at = 0
        for kind, n, _ in contexts:  # per optimizer: its norms, then any reference
            parts[kind].append(values[at : at + n])
            at += n
        obs.grad_norm = np.concatenate(parts["norms"])
        obs.grad_samples = contexts[-1][2]
        if parts["reference"] and obs.rank == 0:
            check_combined(obs.grad_norm, np.concatenate(parts["reference"]))


def check_combined(combined: np.ndarray, reference: np.ndarray, rtol: float = 1e-3) -> bool:
    """Whether the gradient norms combined from the ranks' shards agree with the norms of
    the whole gradients as the strategy gives them (see ``ParameterProbe.whole_grad_norms``);
    if not, a warning says so (once: it is checked once).
    Both non-finite in the same places counts as agreeing."""
    finite = np.isfinite(reference)
    same = np.array_equal(finite, np.isfinite(combined)) and np.allclose(
        combined[finite], reference[finite], rtol=rtol, atol=0.0
    )
    if not same:
        # the first parameter non-finite in one only, else the one furthest apart
        combined_finite = np.isfinite(combined)
        gap = np.abs(combined - reference) / np.maximum(np.abs(reference), 1e-30)
        gap = np.where(finite & combined_finite, gap, 0.0)
        worst = int(np.argmax(np.where(finite != combined_finite, np.inf, gap)))
        warnings.warn(
            f"stethoscope: the gradient norms combined from the ranks' shards disagree with "
            "the norms of the whole gradients the strategy gives (torch's DTensor norms, "
            f"DeepSpeed's gathered gradients; parameter {worst}: {combined[worst]:.6g} "
            f"against {reference[worst]:.6g}), so the gradient, update and weight "
            "statistics of this sharded run may be wrong; please report it with the strategy "
            "and the model's sharding",
            RuntimeWarning,
            stacklevel=2,
        )
    return same


class StaleGrads(Reduction):
    """How many of the parameters an optimizer steps still held a non-zero gradient from
    before the step at every backward pass of the step before that optimizer stepped:
    never zeroed. One fused norm kernel per backward pass (of the shards, combined,
    under sharding), the least norm each gradient held kept on the device, counted on
    the host.

    A parameter that held none (or a zero one) at any of those backward passes was
    zeroed within the step: the first micro-batch of an accumulated step, each closure
    call of LBFGS, each player of a game zeroing its own before its backward pass. A
    parameter that no optimizer stepped (a layer that trained earlier, in layer-wise
    training; one in no optimizer) is not counted, whatever it holds.
    """

    statistics = frozenset({"stale_grads"})
    name = "stale_grads"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe
        self._of: StepMeasures | None = None  # the step the least norms are of
        #: Per watched parameter: the least norm its gradient held before this step's
        #: backward passes so far (None: none, or known zero, before one of them).
        self._least: dict[int, torch.Tensor | None] = {}

    def each_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        probe = self.probe
        if self._of is not measures:
            self._of, self._least = measures, {}
        least = self._least
        # as the optimizer steps count them: alike on every rank (see with_grad)
        held = set(probe.with_grad(range(len(probe.params))))
        fresh, again = [], []
        for i in range(len(probe.params)):
            if i not in held:
                least[i] = None
            elif i not in least:
                fresh.append(i)
            elif least[i] is not None:  # None: zeroed within the step already, stays so
                again.append(i)
        if fresh:
            norms = torch._foreach_norm([probe.grad(i) for i in fresh])
            for i, n in zip(fresh, norms, strict=True):
                least[i] = n
        if again:
            norms = torch._foreach_norm([probe.grad(i) for i in again])
            lower = torch._foreach_minimum([least[i] for i in again], norms)
            for i, n in zip(again, lower, strict=True):
                least[i] = n

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        if self._of is not measures:  # no backward pass seen in this step
            return
        least = [self._least.get(i) for i in indices]
        known = next((t for t in least if t is not None), None)
        if known is None:  # every one of them zeroed within the step
            device = self.probe.params[indices[0]].device
            measures.add("stale_grads", torch.zeros(len(indices), device=device), combine="norm")
            return
        zero = known.new_zeros(())
        norms = torch.stack([t if t is not None else zero for t in least])
        measures.add("stale_grads", norms, combine="norm")

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.stale_grads = float(np.count_nonzero(values > 0))


class WeightNorms(Reduction):
    """Each parameter's L2 norm after the optimizer step; and the watched parameters that
    got a gradient this step but are in no optimizer (held on the host: their names).

    A step whose optimizers stepped no parameter with a gradient gives no norm, and
    says what the optimizers hold instead (``ParameterProbe.idle_held``)."""

    statistics = frozenset({"weights"})
    name = "weights"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe
        self._of: StepMeasures | None = None  # the step the gradients below are of
        self._unheld: dict[int, tuple[torch.Tensor, int] | None] = {}

    def at_start(self, measures: StepMeasures, batch: Any) -> None:
        # which parameters no optimizer holds, and what gradient each holds before the
        # step: one that got a gradient this step, not one left over from earlier steps
        self._of, self._unheld = measures, self.probe.grads_held(self.probe.unheld())

    def at_end(self, measures: StepMeasures) -> None:
        if not (measures.params or measures.optimizers):
            return  # no optimizer stepped in this batch (a micro-batch of the step)
        probe = self.probe
        unoptimized: tuple[str, ...] = ()
        if self._of is measures:  # in no optimizer from the step's start to its end
            still = set(probe.unheld())  # (a parameter group changed in the step: not)
            got = probe.received({i: g for i, g in self._unheld.items() if i in still})
            unoptimized = tuple(probe.names[i] for i in got)
            self._of, self._unheld = None, {}  # hold no gradient past its step
        if measures.params:
            norms = probe.weight_norms(measures.params)
        else:
            norms = torch.zeros(0, device=probe.params[0].device)
        context = (unoptimized, tuple(measures.idle))
        measures.add("weights", norms, context, combine="norm")

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.weight_norm = values
        obs.unoptimized, obs.idle_held = contexts[-1]


class UpdateNorms(Reduction):
    """How far the optimizer step moved each parameter: a snapshot before it (bounded by
    the probe's budget: large models take turns), the norm of the difference after.

    The snapshot is taken when an optimizer first reaches its step in the step (see
    ``ReductionSet.before_step``): a closure optimizer such as LBFGS calls its closure,
    and the hook there, many times in one step, after updates of its own."""

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
            if measures.optimizers and not measures.params:  # stepped none: see WeightNorms
                empty = torch.zeros(0, device=self.probe.params[0].device)
                measures.add("updates", empty, (0, ()), combine="norm")
            return
        updates, previous = self.probe.update_norms(measures.snapshots, measures.snapped)
        where = {i: k for k, i in enumerate(measures.params)}
        positions = tuple(where[i] for i in measures.snapped)
        measures.add(
            "updates",
            torch.cat([updates, previous]),
            (len(measures.params), positions),
            combine="norm",
        )
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
    """

    statistics = frozenset({"units"})
    name = "units"
    per_parameter = True

    def __init__(self, probe: ParameterProbe, layers: Sequence[tuple[str, int, Any]]) -> None:
        self.probe, self.layers = probe, layers

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        chosen = set(indices)
        layers = [(name, i) for name, i, _ in self.layers if i in chosen]
        if layers:
            units = tuple((name, self.probe.shapes[i][0]) for name, i in layers)
            rows = self.probe.unit_rows([i for _, i in layers])
            # every micro-batch of the step has started by now: the samples are complete
            measures.add("units", rows, (units, measures.samples), combine="norm")

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        layers = [layer for units, _ in contexts for layer in units]
        obs.unit_samples = contexts[-1][1]
        obs.unit_names = tuple(name for name, _ in layers)
        cuts = np.cumsum([units for _, units in layers])[:-1]
        obs.unit_zero = tuple(part == 0 for part in np.split(values, cuts))


class Distributions(Reduction):
    """A magnitude histogram of each gradient (before the optimizer step) and of each
    parameter (after it), on the bins of ``DISTRIBUTION_EDGES``."""

    statistics = frozenset({"distributions"})
    name = "distributions"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        grads = [self.probe.grad(i) for i in indices]
        hist = magnitude_histograms(grads, scale=measures.grad_scale)
        measures.add("distributions", hist, ("grads", len(indices)), combine="sum")

    def at_end(self, measures: StepMeasures) -> None:
        if measures.params:
            weights = [self.probe.data(i) for i in measures.params]
            hist = magnitude_histograms(weights)
            measures.add("distributions", hist, ("weights", len(measures.params)), combine="sum")

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
        #: The statistics measured just before a step's first backward pass: those of the
        #: reductions that have a ``before_backward`` (its hook is on where a plan names one).
        self.before_backward = frozenset(
            s
            for r in self.all
            if type(r).before_backward is not Reduction.before_backward
            or type(r).each_backward is not Reduction.each_backward
            for s in r.statistics
        )

    def close(self) -> None:
        """The fit is over (or failed): every reduction takes its hooks off the model."""
        for r in self.all:
            r.close()

    def computes_in(self, dtype: str) -> None:
        """The backward pass computes the float32 gradients in ``dtype`` (a name, e.g.
        ``"float16"``): every reduction that measures against a gradient's format is
        told (see ``Reduction.computes_in``)."""
        computed = getattr(torch, dtype)
        for r in self.all:
            r.computes_in(computed)

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

    def backward_begins(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        """A backward pass of a sampled step begins: the reductions of its plan that look
        before the step's first one do, and those that look before each one."""
        first, measures.backward = not measures.backward, True
        for r in self.run(measures.plan):
            if first:
                r.before_backward(measures, loss)
            r.each_backward(measures, loss)

    def before_step(
        self,
        measures: StepMeasures,
        optimizer: torch.optim.Optimizer,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """Before ``optimizer`` steps: measure the parameters it steps that have a
        gradient, for the statistics of ``measures``' plan that need them (the gradients
        divided by ``grad_scale``, a loss scale they still carry, unless None).

        Once per optimizer and step, where it first reaches its step, before it has
        updated anything: a closure optimizer (LBFGS) calls its closure, and the hook
        that calls this, many times per step, each after an update of its own; an
        optimizer stepped several times in one batch is measured over them all."""
        if any(o is optimizer for o in measures.optimizers):
            return
        stepping = self.stepping(measures.plan)
        if not stepping:
            return
        measures.optimizers.append(optimizer)
        indices = self.probe.with_grad(self.probe.indices_of(optimizer))
        if not indices:
            measures.idle.extend(self.probe.idle_held([optimizer]))
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
        measures = StepMeasures(step, epoch, frozenset({"grads", "weights"}), lr=lr)
        self._by_name["grads"].before_step(measures, indices)
        measures.params.extend(indices)
        self._by_name["weights"].at_end(measures)
        return measures.take()


def make_reductions(
    model: torch.nn.Module,
    probe: ParameterProbe,
    layers: Sequence[tuple[str, int, Any]],
    forward: ForwardProbe,
    batch: BatchParts,
    scale_skips: ScaleSkips | EngineScaleSkips | None = None,
) -> ReductionSet:
    """Every reduction of a Lightning run, in the order each hook runs them.

    Args:
        model: The LightningModule.
        probe: The watched parameters.
        layers: ``(name, index of its weight, module)`` of each layer with units.
        forward: The forward hooks.
        batch: The parts of a batch (inputs, labels, samples).
        scale_skips: The steps the loss scaler skipped (None: no loss scaler).
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
        GradientSamples(batch.samples),  # before the two that read its count
        GradNorms(probe),
        UnitRows(probe, layers),
        GradientPrecision(probe),  # before UpdateNorms: it reads the snapshots unspent
        UpdateNorms(probe),
        Distributions(probe),
        WeightNorms(probe),
        Fp8Fit(probe),
        LossScale(scale_skips),
    )
    return ReductionSet(reductions, probe)


def watch_parameters(
    model: torch.nn.Module, batch: BatchParts
) -> tuple[ParameterProbe, ForwardProbe, ScaleSkips | EngineScaleSkips | None, ReductionSet]:
    """The probes of ``model``'s parameters and layers, the counter of the steps its loss
    scaler skips (None without one), and every reduction of its run.

    Args:
        model: The LightningModule, with the parameters it trains with (sharded ones
            included: made after a strategy's ``configure_model``).
        batch: The parts of a batch (inputs, labels, samples).
    """
    flat = flat_slices(model) | zero_slices(model)  # FSDP1's and DeepSpeed's slices
    probe = ParameterProbe(list(model.named_parameters()), flat=flat)
    layers = unit_layers(model, probe)
    for _, i, _ in layers:
        shape = probe.shapes[i]
        probe.fan_in[i] = shape.numel() / max(shape[0], 1)
    forward = ForwardProbe(model, layers)
    skips = scale_skips(model.trainer)  # a GradScaler's, DeepSpeed's, or None
    return probe, forward, skips, make_reductions(model, probe, layers, forward, batch, skips)
