"""The Keras probe's tensor reductions, as pure functions of tensors (``keras.ops``, with
TensorFlow's single-op forms where TensorFlow runs them).

Each op of a train step has a fixed cost to launch which, on a small model, outweighs
the work it does: these are written in as few ops as they can be."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.prints import PRINT_PRIME, print_plan, print_tensors, print_weights
from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES, SATURATION_BOUNDS

__all__ = [
    "MAX_CLASSES",
    "ROW",
    "SATURATED_OUTPUT",
    "by_position",
    "checked",
    "either",
    "forward_row",
    "graph",
    "half_square",
    "input_stats",
    "inputs_finite",
    "is_dense",
    "is_float",
    "is_symbolic",
    "label_histogram",
    "magnitude_histogram",
    "norms",
    "put",
    "scalar",
    "squares_by_position",
    "step_index",
    "unit_zero_rows",
    "value",
]

#: Class labels are counted in a histogram of this many classes (larger: not judged).
MAX_CLASSES = 1024
#: A forward row: saturated fraction, rms, max |x|, finite, elements (to weigh replicas).
ROW = 5
#: Output magnitudes that correspond to the saturation bounds on the pre-activation.
SATURATED_OUTPUT = {
    "tanh": math.tanh(SATURATION_BOUNDS["tanh"]),
    "sigmoid": 1.0 / (1.0 + math.exp(-SATURATION_BOUNDS["sigmoid"])),
}


def is_symbolic(x: Any) -> bool:
    """Whether ``x`` holds Keras' symbolic tensors (a functional model being built).
    Asked on every step, so lists, tuples and dicts are walked here: ``keras.tree``
    takes tens of microseconds for a handful of tensors."""
    if isinstance(x, keras.KerasTensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(is_symbolic(t) for t in x)
    if isinstance(x, dict):
        return any(is_symbolic(t) for t in x.values())
    return False


def is_float(t: Any) -> bool:
    return "float" in keras.backend.standardize_dtype(t.dtype)


#: The classes of sparse and ragged tensors (TensorFlow's, JAX's), known by name: no
#: import of a framework the user did not ask for.
_NOT_DENSE = frozenset({"SparseTensor", "RaggedTensor", "IndexedSlices", "BCOO", "BCSR"})


def is_dense(t: Any) -> bool:
    """Whether ``t`` is a dense tensor: a sparse or ragged one has no rows to read by
    position (its dense ops take another API); None is none."""
    if t is None or any(c.__name__ in _NOT_DENSE for c in type(t).__mro__):
        return False
    if isinstance(t, keras.KerasTensor):
        return not (t.sparse or t.ragged)
    if keras.backend.backend() == "torch":
        import torch

        return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
    return True


def _stored(t: Any) -> Any:
    """The values a tensor stores, as a dense tensor: a sparse one's values, a ragged
    one's flat values, a dense one itself (None: none to read)."""
    if is_dense(t):
        return t
    for name in ("flat_values", "values", "data"):  # ragged, sparse (TensorFlow), BCOO
        values = getattr(t, name, None)
        if values is not None and not callable(values) and is_dense(values):
            return values
    return None


def inputs_finite(x: Any) -> Any:
    """Whether every floating (or complex) value of the inputs ``x`` (nested as a batch's
    may be; a sparse or ragged tensor's stored values) is finite: a boolean tensor, True
    without a floating input."""
    verdict = ops.convert_to_tensor(True)
    for t in keras.tree.flatten(x):
        t = _stored(t)
        if t is None:
            continue
        if "complex" in keras.backend.standardize_dtype(t.dtype):
            finite = ops.logical_and(ops.isfinite(ops.real(t)), ops.isfinite(ops.imag(t)))
        elif is_float(t):
            finite = ops.isfinite(t)
        else:
            continue
        verdict = ops.logical_and(verdict, ops.all(finite))
    return verdict


def scalar(t: Any) -> bool:
    """Whether ``t`` is known to be a scalar (a reshape to one is then an op for nothing)."""
    try:
        return len(t.shape) == 0
    except (TypeError, ValueError):  # an unknown rank
        return False


def graph() -> Any:
    """The TensorFlow graph ops are being built in (None when eager, or on another
    backend)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def value(v: Any) -> Any:
    """A variable's value now, as a tensor. ``keras.ops.convert_to_tensor`` hands back the
    TensorFlow variable itself, which every op that uses it reads anew (after an update
    in between, too)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(v.value)
    return ops.convert_to_tensor(v)


