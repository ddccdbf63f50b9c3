"""The Lightning adapter's reductions of the parameters (gradient, weight and update
norms, unit rows, histograms), the set of every reduction of a run, and how a step's
reading becomes an observation.

The reductions of a step's batch and forward pass are in
:mod:`~stethoscope.callbacks._lightning.batch_reductions`; what a reduction is, in
:mod:`~stethoscope.callbacks._lightning.reduction`. The statistics gathered from every
rank where the ranks meet are not per step: their reductions (:class:`ReplicaChecksums`,
:class:`RankTiming`) hand the meeting this rank's values instead (``shared``).
"""

from __future__ import annotations

import math
import time
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
    checksums,
    magnitude_histograms,
    unit_layers,
)
from stethoscope.callbacks._lightning.precision import Fp8Fit, GradientPrecision
from stethoscope.callbacks._lightning.reduction import Reduction
from stethoscope.callbacks._lightning.shards import (
    flat_replicas,
    flat_slices,
    replicated,
    summed_over_groups,
    unwrapped_name,
    whole_checksums,
)
from stethoscope.callbacks._lightning.zero import zero_slices, zero_stage
from stethoscope.observation import Observation
from stethoscope.statistics import DISTRIBUTION_BINS

__all__ = [
    "Distributions",
    "GradNorms",
    "RankTiming",
    "ReductionSet",
    "ReplicaChecksums",
    "StaleGrads",
    "UnitRows",
    "UpdateNorms",
    "WeightNorms",
    "make_reductions",
    "watch_parameters",
]


class GradNorms(Reduction):
    """Each gradient's L2 norm, in one fused kernel per optimizer.

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
            measures.add("grads", norms, (kind, len(indices)), combine=combine)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        parts: dict[str, list[np.ndarray]] = {"norms": [], "reference": []}
        at = 0
        for kind, n in contexts:  # per optimizer: its norms, then any reference
            parts[kind].append(values[at : at + n])
            at += n
        obs.grad_norm = np.concatenate(parts["norms"])
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
    """How many parameters still hold a non-zero gradient when the step's first backward
    pass begins: one fused norm kernel (of the shards, combined, under sharding), counted
    on the host."""

    statistics = frozenset({"stale_grads"})
    name = "stale_grads"

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_backward(self, measures: StepMeasures, loss: torch.Tensor) -> None:
        probe = self.probe
        # as the optimizer steps count them: alike on every rank (see with_grad)
        held = probe.with_grad(range(len(probe.params)))
        if not held:
            measures.add("stale_grads", torch.zeros(1, device=probe.params[0].device))
            return
        norms = torch.stack(torch._foreach_norm([probe.grad(i) for i in held]))
        measures.add("stale_grads", norms, combine="norm")

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        obs.stale_grads = float(np.count_nonzero(values > 0))


class WeightNorms(Reduction):
    """Each parameter's L2 norm after the optimizer step."""

    statistics = frozenset({"weights"})
    name = "weights"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def at_end(self, measures: StepMeasures) -> None:
        if measures.params:
            measures.add("weights", self.probe.weight_norms(measures.params), combine="norm")

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


class ReplicaChecksums:
    """An exact checksum of every tensor the ranks hold alike, for the meeting to compare
    across ranks: under DDP, every replica's parameters (and the buffers DDP does not
    re-broadcast); with sharded parameters, those placed ``Replicate`` along some mesh
    dimension (HSDP's replicas), each summed over its shards first."""

    statistics = frozenset({"replicas"})

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        buffers: int,
        *,
        sharded: bool = False,
        groups: Sequence[Any] | None = None,
        grads: bool = False,
    ) -> None:
        self.tensors = [t for _, t in named]
        #: Whether each rank holds every parameter's whole gradient, as DDP's all-reduce
        #: leaves it: then the gradients the step used are compared too.
        self.grads = grads
        self.names = tuple(n for n, _ in named)
        self.buffer = np.array([False] * (len(named) - buffers) + [True] * buffers)
        self.sharded = sharded
        self.groups = groups  # FSDP1's hybrid strategies: each tensor's shard group

    @classmethod
    def of(cls, model: Any, module: torch.nn.Module) -> ReplicaChecksums | None:
        """What ``module``'s replicas compare under ``model`` (the strategy's wrapped model):
        under DDP, every parameter, and the buffers DDP does not overwrite from rank zero at
        each forward pass; with DTensor parameters, those held alike by several ranks.
        Under DeepSpeed's ZeRO below stage 3, every parameter: each rank holds it whole.
        Under FSDP1's hybrid strategies, every parameter, each rank's slices summed over
        its replica first. None where the ranks hold nothing alike to compare (FSDP2
        sharding every parameter, FSDP1's FULL_SHARD, ZeRO stage 3)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            buffers = [] if model.broadcast_buffers else list(module.named_buffers())
            return cls(list(module.named_parameters()) + buffers, len(buffers), grads=True)
        if zero_stage(model) in (0, 1, 2):  # the updated slices are gathered to every rank
            return cls(list(module.named_parameters()), 0)
        hybrid = flat_replicas(model)  # FSDP1's replicas, each sharded over a group
        if hybrid:
            held = [(unwrapped_name(n), p) for n, p in module.named_parameters() if id(p) in hybrid]
            return cls(held, 0, groups=[hybrid[id(p)] for _, p in held])
        alike = [(n, p) for n, p in module.named_parameters() if replicated(p)]
        return cls(alike, 0, sharded=True) if alike else None

    def shared(self) -> dict[str, Any]:
        if self.sharded:
            sums = whole_checksums(self.tensors, checksums([t.to_local() for t in self.tensors]))
        elif self.groups is not None:
            sums = summed_over_groups(self.groups, checksums(self.tensors))
        else:
            sums = checksums(self.tensors)
        shared = {
            "replica_sums": sums.cpu().numpy(),
            "replica_names": self.names,
            "replica_buffer": self.buffer,
        }
        if self.grads:  # after the step: the gradients it used, until the next zero_grad
            params = self.tensors[: len(self.tensors) - int(self.buffer.sum())]
            grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in params]
            sums = checksums(grads)
            shared["replica_grad_sums"] = sums.cpu().numpy()
        return shared


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
        #: The statistics measured just before a step's first backward pass: those of the
        #: reductions that have a ``before_backward`` (its hook is on where a plan names one).
        self.before_backward = frozenset(
            s
            for r in self.all
            if type(r).before_backward is not Reduction.before_backward
            for s in r.statistics
        )

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
        GradNorms(probe),
        UnitRows(probe, layers, batch.samples),
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
