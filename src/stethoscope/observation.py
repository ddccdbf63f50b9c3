"""What a framework adapter hands the monitor for one step: host-side numbers only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PROBES", "Observation"]

#: The probes an adapter can run. ``loss`` is the every-step sentinel; the
#: others reduce every parameter and run only on steps the sampler selects.
PROBES: tuple[str, ...] = ("loss", "grads", "weights", "updates")


@dataclass
class Observation:
    """The statistics of one optimizer step, reduced on the device, read once.

    Per-parameter arrays are aligned with ``names`` and are ``None`` when their
    probe did not run this step.

    Args:
        step: Global optimizer step (0-based).
        epoch: Training epoch (0-based).
        rank: Process rank.
        loss: The training loss of the batch (NaN/Inf kept as is).
        lr: The learning rate of the first parameter group, if known.
        names: Parameter names, in registration order (input side first).
        numel: Number of elements of each parameter.
        is_matrix: Whether each parameter has two or more dimensions (a weight
            matrix or kernel rather than a bias or norm scale).
        grad_norm: L2 norm of each parameter's gradient, before clipping.
        weight_norm: L2 norm of each parameter after the optimizer step.
        update_norm: L2 norm of each parameter's change made by the step.
    """

    step: int
    epoch: int = 0
    rank: int = 0
    loss: float | None = None
    lr: float | None = None
    names: tuple[str, ...] = ()
    numel: np.ndarray | None = None
    is_matrix: np.ndarray | None = None
    grad_norm: np.ndarray | None = None
    weight_norm: np.ndarray | None = None
    update_norm: np.ndarray | None = None

    def has(self, probe: str) -> bool:
        """Whether the data of ``probe`` is present."""
        if probe == "loss":
            return self.loss is not None
        return getattr(self, _PROBE_FIELD[probe]) is not None


_PROBE_FIELD = {"grads": "grad_norm", "weights": "weight_norm", "updates": "update_norm"}


def global_norm(norms: np.ndarray) -> float:
    """The L2 norm of all tensors together, from their individual L2 norms."""
    return float(np.sqrt(np.sum(np.square(norms, dtype=np.float64))))
