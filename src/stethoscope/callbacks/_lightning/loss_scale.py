"""The loss scale a step's gradients still carry when the callback measures them.

Under ``precision="16-mixed"`` Lightning's precision plugin unscales the gradients
(``GradScaler.unscale_``) before ``on_before_optimizer_step``, except for an optimizer
that unscales inside its own step (a fused ``Adam``, ``AdamW`` or ``SGD``: Lightning
leaves it to the optimizer, which the GradScaler hands its scale). Its gradients then
reach the hook multiplied by the scale (2**16 at first), and every gradient statistic
measured there must divide it out.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pending_scale", "scaler_of"]


def scaler_of(trainer: Any) -> Any:
    """The GradScaler of ``trainer``'s precision plugin (16-mixed), or None."""
    return getattr(trainer.strategy.precision_plugin, "scaler", None)


def pending_scale(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scale ``optimizer``'s gradients carry at ``on_before_optimizer_step``, a 1-element
    tensor on the device (reading it would wait), or None when they carry none."""
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    return getattr(scaler, "_scale", None)  # the GradScaler's own tensor: no copy
