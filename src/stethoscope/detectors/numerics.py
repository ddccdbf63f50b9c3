"""Non-finite values: in the loss, the gradients and the weights."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["NonfiniteGradients", "NonfiniteLoss", "NonfiniteWeights"]


def _describe(x: float) -> str:
    return "NaN" if np.isnan(x) else ("+Inf" if x > 0 else "-Inf")


class NonfiniteLoss(Detector):
    """The training loss is NaN or ±Inf.

    Rule: any non-finite minibatch loss is an error, at once. This is the
    every-step sentinel (SageMaker Debugger ``exploding_tensor``, Keras
    ``TerminateOnNaN``, AutoTrainer's NaN-loss check); it reads a scalar the
    adapter keeps on the device, so it costs no synchronisation.
    """

    name = "nonfinite_loss"
    needs = frozenset({"loss"})
    base_interval = 1
    advice = "check the batch; lower the LR or clip gradients"

    def _update(self, obs: Observation) -> list[Finding]:
        loss = obs.loss
        if loss is None or math.isfinite(loss):  # math, not numpy: this runs every step
            return []
        return [
            self.finding(
                obs,
                "error",
                f"The training loss is {_describe(loss)} at step {obs.step}: the forward pass or "
                "the loss produced it (log/sqrt/division at 0, a NaN in the batch, or weights "
                "that overflowed); check that batch, lower the learning rate or clip gradients.",
                value=loss,
                where="loss",
            )
        ]


class NonfiniteGradients(Detector):
    """A gradient holds NaN or ±Inf.

    Rule: any parameter whose gradient norm is non-finite (a norm is NaN/Inf
    exactly when the tensor holds a NaN/Inf, or overflows) is an error. The
    finding names the first such parameter in backward order, the one nearest
    the output, which is where the non-finite value entered the backward pass.
    """

    name = "nonfinite_gradients"
    needs = frozenset({"grads"})
    base_interval = 16
    advice = "look for log/sqrt/div at 0; lower the LR"

    def _update(self, obs: Observation) -> list[Finding]:
        bad = ~np.isfinite(obs.grad_norm)
        if not bad.any():
            return []
        idx = np.flatnonzero(bad)
        first = int(idx[-1])  # registration order runs input → output; backward runs the other way
        value = float(obs.grad_norm[first])
        return [
            self.finding(
                obs,
                "error",
                f"The gradient of {obs.names[first]} is {_describe(value)} at step {obs.step}, "
                f"the first non-finite one in backward order ({len(idx)} of {len(bad)} "
                "parameters): the backward pass overflowed or hit an undefined op; look for "
                "log/sqrt/division at 0 near that layer, lower the learning rate or clip "
                "gradients.",
                value=value,
                where=obs.names[first],
            )
        ]


class NonfiniteWeights(Detector):
    """A weight became NaN or ±Inf after an optimizer step.

    Rule: any parameter whose norm after the step is non-finite is an error. The
    model cannot recover from this: the message says to restart from a checkpoint.
    """

    name = "nonfinite_weights"
    needs = frozenset({"weights"})
    base_interval = 16
    advice = "restart from a checkpoint with a lower LR"

    def _update(self, obs: Observation) -> list[Finding]:
        bad = ~np.isfinite(obs.weight_norm)
        if not bad.any():
            return []
        idx = np.flatnonzero(bad)
        first = int(idx[0])
        value = float(obs.weight_norm[first])
        return [
            self.finding(
                obs,
                "error",
                f"The weights of {obs.names[first]} are {_describe(value)} after the optimizer "
                f"step {obs.step} ({len(idx)} of {len(bad)} parameters): the update diverged and "
                "the model cannot recover; restart from a checkpoint with a lower learning rate "
                "or gradient clipping.",
                value=value,
                where=obs.names[first],
            )
        ]
