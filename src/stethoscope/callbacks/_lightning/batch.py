"""The model inputs and class labels of a batch, reduced on the device.

A batch is whatever the user's loader yields: a tensor, a (nested) tuple, list or mapping
of them, or an object of its own. Every statistic here reads the tensors it can and
skips the rest: a sparse or nested tensor, a scalar, an empty batch, a dtype it has no
use for (token ids have no scale, an adjacency matrix no class labels). Nothing here
reads a number on the host: each reduction stays on the device (see ``device.py``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.device import accelerator_for, to_host
from stethoscope.prints import (
    MAX_VAL_PRINTS,
    PRINT_PRIME,
    batch_fingerprint,
    join_prints,
    print_plan,
    print_tensors,
    print_weights,
)
from stethoscope.statistics import MAX_FEATURES

__all__ = [
    "INPUT_KEYS",
    "LABEL_KEYS",
    "MAX_LABEL_COLUMNS",
    "BatchParts",
    "ValidationPrints",
    "class_labels",
    "input_moments",
    "inputs_finite",
    "loader_order",
    "sample_prints",
    "split_batch",
]

#: Keys of a dict batch that hold the inputs, and the labels, in order of preference.
INPUT_KEYS = (
    "x",
    "input",
    "inputs",
    "features",
    "image",
    "images",
    "pixel_values",
    "input_ids",
)
LABEL_KEYS = ("labels", "label", "y", "target", "targets")
#: Columns of a float target read as rows of class probabilities at most (the Keras
#: adapter's class histogram has as many bins): a wider matrix, a graph's adjacency or
#: a distillation target over a vocabulary, is not judged as class labels.
MAX_LABEL_COLUMNS = 1024
#: Levels of nested lists, tuples and mappings searched for tensors.
_DEPTH = 8
#: The floating types reduced as they are (another, float8, is widened first: torch has
#: no sum, norm or finiteness test of its own for it).
_SUMMED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """The (inputs, labels) of a batch: ``(x, y)`` pairs or mappings with usual keys (a
    ``dict``, a ``transformers`` ``BatchEncoding``); anything else, none. A sequence of
    more than two holds its inputs first and does not say which of the rest is the label
    (``(x, y, weights)``, an agent's ``(states, actions, returns)``, a graph's ``(x,
    adjacency, y)``): it gives none (``labels_from=`` names them)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0], batch[1] if len(batch) == 2 else None
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        return x, y
    return None, None


