"""How far the batch norms' running statistics are from their batches': the
``val_norms`` statistic in torch (its definition: ``stethoscope.running_statistics``).

At the training's start each batch norm that keeps running statistics with a momentum is
copied (its mean, variance and ``num_batches_tracked``: two vectors of its channels and a
count, on its device). At a validation the error of each is worked out from the copy and
the buffers, on their device, and read back at once: one read a validation, none a step.
``num_batches_tracked`` counts the training-mode forward passes that moved them, whatever
a step holds (accumulated micro-batches, a game's several passes). A momentum of None
(a cumulative average) holds nothing of its start after one batch, and is left out.
"""

from __future__ import annotations

import torch
from torch import nn

from stethoscope.running_statistics import StatisticsLag, lag_error

__all__ = ["RunningStatisticsWatch"]


class RunningStatisticsWatch:
    """The batch norms of a fit, copied at its training's start."""

    def __init__(self) -> None:
        self._norms: list[tuple[str, nn.modules.batchnorm._BatchNorm, tuple]] = []

    @property
    def watching(self) -> bool:
        """Whether the model has a batch norm whose running statistics move."""
        return bool(self._norms)

    def start(self, module: nn.Module) -> None:
        """Copy the running statistics that each step moves (none: nothing to measure)."""
        self._norms = []
        with torch.no_grad():
            for name, m in module.named_modules():
                if (
                    isinstance(m, nn.modules.batchnorm._BatchNorm)
                    and m.track_running_stats
                    and m.momentum is not None
                    and m.running_mean is not None
                ):
                    start = (m.running_mean, m.running_var, m.num_batches_tracked)
                    self._norms.append((name, m, tuple(t.clone() for t in start)))

    def measure(self) -> StatisticsLag | None:
        """The norm furthest from its batches, or None: none moved since the start."""
        if not self._norms:
            return None
        rows = []
        device = self._norms[0][1].running_mean.device
        with torch.no_grad():
            for _, m, (mean0, var0, count0) in self._norms:
                updates = (m.num_batches_tracked - count0).float()
                share = (1.0 - float(m.momentum)) ** updates
                mean, var = m.running_mean.float(), m.running_var.float()  # bf16 cancels
                error = lag_error(mean0.float(), var0.float(), mean, var, share, m.eps)
                error = torch.where(share < 1, error.float(), 0.0)  # unmoved: 0, not 0/0
                rows.append(torch.stack([error, share, updates]).to(device))
        table = torch.stack(rows).tolist()  # the one read of a validation
        i = max(range(len(table)), key=lambda j: table[j][0])
        error, share, updates = table[i]
        if updates < 1:
            return None
        name, m, _ = self._norms[i]
        return StatisticsLag(name, f"momentum={float(m.momentum):g}", error, share, int(updates))
