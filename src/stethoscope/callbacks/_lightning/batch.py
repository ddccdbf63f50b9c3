"""The model inputs and class labels of a batch, reduced on the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.device import accelerator_for, to_host
from stethoscope.prints import (
    MAX_PRINTS,
    MAX_VAL_PRINTS,
    PRINT_PRIME,
    PRINT_WIDTH,
    batch_fingerprint,
    join_prints,
    print_weights,
)
from stethoscope.statistics import MAX_FEATURES

__all__ = [
    "INPUT_KEYS",
    "LABEL_KEYS",
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


def split_batch(batch: Any) -> tuple[Any, Any]:
    """The (inputs, labels) of a batch: ``(x, y, ...)`` sequences or dicts with usual keys."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0], batch[1] if len(batch) > 1 else None
    if isinstance(batch, dict):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        return x, y
    return None, None


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
        """The samples of a batch (0: unknown), on every rank when DDP averages gradients."""
        x = self.inputs(batch)
        n = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() > 0 else 0
        return n * self.world_size


def input_moments(x: Any) -> tuple[torch.Tensor, int] | None:
    """Per-feature mean of x^2 (channels for images, last dim for sequences), and the samples."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or not len(x):
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
        norms = torch.linalg.vector_norm(flat, dim=0, dtype=torch.float32)  # one fused pass
        return norms.square() / max(flat.shape[0], 1), int(x.shape[0])


def class_labels(y: Any) -> torch.Tensor | None:
    """Integer class labels of a batch as float32 (exact below 2**24), then a validity flag.

    One-hot or soft labels (rows of probabilities) become their argmax; the last
    element is 1.0 when the labels are class labels and 0.0 when a float target
    turned out not to be rows of probabilities (decided on the host, no sync).
    """
    if not isinstance(y, torch.Tensor) or y.numel() == 0:
        return None
    with torch.no_grad():
        y = y.detach()
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.dim() == 1 and not y.is_floating_point() and y.dtype != torch.bool:
            return torch.cat([y.float(), y.new_ones(1, dtype=torch.float32)])
        if y.dim() == 2 and y.is_floating_point() and y.shape[1] >= 2:
            rows = ((y.sum(1) - 1).abs() < 1e-3).all() & (y >= 0).all()
            return torch.cat([y.argmax(1).float(), rows.float().reshape(1)])
    return None


#: The integer type whose bit pattern each element size is read as.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample_prints(x: Any) -> torch.Tensor | None:
    """The ``prints`` statistic of the inputs ``x``: two numbers for each of its first
    ``MAX_PRINTS`` samples, shape ``(samples, 2)``, exact integers below 2**24 held in
    float32 (see :func:`~stethoscope.prints.print_weights`). None: no tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not len(x) or x.is_complex():
        return None
    with torch.no_grad():
        flat = x.detach()[:MAX_PRINTS].reshape(min(len(x), MAX_PRINTS), -1)
        if flat.shape[1] > PRINT_WIDTH:  # evenly spaced elements of a huge sample
            flat = flat[:, :: -(-flat.shape[1] // PRINT_WIDTH)]
        size = flat.element_size()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        bits = flat.contiguous().view(_BITS[size]).to(torch.int64)
        # 16-bit chunks (a byte is one chunk): exact products and sums, see print_weights
        chunks = [(bits >> (16 * k)) & 0xFFFF for k in range(max(size // 2, 1))]
        stacked = torch.cat(chunks, dim=1)
        weights = _weights(stacked.shape[1], stacked.device)
        sums = torch.stack([(stacked * w).sum(dim=1) for w in weights], dim=1)
        return torch.remainder(sums, PRINT_PRIME).float()


_WEIGHTS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _weights(width: int, device: torch.device) -> torch.Tensor:
    """:func:`~stethoscope.prints.print_weights` on ``device``, made once per width. On an
    accelerator they cross from a pinned buffer without the host waiting (a copy from
    pageable memory would wait for the device); the buffer is kept with them."""
    key = (width, device)
    if key not in _WEIGHTS:
        weights = torch.from_numpy(print_weights(width))
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
    """Whether every floating value of a batch's inputs is finite (True without one). On
    an accelerator its read waits for the device: for a skipped step only."""
    tensors = _tensors(split_batch(batch)[0])
    floating = [t for t in tensors if t.is_floating_point()]
    if not floating:
        return True
    finite = torch.stack([torch.isfinite(t).all() for t in floating]).all()
    return bool(to_host(finite.reshape(1)).wait().numpy()[0])


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of ``x``: a tensor, or a (nested) list, tuple or dict of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for part in x for t in _tensors(part)]
    return []


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
        # a validation's end reads its losses too: one wait there, by design
        pairs = torch.cat(parts)[:MAX_VAL_PRINTS].cpu().numpy()
        return join_prints(pairs)
