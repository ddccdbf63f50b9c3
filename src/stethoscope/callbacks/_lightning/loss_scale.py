"""The loss scale a step's gradients still carry when the callback measures them.

Under ``precision="16-mixed"`` Lightning's precision plugin unscales the gradients
(``GradScaler.unscale_``) before ``on_before_optimizer_step``, except for an optimizer
that unscales inside its own step (a fused ``Adam``, ``AdamW`` or ``SGD``: Lightning
leaves it to the optimizer, which the GradScaler hands its scale). Its gradients then
reach the hook multiplied by the scale (2**16 at first), and every gradient statistic
measured there must divide it out.

DeepSpeed's fp16 (``DeepSpeedStrategy``, ``precision="16-mixed"``) scales the loss with a
loss scaler of its own and unscales the gradients inside its step: they too reach the
hook multiplied by its scale.
"""

from __future__ import annotations

from typing import Any

import torch

from stethoscope.callbacks._lightning.zero import is_deepspeed_optimizer

__all__ = ["pending_scale", "scaler_of"]


def scaler_of(trainer: Any) -> Any:
    """The GradScaler of ``trainer``'s precision plugin (16-mixed), or None."""
    return getattr(trainer.strategy.precision_plugin, "scaler", None)


def pending_scale(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scale ``optimizer``'s gradients carry at ``on_before_optimizer_step``, a 1-element
    tensor (a GradScaler's, on the device: reading it would wait; DeepSpeed's, on the
    host), or None when they carry none."""
    if is_deepspeed_optimizer(optimizer):
        return _deepspeed_scale(optimizer)
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    return getattr(scaler, "_scale", None)  # the GradScaler's own tensor: no copy


def _deepspeed_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale of DeepSpeed's optimizer, a number its loss scaler keeps on the host
    (``loss_scale``), as a 0-dimensional host tensor: dividing a device tensor by it
    copies nothing to the device. None at 1 (bf16 and float32 keep a static 1)."""
    scale = getattr(optimizer, "loss_scale", None)
    if not isinstance(scale, (int, float)) or scale == 1:
        return None
    return torch.tensor(float(scale))
