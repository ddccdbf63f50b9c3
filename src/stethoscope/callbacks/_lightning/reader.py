"""Numbers from the device to the host, in order, without synchronising the device.

Each reading crosses to the host as :func:`~stethoscope.callbacks._lightning.device.to_host`
says (on CUDA: a non-blocking copy into pinned memory, then an event); it is taken once
it has landed, so the training stream is never synchronised. A reading is taken at most
``max_lag`` steps after it was produced (then, and only then, the reader waits for it:
the device still has the steps since queued, so it never idles for that wait).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.device import Crossing, to_host

__all__ = ["HostReader"]


class HostReader:
    """Moves small 1-D device tensors to the host in order, without blocking.

    Args:
        max_lag: How many pushes a device's result may wait before the reader blocks
            on it. This bounds the detection delay, in steps, on a GPU; on the CPU
            results are read at once.
    """

    def __init__(self, max_lag: int = 2) -> None:
        self.max_lag = max_lag
        self._pending: deque[tuple[Any, Crossing]] = deque()

    def push(self, meta: Any, tensor: torch.Tensor) -> None:
        self._pending.append((meta, to_host(tensor)))

    def pop(self, *, wait: bool = False) -> list[tuple[Any, np.ndarray]]:
        """The results whose copies are done, oldest first (all of them if ``wait``)."""
        out: list[tuple[Any, np.ndarray]] = []
        while self._pending:
            meta, crossing = self._pending[0]
            if not wait and len(self._pending) <= self.max_lag and not crossing.landed():
                break
            self._pending.popleft()  # landed, or the lag bound: never more than max_lag behind
            out.append((meta, crossing.wait().numpy()))
        return out

    def __len__(self) -> int:
        return len(self._pending)
