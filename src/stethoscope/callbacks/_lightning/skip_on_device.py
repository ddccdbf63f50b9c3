"""A skip decided on the device: the gate's verdict as a tensor, handed to a fused
optimizer as its ``found_inf`` (how PyTorch's GradScaler skips an overflowing step
without waiting for the device), and read back on the host once it has landed.

A fused ``Adam``, ``AdamW`` or ``SGD`` (``fused=True``) given ``found_inf`` = 1 leaves
the weights, its state and its step count exactly as they were, all on the device. The
host learns of the skip when the verdict's copy lands (on a GPU, a step or so later),
and only then climbs the ladder: a cool-down or a roll back starts that much later; the
skip itself was on time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from stethoscope.callbacks._lightning.parameters import total_norm
from stethoscope.recovery import (
    GRADIENT_PAST_BAR,
    LOSS_PAST_BAR,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
    skip_reason,
)

__all__ = [
    "DeviceVerdicts",
    "Landed",
    "skips_on_device",
]


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device (a fused one)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and any(
        group.get("fused") for group in optimizer.param_groups
    )


@dataclass
class Landed:
    """A verdict back on the host: the step, its code and why."""

    step: int
    code: int
    why: str


@dataclass
class _InFlight:
    step: int
    values: torch.Tensor  # [code, loss, norm, loss_bar, grad_bar], on the host once landed
    event: Any  # a CUDA event recorded after the copy, or None (on the CPU)


class DeviceVerdicts:
    """Verdicts computed on the device, and their trip back to the host."""

    def __init__(self) -> None:
        self._flying: deque[_InFlight] = deque()

    def verdict(
        self,
        losses: list[torch.Tensor],
        grads: list[torch.Tensor],
        loss_bar: float | None,
        grad_bar: float | None,
        *,
        scaler_skips_nonfinite: bool,
    ) -> torch.Tensor:
        """The step's code (see :data:`REASONS`) as a 0-d int64 tensor on the gradients'
        device, computed there; a GradScaler's non-finite gradients are left to it."""
        device = grads[0].device if grads else losses[0].device
        norm = total_norm(grads) if grads else torch.zeros((), device=device)
        loss = torch.stack([v.float() for v in losses]).to(device) if losses else norm * 0
        worst = loss.max() if loss.ndim else loss
        loss_bar = math.inf if loss_bar is None else loss_bar
        grad_bar = math.inf if grad_bar is None else grad_bar
        code = torch.zeros((), dtype=torch.int64, device=device)
        code = torch.where(worst > loss_bar, LOSS_PAST_BAR, code)
        code = torch.where(norm > grad_bar, GRADIENT_PAST_BAR, code)
        if not scaler_skips_nonfinite:
            code = torch.where(torch.isfinite(norm), code, NONFINITE_GRADIENT)
        code = torch.where(torch.isfinite(loss).all(), code, NONFINITE_LOSS)
        self._last = (worst, norm, loss_bar, grad_bar)
        return code

    def hand_to(self, optimizer: torch.optim.Optimizer, code: torch.Tensor) -> None:
        """Make the optimizer's next step skip itself when ``code`` is not 0."""
        optimizer.found_inf = (code > 0).float()  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]

    def taken_back(self, optimizer: torch.optim.Optimizer) -> None:
        for name in ("found_inf", "grad_scale"):
            optimizer.__dict__.pop(name, None)

    def send(self, step: int, code: torch.Tensor) -> None:
        """Start the verdict's copy to the host, without waiting for it."""
        worst, norm, loss_bar, grad_bar = self._last
        bars = torch.tensor(
            [math.nan if b is None else b for b in (loss_bar, grad_bar)], device=code.device
        )
        parts = (code.reshape(1), worst.reshape(1), norm.reshape(1), bars)
        values = torch.cat([v.double() for v in parts])
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._flying.append(_InFlight(step, values, event))

    def landed(self, *, wait: bool = False) -> list[Landed]:
        """The verdicts whose copies have arrived, in step order (``wait``: all of them)."""
        out: list[Landed] = []
        while self._flying:
            first = self._flying[0]
            if first.event is not None and not first.event.query():
                if not wait:
                    break
                first.event.synchronize()
            self._flying.popleft()
            code, loss, norm, loss_bar, grad_bar = first.values.tolist()
            code = int(code)
            why = ""
            if code:
                why = skip_reason(code, loss=loss, norm=norm, loss_bar=loss_bar, grad_bar=grad_bar)
            out.append(Landed(first.step, code, why))
        return out