def step_index(optimizer: Any, variables: Any) -> Any:
    """The index of the step being taken (int64), counted as the host counts them. The
    optimizer's ``iterations`` counts the updates applied; with ``recover=`` a skipped
    step leaves it as it was (Adam's bias correction and a schedule see only applied
    steps, as in a run that never saw the batch), and the probe's ``skipped`` variable
    counts those steps back in; so does its ``scale_skips`` the steps a
    ``LossScaleOptimizer`` skipped, which it does not count either."""
    index = ops.cast(optimizer.iterations, "int64")
    for skips in ("skipped", "scale_skips"):
        if skips in variables.slots:
            index = index + value(variables[skips])
    return index


def put(var: Any, index: Any, row: Any) -> None:
    """``var[index] = row`` along the first axis, with a mask: ``ops.slice_update`` is an
    XLA op on TensorFlow, which the CPU runs through an on-demand compilation."""
    if keras.backend.backend() == "torch":  # eager: the row is written in place
        import torch

        with torch.no_grad():
            var.value[index] = row
        return
    n = var.shape[0]
    hit = ops.equal(ops.arange(n, dtype="int32"), ops.cast(index, "int32"))
    if len(var.shape) > 1:
        hit = ops.reshape(hit, (n,) + (1,) * (len(var.shape) - 1))
    var.assign(ops.where(hit, row, var))


def either(a: Any, b: Any) -> Any:
    """``a or b`` for Python bools and bool tensors alike, folding the constants away."""
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return ops.logical_or(a, b)


def half_square(t: Any) -> Any:
    """``sum(t**2) / 2`` in float32, in one op on TensorFlow (``tf.nn.l2_loss``)."""
    t = ops.cast(t, "float32")
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.l2_loss(t)
    return ops.sum(ops.square(t)) / 2.0


def norms(halves: dict[int, Any], count: int) -> Any:
    """The L2 norms of ``count`` tensors from the :func:`half_square` of some of them, by
    position (NaN for the others): one op per tensor, then two for the vector."""
    nan = ops.convert_to_tensor(np.float32(np.nan))
    return ops.sqrt(ops.multiply(ops.stack([halves.get(i, nan) for i in range(count)]), 2.0))


def by_position(grads: list, tvars: list, position: dict[int, int]) -> dict[int, Any]:
    """The gradients handed with a watched variable, by its position."""
    return {
        pos: g
        for g, v in zip(grads, tvars, strict=True)
        if g is not None and (pos := position.get(id(v))) is not None
    }


def checked(grads: list, tvars: list, position: dict[int, int]) -> tuple[list, dict]:
    """Each gradient's :func:`half_square`, by variable position, and the gradients to
    hand the optimizer: each one after its own sum (a control dependency on an identity,
    no copy). The optimizer's element-wise ops then find the gradient's buffer with no
    other reader left and update it in place, instead of racing the sums for it."""
    import tensorflow as tf

    squares: dict[int, Any] = {}
    out = list(grads)
    for i, (g, v) in enumerate(zip(grads, tvars, strict=True)):
        if g is None or id(v) not in position:
            continue
        sq = squares[position[id(v)]] = half_square(g)
        with tf.control_dependencies([sq]):
            out[i] = tf.identity(g)
    return out, squares


def squares_by_position(grads: list, tvars: list, position: dict[int, int]) -> dict[int, Any]:
    """Each watched gradient's :func:`half_square`, by its variable's position."""
    return {
        position[id(v)]: half_square(g)
        for g, v in zip(grads, tvars, strict=True)
        if g is not None and id(v) in position
    }


def unit_zero_rows(grads: list[Any | None], units: list[int]) -> Any:
    """For each kernel gradient (``None``: not handed this step), 1.0 for every output unit
    (last axis) whose gradient is exactly zero, else 0.0; all layers in one vector."""
    parts = []
    for g, n in zip(grads, units, strict=True):
        if g is None:
            parts.append(ops.zeros((n,), "float32"))
            continue
        axes = tuple(range(len(g.shape) - 1))
        rows = ops.sum(ops.square(ops.cast(g, "float32")), axis=axes)
        parts.append(ops.cast(ops.equal(rows, 0.0), "float32"))
    return ops.concatenate(parts)


