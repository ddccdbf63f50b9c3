"""Builders for synthetic observations and the sequences the detector units feed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

#: Four parameters in registration order (input side first): two matrices, two biases.
NAMES = ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias")
IS_MATRIX = (True, False, True, False)
NUMEL = (784 * 128, 128, 128 * 10, 10)


def _array(x: Sequence[float] | np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.asarray(x, dtype=np.float64)


def make_obs(
    step: int,
    *,
    loss: float | None = None,
    lr: float | None = None,
    grads: Sequence[float] | np.ndarray | None = None,
    weights: Sequence[float] | np.ndarray | None = None,
    updates: Sequence[float] | np.ndarray | None = None,
    names: Sequence[str] | None = None,
    is_matrix: Sequence[bool] | None = None,
    numel: Sequence[int] | None = None,
    epoch: int = 0,
    rank: int = 0,
) -> Observation:
    """An observation; per-parameter fields default to :data:`NAMES` when their length is 4."""
    arrays = [a for a in (grads, weights, updates) if a is not None]
    n = len(arrays[0]) if arrays else 0
    if names is None:
        names = NAMES if n == len(NAMES) else tuple(f"p{i}" for i in range(n))
    if is_matrix is None:
        is_matrix = IS_MATRIX if n == len(NAMES) else (True,) * n
    if numel is None:
        numel = NUMEL if n == len(NAMES) else (1000,) * n
    return Observation(
        step=step,
        epoch=epoch,
        rank=rank,
        loss=None if loss is None else float(loss),
        lr=lr,
        names=tuple(names),
        numel=np.asarray(numel, dtype=np.int64),
        is_matrix=np.asarray(is_matrix, dtype=bool),
        grad_norm=_array(grads),
        weight_norm=_array(weights),
        update_norm=_array(updates),
    )


def loss_obs(losses: Iterable[float], *, lr: float | Sequence[float] | None = None):
    """One loss-only observation per value, at steps 0, 1, 2 …"""
    losses = list(losses)
    lrs = [lr] * len(losses) if lr is None or np.isscalar(lr) else list(lr)
    return [
        make_obs(t, loss=x, lr=None if r is None else float(r))
        for t, (x, r) in enumerate(zip(losses, lrs, strict=True))
    ]


def grad_obs(grads: np.ndarray, losses: Iterable[float] | None = None, **kw):
    """One gradient observation per row of ``grads`` (samples × parameters)."""
    grads = np.asarray(grads, dtype=np.float64)
    losses = [2.3] * len(grads) if losses is None else list(losses)
    return [
        make_obs(t, loss=x, grads=g, **kw)
        for t, (g, x) in enumerate(zip(grads, losses, strict=True))
    ]


def run(detector: Detector, observations: Iterable[Observation]) -> list[Finding]:
    """Feed every observation in order; return every finding."""
    found: list[Finding] = []
    for obs in observations:
        found.extend(detector.update(obs))
    return found


def alarms(findings: Iterable[Finding]) -> list[Finding]:
    """The warnings and errors among ``findings``."""
    return [f for f in findings if f.severity.rank >= 1]
