"""The Lightning adapter's precision statistics: how each gradient and update fares in
the dtype it is held in (``precision``), and how far each tensor's values sit from an fp8
format's range (``fp8``), measured on the device on sampled steps only. The loss
scaler's scale and skipped steps are :mod:`~stethoscope.callbacks._lightning.loss_scale`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.measures import StepMeasures
from stethoscope.callbacks._lightning.parameters import ParameterProbe
from stethoscope.callbacks._lightning.reduction import Reduction
from stethoscope.number_formats import E4M3, E5M2, FORMATS, HALF
from stethoscope.observation import Observation

__all__ = [
    "Fp8Fit",
    "GradientPrecision",
    "fp8_counts",
    "gradient_counts",
    "rounded_counts",
]

#: Elements taken at once: bounds the temporaries of one large tensor.
_CHUNK = 2**24


#: Per 16-bit dtype, the bit pattern of its smallest normal magnitude. A non-negative
#: float's bit pattern, read as an integer, orders as its value does: with the sign bit
#: masked off, a 16-bit tensor is judged in integer ops, which a CPU runs several times
#: faster than bfloat16 arithmetic.
_TINY_BITS = {
    getattr(torch, name): int(
        torch.tensor(FORMATS[name].tiny, dtype=getattr(torch, name)).view(torch.int16)
    )
    for name in HALF
}
_MAGNITUDE = 0x7FFF  # all but the sign bit
#: Per 16-bit dtype, the bit pattern of infinity: a magnitude at or above it is not finite.
_INF_BITS = {
    getattr(torch, name): int(torch.tensor(math.inf, dtype=getattr(torch, name)).view(torch.int16))
    for name in HALF
}


def gradient_counts(
    grads: Sequence[torch.Tensor],
    scale: torch.Tensor | None = None,
    computed_in: torch.dtype | None = None,
) -> torch.Tensor:
    """For each gradient held in 16 bits, how many of its elements are subnormal in its
    dtype, how many are exactly zero, how many there are, and its largest magnitude
    (``scale``, a loss scale it still carries, divided out of that); NaN for a wider
    gradient (the precision detectors judge 16-bit ones only, and nothing is spent on the
    others). ``computed_in``: the 16-bit dtype an autocast backward pass computed the
    float32 gradients in; theirs are counted in it too, a subnormal being an element that
    is one of that dtype's subnormals exactly (see :func:`_computed_bits`). Counts, not
    shares, so that the ranks holding shards of a gradient add them up. One float32
    tensor ``(len(grads), 4)`` on the device."""
    rows = []
    with torch.no_grad():
        for g in grads:
            tiny = _TINY_BITS.get(g.dtype)
            cast = tiny is None and computed_in in _TINY_BITS and g.dtype == torch.float32
            if cast:
                tiny = _TINY_BITS[computed_in]
            if tiny is None:
                rows.append(torch.full((4,), math.nan, device=g.device))
                continue
            flat = g.detach().reshape(-1)
            subnormal = torch.zeros((), dtype=torch.int64, device=g.device)
            zero = torch.zeros_like(subnormal)
            peak = torch.zeros((), dtype=torch.int16, device=g.device)
            for part in flat.split(_CHUNK):
                chunk = _computed_bits(part, computed_in) if cast else part.view(torch.int16)
                magnitude = chunk & _MAGNITUDE
                zeros = torch.count_nonzero(magnitude == 0)
                subnormal += torch.count_nonzero(magnitude < tiny) - zeros
                zero += zeros
                if chunk.numel() and not cast:
                    peak = torch.maximum(peak, magnitude.max())
            if cast:  # as held: its float32 values (NaN where one is)
                peak = flat.abs().max().float() if flat.numel() else peak.float()
            else:  # a NaN's pattern is above every number's
                peak = peak.view(g.dtype).float()
            if scale is not None:
                peak = peak / scale
            size = torch.full((), float(g.numel()), device=g.device)
            rows.append(torch.stack([subnormal.float(), zero.float(), size, peak.reshape(())]))
    if not rows:
        return torch.zeros((0, 4))
    return torch.stack(rows)


def _computed_bits(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bit patterns, in the 16-bit ``dtype``, of the float32 gradient ``flat`` that an
    autocast backward pass computed in it: each element's own where it is one of that
    dtype's values exactly, else that of the smallest normal value (counted as neither
    zero nor subnormal). A gradient computed in float16 and cast up holds float16 values
    only; a float32 one lands on float16's grid one time in thousands below its normal
    range, so its small values are not mistaken for an underflow."""
    narrow = flat.to(dtype)
    exact = narrow.to(flat.dtype) == flat
    bits = narrow.view(torch.int16)
    return torch.where(exact, bits, torch.full_like(bits, _TINY_BITS[dtype]))


