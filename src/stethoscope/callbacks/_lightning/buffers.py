"""The module's buffers as a step found them, for the recovery ladder: a step it skips
(or computes again) puts them back. A training forward pass moves them before any
verdict: ``BatchNorm``'s running statistics take the batch's mean and variance, NaN
included, and its count goes up. Skipping the optimizer's step alone would leave a bad
batch in them, and every evaluation after it NaN."""

from __future__ import annotations

import torch

__all__ = ["StepBuffers"]


class StepBuffers:
    """A copy of every buffer of ``module``, kept at the start of each step into tensors
    made once: a device-side copy, no wait and no allocation per step (nothing at all for
    a module without buffers).

    Args:
        module: The LightningModule being trained.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._buffers = list(module.buffers())
        self._kept = [torch.empty_like(b) for b in self._buffers]

    def keep(self) -> None:
        """The step begins: keep the buffers as they are."""
        if self._buffers:
            torch._foreach_copy_(self._kept, self._buffers)

    def put_back(self) -> None:
        """The step is skipped (or computed again): the buffers as it found them."""
        if self._buffers:
            torch._foreach_copy_(self._buffers, self._kept)