def _tensors(x: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of ``x``: a tensor, or a (nested) list, tuple or mapping of them, in
    the order ``keras.tree.flatten`` gives (a mapping's by sorted key, where its keys
    sort), so both adapters find the same tensors first."""
    if isinstance(x, torch.Tensor):
        return [x]
    if depth >= _DEPTH:
        return []
    if isinstance(x, Mapping):
        keys = list(x)
        with contextlib.suppress(TypeError):  # keys of several types: the mapping's order
            keys = sorted(keys)
        x = [x[k] for k in keys]
    if isinstance(x, (list, tuple)):
        return [t for part in x for t in _tensors(part, depth + 1)]
    return []


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor of at least one dimension: samples in rows. A
    sparse or nested tensor's rows cannot be read without a host sync (their sizes live
    in the indices) or at all; a scalar has none."""
    return not t.is_nested and t.layout == torch.strided and t.dim() >= 1


def _samples(t: torch.Tensor) -> int:
    """The samples of a tensor of the batch: its leading size (0: a scalar)."""
    return int(t.size(0)) if t.dim() > 0 else 0


class BatchParts:
    """The model inputs and class labels of a batch: the user's functions when given,
    else :func:`split_batch`.

    Args:
        inputs_from: ``batch -> inputs``, or None.
        labels_from: ``batch -> labels``, or None.
        world_size: Ranks whose batches DDP averages the gradients over.
    """

    def __init__(
        self,
        inputs_from: Callable[[Any], Any] | None,
        labels_from: Callable[[Any], Any] | None,
        world_size: int = 1,
    ) -> None:
        self.inputs_from, self.labels_from, self.world_size = inputs_from, labels_from, world_size

    def inputs(self, batch: Any) -> Any:
        return self.inputs_from(batch) if self.inputs_from is not None else split_batch(batch)[0]

    def labels(self, batch: Any) -> Any:
        return self.labels_from(batch) if self.labels_from is not None else split_batch(batch)[1]

    def samples(self, batch: Any) -> int:
        """The samples of a batch (0: unknown), on every rank when DDP averages gradients:
        the leading size of its inputs' first tensor."""
        first = next(iter(_tensors(self.inputs(batch))), None)
        return (_samples(first) if first is not None else 0) * self.world_size


def input_moments(x: Any) -> tuple[torch.Tensor, int] | None:
    """Per-feature mean of x^2 (channels for images, last dim for sequences), in float32,
    and the samples: of the first floating tensor of the inputs ``x`` (token ids and
    masks have no scale), dense and not empty. None: no such tensor."""
    x = next((t for t in _tensors(x) if t.is_floating_point() and _dense(t)), None)
    if x is None or not x.numel():
        return None
    with torch.no_grad():
        x = x.detach()
        if x.dim() == 1:
            flat = x.reshape(-1, 1)
        elif x.dim() == 2:
            flat = x
        elif x.dim() == 3:
            flat = x.reshape(-1, x.shape[-1])
        else:
            flat = x.transpose(0, 1).reshape(x.shape[1], -1).T
        if flat.shape[1] > MAX_FEATURES:
            flat = flat.reshape(-1, 1)
        # one fused pass, summed in float32 at least (float64 inputs in float64: a norm
        # is never taken in a narrower type than its input's, and float8 has no norm)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        if x.dtype not in _SUMMED:
            flat = flat.to(wide)
        norms = torch.linalg.vector_norm(flat, dim=0, dtype=wide)
        return (norms.square() / max(flat.shape[0], 1)).float(), int(x.shape[0])


def class_labels(y: Any) -> torch.Tensor | None:
    """Integer class labels of a batch as float32 (exact below 2**24), then a validity flag.

    One-hot or soft labels (rows of probabilities) become their argmax; the last
    element is 1.0 when the labels are class labels and 0.0 when a float target
    turned out not to be rows of probabilities (decided on the device, no sync).

    Decided from the shape and dtype first, at no cost: a dense tensor of integers of
    one dimension (or one column) holds class labels; a float matrix of 2 to
    ``MAX_LABEL_COLUMNS`` columns may, unless it is square (as many columns as samples:
    a graph's adjacency, whose normalised rows sum to 1 as probabilities do; one-hot
    labels of as many classes as the batch has samples are not judged either). Anything
    else (a sparse matrix, bool masks, complex values, token targets) holds none.
    """
    if not isinstance(y, torch.Tensor) or not _dense(y) or y.numel() == 0:
        return None
    with torch.no_grad():
        y = y.detach()
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.dim() == 1 and not (y.is_floating_point() or y.is_complex()):
            if y.dtype == torch.bool:
                return None
            return torch.cat([y.float(), y.new_ones(1, dtype=torch.float32)])
        columns = y.shape[1] if y.dim() == 2 else 0
        square = columns == y.shape[0]
        if y.is_floating_point() and 2 <= columns <= MAX_LABEL_COLUMNS and not square:
            if y.dtype not in _SUMMED:  # float8: no sum of its own
                y = y.float()
            rows = ((y.sum(1) - 1).abs() < 1e-3).all() & (y >= 0).all()
            return torch.cat([y.argmax(1).float(), rows.float().reshape(1)])
    return None


#: The integer type whose bit pattern each element size is read as.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample_prints(x: Any) -> torch.Tensor | None:
    """The ``prints`` statistic of the inputs ``x`` (a tensor, or a nested list, tuple or
    mapping of them): two numbers for each of its first samples, shape ``(samples, 2)``,
    exact integers below 2**24 held in float32. The samples, the tensors and the elements
    read are those of :func:`~stethoscope.prints.print_plan` and
    :func:`~stethoscope.prints.print_tensors`: a bounded read, whatever the batch. None:
    no dense tensor of samples."""
    tensors = [t for t in _tensors(x) if _dense(t) and _bits_of(t.dtype) is not None]
    tensors = [tensors[i] for i in print_tensors([t.shape for t in tensors])]
    if not tensors:
        return None
    widths = [math.prod(t.shape[1:]) * (2 if t.is_complex() else 1) for t in tensors]
    strides, count = print_plan(widths, _samples(tensors[0]))
    if count < 1:
        return None
    with torch.no_grad():
        total = None
        for t, width, stride in zip(tensors, widths, strides, strict=True):
            sums = _tensor_sums(t.detach()[:count], width, stride)
            total = sums if total is None else total + sums
        return torch.remainder(total, PRINT_PRIME).float()


def _bits_of(dtype: torch.dtype) -> torch.dtype | None:
    """The integer type a dtype's elements are read as (a complex one's parts); None:
    one with no bit pattern of 1, 2, 4 or 8 bytes to read."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    return _BITS.get(dtype.itemsize)


def _tensor_sums(rows: torch.Tensor, width: int, stride: int) -> torch.Tensor:
    """The two sums of each sample's print in one tensor, modulo ``PRINT_PRIME``: every
    ``stride``-th element of its ``width`` (a complex tensor: its parts), as int64 on a
    device and float64 on the host (both exact, see ``print_weights``)."""
    if rows.is_complex():
        rows = torch.view_as_real(rows)
    bits = rows.view(_bits_of(rows.dtype))  # any strides: same-size elements
    n = len(rows)
    if stride == 1 or bits.is_contiguous():
        # a view of a contiguous batch (the elements read are copied below); else a copy
        # of the elements read, which are all of them
        flat = bits.reshape(n, width)[:, ::stride]
    else:
        # every stride-th element of a non-contiguous batch, read where it lies
        at = torch.arange(0, width, stride, device=rows.device)
        flat = torch.take(bits, torch.arange(n, device=rows.device)[:, None] * width + at)
    size = flat.element_size()
    wide = torch.int64 if size == 8 else torch.int32
    flat = flat.to(wide)
    # 16-bit chunks (a byte is one chunk): exact products and sums, see print_weights
    chunks = [(flat >> (16 * k)) & 0xFFFF for k in range(max(size // 2, 1))]
    stacked = torch.cat(chunks, dim=1)
    host = rows.device.type == "cpu"
    weights = _weights(stacked.shape[1], rows.device, host)
    return _sums(stacked, weights, host)


def _sums(stacked: torch.Tensor, weights: torch.Tensor, host: bool) -> torch.Tensor:
    """``stacked @ weights.T`` modulo ``PRINT_PRIME``, exactly: on the host one float64
    matrix product (integers below 2**53 add exactly in any order, and a CPU multiplies
    float64 matrices far faster than int64 ones); on a device int64 products and sums (a
    device may have no float64, or a slow one). ``weights`` is ``(width, 2)`` float64 on
    the host, ``(2, width)`` int64 on a device (see :func:`_weights`)."""
    if host:
        return torch.remainder(stacked.to(torch.float64) @ weights, PRINT_PRIME).to(torch.int64)
    wide = stacked.to(torch.int64)
    sums = torch.stack([(wide * w).sum(dim=1) for w in weights], dim=1)
    return torch.remainder(sums, PRINT_PRIME)


_WEIGHTS: dict[tuple[int, torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


def _weights(width: int, device: torch.device, host: bool) -> torch.Tensor:
    """:func:`~stethoscope.prints.print_weights` on ``device``, made once per width
    (``host``: transposed, as float64, for :func:`_sums`). On an accelerator they cross
    from a pinned buffer without the host waiting (a copy from pageable memory would
    wait for the device); the buffer is kept with them."""
    key = (width, device, host)
    if key not in _WEIGHTS:
        drawn = print_weights(width)
        weights = torch.from_numpy(drawn.T.astype(np.float64) if host else drawn)
        accelerator = accelerator_for(device)
        if accelerator is None:
            _WEIGHTS[key] = (weights, weights.to(device))
        else:
            pinned = accelerator.pinned(weights.shape, weights.dtype).copy_(weights)
            _WEIGHTS[key] = (pinned, pinned.to(device, non_blocking=True))
    return _WEIGHTS[key][1]


def fingerprint(batch: Any) -> str | None:
    """The fingerprint of a batch's inputs (see ``stethoscope.prints``), or None without
    an input tensor. On an accelerator its read waits for the device: for a skipped
    step only."""
    prints = sample_prints(split_batch(batch)[0])
    return None if prints is None else batch_fingerprint(to_host(prints).wait().numpy())


def inputs_finite(batch: Any) -> bool:
    """Whether every floating (or complex) value of a batch's inputs is finite (True
    without one): a sparse tensor's stored values, a nested tensor's too. On an
    accelerator its read waits for the device: for a skipped step only."""
    values = [_stored(t) for t in _tensors(split_batch(batch)[0])]
    values = [v for v in values if v is not None and v.numel()]
    if not values:
        return True
    finite = torch.stack([torch.isfinite(v).all() for v in values]).all()
    return bool(to_host(finite.reshape(1)).wait().numpy()[0])


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _stored(t: torch.Tensor) -> torch.Tensor | None:
    """The values a floating or complex tensor stores, as a dense tensor: itself, a
    sparse tensor's values, a nested tensor's buffer. None: another dtype, or a layout
    whose values cannot be had."""
    if not (t.is_floating_point() or t.is_complex()):
        return None
    if t.is_nested or t.layout in _COMPRESSED:
        values = t.values()
    elif t.layout == torch.sparse_coo:
        values = t._values()  # uncoalesced as stored: each value is finite or not alike
    elif t.layout == torch.strided:
        values = t
    else:
        return None
    values = values.detach()
    return values if values.is_complex() or values.dtype in _SUMMED else values.float()


def loader_order(trainer: Any) -> str:
    """The order the training loader was asked for: ``"shuffle"`` (a random sampler, or a
    distributed one that shuffles), ``"sequential"`` (shuffling turned off) or ``""``
    (an iterable dataset, a custom sampler: unknown). A batch sampler is judged by the
    sampler it batches."""
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

    sampler = getattr(getattr(trainer, "train_dataloader", None), "sampler", None)
    if isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    if isinstance(sampler, RandomSampler):
        return "shuffle"
    if isinstance(sampler, SequentialSampler):
        return "sequential"
    if isinstance(sampler, DistributedSampler):
        return "shuffle" if sampler.shuffle else "sequential"
    return ""


class ValidationPrints:
    """The prints of a validation's first samples (up to ``MAX_VAL_PRINTS``), kept on the
    device until the validation ends and read then, in one transfer.

    Args:
        inputs_of: ``batch -> inputs``.
    """

    def __init__(self, inputs_of: Callable[[Any], Any]) -> None:
        self.inputs_of = inputs_of
        self._parts: list[torch.Tensor] = []
        self._count = 0

    def add(self, batch: Any) -> None:
        """Print a validation batch's samples, while fewer than the most were."""
        if self._count >= MAX_VAL_PRINTS:
            return
        prints = sample_prints(self.inputs_of(batch))
        if prints is not None:
            self._parts.append(prints)
            self._count += len(prints)

    def take(self) -> np.ndarray | None:
        """The prints of this validation's samples (None: none printed), and start over."""
        parts, self._parts, self._count = self._parts, [], 0
        if not parts:
            return None
        # a validation's end reads its losses too: one wait there, by design (through
        # the one way a device's numbers reach the host)
        pairs = to_host(torch.cat(parts)[:MAX_VAL_PRINTS]).wait().numpy()
        return join_prints(pairs)
