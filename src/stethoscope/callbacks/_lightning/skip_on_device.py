"""A skip decided on the device: the gate's verdict as a tensor, handed to a fused
optimizer as its ``found_inf`` (how PyTorch's GradScaler skips an overflowing step
without waiting for the device), and read back on the host once it has landed.

A fused ``Adam``, ``AdamW`` or ``SGD`` (``fused=True``) given ``found_inf`` = 1 leaves
the weights, its state and its step count exactly as they were, all on the device. The
host learns of the skip when the verdict's copy lands (on a GPU, a step or so later),
and only then climbs the ladder: a cool-down or a roll back starts that much later; the
skip itself was on time.

Under a GradScaler the scaler hands the fused optimizer a ``found_inf`` of its own (its
gradients overflowed): the optimizer gets the larger of the two, so it skips when
either says so, and the verdict carries the scaler's back to the host too (a step the
scaler skipped is the scaler's, not a skip of the ladder's).

Nothing here waits: the bars the verdict compares against are Python numbers, passed
to the kernels as scalars (a tensor built from them would be a copy from the host,
which waits), and they stay on the host for the verdict's sentence.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from stethoscope.callbacks._lightning.device import Crossing, to_host
from stethoscope.callbacks._lightning.parameters import total_norm
from stethoscope.recovery.settings import (
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
    """A verdict back on the host: the step, its code and why, and whether a GradScaler
    skipped the step itself (its gradients were not finite)."""

    step: int
    code: int
    why: str
    scaler_skipped: bool = False


@dataclass
class _InFlight:
    step: int
    values: Crossing  # [code, loss, norm, the scaler's found_inf], on its way to the host
    loss_bar: float
    grad_bar: float


#: Where an optimizer's ``found_inf`` and ``grad_scale`` were before :meth:`hand_to`
#: (a GradScaler sets them for the step, and deletes them after it).
_ATTRIBUTES = ("found_inf", "grad_scale")


class DeviceVerdicts:
    """Verdicts computed on the device, and their trip back to the host."""

    def __init__(self) -> None:
        self._flying: deque[_InFlight] = deque()
        self._handed: dict[int, tuple[torch.Tensor | None, dict]] = {}

    def verdict(
        self,
        losses: list[torch.Tensor],
        grads: list[torch.Tensor],
        loss_bar: float | None,
        grad_bar: float | None,
        *,
        scaler_skips_nonfinite: bool,
        grad_scale: torch.Tensor | None = None,
        across_ranks: bool = False,
    ) -> torch.Tensor:
        """The step's code (see :data:`REASONS`) as a 0-d int64 tensor on the gradients'
        device, computed there; a GradScaler's non-finite gradients are left to it, and
        the scale it left on them (``grad_scale``) divided out of their norm;
        ``across_ranks``: the gradients are the ranks' slices of them (FSDP1), whose norm
        the ranks combine (see ``total_norm``)."""
        device = grads[0].device if grads else losses[0].device
        norm = total_norm(grads, across_ranks=across_ranks, device=device)
        if grad_scale is not None:
            norm = norm / grad_scale.reshape(())
        loss = torch.stack([v.float() for v in losses]).to(device) if losses else norm * 0
        worst = loss.max() if loss.ndim else loss
        loss_bar = math.inf if loss_bar is None else float(loss_bar)
        grad_bar = math.inf if grad_bar is None else float(grad_bar)
        code = torch.zeros((), dtype=torch.int64, device=device)
        code = torch.where(worst > loss_bar, LOSS_PAST_BAR, code)
        code = torch.where(norm > grad_bar, GRADIENT_PAST_BAR, code)
        if not scaler_skips_nonfinite:
            code = torch.where(torch.isfinite(norm), code, NONFINITE_GRADIENT)
        code = torch.where(torch.isfinite(loss).all(), code, NONFINITE_LOSS)
        self._last = (worst, norm, loss_bar, grad_bar)
        return code

    def hand_to(self, optimizer: torch.optim.Optimizer, code: torch.Tensor) -> None:
        """Make the optimizer's next step skip itself when ``code`` is not 0, or when the
        GradScaler that is stepping it found its gradients not finite."""
        held = optimizer.__dict__
        scalers = held.get("found_inf")  # set by GradScaler.step for a fused optimizer
        self._handed[id(optimizer)] = (scalers, {k: held[k] for k in _ATTRIBUTES if k in held})
        skip = (code > 0).float()
        if scalers is None:
            optimizer.found_inf = skip  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
        else:  # the scaler's grad_scale stays as it set it
            optimizer.found_inf = torch.maximum(scalers, skip)  # type: ignore[attr-defined]

    def taken_back(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Leave the optimizer's ``found_inf`` and ``grad_scale`` as they were; the
        GradScaler's ``found_inf`` of the step (None: no scaler)."""
        scalers, before = self._handed.pop(id(optimizer), (None, {}))
        for name in _ATTRIBUTES:
            optimizer.__dict__.pop(name, None)
        optimizer.__dict__.update(before)
        return scalers

    def send(self, step: int, code: torch.Tensor, scalers: torch.Tensor | None) -> None:
        """Start the verdict's copy to the host, without waiting for it (``scalers``: the
        GradScaler's ``found_inf`` of the step, if any)."""
        worst, norm, loss_bar, grad_bar = self._last
        scaler = torch.zeros_like(norm) if scalers is None else scalers.reshape(-1)[0].float()
        parts = (code.reshape(1), worst.reshape(1), norm.reshape(1), scaler.reshape(1))
        values = torch.cat([v.double() for v in parts])
        self._flying.append(_InFlight(step, to_host(values), loss_bar, grad_bar))

    def landed(self, *, wait: bool = False) -> list[Landed]:
        """The verdicts whose copies have arrived, in step order (``wait``: all of them)."""
        out: list[Landed] = []
        while self._flying:
            first = self._flying[0]
            if not wait and not first.values.landed():
                break
            self._flying.popleft()
            code, loss, norm, scaler = first.values.wait().tolist()
            code = int(code)
            why = ""
            if code:
                why = skip_reason(
                    code, loss=loss, norm=norm, loss_bar=first.loss_bar, grad_bar=first.grad_bar
                )
            out.append(Landed(first.step, code, why, scaler_skipped=scaler > 0))
        return out