def input_stats(x: Any, max_features: int, scaling: tuple[Any, ...] = ()) -> tuple[Any, Any] | None:
    """The per-feature mean square of the first float tensor of ``x`` (through the
    ``scaling`` layers first: the class's ``call``, past any wrapper of the probe's),
    padded with NaN to ``max_features`` (wider inputs: one number), and ``[features,
    samples]``; None when ``x`` holds no dense float tensor (a sparse one is skipped)."""
    t = next((t for t in keras.tree.flatten(x) if is_dense(t) and is_float(t)), None)
    if t is None or len(t.shape) < 1:
        return None
    t = ops.stop_gradient(t)
    for layer in scaling:
        t = type(layer).call(layer, t)
    t = ops.cast(t, "float32")
    features = t.shape[-1] if len(t.shape) >= 2 else 1
    if features is None or features > max_features:
        flat = ops.reshape(t, (-1, 1))
        features = 1
    else:
        flat = ops.reshape(t, (-1, features))
    mean_sq = ops.mean(ops.square(flat), axis=0)
    padded = ops.pad(mean_sq, [(0, max_features - features)], constant_values=np.nan)
    samples = ops.cast(ops.shape(t)[0], "int64")
    return padded, ops.stack([ops.convert_to_tensor(features, "int64"), samples])


def label_histogram(y: Any) -> Any | None:
    """The class counts of the first tensor of ``y`` (integer labels, or rows of
    probabilities, their argmax): bins ``0 .. MAX_CLASSES - 1`` the classes, then
    negative targets (ignored ones), then labels past ``MAX_CLASSES``, then a validity
    flag (0.0: a float target that is not rows of probabilities). None: no class labels
    (a sparse target, or rows wider than ``MAX_CLASSES``: not judged)."""
    t = next((t for t in keras.tree.flatten(y) if t is not None), None)
    if not is_dense(t):
        return None
    if len(t.shape) == 2 and t.shape[-1] == 1:
        t = ops.reshape(t, (-1,))
    dtype = keras.backend.standardize_dtype(t.dtype)
    valid = ops.convert_to_tensor(1.0, "float32")
    if len(t.shape) == 1 and "int" in dtype:
        labels = ops.cast(t, "int32")
    elif len(t.shape) == 2 and is_float(t) and 2 <= (t.shape[-1] or 0) <= MAX_CLASSES:
        rows_ok = ops.logical_and(
            ops.all(ops.less(ops.abs(ops.sum(t, axis=1) - 1.0), 1e-3)),
            ops.all(ops.greater_equal(t, 0)),
        )
        valid = ops.cast(rows_ok, "float32")
        labels = ops.cast(ops.argmax(t, axis=1), "int32")
    else:
        return None
    c = MAX_CLASSES
    index = ops.where(ops.greater_equal(labels, c), c + 1, labels)
    index = ops.where(ops.less(labels, 0), c, index)
    counts = ops.sum(ops.one_hot(index, c + 2, dtype="float32"), axis=0)
    return ops.concatenate([counts, ops.reshape(valid, (1,))])


def forward_row(t: Any, kind: str | None) -> Any:
    """A layer output's forward row (:data:`ROW`): the fraction of a tanh or sigmoid output
    in its saturated tails (NaN for other layers), its rms, its max |x|, whether it is all
    finite, and its elements."""
    t = ops.cast(ops.stop_gradient(t), "float32")
    a = ops.abs(t)
    bound = SATURATED_OUTPUT.get(kind) if kind else None
    if bound is None:
        sat = ops.convert_to_tensor(np.float32(np.nan))
    elif kind == "tanh":
        sat = ops.mean(ops.cast(ops.greater_equal(a, bound), "float32"))
    else:  # sigmoid: near 1 or near 0
        near = ops.logical_or(ops.greater_equal(t, bound), ops.less_equal(t, 1.0 - bound))
        sat = ops.mean(ops.cast(near, "float32"))
    finite = ops.cast(ops.all(ops.isfinite(t)), "float32")
    count = ops.cast(ops.size(t), "float32")
    return ops.stack([sat, ops.sqrt(ops.mean(ops.square(t))), ops.max(a), finite, count])


def magnitude_histogram(t: Any) -> Any:
    """How many elements of ``t`` fall in each magnitude bin of the ``distributions``
    statistic (:data:`~stethoscope.statistics.DISTRIBUTION_BINS` counts, float32): exact
    zeros, the bins of ``DISTRIBUTION_EDGES``, then non-finite values."""
    a = ops.reshape(ops.abs(ops.cast(ops.stop_gradient(t), "float32")), (-1,))
    # the edges are 10**(j/2) from 10**(first/2) on: |x| lies above the edges j with
    # j < 2 log10|x| - first, so it falls in bin 1 + (how many), exact up to the rounding
    # of a log at an edge itself; temporaries the size of t, not one per edge
    first = round(2 * math.log10(DISTRIBUTION_EDGES[0]))
    above = ops.ceil(ops.multiply(ops.log10(a), 2.0) - first)
    above = ops.cast(ops.clip(above, 0, len(DISTRIBUTION_EDGES)), "int32")
    index = ops.where(ops.equal(a, 0.0), 0, above + 1)
    index = ops.where(ops.isfinite(a), index, DISTRIBUTION_BINS - 1)
    return ops.cast(ops.bincount(index, minlength=DISTRIBUTION_BINS), "float32")


