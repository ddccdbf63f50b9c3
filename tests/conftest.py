"""What every test shares: a random state of its own.

``make test`` spreads the test files over two processes, in an order that depends on
which process frees first, so the random state a test starts from would depend on
which tests ran before it in its process. Each test starts from the same seeds instead,
whatever ran before: Python's, NumPy's global one, torch's, and, once Keras has been
imported, Keras' (its backend's too). A library not imported yet starts from its own
fixed seed when the test imports it."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(0)
    if "keras" in sys.modules:
        sys.modules["keras"].utils.set_random_seed(0)
