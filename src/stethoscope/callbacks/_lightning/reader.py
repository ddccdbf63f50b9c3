"""Numbers from the device to the host, in order, without synchronising the device.

On CUDA a reading is copied into pinned memory with ``non_blocking=True`` and a CUDA
event is recorded; the reading is taken once the event has completed, so the training
stream is never synchronised. A reading is taken at most ``max_lag`` steps after it was
produced (then, and only then, the reader waits for it).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["HostReader"]


class HostReader:
    """Moves small 1-D device tensors to the host in order, without blocking.

    Args:
        max_lag: How many pushes a CUDA result may wait before the reader blocks
            on it. This bounds the detection delay, in steps, on a GPU; on the
            CPU results are read at once.
    """

    def __init__(self, max_lag: int = 2) -> None:
        self.max_lag = max_lag
        self._pending: deque[tuple[Any, torch.Tensor, Any]] = deque()

    def push(self, meta: Any, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            self._pending.append((meta, host, event))
        else:
            # CPU: nothing to wait for. Other accelerators: a plain copy (may synchronise).
            self._pending.append((meta, tensor.cpu(), None))

    def pop(self, *, wait: bool = False) -> list[tuple[Any, np.ndarray]]:
        """The results whose copies are done, oldest first (all of them if ``wait``)."""
        out: list[tuple[Any, np.ndarray]] = []
        while self._pending:
            meta, host, event = self._pending[0]
            if event is not None and not event.query():
                if not wait and len(self._pending) <= self.max_lag:
                    break
                event.synchronize()  # the lag bound: never more than max_lag steps behind
            self._pending.popleft()
            out.append((meta, host.numpy()))
        return out

    def __len__(self) -> int:
        return len(self._pending)
