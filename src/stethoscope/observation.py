"""What a framework adapter hands the monitor for one step: host-side numbers only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "EVENT_PROBES",
    "PROBES",
    "RANK_PROBES",
    "REPLICATED_PROBES",
    "SATURATION_BOUNDS",
    "Observation",
    "global_norm",
]

#: The probes an adapter can run. ``loss`` is the every-step sentinel; the
#: others reduce every parameter and run only on steps the sampler selects.
PROBES: tuple[str, ...] = (
    "loss",
    "grads",
    "weights",
    "updates",
    "units",
    "activations",
    "outputs",
    "inputs",
    "labels",
    "val",
    "trace",
    "replicas",
    "ranks",
)

#: Probes that arrive with an event (a validation) rather than being planned per step.
EVENT_PROBES: frozenset[str] = frozenset({"val"})

#: Probes gathered from every rank by the one collective of a distributed run's sampled
#: step (see :mod:`stethoscope.distributed`). No step computes them alone, so a single
#: process never has them, and the detectors that need them stay idle there.
RANK_PROBES: frozenset[str] = frozenset({"replicas", "ranks"})

#: Probes that are the same on every rank of a data-parallel (DDP) run: DDP all-reduces
#: the gradients before the optimizer step, so every replica holds the global gradient
#: and takes the same step (``replica_divergence`` checks that they do). Rank zero judges
#: them for everyone; the other ranks neither compute nor judge them.
REPLICATED_PROBES: frozenset[str] = frozenset({"grads", "weights", "updates", "units"})

#: Pre-activation magnitudes past which an activation counts as saturated: where its
#: local gradient falls below 1/5000 of its peak (tanh'(5) = 1.8e-4; the logistic
#: sigmoid is tanh at half the input, so its bound is twice as far). DeepDiagnosis uses
#: |x| >= 5; SageMaker Debugger's ±9.5 / (-23, 17) only flags float32 saturation to
#: exactly 1, far past the point where learning has stopped.
SATURATION_BOUNDS: dict[str, float] = {"tanh": 5.0, "sigmoid": 10.0}


@dataclass
class Observation:
    """The statistics of one optimizer step, reduced on the device, read once.

    Per-parameter arrays are aligned with ``names`` and are ``None`` when their
    probe did not run this step.

    Args:
        step: Global optimizer step (0-based).
        epoch: Training epoch (0-based).
        rank: Process rank (under Keras' ``MirroredStrategy``: the replica; see ``Finding``).
        loss: The training loss of the batch (NaN/Inf kept as is).
        lr: The learning rate of the first parameter group, if known.
        names: Parameter names, in registration order (input side first).
        numel: Number of elements of each parameter.
        is_matrix: Whether each parameter has two or more dimensions (a weight
            matrix or kernel rather than a bias or norm scale).
        grad_norm: L2 norm of each parameter's gradient, before clipping.
        weight_norm: L2 norm of each parameter after the optimizer step.
        update_norm: L2 norm of each parameter's change made by the step (NaN for a
            parameter not measured this step: large models take turns).
        prev_weight_norm: L2 norm of each parameter before the step (present with
            ``update_norm``; at step 0, the initialisation).
        fan_in: Inputs per output unit of each parameter that is the weight of a
            layer with units (dense, convolution); NaN for every other parameter.
        unoptimized: Parameters that require grad but that no optimizer updates.
        unit_names: Layers (with units) whose per-unit gradient flags follow.
        unit_zero: Per layer, whether each output unit's weight-gradient row was
            exactly zero this step (no sample of the batch passed through it).
        unit_samples: The samples behind those gradients (every micro-batch, every
            rank); 0 when the adapter does not know.
        act_names: Modules whose activations were observed, in forward order.
        act_kinds: ``"tanh"`` or ``"sigmoid"`` (their inputs were observed: the
            ``activations`` probe) or ``"layer"`` (a layer with units: its output
            was observed, the ``outputs`` probe).
        act_saturated: Fraction of each activation's inputs beyond
            :data:`SATURATION_BOUNDS` (NaN for layers).
        act_rms: Root mean square of each observed tensor.
        act_max: Largest absolute value of each observed tensor (0: all zero).
        input_sq: Per-feature mean of the batch's squared inputs (per channel for images).
        input_count: Samples behind ``input_sq``.
        labels: The batch's integer class labels, flattened.
        val_loss: A validation loss (set only on a validation observation).
        train_loss: Mean training loss since the previous validation.
        trace_names: Modules in the order their forward ran (the deep non-finite probe).
        trace_finite: Whether each of those modules' outputs was entirely finite.
        replica_names: The tensors of the replicas that are compared across ranks:
            every parameter, then the buffers DDP does not re-broadcast each step.
        replica_buffer: Whether each of those is a buffer (True) or a parameter.
        replica_sums: Checksum of each of those tensors on each rank, shape
            ``(world_size, len(replica_names))``: the int64 sum of the tensor's bit
            patterns, so any change to any element changes it, exactly.
        rank_busy: Mean seconds per batch each rank spent alone since they were last
            gathered (data loading and forward pass: the part of a step no collective
            waits in), shape ``(world_size,)``; NaN for a rank that timed no batch.
    """

    step: int
    epoch: int = 0
    rank: int = 0
    loss: float | None = None
    lr: float | None = None
    names: tuple[str, ...] = ()
    numel: np.ndarray | None = None
    is_matrix: np.ndarray | None = None
    grad_norm: np.ndarray | None = None
    weight_norm: np.ndarray | None = None
    update_norm: np.ndarray | None = None
    prev_weight_norm: np.ndarray | None = None
    fan_in: np.ndarray | None = None
    unoptimized: tuple[str, ...] = ()
    unit_names: tuple[str, ...] = ()
    unit_zero: tuple[np.ndarray, ...] | None = None
    unit_samples: int = 0
    act_names: tuple[str, ...] = ()
    act_kinds: tuple[str, ...] = ()
    act_saturated: np.ndarray | None = None
    act_rms: np.ndarray | None = None
    act_max: np.ndarray | None = None
    input_sq: np.ndarray | None = None
    input_count: int = 0
    labels: np.ndarray | None = None
    val_loss: float | None = None
    train_loss: float | None = None
    trace_names: tuple[str, ...] = ()
    trace_finite: np.ndarray | None = None
    replica_names: tuple[str, ...] = ()
    replica_buffer: np.ndarray | None = None
    replica_sums: np.ndarray | None = None
    rank_busy: np.ndarray | None = None

    def has(self, probe: str) -> bool:
        """Whether the data of ``probe`` is present."""
        if probe == "loss":
            return self.loss is not None
        return getattr(self, _PROBE_FIELD[probe]) is not None


_PROBE_FIELD = {
    "grads": "grad_norm",
    "weights": "weight_norm",
    "updates": "update_norm",
    "units": "unit_zero",
    "activations": "act_rms",
    "outputs": "act_rms",
    "inputs": "input_sq",
    "labels": "labels",
    "val": "val_loss",
    "trace": "trace_finite",
    "replicas": "replica_sums",
    "ranks": "rank_busy",
}


def global_norm(norms: np.ndarray) -> float:
    """The L2 norm of all tensors together, from their individual L2 norms."""
    return float(np.sqrt(np.sum(np.square(norms, dtype=np.float64))))
