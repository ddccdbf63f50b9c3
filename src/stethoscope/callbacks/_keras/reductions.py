"""The Keras adapter's reduction of each statistic: what the train step computes, where
it leaves it, and how the host decodes it into observation fields, side by side.

Each :class:`KerasReduction` serves a statistic of :mod:`stethoscope.statistics` (the
forward rows serve three at once). It declares the variables it writes (its
:class:`~stethoscope.callbacks._keras.variables.Slot`\\ s), the switch the host flips
for it (its ``group``), and the points of the train step where it measures (its
``hooks``), where the probe calls it inside its switch:

- ``"batch"``: :meth:`~KerasReduction.on_batch` with the batch's inputs, targets and
  predictions (in ``compute_loss``);
- ``"gradients"``: :meth:`~KerasReduction.on_gradients` with the gradients the
  optimizer applies, by variable position (summed across replicas under a strategy);
- ``"before_update"``: :meth:`~KerasReduction.before_update` with the variables about
  to be updated, to keep what the reduction compares against;
- ``"update"``: :meth:`~KerasReduction.on_update` with the weights after the update,
  and what ``before_update`` kept;
- ``"layer"``: :meth:`~KerasReduction.on_layer` with a leaf layer's output;
- ``"test_batch"``: :meth:`~KerasReduction.on_test_batch` with a test step's inputs (a
  validation's, within ``fit``), outside any switch: it runs only where a detector reads
  a validation's statistics.

A reduction hands its tensors to a :class:`Store`, which writes them where the regime
says (a variable, or the step's own outputs); :meth:`~KerasReduction.decode` reads them
back on the host through a :class:`ReadBack`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import keras
import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import BY_REPLICAS, Slot
from stethoscope.observation import Observation
from stethoscope.prints import MAX_PRINTS, join_prints
from stethoscope.statistics import DISTRIBUTION_BINS, MAX_FEATURES, STATISTICS

__all__ = [
    "NOT_IN_FIT",
    "ClassLabels",
    "Distributions",
    "ForwardRows",
    "GradNorms",
    "InputScale",
    "KerasReduction",
    "Layout",
    "ReadBack",
    "SamplePrints",
    "Store",
    "UnitRows",
    "UpdateNorms",
    "WeightNorms",
    "slots_of",
    "snapshotted",
    "value_before",
]

#: Statistics of mistakes Keras' ``fit`` cannot make, which no Keras reduction measures:
#: it passes ``training=True`` to every layer (no model left in eval mode), takes each
#: step's gradients afresh from the tape (none left unzeroed), and its losses bring the
#: target and the prediction to the same rank before they meet (no broadcast square).
NOT_IN_FIT = frozenset({"train_mode", "stale_grads", "loss_graph"})


@dataclass(frozen=True)
class Layout:
    """What the probe watches in a model, fixed for its life.

    Args:
        names: The trainable variables' paths, in the model's order.
        shapes: Their shapes.
        numel: Their elements.
        is_matrix: Whether each has two or more dimensions.
        fan_in: Inputs per output unit of each kernel of a layer with units; NaN elsewhere.
        unit_layers: ``(layer, position of its kernel, units)`` of each dense or
            convolution layer.
        forward_layers: ``(layer, "tanh" / "sigmoid" / None, whether it has units)`` of
            each leaf layer whose output is read (a forward row each).
        snapshot: Positions of the variables whose update is measured (a budget of
            elements, in order).
        input_scaling: The layers the model scales its input with first (see
            ``layers.input_scaling``): the inputs are measured after them.
        dtypes: The dtype each variable is held in, by name (``"bfloat16"``).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: np.ndarray
    is_matrix: np.ndarray
    fan_in: np.ndarray
    unit_layers: tuple[tuple[str, int, int], ...]
    forward_layers: tuple[tuple[str, str | None, bool], ...]
    snapshot: frozenset[int]
    input_scaling: tuple[Any, ...] = ()
    dtypes: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.names)


