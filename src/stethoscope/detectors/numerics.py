"""Non-finite values: in the loss, the gradients and the weights."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.advice import epsilon_advice, epsilon_cause, float16_note
from stethoscope.detectors.base import (
    Detector,
    Losses,
    Rates,
    Steps,
    check_positive,
)
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

    If training goes on (``stop_on`` did not stop it), the detector asks for the
    ``trace`` probe on the next step: forward hooks on every module name the first
    one whose output is non-finite, or tell that the problem did not recur (one
    bad batch) or that the model's outputs were finite (the loss function itself).
    A targeted ``detect_anomaly`` that costs nothing on healthy steps.
    """

    name = "nonfinite_loss"
    needs = frozenset({"loss"})
    requests = frozenset({"trace"})  # the forward trace after a non-finite loss
    base_interval = 1
    advice = "check the batch; lower the LR or clip gradients"

    def current_advice(self) -> str:
        return "check the batch; lower the LR" if self.setup.clipping else self.advice

    def _initial_state(self) -> dict:
        return {"tracing": None}  # the step whose non-finite loss the next trace explains

    def waits_below(self, steps: int) -> float | None:
        return math.inf  # a non-finite loss never waits: any finite one may

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        # a finite loss changes nothing here, unless a trace is awaited
        return len(losses) if self.state["tracing"] is None else start

    def _update(self, obs: Observation) -> list[Finding]:
        loss = obs.loss
        if loss is not None and math.isfinite(loss) and self.quiet(obs.step, loss, obs.lr):
            return []
        findings: list[Finding] = []
        tracing = self.state["tracing"]
        if tracing is not None and obs.trace_finite is not None and obs.step > tracing:
            findings.append(self._located(obs, tracing))
            self.state["tracing"] = None
        if loss is None or math.isfinite(loss):  # math, not numpy: this runs every step
            if self.state["tracing"] is not None:
                self.request = frozenset({"trace"})
            return findings
        if self.state["tracing"] is None:
            self.state["tracing"] = obs.step
        self.request = frozenset({"trace"})
        findings.append(
            self.finding(
                obs,
                "error",
                f"The training loss is {_describe(loss)} at step {obs.step}: the forward pass or "
                "the loss produced it (log/sqrt/division at 0, a NaN in the batch, or weights "
                "that overflowed); the next step's trace says where it began. Check that "
                f"batch first, then the learning rate.{float16_note(self.setup)}",
                value=loss,
                where="loss",
            )
        )
        return findings

    def _located(self, obs: Observation, origin: int) -> Finding:
        bad = np.flatnonzero(np.asarray(obs.trace_finite) == 0)
        if len(bad):
            where = obs.trace_names[int(bad[0])]
            if bad[0] == 0:  # the very first module: what it was given is the likely cause
                cause = (
                    "the first module of all: what it was given (the batch: check the data "
                    "pipeline) or its own weights (nonfinite_weights says whether they went "
                    "bad) carry the non-finite value"
                )
            else:
                cause = (
                    f"after {bad[0]} finite module output(s): its input is finite, so its "
                    "weights or its operation (overflow, log/sqrt/division at 0) produce it; "
                    "inspect that module"
                )
            return self.finding(
                obs,
                "error",
                f"Traced at step {obs.step} (after the non-finite loss at step {origin}): the "
                f"first module whose output is non-finite is {where} (in forward order), "
                f"{cause}.{float16_note(self.setup)}",
                value=float(len(bad)),
                where=where,
            )
        if obs.loss is not None and not math.isfinite(obs.loss):
            return self.finding(
                obs,
                "error",
                f"Traced at step {obs.step}: every module output is finite but the loss is "
                f"{_describe(obs.loss)}, so the loss function produces it (log of 0, division "
                "by zero, a bad reduction); use a numerically stable loss (e.g. "
                "cross_entropy on logits, not log(softmax)).",
                value=obs.loss,
                where="loss",
            )
        return self.finding(
            obs,
            "info",
            f"Traced at step {obs.step}: every module output and the loss are finite again, so "
            f"the non-finite loss at step {origin} came from that batch or that one step; "
            "check the data of that batch.",
            where="loss",
        )


