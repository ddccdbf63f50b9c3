"""The reference a ``distributions`` statistic is checked against: numpy's own count."""

from __future__ import annotations

import numpy as np

from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES


def magnitude_histogram(x) -> np.ndarray:
    """How many elements of ``x`` (in float32) fall in each bin of the statistic."""
    a = np.abs(np.asarray(x, dtype=np.float32).ravel())
    index = np.searchsorted(np.array(DISTRIBUTION_EDGES, dtype=np.float32), a, side="left") + 1
    index[a == 0] = 0
    index[~np.isfinite(a)] = DISTRIBUTION_BINS - 1
    return np.bincount(index, minlength=DISTRIBUTION_BINS)
