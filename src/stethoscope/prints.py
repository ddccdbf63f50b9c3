"""How a sample is fingerprinted: the ``prints`` statistic's definition, which both
frameworks' adapters compute alike (a sample gets the same print in either), and how the
host reads it back.

A batch's inputs are one tensor or several (a dict or tuple of them: token ids and their
mask, features and a mask). A sample's print covers its row of each (see
:func:`print_tensors`), and reads a bounded number of elements whatever the batch: at
most :data:`PRINT_WIDTH` of a sample's row in each tensor, evenly spaced with a stride
that depends on the row's width alone (so a sample gets the same print in any batch),
and at most :data:`PRINT_BUDGET` in all, which bounds how many of a batch's first samples
are printed (:func:`print_plan`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_PRINTS",
    "MAX_PRINT_TENSORS",
    "MAX_VAL_PRINTS",
    "PRINT_BUDGET",
    "PRINT_PRIME",
    "PRINT_WIDTH",
    "batch_fingerprint",
    "join_prints",
    "print_plan",
    "print_tensors",
    "print_weights",
]

#: Samples of a batch fingerprinted by the ``prints`` statistic at most (the first ones).
MAX_PRINTS = 1024
#: Validation samples fingerprinted at most per validation (its first batches').
MAX_VAL_PRINTS = 4096
#: Elements of a sample's row in one tensor a print reads at most (evenly spaced beyond):
#: 4096 reads a CIFAR image or a 4096-token sequence whole, an ImageNet crop every 37th.
PRINT_WIDTH = 1 << 12
#: Elements a batch's prints read in all at most (some 2 MB of float32), whatever its
#: size: a batch prints its first ``PRINT_BUDGET // (elements read per sample)`` samples
#: (at most ``MAX_PRINTS``), so at least 64 of one tensor and 8 of ``MAX_PRINT_TENSORS``.
PRINT_BUDGET = 1 << 18
#: Tensors of a batch's inputs a print covers at most (the first ones).
MAX_PRINT_TENSORS = 8
#: The prime a print's two sums are taken modulo: below 2**24, so float32 holds each
#: exactly, and odd, so no difference between samples vanishes by its factors of two.
PRINT_PRIME = 16_777_213


def print_weights(width: int) -> np.ndarray:
    """The weights of the ``prints`` statistic for sample rows of ``width`` 16-bit chunks:
    shape ``(2, width)``, random integers in ``[1, 2**20)`` drawn from a seed that depends
    on ``width`` alone, so every run (resumed or not) and both frameworks print a sample
    alike.

    A sample's print in one tensor is two numbers: each ``sum(chunk * weight) mod
    PRINT_PRIME`` over the elements of its row read (see :func:`print_plan`), their bit
    patterns cut into 16-bit chunks (a float's bits, not its value: exact, and blind to
    no difference; a complex element is its real and imaginary parts, a byte one chunk).
    Chunks below ``2**16`` times weights below ``2**20``, summed over at most ``4 *
    PRINT_WIDTH`` chunks (8-byte elements), stay below ``2**50``: exact in an int64, and
    in a float64 too, in any order of summation. Two different samples share a print
    with a chance of about ``PRINT_PRIME ** -2``, as long as they differ in an element
    read.
    """
    rng = np.random.default_rng(width)
    return rng.integers(1, 1 << 20, size=(2, width), dtype=np.int64)


def print_plan(widths: Sequence[int], samples: int) -> tuple[list[int], int]:
    """How a batch's tensors are printed: for sample rows of ``widths`` elements (one per
    tensor), the stride each is read with (every element up to ``PRINT_WIDTH``, then
    evenly spaced: at most ``PRINT_WIDTH`` read), and how many of the batch's first
    ``samples`` are printed: at most ``MAX_PRINTS``, reading at most ``PRINT_BUDGET``
    elements in all."""
    strides = [max(-(-w // PRINT_WIDTH), 1) for w in widths]
    read = sum(-(-w // s) for w, s in zip(widths, strides, strict=True))
    return strides, min(samples, MAX_PRINTS, PRINT_BUDGET // max(read, 1))


def print_tensors(shapes: Sequence[Sequence[int | None]]) -> list[int]:
    """Which of the input tensors of ``shapes`` (in order: a dict's by sorted key, as
    ``keras.tree.flatten`` gives them) a print covers: those of at least one dimension
    with as many samples as the first such, and whose rows hold elements, up to
    ``MAX_PRINT_TENSORS``. Their prints are added modulo ``PRINT_PRIME``: a single
    tensor's print is its own."""
    dims = [i for i, shape in enumerate(shapes) if len(shape) >= 1]
    if not dims:
        return []
    samples = shapes[dims[0]][0]
    kept = [i for i in dims if shapes[i][0] == samples and 0 not in tuple(shapes[i][1:])]
    return kept[:MAX_PRINT_TENSORS]


def join_prints(pairs: np.ndarray) -> np.ndarray:
    """The prints of the samples whose two sums ``pairs`` holds, flattened in pairs, as
    one exact number each (below 2**48 in a float64)."""
    pairs = np.asarray(pairs, dtype=np.float64).reshape(-1, 2)
    return pairs[:, 0] * PRINT_PRIME + pairs[:, 1]


def batch_fingerprint(pairs: np.ndarray) -> str:
    """A batch's fingerprint, from the prints of its samples (``pairs``, as the
    ``prints`` statistic gives them): twelve hexadecimal digits, the same for the same
    samples in the same order, in either framework."""
    joined = join_prints(pairs).astype("<f8")
    return hashlib.sha1(joined.tobytes()).hexdigest()[:12]