class Store(Protocol):
    """Where a reduction's tensors go (the probe implements it for the regime)."""

    layout: Layout

    def variable(self, name: str) -> Any:
        """The probe's variable of slot ``name`` (to read or assign in the graph)."""

    def put(self, name: str, value: Any) -> None:
        """Record ``value`` as slot ``name``'s value for this step."""

    def put_row(self, name: str, row: int, value: Any) -> None:
        """Record ``value`` as row ``row`` of slot ``name``."""

    def gradients(self) -> dict[int, Any]:
        """The gradients the step hands the optimizer, by variable position (from the
        ``"gradients"`` hook on; as they are, a loss scale in them)."""

    def loss_scale(self) -> Any:
        """The step's :class:`~stethoscope.callbacks._keras.loss_scale.ScaleStep` (from
        the ``"update"`` hook on), or None without a ``LossScaleOptimizer``."""


class ReadBack(Protocol):
    """The host's view of what a step measured."""

    regime: Regime
    layout: Layout
    #: The loss ring of the last execution (a direct ring: the loss, then each
    #: variable's gradient sum of squares over 2).
    last_ring: np.ndarray
    #: Samples per batch, once the inputs were measured (0: unknown).
    batch_samples: int

    def read(self, name: str) -> np.ndarray:
        """Slot ``name`` on the host (combined across replicas)."""


class KerasReduction:
    """The measuring, storing and decoding of one statistic (or a few sharing a probe)."""

    #: The statistics it serves.
    statistics: ClassVar[frozenset[str]] = frozenset()
    #: The switch the host flips for it.
    group: ClassVar[str] = ""
    #: Other switches its graph code runs under (it measures inside their branch).
    requires: ClassVar[frozenset[str]] = frozenset()
    #: Where the train step calls it: "batch", "gradients", "before_update", "update",
    #: "layer"; and "test_batch", where the test step does.
    hooks: ClassVar[frozenset[str]] = frozenset()
    #: Whether its fields are per parameter (read only on the step actually sampled).
    per_parameter: ClassVar[bool] = False

    def in_ring(self, regime: Regime) -> bool:
        """Whether every step's ring carries what it measures in ``regime``, so that a step
        planning it alone runs the light function."""
        return False

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        """The variables it writes (a slot that names no ``combine`` gets its statistic's:
        see :func:`slots_of`)."""
        return []

    def on_batch(self, store: Store, x: Any, y: Any, y_pred: Any) -> None:
        raise NotImplementedError

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        """Measure ``grads`` (by variable position), which still carry the loss scale
        ``scale`` (a number or a scalar tensor; None: none)."""
        raise NotImplementedError

    def on_test_batch(self, store: Store, x: Any) -> None:
        raise NotImplementedError

    def before_update(self, store: Store, tvars: list[Any]) -> Any:
        """Keep what :meth:`on_update` compares against; called before the update."""
        return None

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        raise NotImplementedError

    def on_layer(self, store: Store, row: int, t: Any) -> None:
        raise NotImplementedError

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        """Fill ``obs`` (per-parameter arrays at positions ``idx``) from the step."""
        raise NotImplementedError


class GradNorms(KerasReduction):
    """Each gradient's L2 norm. A direct ring carries every gradient's sum of squares on
    every step anyway: the host takes the norms from it, and the graph computes none."""

    statistics = frozenset({"grads"})
    group = "grads"
    hooks = frozenset({"gradients"})
    per_parameter = True

    def __init__(self, regime: Regime) -> None:
        self.regime = regime

    def in_ring(self, regime: Regime) -> bool:
        return regime.direct

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [] if regime.direct else [Slot("grad_norm", (layout.count,), np.nan)]

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        if self.regime.direct:
            return
        count = store.layout.count
        norms = kops.norms({pos: kops.half_square(g) for pos, g in grads.items()}, count)
        store.put("grad_norm", norms / scale if scale is not None else norms)

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        direct = src.regime.direct
        norms = np.sqrt(2.0 * src.last_ring[1:]) if direct else src.read("grad_norm")
        obs.grad_norm = norms[idx].astype(np.float64)


