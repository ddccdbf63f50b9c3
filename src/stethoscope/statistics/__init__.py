"""Every statistic an adapter can measure, declared once.

A *statistic* is what a detector asks for in ``needs`` (``"grads"``, ``"labels"`` …):
a few :class:`~stethoscope.Observation` fields measured together, by one reduction
in each framework's adapter. Its declaration here says everything the framework-free
core needs to know about it:

- ``fields``: the :class:`~stethoscope.Observation` fields it fills (the observation
  class is built from these declarations; see :mod:`stethoscope.observation`);
- ``cadence``: when it is measured: every step, on the steps the sampler selects, with
  an event (a validation), or where the ranks of a distributed run meet;
- ``across_ranks``: how the ranks of a distributed (DDP) run combine it;
- ``across_replicas``: how the replicas of one process (Keras' ``MirroredStrategy``)
  combine it.

From these the monitor plans each step's probes, idles the detectors a rank need not
run, and lays out what the ranks exchange when they meet. Adding a statistic is one
:class:`Statistic` here, one reduction per framework adapter (measuring it on the
device and decoding it into its fields, side by side), and the detector that reads
it; ``docs/design.md`` walks through one such change.
"""

from __future__ import annotations

from dataclasses import MISSING

from stethoscope.statistics.declaration import (
    ARRAY,
    AcrossRanks,
    AcrossReplicas,
    Cadence,
    Field,
    Statistic,
)
from stethoscope.statistics.precision import PRECISION_STATISTICS
from stethoscope.statistics.predictions import PREDICTIONS
from stethoscope.statistics.validation import VALIDATION_STATISTICS

__all__ = [
    "CORE_FIELDS",
    "DISTRIBUTION_BINS",
    "DISTRIBUTION_EDGES",
    "EVENT",
    "EVERY_STEP",
    "GATHERED",
    "MAX_FEATURES",
    "PLANNED",
    "REPLICATED",
    "SATURATION_BOUNDS",
    "STATISTICS",
    "AcrossRanks",
    "AcrossReplicas",
    "Cadence",
    "Field",
    "Statistic",
    "judged_elsewhere",
    "with_requirements",
]


_ARRAY = ARRAY

#: Fields every observation has, whatever was measured: where and when it was taken,
#: and (with any per-parameter statistic) which parameters its arrays describe.
CORE_FIELDS: tuple[Field, ...] = (
    Field("step", "int", "Global optimizer step (0-based).", default=MISSING),
    Field("epoch", "int", "Training epoch (0-based).", default=0),
    Field(
        "rank",
        "int",
        "Process rank (under Keras' ``MirroredStrategy``: the replica; see ``Finding``).",
        default=0,
    ),
    Field(
        "lr",
        "float | None",
        "The learning rate the step's update was taken at (the first parameter group's), if known.",
    ),
    Field(
        "names",
        "tuple[str, ...]",
        "Parameter names, in registration order (input side first); the per-parameter "
        "arrays below are aligned with them.",
        default=(),
    ),
    Field("numel", _ARRAY, "Number of elements of each parameter."),
    Field(
        "is_matrix",
        _ARRAY,
        "Whether each parameter has two or more dimensions (a weight matrix or kernel "
        "rather than a bias or norm scale).",
    ),
    Field(
        "fan_in",
        _ARRAY,
        "Inputs per output unit of each parameter that is the weight of a layer with units "
        "(dense, convolution); NaN for every other parameter.",
    ),
    Field(
        "dtypes",
        "tuple[str, ...]",
        'The dtype each parameter is held in (``"float32"``, ``"bfloat16"``…); its gradient '
        "is held in the same.",
        default=(),
    ),
    Field(
        "unoptimized",
        "tuple[str, ...]",
        "Parameters that require grad but that no optimizer updates (the Lightning adapter: "
        "those of them that got a gradient at the step).",
        default=(),
    ),
    Field(
        "idle_held",
        "tuple[str, ...]",
        "At a step whose optimizers stepped no parameter that had a gradient: what they hold "
        'instead, each in a few words (``"head.weight (requires_grad=False)"``).',
        default=(),
    ),
)