class NonfiniteGradients(Detector):
    """A gradient holds NaN or ±Inf.

    Rule: any parameter whose gradient norm is non-finite (a norm is NaN/Inf
    exactly when the tensor holds a NaN/Inf, or overflows) is an error. The
    finding names the first such parameter in backward order, the one nearest
    the output, which is where the non-finite value entered the backward pass.

    Under a loss scaler (``TrainingSetup.loss_scaler``: float16 with PyTorch's
    GradScaler, DeepSpeed's, or Keras' LossScaleOptimizer), gradients that overflow while
    the loss is finite are the scaler's business: it skips that step and lowers its
    scale, which is how it finds its scale (at the start of a run, and after each
    growth). That is an info finding; only ``patience`` measured steps in a row that all
    overflowed are an error: the scaler skips every step then, and training has stalled.

    Args:
        patience: Under a loss scaler, consecutive measured steps whose gradients
            overflowed that make an error.
    """

    name = "nonfinite_gradients"
    needs = frozenset({"grads"})
    base_interval = 16
    advice = "look for log/sqrt/div at 0; lower the LR"

    def __init__(self, *, patience: int = 16) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"overflows": 0, "since": None}  # measured steps in a row that overflowed

    def _update(self, obs: Observation) -> list[Finding]:
        bad = ~np.isfinite(obs.grad_norm)
        if not bad.any():
            self.state["overflows"], self.state["since"] = 0, None
            return []
        idx = np.flatnonzero(bad)
        first = int(idx[-1])  # registration order runs input → output; backward runs the other way
        value = float(obs.grad_norm[first])
        if self.setup.loss_scaled and (obs.loss is None or math.isfinite(obs.loss)):
            return [self._overflow(obs, first, len(idx), len(bad), value)]
        return [
            self.finding(
                obs,
                "error",
                f"The gradient of {obs.names[first]} is {_describe(value)} at step {obs.step}, "
                f"the first non-finite one in backward order ({len(idx)} of {len(bad)} "
                "parameters): the backward pass overflowed or hit an undefined op; look for "
                "log/sqrt/division at 0 near that layer, then lower the learning rate"
                f"{'' if self.setup.clipping else ' or clip gradients'}."
                f"{float16_note(self.setup)}",
                value=value,
                where=obs.names[first],
            )
        ]

    def _overflow(self, obs: Observation, first: int, n_bad: int, n: int, value: float) -> Finding:
        """Gradients that overflowed under a loss scaler, with a finite loss."""
        scaler = self.setup.loss_scaler or "loss scaler"
        if "'s " not in scaler:  # "DeepSpeed's loss scaler" takes no article
            scaler = f"the {scaler}"
        state = self.state
        state["overflows"] += 1
        if state["since"] is None:
            state["since"] = obs.step
        where = obs.names[first]
        if state["overflows"] < self.patience:
            return self.finding(
                obs,
                "info",
                f"The gradients overflowed at step {obs.step} ({where} first, {n_bad} of {n} "
                f"parameters) with a finite loss: {scaler} skips this step and lowers its "
                "loss scale, as it is meant to; nothing to do unless it repeats.",
                value=value,
                where=where,
            )
        return self.finding(
            obs,
            "error",
            f"The gradients have overflowed on {state['overflows']} measured steps in a row "
            f"(since step {state['since']}; {where} first at step {obs.step}) with a finite "
            f"loss: {scaler} skips every step and keeps lowering its scale, so training "
            f"has stalled. A non-finite value that no scale removes (log/sqrt/division at 0 "
            f"near {where}) is the likely cause; else lower the learning rate.",
            value=value,
            where=where,
        )


class NonfiniteWeights(Detector):
    """A weight became NaN or ±Inf after an optimizer step.

    Rule: any parameter whose norm after the step is non-finite is an error. The
    model cannot recover from this: the message says to restart from a checkpoint. Where
    the optimizer's epsilon is small for the 16-bit weights it updates
    (``TrainingSetup.small_epsilon``), the message names it as the cause: a step where a
    gradient's second moment underflowed divides by that epsilon.
    """

    name = "nonfinite_weights"
    needs = frozenset({"weights"})
    base_interval = 16
    advice = "restart from a checkpoint with a lower LR"

    def current_advice(self) -> str:
        if self.setup.small_epsilon is None:
            return self.advice
        return "restart with a larger epsilon (1e-4)"

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
                f"step {obs.step} ({len(idx)} of {len(bad)} parameters): {self._cause()}",
                value=value,
                where=obs.names[first],
            )
        ]

    def _cause(self) -> str:
        """Why, and what to do: the end of the message."""
        risk = self.setup.small_epsilon
        if risk is None:
            return (
                "the update diverged and the model cannot recover; restart from a checkpoint "
                "with a lower learning rate or gradient clipping."
            )
        return (
            f"{epsilon_cause(risk)}, so the model cannot recover; "
            f"restart from a checkpoint and {epsilon_advice(self.setup)}."
        )