class UnitRows(KerasReduction):
    """Which output units of each dense or convolution layer got an exactly-zero
    gradient (the last axis of the kernel holds the units)."""

    statistics = frozenset({"units"})
    group = "units"
    hooks = frozenset({"gradients"})
    per_parameter = True

    def __init__(self, layout: Layout) -> None:
        self.layers = layout.unit_layers

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        units = sum(n for _, _, n in layout.unit_layers)
        return [Slot("unit_zero", (max(units, 1),), 0.0)]

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        if self.layers:
            kernels = [grads.get(pos) for _, pos, _ in self.layers]
            store.put("unit_zero", kops.unit_zero_rows(kernels, [n for _, _, n in self.layers]))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        if not self.layers:
            return
        zero = src.read("unit_zero")
        cuts = np.cumsum([n for _, _, n in self.layers])[:-1]
        kept = set(idx.tolist())
        parts = [
            (name, part.astype(bool))
            for (name, pos, _), part in zip(self.layers, np.split(zero, cuts), strict=True)
            if pos in kept
        ]
        obs.unit_names = tuple(name for name, _ in parts)
        obs.unit_zero = tuple(part for _, part in parts)
        obs.unit_samples = src.batch_samples


class WeightNorms(KerasReduction):
    """Each variable's L2 norm after the update."""

    statistics = frozenset({"weights"})
    group = "weights"
    hooks = frozenset({"update"})
    per_parameter = True

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [Slot("weight_norm", (layout.count,), np.nan)]

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        count = store.layout.count
        store.put(
            "weight_norm", kops.norms({p: kops.half_square(w) for p, w in now.items()}, count)
        )

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        obs.weight_norm = src.read("weight_norm")[idx].astype(np.float64)


class UpdateNorms(KerasReduction):
    """How far the update moved each variable (within the snapshot budget), and its norm
    before. In a whole heavy function the weights before the update are the step's own
    reads (TensorFlow copies a variable on write while a read of it is alive: one copy
    of the weights); elsewhere (inside a cond, or eager, where a read is the live tensor)
    they are copied into snapshot variables of the probe first."""

    statistics = frozenset({"updates"})
    group = "updates"
    requires = frozenset({"weights"})  # measured after the update, with the weights
    hooks = frozenset({"before_update", "update"})
    per_parameter = True

    def __init__(self, layout: Layout, regime: Regime, position: dict[int, int]) -> None:
        self.snapshot = layout.snapshot
        self.whole = regime.whole
        self.position = position

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        out = [
            Slot("update_norm", (layout.count,), np.nan),
            Slot("prev_weight_norm", (layout.count,), np.nan),
        ]
        if not regime.whole:
            out += [
                Slot(f"snapshot_{pos}", layout.shapes[pos], 0.0, returned=False)
                for pos in sorted(layout.snapshot)
            ]
        return out

    def before_update(self, store: Store, tvars: list[Any]) -> Any:
        chosen = snapshotted(tvars, self.position, self.snapshot)
        if self.whole:
            return {pos: kops.value(v) for pos, v in chosen}
        for pos, v in chosen:
            store.variable(f"snapshot_{pos}").assign(v)
        return None

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        changes: dict[int, Any] = {}
        prev: dict[int, Any] = {}
        for pos, w in now.items():
            if pos not in self.snapshot:
                continue
            old = ops.cast(value_before(store, before, pos), "float32")
            changes[pos] = kops.half_square(ops.subtract(ops.cast(w, "float32"), old))
            prev[pos] = kops.half_square(old)
        count = store.layout.count
        store.put("update_norm", kops.norms(changes, count))
        store.put("prev_weight_norm", kops.norms(prev, count))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        obs.update_norm = src.read("update_norm")[idx].astype(np.float64)
        obs.prev_weight_norm = src.read("prev_weight_norm")[idx].astype(np.float64)


class Distributions(KerasReduction):
    """A magnitude histogram of each gradient the optimizer applies and of each variable
    after the update, on the bins of ``DISTRIBUTION_EDGES``."""

    statistics = frozenset({"distributions"})
    group = "distributions"
    hooks = frozenset({"gradients", "update"})
    per_parameter = True

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        shape = (layout.count, DISTRIBUTION_BINS)
        return [Slot("grad_hist", shape, np.nan), Slot("weight_hist", shape, np.nan)]

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        if scale is not None:
            grads = {pos: g / scale for pos, g in grads.items()}
        store.put("grad_hist", _histograms(grads, store.layout.count))

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        store.put("weight_hist", _histograms(now, store.layout.count))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        obs.grad_hist = src.read("grad_hist")[idx].astype(np.float64)
        obs.weight_hist = src.read("weight_hist")[idx].astype(np.float64)


