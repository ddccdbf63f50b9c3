"""How a sample is fingerprinted: the ``prints`` statistic's definition, which both
frameworks' adapters compute alike (a sample gets the same print in either), and how the
host reads it back."""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = [
    "MAX_PRINTS",
    "MAX_VAL_PRINTS",
    "PRINT_PRIME",
    "PRINT_WIDTH",
    "batch_fingerprint",
    "join_prints",
    "print_weights",
]

#: Samples of a batch fingerprinted by the ``prints`` statistic at most (the first ones).
MAX_PRINTS = 1024
#: Validation samples fingerprinted at most per validation (its first batches').
MAX_VAL_PRINTS = 4096
#: Elements of a sample a print reads at most (evenly spaced beyond): the sums below stay
#: exact in 64-bit integers.
PRINT_WIDTH = 1 << 20
#: The prime a print's two sums are taken modulo: below 2**24, so float32 holds each
#: exactly, and odd, so no difference between samples vanishes by its factors of two.
PRINT_PRIME = 16_777_213


def print_weights(width: int) -> np.ndarray:
    """The weights of the ``prints`` statistic for samples of ``width`` 16-bit chunks:
    shape ``(2, width)``, random integers in ``[1, 2**20)`` drawn from a seed that depends
    on ``width`` alone, so every run (resumed or not) and both frameworks print a sample
    alike.

    A sample's print is two numbers: each ``sum(chunk * weight) mod PRINT_PRIME`` over
    its elements' bit patterns cut into 16-bit chunks (a float's bits, not its value:
    exact, and blind to no difference). Chunks below ``2**16`` times weights below
    ``2**20``, summed over at most ``2 * PRINT_WIDTH`` chunks, never overflow an int64.
    Two different samples share a print with a chance of about ``PRINT_PRIME ** -2``.
    """
    rng = np.random.default_rng(width)
    return rng.integers(1, 1 << 20, size=(2, width), dtype=np.int64)


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
