"""What the update detectors share: the update ratio of each weight matrix, and why a
step moved the parameters it stepped next to nothing (no learning rate is the cause)."""

from __future__ import annotations

import numpy as np

from stethoscope.advice import TrainingSetup
from stethoscope.detectors._stats import is_finite, median
from stethoscope.number_formats import HALF
from stethoscope.observation import Observation

__all__ = ["MOVED", "line_search_note", "listed", "unmoved_cause", "update_ratios"]


def update_ratios(obs: Observation) -> tuple[np.ndarray, np.ndarray]:
    """||Δw|| / ||w|| of each weight matrix with non-zero weights, and their indices.

    ``w`` is the weight before the step when the adapter measured it (else after):
    a step that moves a weight of norm 0.1 by 1 is a ratio of 10, not of ~1.
    """
    mats = np.flatnonzero(obs.is_matrix) if obs.is_matrix is not None else np.arange(len(obs.names))
    base = obs.prev_weight_norm if obs.prev_weight_norm is not None else obs.weight_norm
    w = base[mats]
    keep = np.isfinite(w) & (w > 0) & np.isfinite(obs.update_norm[mats])
    idx = mats[keep]
    return obs.update_norm[idx] / base[idx], idx


#: The median update ratio of the parameters that moved, below which nothing really moved;
#: also the least ratio a step could move a float32 weight by (its rounding: ~6e-8).
MOVED = 1e-6


def line_search_note(setup: TrainingSetup) -> str:
    """Why an update ratio's healthy band says nothing of a line search's steps."""
    return (
        f"{setup.line_search} takes each step as a search over many calls of its closure, "
        "as long as the search finds: the size of its update is not a learning rate times "
        "a gradient, and the healthy band of the update ratio does not hold"
    )


def listed(names: tuple[str, ...] | list[str], shown: int = 5) -> str:
    """The first ``shown`` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unmoved_cause(obs: Observation, adaptive: bool) -> str | None:
    """Why the step moved the parameters it stepped (next to) nothing, where a small
    learning rate cannot be the cause, at a learning rate above 0:

    * ``"no gradient"``: every gradient of the parameters stepped is exactly zero: no
      learning rate moves them (an optimizer with momentum drifts a little);
    * ``"not applied"``: every update is exactly zero though the gradients are not, and
      a step at this learning rate would move the weights by over ``MOVED`` of their
      norm, which float32 never rounds away (16-bit weights round theirs away:
      ``rounded_updates``' finding): the optimizer's update does not reach them.

    None otherwise, or where the observation cannot tell (no gradients measured)."""
    upd, grads = obs.update_norm, obs.grad_norm
    if not is_finite(obs.lr) or obs.lr <= 0 or upd is None or grads is None:
        return None
    if len(upd) == 0 or len(grads) != len(upd):
        return None
    seen = np.isfinite(grads)
    if seen.any() and np.all(grads[seen] == 0):
        return "no gradient"
    measured = np.isfinite(upd)
    if not measured.any() or np.any(upd[measured] != 0):
        return None
    if any(d in HALF for d in obs.dtypes):
        return None
    base = obs.prev_weight_norm if obs.prev_weight_norm is not None else obs.weight_norm
    if base is None or obs.numel is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        # what the step would move each weight by: about the learning rate per element
        # under an adaptive optimizer, the learning rate times the gradient under SGD
        step = np.sqrt(obs.numel) if adaptive else grads
        would = obs.lr * step / base
    keep = measured & seen & np.isfinite(would) & (base > 0)
    if keep.any() and median(would[keep].tolist()) >= MOVED:
        return "not applied"
    return None