#: The fields of the forward probes: ``activations`` and ``outputs`` fill the same
#: rows, told apart by ``act_kinds``.
_FORWARD_FIELDS: tuple[Field, ...] = (
    Field("act_rms", _ARRAY, "Root mean square of each observed tensor."),
    Field("act_names", "tuple[str, ...]", "Modules observed, in forward order.", default=()),
    Field(
        "act_kinds",
        "tuple[str, ...]",
        '``"tanh"`` or ``"sigmoid"`` (their inputs were observed: the ``activations`` '
        'statistic) or ``"layer"`` (a layer with units: its output was observed, the '
        "``outputs`` statistic).",
        default=(),
    ),
    Field(
        "act_saturated",
        _ARRAY,
        "Fraction of each activation's inputs beyond ``SATURATION_BOUNDS`` (NaN for layers).",
    ),
    Field("act_max", _ARRAY, "Largest absolute value of each observed tensor (0: all zero)."),
    Field("act_dtypes", "tuple[str, ...]", "The dtype of each observed tensor.", default=()),
)

#: The edges of the magnitude bins of the ``distributions`` statistic. A histogram
#: counts, in order: exact zeros; |x| in (0, 1e-12]; each half-decade up to (10**3.5,
#: 1e4]; (1e4, inf); then non-finite values: :data:`DISTRIBUTION_BINS` numbers.
#: Half-decades resolve what matters for a gradient's flow (a layer sliding from 1e-3 to
#: 1e-6) in a few dozen numbers per parameter, whatever its size, and fixed edges make
#: histograms of different steps and layers comparable as they are.
DISTRIBUTION_EDGES: tuple[float, ...] = tuple(10.0 ** (k / 2) for k in range(-24, 9))
#: Bins of each histogram of the ``distributions`` statistic (see the edges above).
DISTRIBUTION_BINS = len(DISTRIBUTION_EDGES) + 3

