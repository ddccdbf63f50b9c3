"""The Keras adapter's precision statistics: how each gradient and update fares in the
dtype it is held in (``precision``), and how each gradient and weight would fit fp8
(``fp8``), reduced inside the train step on the sampled steps that plan them.

The kernels mirror the Lightning adapter's (``_lightning/precision.py``) in
``keras.ops``: a gradient is judged as the optimizer is handed it (under a loss scale,
the scaled values are the ones held in its dtype), its largest magnitude with the scale
divided out.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.reductions import (
    KerasReduction,
    Layout,
    ReadBack,
    Store,
    snapshotted,
    value_before,
)
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.variables import Slot
from stethoscope.number_formats import E4M3, E5M2, HALF, format_of
from stethoscope.observation import Observation

__all__ = [
    "FP8_FLOORS",
    "Fp8Fit",
    "GradientPrecision",
    "fp8_shares",
    "gradient_shares",
    "rounded_away",
]

#: Per fp8 format (e4m3, e5m2), the share of a tensor's largest magnitude below which a
#: value rounds to zero once the tensor is scaled so that its largest magnitude meets the
#: format's largest value: half the smallest subnormal, over the largest value.
FP8_FLOORS = tuple(fmt.smallest / 2 / fmt.max for fmt in (E4M3, E5M2))


def gradient_shares(g: Any, scale: Any = None) -> Any:
    """The share of ``g``'s elements that are subnormal in its dtype, the share that are
    exactly zero, and its largest magnitude (``scale``, a loss scale it carries, divided
    out of that): three float32 numbers; NaN for a gradient wider than 16 bits (the
    precision detectors judge 16-bit ones only, and nothing is spent on the others). The
    magnitudes are compared in ``g``'s own dtype (its smallest normal value is a power of
    two, held exactly)."""
    fmt = format_of(keras.backend.standardize_dtype(g.dtype))
    if fmt is None or fmt.name not in HALF:
        return ops.convert_to_tensor(np.full(3, np.nan, dtype=np.float32))
    n = math.prod(g.shape)
    if not n:
        return ops.zeros((3,), "float32")
    a = ops.abs(ops.stop_gradient(g))
    zero = ops.count_nonzero(ops.equal(a, 0))
    below = ops.count_nonzero(ops.less(a, fmt.tiny)) if fmt is not None else zero
    peak = ops.cast(ops.max(a), "float32")
    if scale is not None:
        peak = peak / ops.cast(scale, "float32")
    shares = ops.cast(ops.stack([below - zero, zero]), "float32") / float(n)
    return ops.concatenate([shares, ops.reshape(peak, (1,))])


def rounded_away(before: Any, after: Any, grad: Any) -> Any:
    """Of a variable's elements whose gradient ``grad`` is finite and not zero and whose
    value was finite, the share that is exactly as it was before the step (``before``:
    its value then, in its own dtype or in float32, which holds every 16-bit value
    exactly): the updates that rounded away. NaN where no element is such, and for a
    variable wider than 16 bits (not judged, not measured). A NaN value stays NaN, and a
    NaN gradient moves nothing: neither is an update that rounded away."""
    if keras.backend.standardize_dtype(after.dtype) not in HALF:
        return ops.convert_to_tensor(np.float32(np.nan))
    if keras.backend.standardize_dtype(before.dtype) != keras.backend.standardize_dtype(
        after.dtype
    ):
        before, after = ops.cast(before, "float32"), ops.cast(after, "float32")
    grad = ops.stop_gradient(grad)
    pushed = ops.logical_and(ops.not_equal(grad, 0), ops.isfinite(grad))
    pushed = ops.logical_and(pushed, ops.isfinite(before))
    stayed = ops.logical_and(pushed, ops.equal(after, before))
    counts = ops.cast(ops.stack([ops.count_nonzero(stayed), ops.count_nonzero(pushed)]), "float32")
    return counts[0] / counts[1]


def fp8_shares(t: Any, scale: Any = None) -> Any:
    """Of ``t``'s non-zero elements, the share that would round to zero in e4m3 and in
    e5m2 under per-tensor scaling to its largest magnitude, and that largest magnitude
    (``scale``, a loss scale ``t`` carries, divided out of it): three float32 numbers
    (NaN shares for a tensor of zeros)."""
    n = math.prod(t.shape)
    if not n:
        return ops.convert_to_tensor(np.array([np.nan, np.nan, 0.0], np.float32))
    a = ops.reshape(ops.abs(ops.cast(ops.stop_gradient(t), "float32")), (-1,))
    amax = ops.max(a)
    nonzero = ops.count_nonzero(a)
    zeros = n - nonzero
    under = [ops.count_nonzero(ops.less(a, amax * floor)) - zeros for floor in FP8_FLOORS]
    shares = ops.cast(ops.stack(under), "float32") / ops.cast(nonzero, "float32")
    peak = amax / ops.cast(scale, "float32") if scale is not None else amax
    return ops.concatenate([shares, ops.reshape(peak, (1,))])


def _rows(tensors: dict[int, Any], count: int, kernel: Any, *args: Any) -> Any:
    """``kernel``'s row of each tensor by position, NaN rows for the positions not given."""
    nan = ops.convert_to_tensor(np.full(3, np.nan, dtype=np.float32))
    return ops.stack([kernel(tensors[p], *args) if p in tensors else nan for p in range(count)])


