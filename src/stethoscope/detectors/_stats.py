"""Small robust statistics shared by detectors: plain Python, bounded windows."""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Scales a median absolute deviation to a standard deviation for normal data.
MAD_TO_SIGMA = 1.4826


def median(xs: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def robust_sigma(xs: Sequence[float], center: float | None = None) -> float:
    """MAD-based estimate of the spread of ``xs``: insensitive to a few outliers."""
    c = median(xs) if center is None else center
    return MAD_TO_SIGMA * median([abs(x - c) for x in xs])


def push(window: list[float], x: float, size: int) -> None:
    """Append ``x`` to ``window`` and keep only the last ``size`` values."""
    window.append(x)
    if len(window) > size:
        del window[: len(window) - size]


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