STATISTICS: dict[str, Statistic] = {
    s.name: s
    for s in (
        Statistic(
            "loss",
            "The training loss of each step: the every-step sentinel.",
            (
                Field(
                    "loss", "float | None", "The loss of the batch (NaN and Inf kept as they are)."
                ),
            ),
            cadence=Cadence.STEP,
            across_replicas=AcrossReplicas.SUM,
        ),
        Statistic(
            "grads",
            "Each parameter's gradient norm, and the samples behind the gradients.",
            (
                Field(
                    "grad_norm", _ARRAY, "L2 norm of each parameter's gradient, before clipping."
                ),
                Field(
                    "grad_samples",
                    "int",
                    "The samples behind those gradients (every micro-batch, every rank): a "
                    "loss summed over a batch has a gradient that grows with it; 0 when the "
                    "adapter does not know.",
                    default=0,
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
        ),
        Statistic(
            "weights",
            "Each parameter's norm after the optimizer step.",
            (Field("weight_norm", _ARRAY, "L2 norm of each parameter after the optimizer step."),),
            across_ranks=AcrossRanks.REPLICATED,
        ),
        Statistic(
            "updates",
            "How far the optimizer step moved each parameter.",
            (
                Field(
                    "update_norm",
                    _ARRAY,
                    "L2 norm of each parameter's change made by the step (NaN for a "
                    "parameter not measured this step: large models take turns).",
                ),
                Field(
                    "prev_weight_norm",
                    _ARRAY,
                    "L2 norm of each parameter before the step (present with "
                    "``update_norm``; at step 0, the initialisation).",
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
            requires=frozenset({"weights"}),  # an update is judged against the weights
        ),
        Statistic(
            "units",
            "Which output units of each dense or convolution layer got no gradient.",
            (
                Field(
                    "unit_zero",
                    "tuple[np.ndarray, ...] | None",
                    "Per layer, whether each output unit's weight-gradient row was exactly "
                    "zero this step (no sample of the batch passed through it).",
                ),
                Field(
                    "unit_names",
                    "tuple[str, ...]",
                    "Layers (with units) whose per-unit gradient flags follow.",
                    default=(),
                ),
                Field(
                    "unit_samples",
                    "int",
                    "The samples behind those gradients (every micro-batch, every rank); 0 "
                    "when the adapter does not know.",
                    default=0,
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
        ),
        Statistic(
            "activations",
            "How saturated the inputs of tanh and sigmoid activations are.",
            _FORWARD_FIELDS,
            across_replicas=AcrossReplicas.POOLED,
        ),
        Statistic(
            "outputs",
            "The scale of each dense or convolution layer's output.",
            _FORWARD_FIELDS,
            across_replicas=AcrossReplicas.POOLED,
        ),
        Statistic(
            "inputs",
            "The scale of the batch's input features.",
            (
                Field(
                    "input_sq",
                    _ARRAY,
                    "Per-feature mean of the batch's squared inputs (per channel for images).",
                ),
                Field("input_count", "int", "Samples behind ``input_sq``.", default=0),
            ),
            across_replicas=AcrossReplicas.POOLED,
        ),
        Statistic(
            "labels",
            "The batch's class labels.",
            (Field("labels", _ARRAY, "The batch's integer class labels, flattened."),),
            across_replicas=AcrossReplicas.COUNTS,
        ),
        Statistic(
            "prints",
            "A fingerprint of each sample of the batch's inputs, and the order the loader "
            "was asked for.",
            (
                Field(
                    "sample_prints",
                    _ARRAY,
                    "A fingerprint of each of the batch's first samples (at most "
                    "``MAX_PRINTS``, fewer where they are wide: a bounded read, see "
                    ":mod:`stethoscope.prints`), in order: equal samples have equal prints, "
                    "and different ones almost surely differ.",
                ),
                Field(
                    "data_order",
                    "str",
                    'The order the training loader was asked for: ``"shuffle"`` (a random '
                    'sampler), ``"sequential"`` (shuffling turned off) or ``""`` (unknown: '
                    "an iterable dataset, a custom sampler, Keras).",
                    default="",
                ),
            ),
        ),
        PREDICTIONS,  # in its place: the observation's fields keep their order
        Statistic(
            "loss_graph",
            "Whether the loss's last operations broadcast a prediction against a target of "
            "another shape.",
            (
                Field(
                    "loss_broadcast",
                    "str | None",
                    "Where one of the loss's last operations made an ``(M, M)`` square of "
                    "an ``(M, 1)`` prediction and an ``(M,)`` target, the shapes in words "
                    '(``""``: none did).',
                ),
            ),
        ),
        *VALIDATION_STATISTICS,  # in their place: the observation's fields keep their order
        Statistic(
            "stale_grads",
            "How many parameters still held a gradient from before the step when its first "
            "backward pass began.",
            (
                Field(
                    "stale_grads",
                    "float | None",
                    "The watched parameters whose gradient was not zero (nor None) when the "
                    "step's first backward pass began: zeroing leaves none.",
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
            requires=frozenset({"grads"}),
        ),
        Statistic(
            "train_mode",
            "The modules found in eval mode during a training step.",
            (
                Field(
                    "eval_modules",
                    "tuple[str, ...] | None",
                    "The modules in eval mode at a training step's start: the model itself "
                    "(``<model>``) when it is, then each dropout module, and each batch "
                    "norm whose scale and shift still train (empty: none).",
                ),
                Field(
                    "bypassed_train",
                    "str | None",
                    "At the first step measured: what the model's own ``train()`` "
                    "overrides would do and have not done, in words (empty: nothing); "
                    "None on every later step.",
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
        ),
        Statistic(
            "val",
            "A validation loss, with the mean training loss since the last one.",
            (
                Field("val_loss", "float | None", "A validation loss (set only on a validation)."),
                Field(
                    "train_loss",
                    "float | None",
                    "Mean training loss since the previous validation.",
                ),
                Field(
                    "start_loss",
                    "float | None",
                    "The run's first finite training loss: where the task started.",
                ),
            ),
            cadence=Cadence.EVENT,
            across_ranks=AcrossRanks.POOLED,
            across_replicas=AcrossReplicas.NONE,
        ),
        Statistic(
            "trace",
            "Which modules' outputs were finite, in forward order (where a NaN began).",
            (
                Field(
                    "trace_finite",
                    _ARRAY,
                    "Whether each of those modules' outputs was entirely finite.",
                ),
                Field(
                    "trace_names",
                    "tuple[str, ...]",
                    "Modules in the order their forward ran.",
                    default=(),
                ),
            ),
            across_replicas=AcrossReplicas.POOLED,
        ),
        Statistic(
            "distributions",
            "A histogram of each parameter's weights and gradients by magnitude.",
            (
                Field(
                    "weight_hist",
                    _ARRAY,
                    "Per parameter, a histogram of its weights' magnitudes after the step, "
                    "shape ``(parameters, DISTRIBUTION_BINS)``: exact zeros, the magnitude "
                    "bins of ``DISTRIBUTION_EDGES``, then non-finite values.",
                ),
                Field(
                    "grad_hist",
                    _ARRAY,
                    "The same histogram of each parameter's gradient (before clipping).",
                ),
            ),
            across_ranks=AcrossRanks.REPLICATED,
        ),
        Statistic(
            "replicas",
            "An exact checksum of every replica's weights, per rank.",
            (
                Field(
                    "replica_sums",
                    _ARRAY,
                    "Checksum of each compared tensor on each rank, shape ``(world_size, "
                    "len(replica_names))``: the int64 sum of the tensor's bit patterns, so any "
                    "change to any element changes it, exactly.",
                    dtype="int64",
                ),
                Field(
                    "replica_names",
                    "tuple[str, ...]",
                    "The tensors compared across ranks: every parameter, then the buffers "
                    "DDP does not re-broadcast each step.",
                    default=(),
                ),
                Field(
                    "replica_buffer",
                    _ARRAY,
                    "Whether each of those is a buffer (True) or a parameter.",
                ),
            ),
            cadence=Cadence.MEETING,
            across_ranks=AcrossRanks.GATHERED,
            across_replicas=AcrossReplicas.NONE,
        ),
        Statistic(
            "replica_grads",
            "An exact checksum of every replica's gradients as the step used them, per rank.",
            (
                Field(
                    "replica_grad_sums",
                    _ARRAY,
                    "Checksum of each parameter's gradient (of ``replica_names``' parameters, "
                    "0 for none) on each rank after the step, shape ``(world_size, "
                    "parameters)``: under DDP's all-reduce every rank holds the same.",
                    dtype="int64",
                ),
            ),
            cadence=Cadence.MEETING,
            across_ranks=AcrossRanks.GATHERED,
            across_replicas=AcrossReplicas.NONE,
        ),
        Statistic(
            "ranks",
            "How long each rank spent alone per batch.",
            (
                Field(
                    "rank_busy",
                    _ARRAY,
                    "Mean seconds per batch each rank spent alone since they were last "
                    "gathered (data loading and forward pass: the part of a step no "
                    "collective waits in), shape ``(world_size,)``; NaN for a rank that "
                    "timed no batch.",
                ),
            ),
            cadence=Cadence.MEETING,
            across_ranks=AcrossRanks.GATHERED,
            across_replicas=AcrossReplicas.NONE,
        ),
        *PRECISION_STATISTICS,
    )
}

#: Pre-activation magnitudes past which an activation counts as saturated: where its
#: local gradient falls below 1/5000 of its peak (tanh'(5) = 1.8e-4; the logistic
#: sigmoid is tanh at half the input, so its bound is twice as far). DeepDiagnosis uses
#: |x| >= 5; SageMaker Debugger's ±9.5 / (-23, 17) only flags float32 saturation to
#: exactly 1, far past the point where learning has stopped.
SATURATION_BOUNDS: dict[str, float] = {"tanh": 5.0, "sigmoid": 10.0}


#: Per-feature input statistics beyond this many features collapse to one number (a
#: wider input is judged as a whole): a bound on what a sampled step sends to the host.
MAX_FEATURES = 4096


def _names(*, cadence: Cadence | None = None, ranks: AcrossRanks | None = None) -> frozenset:
    return frozenset(
        s.name
        for s in STATISTICS.values()
        if (cadence is None or s.cadence is cadence) and (ranks is None or s.across_ranks is ranks)
    )


#: Statistics measured on every step (the sentinel).
EVERY_STEP: frozenset[str] = _names(cadence=Cadence.STEP)
#: Statistics that arrive with an event (a validation), never planned per step.
EVENT: frozenset[str] = _names(cadence=Cadence.EVENT)
#: Statistics gathered from every rank where the ranks meet: a single process never has
#: them, so the detectors that need them stay idle there.
GATHERED: frozenset[str] = _names(cadence=Cadence.MEETING)
#: Statistics every rank of a data-parallel run holds alike: rank zero judges them.
REPLICATED: frozenset[str] = _names(ranks=AcrossRanks.REPLICATED)
#: Statistics an adapter measures on the steps it is asked to (every step or sampled).
PLANNED: frozenset[str] = frozenset(STATISTICS) - EVENT - GATHERED


def judged_elsewhere(*, rank: int, world_size: int, replicated: bool) -> frozenset[str]:
    """The statistics ``rank`` of ``world_size`` leaves to rank zero to judge: what every
    rank holds alike (:data:`REPLICATED`), off rank zero of a run whose ranks hold the
    same gradients and weights (``replicated``); none elsewhere."""
    return REPLICATED if world_size > 1 and rank != 0 and replicated else frozenset()


def with_requirements(names: frozenset[str] | set[str]) -> frozenset[str]:
    """``names`` and every statistic they require, transitively."""
    out = set(names)
    todo = list(out)
    while todo:
        for required in STATISTICS[todo.pop()].requires - out:
            out.add(required)
            todo.append(required)
    return frozenset(out)