class InputScale(KerasReduction):
    """The per-feature mean square of the batch's inputs, and the batch's shape."""

    statistics = frozenset({"inputs"})
    group = "inputs"
    hooks = frozenset({"batch"})

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [
            Slot("input_sq", (MAX_FEATURES,), np.nan, combine="sample_mean"),
            Slot("input_shape", (2,), 0, "int64", combine="features_samples"),
        ]

    def on_batch(self, store: Store, x: Any, y: Any, y_pred: Any) -> None:
        stats = kops.input_stats(x, MAX_FEATURES, store.layout.input_scaling)
        if stats is not None:
            store.put("input_sq", stats[0])
            store.put("input_shape", stats[1])

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        features, samples = (int(v) for v in src.read("input_shape"))
        if samples > 0:
            # the batch's samples (every replica's), as a unit's gradient row sees them:
            # fit's batches keep one size, so later sampled steps reuse it; this step's
            # unit rows were decoded before, when the size was not known yet
            src.batch_samples = obs.unit_samples = samples
        if samples > 0 and 0 < features <= MAX_FEATURES:
            obs.input_sq = src.read("input_sq")[:features].astype(np.float64)
            obs.input_count = samples


class ClassLabels(KerasReduction):
    """The batch's class counts (see :func:`~stethoscope.callbacks._keras.ops.label_histogram`)."""

    statistics = frozenset({"labels"})
    group = "labels"
    hooks = frozenset({"batch"})

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [Slot("label_hist", (kops.MAX_CLASSES + 3,), 0.0)]

    def on_batch(self, store: Store, x: Any, y: Any, y_pred: Any) -> None:
        hist = kops.label_histogram(y)
        if hist is not None:
            store.put("label_hist", hist)

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        hist = src.read("label_hist")
        counts, too_many, valid = hist[: kops.MAX_CLASSES], hist[-2], hist[-1]
        if valid == 1.0 and too_many == 0 and counts.sum() > 0:
            obs.labels = np.repeat(np.arange(kops.MAX_CLASSES), counts.astype(np.int64))


class SamplePrints(KerasReduction):
    """A fingerprint of each sample of the batch's inputs (see
    :func:`~stethoscope.callbacks._keras.ops.sample_prints`), and of a validation's first
    ``VAL_ROWS`` batches (written by the test step, read once the validation is over). The
    order the data was asked for is the callback's to tell (``fit_call.data_order``)."""

    statistics = frozenset({"prints"})
    group = "prints"
    hooks = frozenset({"batch", "test_batch"})
    #: Validation batches printed per validation at most (a later one takes the last row).
    VAL_ROWS = 8

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        # under a strategy, the first replica's shard: a batch served again is served
        # again in every shard, and a validation's shard holds its samples as well
        return [
            Slot("sample_prints", (2 * MAX_PRINTS,), np.nan, combine="first"),
            Slot(
                "val_prints",
                (self.VAL_ROWS, 2 * MAX_PRINTS),
                np.nan,
                combine="first",
                returned=False,
            ),
            Slot("val_printed", (1,), 0.0, combine="first", returned=False),
        ]

    def on_batch(self, store: Store, x: Any, y: Any, y_pred: Any) -> None:
        prints = kops.sample_prints(x, MAX_PRINTS)
        if prints is not None:
            store.put("sample_prints", prints)

    def on_test_batch(self, store: Store, x: Any) -> None:
        """Write the prints of a test step's batch into the next row of ``val_prints``
        (the last row, once they are all written)."""
        prints = kops.sample_prints(x, MAX_PRINTS)
        if prints is None:
            return
        printed, rows = store.variable("val_printed"), store.variable("val_prints")
        row = ops.minimum(ops.cast(printed[0], "int32"), self.VAL_ROWS - 1)
        kops.put(rows, row, prints)
        printed.assign(printed + 1.0)

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        pairs = src.read("sample_prints")
        pairs = pairs[~np.isnan(pairs)]
        if pairs.size:
            obs.sample_prints = join_prints(pairs)