class GradientPrecision(KerasReduction):
    """The ``precision`` statistic: each gradient's subnormal and zero shares and its
    peak before the update, and after it each snapshotted variable's rounded-away share.

    The weights before the update are those :class:`UpdateNorms` compares against (the
    statistic requires ``updates``, whose switch is then on): in a whole heavy function
    the step's own reads (a second read of a variable costs no second copy), elsewhere
    its snapshot variables.
    """

    statistics = frozenset({"precision"})
    group = "precision"
    requires = frozenset({"updates"})
    hooks = frozenset({"gradients", "before_update", "update"})
    per_parameter = True

    def __init__(self, layout: Layout, regime: Regime, position: dict[int, int]) -> None:
        self.snapshot = layout.snapshot
        self.whole = regime.whole
        self.position = position

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        return [
            Slot("grad_precision", (layout.count, 3), np.nan),
            Slot("update_lost", (layout.count,), np.nan),
        ]

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        store.put("grad_precision", _rows(grads, store.layout.count, gradient_shares, scale))

    def before_update(self, store: Store, tvars: list[Any]) -> Any:
        if not self.whole:  # UpdateNorms copies them into its snapshot variables
            return None
        chosen = snapshotted(tvars, self.position, self.snapshot)
        return {pos: kops.value(v) for pos, v in chosen}

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        grads = store.gradients()
        nan = ops.convert_to_tensor(np.float32(np.nan))
        lost = []
        for pos in range(store.layout.count):
            if pos not in self.snapshot or pos not in now or pos not in grads:
                lost.append(nan)
                continue
            lost.append(rounded_away(value_before(store, before, pos), now[pos], grads[pos]))
        store.put("update_lost", ops.stack(lost))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        rows = src.read("grad_precision")[idx].astype(np.float64)
        obs.grad_subnormal, obs.grad_zero, obs.grad_peak = rows[:, 0], rows[:, 1], rows[:, 2]
        obs.update_lost = src.read("update_lost")[idx].astype(np.float64)


class Fp8Fit(KerasReduction):
    """The ``fp8`` statistic: how each gradient (before the update) and each weight (after
    it) would fit e4m3 and e5m2 under per-tensor scaling."""

    statistics = frozenset({"fp8"})
    group = "fp8"
    hooks = frozenset({"gradients", "update"})
    per_parameter = True

    def slots(self, layout: Layout, regime: Regime) -> list[Slot]:
        shape = (layout.count, 3)
        return [Slot("fp8_grads", shape, np.nan), Slot("fp8_weights", shape, np.nan)]

    def on_gradients(self, store: Store, grads: dict[int, Any], scale: Any) -> None:
        store.put("fp8_grads", _rows(grads, store.layout.count, fp8_shares, scale))

    def on_update(self, store: Store, now: dict[int, Any], before: Any) -> None:
        store.put("fp8_weights", _rows(now, store.layout.count, fp8_shares))

    def decode(self, obs: Observation, src: ReadBack, idx: np.ndarray, plan: frozenset) -> None:
        grads = src.read("fp8_grads")[idx].astype(np.float64)
        weights = src.read("fp8_weights")[idx].astype(np.float64)
        obs.fp8_underflow = np.concatenate([weights[:, :2], grads[:, :2]], axis=1)
        obs.fp8_amax = np.stack([weights[:, 2], grads[:, 2]], axis=1)