def rounded_counts(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> torch.Tensor:
    """For each parameter held in 16 bits, of its elements whose gradient is finite and not
    zero and whose weight was finite, how many are exactly as they were before the step
    (``before``: its snapshot), the updates that rounded away, and how many there are
    (their share is the first over the second); NaN for a wider parameter (not judged,
    not measured). A NaN weight stays NaN, and a NaN gradient moves nothing: neither is
    an update that rounded away. One float32 tensor ``(len(after), 2)`` on the device."""
    rows = []
    with torch.no_grad():
        for b, a, g in zip(before, after, grads, strict=True):
            if a.dtype not in _TINY_BITS or g.dtype not in _TINY_BITS:
                rows.append(torch.full((2,), math.nan, device=a.device))
                continue
            g_inf, w_inf = _INF_BITS[g.dtype], _INF_BITS[a.dtype]
            a = a.detach().reshape(-1).view(torch.int16)
            g = g.detach().reshape(-1).view(torch.int16)
            b = b.reshape(-1).view(torch.int16)
            pushed = torch.zeros((), dtype=torch.int64, device=a.device)
            stayed = torch.zeros_like(pushed)
            for lo in range(0, a.numel(), _CHUNK):
                part = slice(lo, lo + _CHUNK)
                g_bits = g[part] & _MAGNITUDE
                moving = (g_bits != 0) & (g_bits < g_inf) & ((b[part] & _MAGNITUDE) < w_inf)
                pushed += torch.count_nonzero(moving)
                stayed += torch.count_nonzero(moving & (a[part] == b[part]))
            rows.append(torch.stack([stayed.float(), pushed.float()]))
    if not rows:
        return torch.zeros((0, 2))
    return torch.stack(rows)


def _share(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """``part / whole``, NaN where ``whole`` is 0 (nothing to take a share of)."""
    out = np.full(np.shape(part), np.nan)
    np.divide(part, whole, out=out, where=whole > 0)
    return out


#: Per fp8 format, the share of a tensor's largest magnitude below which a value rounds to
#: zero once the tensor is scaled so that its largest magnitude meets the format's largest
#: value: half the smallest subnormal, over the largest value.
FP8_FLOORS = tuple(fmt.smallest / 2 / fmt.max for fmt in (E4M3, E5M2))


def fp8_counts(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor | None = None,
    agree: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """For each tensor, of its non-zero elements, how many would round to zero in e4m3 and
    in e5m2 under per-tensor scaling to its largest magnitude, how many there are, and
    that largest magnitude (``scale``, a loss scale the tensors carry, divided out of it):
    one float32 tensor ``(len(tensors), 4)`` on the device.

    ``agree``: under sharding, makes the peaks every rank's largest, in place (an
    all-reduce), before the elements are counted against them: the scaling is the whole
    tensor's, and the counts then add up over the ranks."""
    if not tensors:
        return torch.zeros((0, 4))
    with torch.no_grad():
        zero = torch.zeros((), device=tensors[0].device)  # the peak of an empty shard
        peaks = torch.stack(
            [t.detach().abs().max().float() if t.numel() else zero for t in tensors]
        )
        if agree is not None:
            agree(peaks)
        rows = []
        for t, amax in zip(tensors, peaks, strict=True):
            magnitude = t.detach().reshape(-1).float().abs()
            nonzero = torch.count_nonzero(magnitude).float()
            zeros = magnitude.numel() - nonzero
            under = [torch.count_nonzero(magnitude < amax * f) - zeros for f in FP8_FLOORS]
            rows.append(torch.stack([*under, nonzero]))
        peak = peaks / scale if scale is not None else peaks
        return torch.cat([torch.stack(rows), peak.reshape(-1, 1)], dim=1)


class GradientPrecision(Reduction):
    """The ``precision`` statistic: each gradient's subnormal and zero shares and its
    peak before the step, and each snapshotted parameter's rounded-away share after it
    (read from the ``updates`` snapshots before they are spent, so it runs before
    :class:`~stethoscope.callbacks._lightning.reductions.UpdateNorms`). Measured as counts
    and peaks, which the ranks of a sharded model add up and take the largest of."""

    statistics = frozenset({"precision"})
    name = "precision"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe
        #: The 16-bit dtype the backward pass computes float32 gradients in (see
        #: ``TrainingSetup.computes_in``), once seen; None: as held.
        self.computed_in: torch.dtype | None = None

    def computes_in(self, dtype: torch.dtype) -> None:
        self.computed_in = dtype

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        grads = [self.probe.grad(i) for i in indices]
        counts = gradient_counts(grads, measures.grad_scale, self.computed_in)
        measures.add("precision", counts[:, :3], ("grads", indices), combine="sum")
        measures.add("precision", counts[:, 3], ("peaks", len(indices)), combine="max")

    def at_end(self, measures: StepMeasures) -> None:
        # under master copies (DeepSpeed) no update rounds away (rounded_updates does not
        # apply), and no gradient is left after the step to tell which elements moved
        if not measures.snapshots or self.probe.master_weights:
            return
        snapped = measures.snapped
        params = [self.probe.data(i) for i in snapped]
        lost = rounded_counts(measures.snapshots, params, [self.probe.grad(i) for i in snapped])
        measures.add("precision", lost, ("lost", tuple(snapped)), combine="sum")

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        counts: list[np.ndarray] = []
        peaks: list[np.ndarray] = []
        order: list[int] = []
        lost: dict[int, float] = {}
        at = 0
        for kind, which in contexts:  # per optimizer: counts, peaks; then the lost updates
            if kind == "grads":
                counts.append(values[at : at + 3 * len(which)].reshape(-1, 3))
                order.extend(which)
                at += 3 * len(which)
            elif kind == "peaks":
                peaks.append(values[at : at + which])
                at += which
            else:
                pairs = values[at : at + 2 * len(which)].reshape(-1, 2)
                lost.update(zip(which, _share(pairs[:, 0], pairs[:, 1]).tolist(), strict=True))
                at += 2 * len(which)
        rows = np.concatenate(counts) if counts else np.zeros((0, 3))
        obs.grad_subnormal = _share(rows[:, 0], rows[:, 2])
        obs.grad_zero = _share(rows[:, 1], rows[:, 2])
        obs.grad_peak = np.concatenate(peaks) if peaks else np.zeros(0)
        obs.update_lost = np.array([lost.get(i, np.nan) for i in order])


class Fp8Fit(Reduction):
    """The ``fp8`` statistic: how each gradient (before the step) and each weight (after
    it) would fit e4m3 and e5m2 under per-tensor scaling. Measured as counts against
    each whole tensor's peak, which the ranks of a sharded model agree on first."""

    statistics = frozenset({"fp8"})
    name = "fp8"
    per_parameter = True

    def __init__(self, probe: ParameterProbe) -> None:
        self.probe = probe

    def before_step(self, measures: StepMeasures, indices: list[int]) -> None:
        grads = [self.probe.grad(i) for i in indices]
        self._add(measures, "grads", fp8_counts(grads, measures.grad_scale, _agree(measures)))

    def at_end(self, measures: StepMeasures) -> None:
        if measures.params:
            weights = [self.probe.data(i) for i in measures.params]
            self._add(measures, "weights", fp8_counts(weights, agree=_agree(measures)))

    @staticmethod
    def _add(measures: StepMeasures, kind: str, counts: torch.Tensor) -> None:
        n = counts.shape[0]
        measures.add("fp8", counts[:, :3], (kind, "counts", n), combine="sum")
        measures.add("fp8", counts[:, 3], (kind, "peaks", n))  # agreed already

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        parts: dict[tuple[str, str], list[np.ndarray]] = {}
        at = 0
        for kind, what, n in contexts:  # per optimizer its gradients, then the weights
            width = 3 if what == "counts" else 1
            parts.setdefault((kind, what), []).append(values[at : at + width * n].reshape(n, -1))
            at += width * n
        if ("grads", "counts") not in parts or ("weights", "counts") not in parts:
            return
        shares = {}
        for kind in ("weights", "grads"):
            counts = np.concatenate(parts[kind, "counts"])
            shares[kind] = _share(counts[:, :2], counts[:, 2:3])
        obs.fp8_underflow = np.concatenate([shares["weights"], shares["grads"]], axis=1)
        obs.fp8_amax = np.concatenate(
            [np.concatenate(parts["weights", "peaks"]), np.concatenate(parts["grads", "peaks"])],
            axis=1,
        )


def _agree(measures: StepMeasures) -> Callable[[torch.Tensor], None] | None:
    """Under sharding, how the ranks make a tensor of peaks every rank's largest."""
    combiner = measures.combiner
    return None if combiner is None else lambda peaks: combiner.all_reduce(peaks, "max")