def sample_prints(x: Any, max_prints: int) -> Any | None:
    """The ``prints`` statistic of the inputs ``x`` (nested as a batch's may be): two
    numbers for each of its first samples (at most ``max_prints``), flattened in pairs and
    padded with NaN to ``2 * max_prints``, exact integers below 2**24. The samples, the
    tensors and the elements read are those of :func:`~stethoscope.prints.print_plan`
    and :func:`~stethoscope.prints.print_tensors`, as the Lightning adapter reads them:
    a sample prints alike in either. None: no dense tensor of samples, a row of unknown
    width (its weights are drawn on the host), or a backend other than TensorFlow (a
    float's bit pattern is read with ``tf.bitcast``, which ``keras.ops`` lacks)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(t) for t in keras.tree.flatten(x) if is_dense(t)]
    tensors = [t for t in tensors if t.shape.rank is not None and _bits(t.dtype) is not None]
    tensors = [tensors[i] for i in print_tensors([t.shape.as_list() for t in tensors])]
    shapes = [t.shape.as_list() for t in tensors]
    if not tensors or any(d is None for shape in shapes for d in shape[1:]):
        return None
    widths = [
        math.prod(shape[1:]) * (2 if t.dtype.is_complex else 1)
        for t, shape in zip(tensors, shapes, strict=True)
    ]
    samples = max_prints if shapes[0][0] is None else min(shapes[0][0], max_prints)
    strides, count = print_plan(widths, samples)
    if count < 1:
        return None
    total = None
    for t, width, stride in zip(tensors, widths, strides, strict=True):
        pairs = _tensor_sums(tf.stop_gradient(t)[:count], width, stride)
        pad = tf.fill([2 * max_prints], tf.constant(np.nan, tf.float64))
        pairs = tf.concat([tf.reshape(pairs, (-1,)), pad], axis=0)[: 2 * max_prints]
        total = pairs if total is None else total + pairs  # NaN past a tensor's samples
    return tf.cast(tf.math.floormod(total, PRINT_PRIME), tf.float32)


def _bits(dtype: Any) -> Any | None:
    """The integer type a TensorFlow dtype's elements are read as (a complex one's
    parts): None for one with no bit pattern to read (strings, resources)."""
    import tensorflow as tf

    if dtype.is_complex:
        dtype = dtype.real_dtype
    if dtype == tf.bool or (dtype.is_integer and not dtype.is_quantized):
        return dtype
    floats = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32}
    return tf.int64 if dtype == tf.float64 else floats.get(dtype)


def _tensor_sums(rows: Any, width: int, stride: int) -> Any:
    """The two sums of each sample's print in one tensor, modulo ``PRINT_PRIME``, as
    float64 (exact: see ``print_weights``): every ``stride``-th element of its
    ``width``."""
    import tensorflow as tf

    if rows.dtype.is_complex:  # its parts, interleaved as torch.view_as_real lays them
        rows = tf.stack([tf.math.real(rows), tf.math.imag(rows)], axis=-1)
    flat = tf.reshape(rows, (-1, width))
    if stride > 1:  # evenly spaced elements of a wide sample
        flat = flat[:, ::stride]
    size = rows.dtype.size
    if rows.dtype == tf.bool:
        flat = tf.cast(flat, tf.uint8)
    elif rows.dtype.is_floating:
        flat = tf.bitcast(flat, _bits(rows.dtype))
    bits = tf.cast(flat, tf.int64)
    # 16-bit chunks (a byte is one chunk, its bits as unsigned): exact products and sums
    mask = 0xFFFF if size > 1 else 0xFF
    chunks = [
        tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16 * k), mask)
        for k in range(max(size // 2, 1))
    ]
    stacked = tf.concat(chunks, axis=1)
    weights = tf.constant(print_weights(int(stacked.shape[1])))
    sums = tf.stack([tf.reduce_sum(stacked * weights[i], axis=1) for i in range(2)], axis=1)
    return tf.cast(tf.math.floormod(sums, PRINT_PRIME), tf.float64)
