"""What the model hands its Keras loss: whether its output rows are probabilities as the
loss takes them, and, for a loss of the user's own, what it would be for each way of
taking them (the Lightning adapter's ``_lightning/predictions.py``, in ``keras.ops``)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.callbacks._keras.describe import LossForm
from stethoscope.callbacks._keras.ops import is_dense, is_float
from stethoscope.callbacks._keras.reductions import KerasReduction, Layout, ReadBack, Store
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import Slot
from stethoscope.number_formats import sum_tolerance
from stethoscope.observation import Observation

__all__ = ["WAYS", "Predictions", "likelihood_bce", "probability_rows", "way_losses"]

#: The values of :func:`way_losses`: seven class losses, the unit flag and three binary
#: losses, and the terms their means are over.
WAYS = 12


def _first_float(y_pred: Any) -> Any | None:
    return next((t for t in keras.tree.flatten(y_pred) if is_dense(t) and is_float(t)), None)


def _first_dense(y: Any) -> Any | None:
    return None if y is None else next((u for u in keras.tree.flatten(y) if is_dense(u)), None)


def probability_rows(y_pred: Any, *, axis: int = -1, binary: bool = False) -> Any | None:
    """``[1.0 or 0.0, columns]``: whether every row of the first float tensor of
    ``y_pred`` along ``axis`` (the loss's class axis) is probabilities (several columns:
    non-negative and summing to 1; one column: within [0, 1]), and its columns; ``binary``
    (a loss that takes each element as a probability of its own, a sigmoid's): whether
    every element is within [0, 1], and the last axis's columns. None: no float tensor."""
    t = _first_float(y_pred)
    if t is None or len(t.shape) < 1:
        return None
    if len(t.shape) >= 2 and axis not in (-1, len(t.shape) - 1) and not binary:
        if not -len(t.shape) <= axis < len(t.shape):
            return None
        t = ops.moveaxis(t, axis, -1)  # classes last: (N, C, T) -> (N, T, C)
    width = t.shape[-1] if len(t.shape) >= 2 else 1
    if width is None:
        return None
    rows = ops.reshape(ops.cast(ops.stop_gradient(t), "float32"), (-1, width))
    low = ops.min(rows)  # a reduction: cheaper than a mask of every element
    if width >= 2 and not binary:  # a 16-bit softmax's rows sum to 1 within its rounding only
        sums = ops.sum(rows, axis=1)
        near = ops.less(ops.abs(sums - 1.0), sum_tolerance(t.dtype))
        probs = ops.logical_and(ops.greater_equal(low, 0.0), ops.all(near))
    else:
        probs = ops.logical_and(ops.greater_equal(low, 0.0), ops.less_equal(ops.max(rows), 1.0))
    return ops.stack([ops.cast(probs, "float32"), ops.convert_to_tensor(float(width), "float32")])


def likelihood_bce(y: Any, y_pred: Any) -> Any:
    """The binary cross-entropy of the targets ``y`` with the first float tensor of
    ``y_pred`` taken as probabilities, as Keras' own ``binary_crossentropy`` computes it
    (from a sigmoid's cached logits where it has them), averaged; NaN where the targets
    are not of its shape."""
    t = _first_float(y_pred)
    u = _first_dense(y)
    if t is None or u is None or len(u.shape) != len(t.shape) or u.shape[1:] != t.shape[1:]:
        return ops.convert_to_tensor(np.nan, "float32")
    bce = keras.losses.binary_crossentropy(ops.cast(u, t.dtype), t)  # t itself: its logits
    return ops.cast(ops.mean(bce), "float32")


def way_losses(y: Any, y_pred: Any) -> Any | None:
    """What a loss of the user's own would be for each way of taking the output, as
    :data:`WAYS` values (NaN where a way does not apply): the seven class losses of
    :func:`_class_losses` (class targets: integer labels, one per row along the last
    axis, or one distribution per row, one-hot or soft); the four of
    :func:`_binary_losses` (targets of the output's shape); the terms those means are
    over (the class targets' rows, else the targets' elements). None: no float output,
    or no targets. The means are over the batch, as Keras reduces a loss function's
    values (``sum_over_batch_size``)."""
    t = _first_float(y_pred)
    u = _first_dense(y)
    if t is None or u is None or len(t.shape) < 1 or t.shape[-1] is None:
        return None
    t = ops.cast(ops.stop_gradient(t), "float32")
    u = ops.stop_gradient(u)
    nan = ops.convert_to_tensor(np.nan, "float32")
    width = t.shape[-1] if len(t.shape) >= 2 else 1
    classes = _class_losses(ops.reshape(t, (-1, width)), t, u) if width >= 2 else None
    binary = _binary_losses(t, u)
    if classes is None and binary is None:
        return None
    losses, terms = classes if classes is not None else (ops.full((7,), nan), None)
    if binary is None:
        binary = ops.full((4,), nan)
    elif terms is None:  # a binary loss's mean is over the elements
        terms = ops.cast(ops.size(t), "float32")
    if terms is None:
        terms = nan
    return ops.concatenate([losses, binary, ops.reshape(terms, (1,))])


def _class_losses(rows: Any, t: Any, u: Any) -> tuple[Any, Any] | None:
    """The cross-entropy at the targets ``u`` of the ``rows`` of the output ``t`` taken
    as logits, as log-probabilities, as probabilities, and as logits whose softmax is
    taken as logits again (a softmax in the loss function before a cross-entropy that
    applies its own); then, for the first, third and fourth, the cross-entropy against
    the uniform distribution, which label smoothing mixes in; and the rows kept. Labels
    below zero are left out; distributions are all NaN unless every row is one. None:
    the targets are neither labels of the rows nor a distribution per row."""
    dtype = keras.backend.standardize_dtype(u.dtype)
    if tuple(u.shape[1:]) == tuple(t.shape[1:]) and "bool" not in dtype:  # one per row
        q = ops.reshape(ops.cast(u, "float32"), ops.shape(rows))
        near = ops.less(ops.abs(ops.sum(q, axis=1) - 1.0), sum_tolerance(u.dtype))
        valid = ops.logical_and(ops.all(ops.greater_equal(q, 0.0)), ops.all(near))
        weight = ops.ones_like(rows[:, 0])

        def at(v: Any) -> Any:
            return ops.sum(q * v, axis=1)

    elif tuple(u.shape[1:]) in (tuple(t.shape[1:-1]), (*t.shape[1:-1], 1)) and "bool" not in dtype:
        labels = ops.reshape(ops.cast(u, "int32"), (-1,))
        kept = ops.greater_equal(labels, 0)
        index = ops.expand_dims(ops.where(kept, labels, 0), 1)
        weight, valid = ops.cast(kept, "float32"), None

        def at(v: Any) -> Any:
            return ops.squeeze(ops.take_along_axis(v, index, axis=1), 1)

    else:
        return None
    count = ops.sum(weight)

    def mean(per_row: Any) -> Any:
        return ops.sum(per_row * weight) / count

    soft = ops.softmax(rows, axis=1)
    lse = _lse_from(rows, soft)
    soft_lse = _lse_from(soft, ops.softmax(soft, axis=1))
    logs = ops.log(ops.maximum(rows, 1e-30))
    means = ops.stack(
        [
            mean(lse - at(rows)),
            mean(-at(rows)),
            mean(-at(logs)),
            mean(soft_lse - at(soft)),
            mean(lse - ops.mean(rows, axis=1)),
            mean(-ops.mean(logs, axis=1)),
            mean(soft_lse - ops.mean(soft, axis=1)),
        ]
    )
    if valid is not None:  # not distributions: a binary loss's targets, its elements' terms
        means = ops.where(valid, means, ops.full_like(means, np.nan))
        count = ops.where(valid, count, ops.cast(ops.size(t), "float32"))
    return means, count


def _lse_from(rows: Any, soft: Any) -> Any:
    """Each row's log-sum-exp from the rows and their softmax, as the Lightning adapter
    takes it: at the row's largest entry, ``x - log(softmax(x))``."""
    return ops.max(rows, axis=1) - ops.log(ops.max(soft, axis=1))


def _binary_losses(t: Any, u: Any) -> Any | None:
    """With targets ``u`` of the output ``t``'s shape (``(N,)`` against a one-column
    ``(N, 1)`` too): 1.0 when every element of ``t`` is within [0, 1] (a sigmoid's
    output), else 0.0; then the binary cross-entropy with ``t`` taken as logits, as
    probabilities (logs clamped at -100, as torch's), and as logits whose sigmoid is
    taken as logits again (a sigmoid in the loss function before a loss that applies its
    own). NaN where a target is outside [0, 1]. None without such targets."""
    same = tuple(u.shape[1:]) == tuple(t.shape[1:])
    squeezed = [s for s in u.shape[1:] if s != 1] == [s for s in t.shape[1:] if s != 1]
    if not (same or squeezed) or "bool" in keras.backend.standardize_dtype(u.dtype):
        return None
    x = ops.reshape(t, (-1,))
    y = ops.reshape(ops.cast(u, "float32"), (-1,))

    def with_logits(z: Any) -> Any:  # softplus(z) - y * z, as torch computes it stably
        return ops.mean(ops.maximum(z, 0.0) - z * y + ops.log1p(ops.exp(-ops.abs(z))))

    log_p = ops.maximum(ops.log(x), -100.0)
    log_q = ops.maximum(ops.log1p(-x), -100.0)
    losses = ops.stack(
        [with_logits(x), -ops.mean(y * log_p + (1 - y) * log_q), with_logits(ops.sigmoid(x))]
    )
    targets = ops.all(ops.logical_and(ops.greater_equal(y, 0.0), ops.less_equal(y, 1.0)))
    losses = ops.where(targets, losses, ops.full_like(losses, np.nan))
    unit = ops.all(ops.logical_and(ops.greater_equal(x, 0.0), ops.less_equal(x, 1.0)))
    return ops.concatenate([ops.reshape(ops.cast(unit, "float32"), (1,)), losses])


class Predictions(KerasReduction):
    """Whether the predictions the loss is fed are probabilities as the loss takes them
    (``form``: by element for a binary cross-entropy, by row along its class axis for the
    others; see :func:`probability_rows`), their columns, and for a binary loss their
    likelihood (:func:`likelihood_bce`); for a loss of the user's own, what it would be
    for each way of taking them (:func:`way_losses`), which the rule sets against the
    loss's value. Under a mirrored strategy, the first replica's."""

    statistics = frozenset({"predictions"})
    group = "predictions"
    hooks = frozenset({"batch"})

    def __init__(self, form: LossForm | None = None) -> None:
        self.form = form if form is not None else LossForm()

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        slots = [Slot("output_probs", (3,), np.nan)]
        if self.form.own:
            slots.append(Slot("output_ways", (WAYS,), np.nan, combine="first"))
        return slots

    def on_batch(self, store: Store, x: Any, y: Any, y_pred: Any) -> None:
        form = self.form
        rows = probability_rows(y_pred, axis=form.axis, binary=form.binary)
        if rows is not None:
            bce = likelihood_bce(y, y_pred) if form.binary else ops.convert_to_tensor(np.nan)
            store.put("output_probs", ops.concatenate([rows, ops.reshape(bce, (1,))]))
        ways = way_losses(y, y_pred) if form.own else None
        if ways is not None:
            store.put("output_ways", ways)

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        probs, width, bce = src.read("output_probs")
        if not np.isnan(probs):
            obs.output_probs, obs.output_width = float(probs), int(width)
        if self.form.binary and not np.isnan(probs):  # each element a probability of its own
            obs.output_in_unit, obs.bce_as_probs = (
                float(probs),
                None if np.isnan(bce) else float(bce),
            )
        if self.form.own and not np.isnan(probs):
            obs.read_ways(src.read("output_ways"))
