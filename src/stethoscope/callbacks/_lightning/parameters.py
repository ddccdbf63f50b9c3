"""Fused reductions over the model's parameters, on the device they live on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.shards import (
    FlatSlice,
    flat_row_norms,
    is_sharded,
    local_part,
    row_span,
    scatter_rows,
    unwrapped_name,
)
from stethoscope.callbacks._lightning.zero import is_deepspeed_optimizer, trained_by
from stethoscope.observation import Observation
from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES

__all__ = [
    "UNIT_LAYERS",
    "ParameterProbe",
    "checksums",
    "magnitude_histograms",
    "row_norms",
    "unit_layers",
]


class ParameterProbe:
    """Fused reductions over a fixed, ordered set of named parameters.

    Under a strategy that shards the parameters (FSDP2's DTensors, FSDP1's flat slices),
    each reduction is of the part this rank holds (see
    :mod:`~stethoscope.callbacks._lightning.shards`); the sizes, shapes and names are the
    whole parameters'.

    Args:
        named_parameters: ``(name, parameter)`` pairs in registration order; only
            those that require grad are watched.
        flat: FSDP1's slice of each parameter it shards, by ``id`` (see ``flat_slices``).
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        snapshot_budget: int = 2**25,
        flat: dict[int, FlatSlice] | None = None,
    ) -> None:
        pairs = [(n, p) for n, p in named_parameters if p.requires_grad]
        #: The model's parameters that require no grad, by ``id``: named where an optimizer
        #: holds them (see :meth:`idle_held`).
        self._frozen = {
            id(p): unwrapped_name(n) for n, p in named_parameters if not p.requires_grad
        }
        self.snapshot_budget = snapshot_budget
        self._rotation = 0
        # FSDP1 names a wrapped module's parameters through its wrapper
        self.names: tuple[str, ...] = tuple(unwrapped_name(n) for n, _ in pairs)
        self.params: list[torch.nn.Parameter] = [p for _, p in pairs]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._slices = dict(flat or {})  # of every parameter, watched or frozen
        self._flat = [self._slices.get(id(p)) for p in self.params]
        #: The shape of each whole parameter.
        self.shapes: tuple[torch.Size, ...] = tuple(
            f.shape if f is not None else p.shape
            for p, f in zip(self.params, self._flat, strict=True)
        )
        #: Whether the parameters are sharded over the ranks: their reductions are then
        #: partial, to be combined (see ``StepMeasures.add``'s ``combine``).
        self.sharded = any(is_sharded(p) for p in self.params) or any(self._flat)
        #: Whether the strategy can give the whole gradients to check the combined norms
        #: against (:meth:`whole_grad_norms`): FSDP2's DTensors and ZeRO, not FSDP1.
        self.checkable = any(is_sharded(p) for p in self.params) or any(
            f is not None and f.gathers_whole for f in self._flat
        )
        self.numel = np.array([s.numel() for s in self.shapes], dtype=np.float64)
        self.is_matrix = np.array([len(s) >= 2 for s in self.shapes], dtype=bool)
        #: The dtype each parameter is held in, by name (``"bfloat16"``); see ``describe``.
        self.dtypes: tuple[str, ...] = tuple(_dtype_name(p) for p in self.params)
        #: Inputs per output unit of each weight of a layer with units; NaN elsewhere
        #: (see :meth:`watch_layers`).
        self.fan_in = np.full(len(self.params), np.nan)
        #: The optimizers of the run (see :meth:`optimized_by`): what they hold is read from
        #: their param groups when asked, which a run may change as it goes.
        self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        #: Whether the optimizer updates float32 master copies of the parameters
        #: (DeepSpeed's, known at train start): what rounds away is kept there.
        self.master_weights = False

    def optimized_by(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Learn the run's optimizers (what they update is asked of them when needed: see
        :meth:`unheld`), and the dtypes the parameters are held in now: a precision plugin
        (``"bf16-true"``) casts them after the probe is made."""
        self.dtypes = tuple(_dtype_name(p) for p in self.params)
        self.master_weights = any(is_deepspeed_optimizer(o) for o in optimizers)
        self.optimizers = tuple(optimizers)

    def unheld(self) -> list[int]:
        """The watched parameters that no optimizer holds now (none without any optimizer:
        a training step that updates the weights by hand)."""
        if not self.optimizers:
            return []
        held = {i for opt in self.optimizers for i in self.indices_of(opt)}
        return [i for i in range(len(self.params)) if i not in held]

    def grads_held(self, indices: Sequence[int]) -> dict[int, tuple[torch.Tensor, int] | None]:
        """The gradient each of these parameters holds now and its version (None: it holds
        none), to tell later whether a backward pass wrote to it (see :meth:`received`)."""
        out: dict[int, tuple[torch.Tensor, int] | None] = {}
        for i in indices:
            g = self.params[i].grad
            out[i] = None if g is None else (g, g._version)
        return out

    def received(self, before: dict[int, tuple[torch.Tensor, int] | None]) -> list[int]:
        """Those of the parameters of ``before`` (see :meth:`grads_held`) that a backward
        pass wrote a gradient to since: a new gradient, or one accumulated into (its
        version moved). A gradient left over from earlier steps is not one. FSDP1's and
        ZeRO's slices count as written to, alike on every rank (see :meth:`with_grad`)."""
        out = []
        for i, was in before.items():
            g = self.params[i].grad
            written = g is not None and (was is None or g is not was[0] or g._version != was[1])
            if written or self._flat[i] is not None:
                out.append(i)
        return out

    def idle_held(self, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[str, ...]:
        """What ``optimizers`` hold that got no gradient, in a few words each: the watched
        parameters without one, the model's parameters that require no grad, and a count
        of the tensors that are not the model's parameters at all (an optimizer built
        before its layers were replaced). For a step that stepped none with a gradient."""
        idle: list[str] = []
        strangers = 0
        for opt in optimizers:
            params = trained_by(opt)
            if params is None:
                params = [p for group in opt.param_groups for p in group["params"]]
            for p in params:
                i = self.index.get(id(p))
                if i is not None:
                    if i not in self.with_grad([i]):
                        idle.append(f"{self.names[i]} (no gradient)")
                elif id(p) in self._frozen:
                    idle.append(f"{self._frozen[id(p)]} (requires_grad=False)")
                else:
                    strangers += 1
        if strangers:
            idle.append(f"{strangers} tensor(s) that are not the model's parameters")
        return tuple(idle)

    def as_whole(
        self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]
    ) -> list[tuple[str, torch.Size, torch.nn.Parameter]]:
        """``(name, shape, parameter)`` of each of ``named_parameters`` as the model has it
        whole: without FSDP1's wrappers in the name, with the whole shape of a slice
        (FSDP1's, ZeRO's: under ZeRO-3 the parameter itself is empty)."""
        out = []
        for name, p in named_parameters:
            held = self._slices.get(id(p))
            out.append((unwrapped_name(name), p.shape if held is None else held.shape, p))
        return out

    def indices_of(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Indices of the watched parameters this optimizer updates."""
        params = trained_by(optimizer)  # DeepSpeed's: its groups hold its own partitions
        if params is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        seen = []
        for p in params:
            i = self.index.get(id(p))
            if i is not None:
                seen.append(i)
        return seen

    def with_grad(self, indices: Sequence[int]) -> list[int]:
        """The indices whose parameter has a gradient this step. FSDP1 leaves none on a
        rank that holds no element of the parameter: every rank counts it alike, with an
        empty gradient there (see :meth:`grad`), so that the ranks' readings match."""
        params, flat = self.params, self._flat
        return [i for i in indices if params[i].grad is not None or flat[i] is not None]

    def grad(self, i: int) -> torch.Tensor:
        """The gradient of parameter ``i`` that this rank reduces (detached; its shard,
        under sharding; empty where FSDP1 left this rank none)."""
        flat = self._flat[i]
        if flat is not None:  # FSDP1's or ZeRO's slice, maybe empty (see with_grad)
            return flat.grad(self.params[i])
        return local_part(self.params[i].grad).detach()

    def unit_rows(self, indices: Sequence[int]) -> torch.Tensor:
        """The L2 norm of each output unit's row of each of these gradients, in one tensor
        (see :func:`row_norms`; FSDP1's slices: :func:`flat_row_norms`)."""
        parts = []
        for i in indices:
            flat = self._flat[i]
            if flat is None:
                parts.append(row_norms([self.params[i].grad]))
            else:  # an empty slice where FSDP1 left this rank no gradient (see grad)
                parts.append(flat_row_norms(self.grad(i), flat))
        return torch.cat(parts)

    def data(self, i: int) -> torch.Tensor:
        """Parameter ``i`` as this rank reduces it (detached; its shard, under sharding)."""
        flat = self._flat[i]
        if flat is not None:
            return flat.data(self.params[i])
        return local_part(self.params[i]).detach()

    def grad_norms(self, indices: Sequence[int]) -> torch.Tensor:
        """L2 norm of each gradient, as one float32 tensor on the device."""
        return _stack_norms([self.grad(i) for i in indices])

    def whole_grad_norms(self, indices: Sequence[int]) -> torch.Tensor:
        """The L2 norm of each whole gradient as the strategy itself gathers or reduces
        it, as one float32 tensor: a DTensor reduction, or ZeRO's gather (a collective per
        tensor, which every rank must make: the reference of a check, not a statistic;
        only where :attr:`checkable`)."""
        out = []
        for i in indices:
            flat, param = self._flat[i], self.params[i]
            whole = flat.whole_grad(param) if flat is not None else param.grad.detach()
            wide = torch.float64 if whole.dtype == torch.float64 else torch.float32
            norm = torch.linalg.vector_norm(whole, dtype=wide).float()  # never narrowed
            out.append(norm.full_tensor() if is_sharded(norm) else norm)
        return torch.stack(out)

    def snapshot(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Copies of these parameters, to measure the optimizer's update against."""
        return torch._foreach_mul([self.data(i) for i in indices], 1.0)

    def choose(self, indices: Sequence[int]) -> list[int]:
        """The parameters to snapshot this sampled step: at most ``snapshot_budget`` elements.

        A snapshot copies the weights, so an unbounded one would double a large model's
        parameter memory on every sampled step. Past the budget, successive sampled steps
        take turns through the parameters, so each is measured every few samples.
        """
        if not indices:
            return []
        n = len(indices)
        start = self._rotation % n
        chosen, used = [], 0
        for k in range(n):
            i = indices[(start + k) % n]
            size = int(self.numel[i])
            if chosen and used + size > self.snapshot_budget:
                self._rotation = start + k
                break
            chosen.append(i)
            used += size
        else:
            self._rotation = start
        return sorted(chosen)

    def weight_norms(self, indices: Sequence[int]) -> torch.Tensor:
        """L2 norm of each parameter now, as one float32 tensor on the device."""
        return _stack_norms([self.data(i) for i in indices])

    def update_norms(
        self, before: list[torch.Tensor], snapped: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms of the change of the parameters ``snapped`` since their snapshots
        ``before``, and of ``before`` itself. The snapshots' memory is reused for the
        differences: they are spent."""
        previous = _stack_norms(before)
        torch._foreach_sub_(before, [self.data(i) for i in snapped])
        return _stack_norms(before), previous

    def describe(self, obs: Observation, indices: Sequence[int]) -> None:
        """Name the parameters behind ``obs``'s per-parameter arrays: ``indices``."""
        obs.names = tuple(self.names[i] for i in indices)
        obs.numel = self.numel[indices]
        obs.dtypes = tuple(self.dtypes[i] for i in indices)
        obs.is_matrix = self.is_matrix[indices]
        obs.fan_in = self.fan_in[indices]


def _dtype_name(t: torch.Tensor) -> str:
    """``torch.bfloat16`` as ``"bfloat16"``: the name both frameworks' dtypes share."""
    return str(t.dtype).rsplit(".", 1)[-1]


#: Dtypes whose norm accumulates in float32 inside the kernel (see :func:`_stack_norms`).
_NARROW = (torch.float16, torch.bfloat16, torch.float32)


def _stack_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All L2 norms in one fused kernel, accumulated in float32, stacked into one tensor.

    Accumulating in float32 keeps an fp16/bf16 tensor of large but finite values from
    reporting an infinite norm (which would read as a non-finite gradient). A float64 or
    complex tensor cannot be narrowed inside the norm (a complex one's norm is real): those
    take their own norms, in the same order, then float32.
    """
    if all(t.dtype in _NARROW for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    wide = [i for i, t in enumerate(tensors) if t.dtype not in _NARROW]
    rest = [i for i, t in enumerate(tensors) if t.dtype in _NARROW]
    for idx, kw in ((wide, {}), (rest, {"dtype": torch.float32})):
        if idx:
            norms = torch._foreach_norm([tensors[i] for i in idx], 2, **kw)
            for i, n in zip(idx, norms, strict=True):
                out[i] = n.float()
    return torch.stack(out)


def total_norm(
    tensors: list[torch.Tensor], *, across_ranks: bool = False, device: Any = None
) -> torch.Tensor:
    """The L2 norm of all of ``tensors`` together, a float32 0-d tensor on their device,
    accumulated as :func:`_stack_norms` does (an fp16 gradient whose norm passes 65504 is
    large, not infinite).

    No tensor at all gives 0, on ``device``. ``across_ranks``: the tensors are this rank's
    shards of them (DTensors, or FSDP1's slices): the norm is of the whole tensors, each
    rank's sum of the squares of what it holds summed over the ranks in one all-reduce on
    the device, so every rank calls it at the same step (the recovery gate does, at every
    step), also one that holds no tensor.
    """
    if not tensors:
        local = torch.zeros((), device=device)
    else:  # the recovery gate's plain tensors, at every step: no list made for them
        parts = [local_part(t) for t in tensors] if across_ranks else tensors
        local = torch.linalg.vector_norm(_stack_norms(parts))
    if not across_ranks:
        return local
    squares = local.double().square()  # float64: a large norm's square would overflow
    torch.distributed.all_reduce(squares)
    return squares.sqrt().float()


#: The integer type of each element size, to read a tensor's bit patterns as integers.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An exact checksum of each tensor: the int64 sum of its elements' bit patterns.

    Integer addition does not depend on the order of the sum, so identical tensors give
    identical checksums on any rank and any kernel, and changing any element changes it
    (floats would round, and a norm cannot see a sign flip or a permutation within a
    row either). One int64 tensor on the device; no copy of any tensor is made.
    """
    out = []
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        bits = t.view(_BITS[t.element_size()]) if t.element_size() in _BITS else t
        out.append(bits.sum(dtype=torch.int64))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


#: Layers whose weight has one row per output unit (dim 0): dense and convolution layers.
UNIT_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
)


def unit_layers(
    module: torch.nn.Module, probe: ParameterProbe
) -> list[tuple[str, int, torch.nn.Module]]:
    """``(module name, index of its weight in probe, module)`` for each watched layer with units."""
    out = []
    for name, mod in module.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, UNIT_LAYERS) and isinstance(w, torch.Tensor) and id(w) in probe.index:
            out.append((unwrapped_name(name) or type(mod).__name__, probe.index[id(w)], mod))
    return out


def row_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """For each gradient, the L2 norm of each output unit's row (dim 0), accumulated in
    float32, all in one tensor: a unit got no gradient where it is zero (exactly when
    every entry is, or under ~1e-19, where a square underflows). On the CPU it is far
    cheaper than the max-abs norm, and it leaves no temporary the size of the gradient.

    A sharded gradient (a DTensor) gives the norms of the rows held here, at their rows
    of the whole gradient, and zeros elsewhere: the ranks' norms combine as norms do.
    """
    out = []
    for g in grads:
        span = row_span(g)
        if span is not None and span[2] == 0:  # no row held here, or counted elsewhere
            out.append(torch.zeros(span[0], device=g.device))
            continue
        local = local_part(g).detach()
        wide = torch.float64 if local.dtype == torch.float64 else torch.float32  # never narrowed
        norms = torch.linalg.vector_norm(local.flatten(1), 2, dim=1, dtype=wide).float()
        out.append(norms if span is None else scatter_rows(norms, span))
    return torch.cat(out)


#: Elements histogrammed at once: bounds the temporaries of one large tensor.
_HISTOGRAM_CHUNK = 2**24

# The histogram is taken on l = -2 log10|x| in bins one wide, where every edge of
# DISTRIBUTION_EDGES (10**(k/2)) falls on an integer: far cheaper than a binary search of
# the edges per element (bucketize), and exact up to the float32 rounding of a log at an
# edge itself. Finite float32 magnitudes give l in about [-77.1, 89.7]; an exact zero
# (l = +inf) is moved to the top bin, a non-finite value (l = -inf or NaN) to the bottom
# one, and each fine bin is then folded into the statistic's bin.
_FINE_LOW, _FINE_HIGH = -80, 92
_FINE_BINS = _FINE_HIGH - _FINE_LOW


def _fine_to_coarse() -> list[int]:
    """For each fine bin ``[l, l + 1)`` of ``-2 log10|x|``, the statistic's bin."""
    n_edges = len(DISTRIBUTION_EDGES)
    top = -round(2 * math.log10(DISTRIBUTION_EDGES[0]))  # l at the first edge (24)
    bottom = -round(2 * math.log10(DISTRIBUTION_EDGES[-1]))  # l at the last edge (-8)
    fold = []
    for j in range(_FINE_BINS):
        level = _FINE_LOW + j
        if j == 0:
            fold.append(DISTRIBUTION_BINS - 1)  # non-finite
        elif j == _FINE_BINS - 1:
            fold.append(0)  # exact zero
        elif level >= top:
            fold.append(1)  # (0, e0]
        elif level < bottom:
            fold.append(n_edges + 1)  # (e_last, inf)
        else:  # |x| in (10**(-(l+1)/2), 10**(-l/2)]
            fold.append(1 + top - level)
    return fold


_FOLD = _fine_to_coarse()
_TOP_LEVEL = -round(2 * math.log10(DISTRIBUTION_EDGES[0]))


_FOLDS: dict[torch.device, torch.Tensor] = {}


def _fold_on(device: torch.device) -> torch.Tensor:
    """:data:`_FOLD` as a tensor on ``device``, computed there once: a tensor made from a
    Python list would be a copy from the host, and so would an element set to a Python
    number (``fold[0] = n``): on CUDA, each waits for the device. ``masked_fill`` takes
    its number as a kernel's argument."""
    if device not in _FOLDS:
        level = torch.arange(_FINE_LOW, _FINE_HIGH, device=device)
        fold = (1 + _TOP_LEVEL - level).clamp_(1, len(DISTRIBUTION_EDGES) + 1)
        fold = fold.masked_fill_(level == _FINE_LOW, DISTRIBUTION_BINS - 1)  # non-finite
        _FOLDS[device] = fold.masked_fill_(level == _FINE_HIGH - 1, 0)  # exact zero
    return _FOLDS[device]


def magnitude_histograms(
    tensors: Sequence[torch.Tensor], scale: torch.Tensor | None = None
) -> torch.Tensor:
    """For each tensor, how many of its elements fall in each magnitude bin: exact zeros,
    then ``(0, e0]``, ``(e0, e1]`` … up to ``(e_last, inf)`` for the edges of
    :data:`~stethoscope.statistics.DISTRIBUTION_EDGES`, then non-finite values. A value
    within float32 rounding of an edge may be counted on either side of it.

    One float32 tensor ``(len(tensors), DISTRIBUTION_BINS)`` on the device (counts are
    exact below 2**24 per bin). Large tensors are taken in chunks, so the temporaries
    stay a few times :data:`_HISTOGRAM_CHUNK` elements whatever the model. ``scale``: a
    factor every tensor carries (a loss scale), divided out of the magnitudes.
    """
    bins = DISTRIBUTION_BINS
    if not tensors:
        return torch.zeros((0, bins))
    device = tensors[0].device
    fold = _fold_on(device)
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for t in tensors:
            fine = torch.zeros(_FINE_BINS, dtype=torch.int64, device=device)
            for chunk in t.detach().reshape(-1).split(_HISTOGRAM_CHUNK):
                magnitude = chunk.float().abs()
                if scale is not None:  # a GradScaler's is a power of two: the bins are exact
                    magnitude.div_(scale)
                level = torch.log10(magnitude).mul_(-2.0)
                level = torch.nan_to_num_(
                    level, nan=_FINE_LOW + 0.5, posinf=_FINE_HIGH - 0.5, neginf=_FINE_LOW + 0.5
                )
                fine += torch.histc(level, _FINE_BINS, _FINE_LOW, _FINE_HIGH).long()
            rows.append(fine)
        fine_rows = torch.stack(rows)
        counts = fine_rows.new_zeros((len(rows), bins)).index_add_(1, fold, fine_rows)
    return counts.float()
