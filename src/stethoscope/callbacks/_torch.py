"""Torch-side probes: fused per-parameter reductions and non-blocking host reads.

Everything here runs on the device the tensors live on. The only way numbers
reach the host is :class:`HostReader`, which on CUDA copies into pinned memory
with ``non_blocking=True`` and polls a CUDA event, so the training stream is
never synchronised; a result is read at most ``max_lag`` steps after it was
produced (then, and only then, the reader waits for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["HostReader", "ParameterProbe"]


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


class ParameterProbe:
    """Fused reductions over a fixed, ordered set of named parameters.

    Args:
        named_parameters: ``(name, parameter)`` pairs in registration order; only
            those that require grad are watched.
    """

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        pairs = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.names: tuple[str, ...] = tuple(n for n, _ in pairs)
        self.params: list[torch.nn.Parameter] = [p for _, p in pairs]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.numel = np.array([p.numel() for p in self.params], dtype=np.float64)
        self.is_matrix = np.array([p.dim() >= 2 for p in self.params], dtype=bool)

    def indices_of(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Indices of the watched parameters this optimizer updates."""
        seen = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self.index.get(id(p))
                if i is not None:
                    seen.append(i)
        return seen

    def with_grad(self, indices: Sequence[int]) -> list[int]:
        """The indices whose parameter has a gradient this step."""
        return [i for i in indices if self.params[i].grad is not None]

    def grad_norms(self, indices: Sequence[int]) -> torch.Tensor:
        """L2 norm of each gradient, as one float32 tensor on the device."""
        return _stack_norms([self.params[i].grad.detach() for i in indices])

    def snapshot(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Copies of these parameters, to measure the optimizer's update against."""
        return torch._foreach_mul([self.params[i].detach() for i in indices], 1.0)

    def weight_and_update_norms(
        self, indices: Sequence[int], before: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Norms of the weights now, and of their change since ``before``."""
        now = [self.params[i].detach() for i in indices]
        weights = _stack_norms(now)
        if before is None:
            return weights, None
        torch._foreach_sub_(before, now)  # reuse the snapshot's memory for the difference
        return weights, _stack_norms(before)


def _stack_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All L2 norms in one fused kernel, accumulated in float32, stacked into one tensor.

    Accumulating in float32 keeps an fp16/bf16 tensor of large but finite values from
    reporting an infinite norm (which would read as a non-finite gradient).
    """
    if all(t.dtype != torch.float64 for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    # float64 cannot be narrowed inside the norm: take those apart, keep the order
    out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    rest = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    for idx, kw in ((wide, {}), (rest, {"dtype": torch.float32})):
        if idx:
            norms = torch._foreach_norm([tensors[i] for i in idx], 2, **kw)
            for i, n in zip(idx, norms, strict=True):
                out[i] = n.float()
    return torch.stack(out)