class ForwardRows(KerasReduction):
    """One row per watched leaf layer's output (see
    :func:`~stethoscope.callbacks._keras.ops.forward_row`): the saturation of tanh and
    sigmoid layers (``activations``), the scale of layers with units (``outputs``), and
    whether each layer's output was finite (``trace``)."""

    statistics = frozenset({"activations", "outputs", "trace"})
    group = "forward"
    hooks = frozenset({"layer"})

    def __init__(self, layout: Layout) -> None:
        self.layers = layout.forward_layers
        #: The dtype of each row's layer output, as the step was traced (by row).
        self.dtypes: dict[int, str] = {}

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        rows = (max(len(layout.forward_layers), 1), kops.ROW)
        return [Slot("forward_rows", rows, np.nan, combine="forward")]

    def reads(self, row: int, planned: frozenset[str]) -> bool:
        """Whether a statistic of ``planned`` reads forward row ``row``."""
        _, kind, units = self.layers[row]
        return (
            "trace" in planned
            or ("activations" in planned and kind is not None)
            or ("outputs" in planned and units)
        )

    def on_layer(self, store: Store, row: int, t: Any) -> None:
        self.dtypes[row] = keras.backend.standardize_dtype(t.dtype)
        store.put_row("forward_rows", row, kops.forward_row(t, self.layers[row][1]))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        if not self.layers:
            return
        rows = src.read("forward_rows").astype(np.float64)
        names, kinds, dtypes, stats = [], [], [], []
        for i, ((name, kind, units), row) in enumerate(zip(self.layers, rows, strict=True)):
            # a row no step has written yet is NaN, and its layer's dtype unknown
            dtype = self.dtypes.get(i, "")
            if units and "outputs" in plan:
                names.append(name)
                kinds.append("layer")
                dtypes.append(dtype)
                stats.append((np.nan, row[1], row[2]))
            if kind is not None and "activations" in plan:
                names.append(f"{name}/{kind}" if units else name)
                kinds.append(kind)
                dtypes.append(dtype)
                stats.append((row[0], row[1], row[2]))
        if names:
            arr = np.array(stats, dtype=np.float64)
            obs.act_names, obs.act_kinds = tuple(names), tuple(kinds)
            obs.act_dtypes = tuple(dtypes)
            obs.act_saturated, obs.act_rms, obs.act_max = arr[:, 0], arr[:, 1], arr[:, 2]
        if "trace" in plan:
            obs.trace_names = tuple(name for name, _, _ in self.layers)
            obs.trace_finite = rows[:, 3] != 0.0  # NaN: a layer this step did not call


def snapshotted(tvars: list[Any], position: dict[int, int], snapshot: frozenset[int]) -> list:
    """``(position, variable)`` of the variables of ``tvars`` whose update is measured
    (those within the snapshot budget)."""
    chosen = ((position.get(id(v)), v) for v in tvars)
    return [(pos, v) for pos, v in chosen if pos in snapshot]


def value_before(store: Store, before: dict[int, Any] | None, pos: int) -> Any:
    """The value of the variable at ``pos`` before the update: the step's own read of it
    (``before``, in a whole heavy function), else its snapshot variable."""
    if before is not None:
        return before[pos]
    return ops.convert_to_tensor(store.variable(f"snapshot_{pos}"))


def slots_of(reduction: KerasReduction, layout: Layout, regime: Regime) -> list[Slot]:
    """The reduction's slots, each combining across replicas as its statistic declares
    unless it names its own combination."""
    (across,) = {STATISTICS[s].across_replicas for s in reduction.statistics}
    default = BY_REPLICAS.get(across)
    out = []
    for slot in reduction.slots(layout, regime):
        if slot.combine is None:
            if default is None:
                raise TypeError(f"{type(reduction).__name__}: slot {slot.name!r} needs a combine")
            slot = dataclasses.replace(slot, combine=default)
        out.append(slot)
    return out


def _histograms(tensors: dict[int, Any], count: int) -> Any:
    """One :func:`~stethoscope.callbacks._keras.ops.magnitude_histogram` per position, NaN
    rows for the positions not given."""
    nan = ops.convert_to_tensor(np.full(DISTRIBUTION_BINS, np.nan, dtype=np.float32))
    return ops.stack(
        [kops.magnitude_histogram(tensors[p]) if p in tensors else nan for p in range(count)]
    )
