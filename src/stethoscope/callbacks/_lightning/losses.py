"""The losses a LightningModule hands the hooks: the training loss of a step, and the
validation loss of an epoch."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from stethoscope.callbacks._lightning import device

__all__ = ["TrainingLosses", "ValidationLosses", "training_loss"]

#: Metrics that hold a validation loss when ``validation_step`` does not return it.
VAL_LOSS_KEYS = ("val_loss", "val/loss", "validation_loss")


def training_loss(outputs: Any, trainer: Any, pl_module: Any) -> torch.Tensor | None:
    """The step's loss as a detached scalar tensor on its device; None when
    ``training_step`` returned none (neither a scalar nor ``{"loss": scalar}``)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, (int, float)):
        return torch.tensor(float(loss))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    loss = loss.detach()
    k = _divided_by(trainer, pl_module)
    return loss * k if k > 1 else loss


def _divided_by(trainer: Any, pl_module: Any) -> int:
    """What Lightning divided the returned loss by: the accumulation factor, under
    automatic optimization (1: nothing)."""
    k = trainer.accumulate_grad_batches
    return k if k > 1 and pl_module.automatic_optimization else 1


class TrainingLosses:
    """Each step's training loss: what ``training_step`` returned, else (manual
    optimization returns nothing as often as not) the one loss the step backpropagated
    through ``manual_backward``; a warning, once, when a step has neither.

    A step that backpropagates several losses (a GAN's players, layer-wise training) has
    no one training loss: their sum would judge none of them, so they are left alone."""

    def __init__(self) -> None:
        self.warned = False
        #: Whether the callback must hand it every step's backward passes: a step returned
        #: no loss (until then the backward hook is off where nothing else needs it).
        self.hearing = False
        #: The step's losses handed to ``on_before_backward``, held (not copied: this runs
        #: on every step) until the step ends.
        self._backward: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor) -> None:
        """A loss the step backpropagates (``on_before_backward``)."""
        self._backward.append(loss)

    def __call__(self, outputs: Any, trainer: Any, pl_module: Any) -> torch.Tensor | None:
        backward, self._backward = self._backward, []
        loss = training_loss(outputs, trainer, pl_module)
        if loss is None and len(backward) == 1:
            loss = training_loss(backward[0], trainer, pl_module)
        if loss is None and not self.hearing:  # the next steps' backward passes will tell
            self.hearing = True
        elif loss is None and not self.warned:
            self.warned = True
            warnings.warn(
                "stethoscope: training_step returned no scalar loss"
                + _backpropagated(len(backward))
                + ", so the loss detectors (nonfinite_loss, loss_spike, loss_not_decreasing, "
                "unstable_loss) are skipped; return the loss or {'loss': loss} to enable them",
                RuntimeWarning,
                stacklevel=3,
            )
        return loss

    def on_cpu(self, outputs: Any, trainer: Any, pl_module: Any) -> float | None:
        """The step's loss as a number when it is a scalar tensor in host memory, which
        reading does not synchronise (None otherwise: see :meth:`__call__`). Every
        unsampled step asks, so this is :func:`training_loss` with only the checks that
        number needs."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is None and len(self._backward) == 1:
            loss = self._backward[0]
        if type(loss) is not torch.Tensor or not device.is_host(loss.device) or loss.numel() != 1:
            return None  # the step's backward losses are left for __call__
        self._backward.clear()
        # scaled on the host: a tensor product would be an operator call on every batch
        k = _divided_by(trainer, pl_module)
        return loss.item() * k if k > 1 else loss.item()


def _backpropagated(count: int) -> str:
    """How many losses a step without a returned loss backpropagated, as a clause."""
    if count == 0:
        return " and backpropagated none through manual_backward"
    return f" and backpropagated {count} losses, none of them the training loss"


class ValidationLosses:
    """The validation loss of an epoch: the mean of what ``validation_step`` returned on
    the first dataloader, else the logged metric.

    Args:
        key: The logged metric to read (default: the first of :data:`VAL_LOSS_KEYS`).
    """

    def __init__(self, key: str | None = None) -> None:
        self.keys = (key,) if key else VAL_LOSS_KEYS
        self._losses: list[torch.Tensor] = []

    def add(self, outputs: Any) -> None:
        """Keep a batch's loss (``loss`` or ``val_loss`` of a dict, or the scalar itself),
        on its device."""
        loss = (
            outputs.get("loss", outputs.get("val_loss"))
            if isinstance(outputs, Mapping)
            else outputs
        )
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(1).float())

    def take(self, trainer: Any) -> float | None:
        """The epoch's validation loss (None if none was returned or logged); forget the
        batches."""
        losses, self._losses = self._losses, []
        if losses:
            return float(torch.cat(losses).mean())  # once per validation: a sync is fine
        for key in self.keys:
            value = trainer.callback_metrics.get(key)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return float(value)
            if isinstance(value, (int, float)):
                return float(value)
        return None
