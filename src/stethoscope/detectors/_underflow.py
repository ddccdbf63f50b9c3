"""Where a zero or vanishing gradient is precision's: 16-bit gradients with no loss
scaling, below the smallest normal value of their format (held in it, or computed in it
under ``torch.autocast`` and held in float32: see :func:`gradient_dtypes`).
``gradient_underflow`` names it, and the detectors that would read the same gradient as
a dead layer, a vanished signal or a frozen part leave it to that finding (their advice
would send the user to the model, where the format is the cause)."""

from __future__ import annotations

import numpy as np

from stethoscope.advice import TrainingSetup
from stethoscope.number_formats import FORMATS, HALF, NumberFormat
from stethoscope.observation import Observation

__all__ = ["flushed", "gradient_dtypes", "half", "underflow_format"]


def gradient_dtypes(obs: Observation, setup: TrainingSetup | None = None) -> list[str]:
    """The dtype each parameter's gradient of ``obs`` was computed in: the one it is held
    in, or the 16-bit one the forward pass computes in (``TrainingSetup.computes_in``) for
    one held in float32. An autocast backward pass computes a float32 weight's gradient
    in float16 and casts it up: it has float16's range, and what fell below it is lost."""
    computes_in = setup.computes_in if setup is not None else None
    if computes_in is None:
        return list(obs.dtypes)
    return [computes_in if d == "float32" else d for d in obs.dtypes]


def half(obs: Observation, setup: TrainingSetup | None = None) -> np.ndarray:
    """Which parameters of ``obs`` have gradients computed in a 16-bit format (held in
    it, or computed in it: see :func:`gradient_dtypes`)."""
    return np.array([d in HALF for d in gradient_dtypes(obs, setup)], dtype=bool)


def _unscaled_loss(obs: Observation, setup: TrainingSetup) -> bool:
    """No loss scaler, and a finite loss above zero: there is a gradient to lose."""
    loss = obs.loss
    return not setup.loss_scaled and loss is not None and bool(np.isfinite(loss)) and loss > 0


def flushed(obs: Observation, setup: TrainingSetup, judged: np.ndarray | None = None) -> bool:
    """Whether the whole 16-bit backward pass flushed to zero: no loss scaling, a finite
    loss above zero, and every element of every 16-bit gradient (of ``judged``, default
    every measured one) exactly zero, the output layer's too, which a dead unit or an
    unused input leaves standing. Read from ``grad_zero`` where the precision probe
    measured it, else from the gradient norms (a norm of 0 is all elements zero)."""
    if len(obs.dtypes) != len(obs.names) or not _unscaled_loss(obs, setup):
        return False
    if obs.grad_zero is not None:
        zero = np.asarray(obs.grad_zero, dtype=np.float64) >= 1.0
    elif obs.grad_norm is not None:
        zero = np.asarray(obs.grad_norm, dtype=np.float64) == 0
    else:
        return False
    if judged is None:
        seen = obs.grad_zero if obs.grad_zero is not None else obs.grad_norm
        judged = half(obs, setup) & np.isfinite(np.asarray(seen, dtype=np.float64))
    return bool(judged.any() and np.all(zero[judged]))


def underflow_format(
    obs: Observation, setup: TrainingSetup, which: np.ndarray, rms: float
) -> NumberFormat | None:
    """The 16-bit format in which the gradients of the parameters ``which`` (a boolean
    mask or indices), of root-mean-square ``rms`` per element, lie below the smallest
    normal value, unscaled: subnormal or flushed to zero, precision's finding and not a
    vanished signal's. None where any of them is not computed in 16 bits, a loss scaler lifts them,
    or they are within the format's normal range."""
    if len(obs.dtypes) != len(obs.names) or not _unscaled_loss(obs, setup):
        return None
    computed = gradient_dtypes(obs, setup)
    dtypes = {computed[i] for i in np.arange(len(obs.names))[which]}
    if len(dtypes) != 1 or not dtypes <= HALF:
        return None
    fmt = FORMATS[dtypes.pop()]
    return fmt if rms < fmt.tiny else None
