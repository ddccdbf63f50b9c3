"""Small robust statistics shared by detectors: bounded windows, label counts."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

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


def tally(counts: Sequence[int], labels: np.ndarray) -> np.ndarray:
    """``counts`` (per class) plus those of ``labels``, the negative ones left out (-100
    and friends: ignored targets), as an int64 array as long as either needs."""
    if np.any(labels < 0):
        labels = labels[labels >= 0]
    new = np.bincount(labels.astype(np.int64, copy=False).ravel())
    total = np.zeros(max(len(counts), len(new)), np.int64)
    total[: len(counts)] += np.asarray(counts, np.int64)
    total[: len(new)] += new
    return total


def push(window: list[float], x: float, size: int) -> None:
    """Append ``x`` to ``window`` and keep only the last ``size`` values."""
    window.append(x)
    if len(window) > size:
        del window[: len(window) - size]


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def sign_bit(x: float) -> int:
    """The bit of ``x``'s sign in a detector's record of the signs a loss took: 1 below
    zero, 2 above (3: both, a loss with no floor at zero, as a policy gradient's)."""
    return 1 if x < 0 else 2 if x > 0 else 0


def restarts_clock(lr: float | None, since: float | None) -> bool:
    """Whether learning rate ``lr`` starts a patience clock again: the first positive one
    (``since`` None), or one past twice the rate the clock started at, so that a warm-up
    from 0 gets its full patience at a real learning rate."""
    return lr is not None and lr > 0 and (since is None or lr > 2 * since)


class SortedWindow:
    """A sorted copy of a detector's bounded window, for its median on every step.

    The window itself (a plain list, oldest first) stays in the detector's state, so
    checkpoints hold only primitives; this copy follows it through :meth:`push` and is
    rebuilt whenever the window it follows was replaced (a reset, a restored state).
    The loss detectors take this median on every step, so it must be cheap: inserting
    into an already sorted copy is one binary search and one list shift, where
    ``sorted()`` would sort the whole window again each time.
    """

    def __init__(self) -> None:
        self._of: list[float] | None = None
        self._sorted: list[float] = []

    def __eq__(self, other: object) -> bool:  # a copied detector equals its original
        return isinstance(other, SortedWindow) and self.values == other.values

    @property
    def values(self) -> list[float]:
        """The sorted copy as it stands (do not change it)."""
        return self._sorted

    __hash__ = None  # type: ignore[assignment]  # mutable

    def _follow(self, window: list[float]) -> list[float]:
        if self._of is not window or len(self._sorted) != len(window):
            self._of, self._sorted = window, sorted(window)
        return self._sorted

    def push(self, window: list[float], x: float, size: int) -> None:
        """:func:`push` ``x`` onto ``window``, keeping the sorted copy in step."""
        s = self._follow(window)
        window.append(x)
        bisect.insort(s, x)
        while len(window) > size:
            del s[bisect.bisect_left(s, window.pop(0))]

    def ordered(self, window: list[float]) -> list[float]:
        """``window``'s values in ascending order (the copy itself: do not change it)."""
        return self._follow(window)

    def median(self, window: list[float]) -> float:
        """The median of ``window`` (non-empty), as :func:`median` gives it."""
        s = self._follow(window)
        n = len(s)
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
