"""What every test shares: a random state of its own.

``make test`` spreads the test files over two processes, in an order that depends on
which process frees first, so the random state a test starts from would depend on
which tests ran before it in its process. Each test starts from the same seeds instead,
whatever ran before: Python's, NumPy's global one, torch's, and, once Keras has been
imported, Keras' (its backend's too). A library not imported yet starts from its own
fixed seed when the test imports it.

And one thread per process for the ops of torch, TensorFlow and their OpenMP pools, set
before any of them is imported (tests that launch ranks hand it on through the environment).
``make test`` already runs two processes on two cores; a second thread per process
makes threads that wait on each other's cores: a Lightning test file measured 460 s with
torch's default two threads against 26 s with one, on a busy 2-core machine. No test
depends on the thread count; this only sets how fast they run. TensorFlow's inter-op
pool is left as it is: a mirrored strategy's collectives wait on each other there."""

from __future__ import annotations

import os
import random
import sys

for _threads in (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
):
    os.environ.setdefault(_threads, "1")
if "torch" in sys.modules:  # imported by a plugin before this file: set its pool directly
    sys.modules["torch"].set_num_threads(1)

import numpy as np  # noqa: E402  (after the thread counts: OpenBLAS reads them at import)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(0)
    if "keras" in sys.modules:
        sys.modules["keras"].utils.set_random_seed(0)
