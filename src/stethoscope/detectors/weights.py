"""Weights and their updates: too small, too large, frozen, all zero."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.advice import (
    epsilon_advice,
    epsilon_cause,
)
from stethoscope.detectors._stats import is_finite, median
from stethoscope.detectors._underflow import flushed
from stethoscope.detectors._updates import line_search_note, unmoved_cause, update_ratios
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["AllZero", "LargeUpdates", "SmallUpdates"]


class LargeUpdates(Detector):
    """Optimizer steps that change a weight matrix by as much as its own size.

    Rule: on sampled steps, each weight matrix's update ratio ||Δw|| / ||w|| (the
    change made by the optimizer step over the weights before it) is compared
    with ``threshold``. Above it on ``patience`` sampled steps in a row is a
    warning; a single ratio above ``error_threshold`` is an error. Healthy runs
    sit near 1e-3 (CS231n) and decay from ~5e-3 to ~3e-4 as they converge; Adam's
    very first step moves every weight by about the learning rate, which is why
    one step alone is not enough.

    It sits out a line search (LBFGS: ``TrainingSetup.line_search``), whose step is as
    long as the search finds, and says so once.

    Sources: SageMaker Debugger ``weight_update_ratio`` (large: > 10, the error
    here); DeepDiagnosis (lr·||g||/||W|| above 1e-3 x 100 hints at the learning rate).

    Args:
        threshold: Update ratio that is a warning when it persists.
        error_threshold: Update ratio that is an error at once.
        patience: Consecutive sampled steps above ``threshold`` for a warning.
    """

    name = "large_updates"
    needs = frozenset({"weights", "updates"})
    base_interval = 32  # slow faults; the snapshot they need is the costliest probe
    advice = "lower the LR or add warm-up"

    def __init__(
        self, *, threshold: float = 1.0, error_threshold: float = 10.0, patience: int = 3
    ) -> None:
        check_positive(self.name, "threshold", threshold)
        check_positive(self.name, "error_threshold", error_threshold)
        if error_threshold < threshold:
            raise ValueError(
                f"{self.name}: error_threshold={error_threshold!r} must be >= threshold="
                f"{threshold!r}"
            )
        check_positive(self.name, "patience", patience, integer=True)
        self.threshold, self.error_threshold = float(threshold), float(error_threshold)
        self.patience = patience
        super().__init__()

    def applies(self) -> bool:
        return not self.setup.line_search

    def not_applying_because(self) -> str:
        return line_search_note(self.setup) if self.setup.line_search else ""

    def _initial_state(self) -> dict:
        return {"streak": 0}

    def _update(self, obs: Observation) -> list[Finding]:
        ratios, idx = update_ratios(obs)
        if len(ratios) == 0:
            return []
        worst = int(np.argmax(ratios))
        ratio, where = float(ratios[worst]), obs.names[idx[worst]]
        if ratio <= self.threshold:
            self.state["streak"] = 0
            return []
        self.state["streak"] += 1
        self.suspect = f"update ratio {ratio:.3g} in {where}"
        error = ratio > self.error_threshold
        if not error and self.state["streak"] < self.patience:
            return []
        lr = f" at a learning rate of {obs.lr:.3g}" if is_finite(obs.lr) else ""
        return [
            self.finding(
                obs,
                "error" if error else "warning",
                f"The optimizer step changed {where} by {ratio:.3g}x its own norm at step "
                f"{obs.step}{lr} (healthy: ~1e-3): {self._cause()}.",
                value=ratio,
                threshold=self.error_threshold if error else self.threshold,
                where=where,
            )
        ]

    def current_advice(self) -> str:
        return self.advice if self.setup.small_epsilon is None else "set a larger epsilon (1e-4)"

    def _cause(self) -> str:
        """Why, and what to do: the end of the message. An epsilon small for the 16-bit
        weights (``TrainingSetup.small_epsilon``) makes such steps at any learning rate."""
        risk = self.setup.small_epsilon
        if risk is None:
            return (
                "the learning rate is far too high for this model; lower it (try 10-100x "
                "smaller) or add a warm-up"
            )
        return f"{epsilon_cause(risk)}; {epsilon_advice(self.setup)}"


class SmallUpdates(Detector):
    """Optimizer steps too small to move the weights while the loss is still high.

    Rule: on sampled steps, the median update ratio ||Δw|| / ||w|| over the
    weight matrices is compared with ``threshold``. It is a warning when it has
    stayed below for at least ``min_steps`` steps (and ``patience`` sampled
    steps), or below ``far_threshold`` for at least ``far_steps`` steps (a ratio
    100x under the bar needs no long look), while (1) the loss is still above
    ``loss_fraction`` of its initial level, since a converged run's updates
    shrink with its gradients, and (2) the learning rate is at least half the
    highest seen so far, since a schedule annealing towards 0 (cosine, step
    decay) shrinks updates on purpose, and (3) the learning rate has not risen
    since the condition began: a warm-up from 0, however long, restarts the
    clock at each rise. A step whose gradients are all exactly zero, or whose
    updates are exactly zero at a learning rate that float32 could not round away,
    is not a small learning rate's: that is ``all_zero``'s and ``frozen_weights``'
    finding, and this rule skips it. It sits out a line search (LBFGS), as
    ``large_updates`` does.

    Sources: SageMaker Debugger ``weight_update_ratio`` (small: < 1e-8);
    DeepDiagnosis (lr·||g||/||W|| below 1e-3 / 100 = 1e-5 hints at the learning
    rate); CS231n (healthy ~1e-3).

    Args:
        threshold: Median update ratio below which updates are too small.
        min_steps: Steps the condition must hold.
        patience: Sampled steps the condition must hold.
        loss_fraction: The loss must still be above this fraction of its initial level.
        far_threshold: Median update ratio so far below healthy that ``far_steps`` do.
        far_steps: Steps the condition must hold below ``far_threshold``.
    """

    name = "small_updates"
    needs = frozenset({"weights", "updates"})
    wants = frozenset({"grads"})  # whether a gradient reached the parameters stepped
    base_interval = 32  # slow faults; the snapshot they need is the costliest probe
    advice = "raise the LR; check the scheduler and frozen params"

    def __init__(
        self,
        *,
        threshold: float = 1e-5,
        min_steps: int = 50,
        patience: int = 3,
        loss_fraction: float = 0.5,
        far_threshold: float = 1e-7,
        far_steps: int = 10,
    ) -> None:
        check_positive(self.name, "threshold", threshold)
        check_positive(self.name, "min_steps", min_steps, integer=True)
        check_positive(self.name, "patience", patience, integer=True)
        check_fraction(self.name, "loss_fraction", loss_fraction)
        check_positive(self.name, "far_threshold", far_threshold)
        check_positive(self.name, "far_steps", far_steps, integer=True)
        if far_threshold > threshold:
            raise ValueError(
                f"{self.name}: far_threshold={far_threshold!r} must be <= threshold={threshold!r}"
            )
        if far_steps > min_steps:
            raise ValueError(
                f"{self.name}: far_steps={far_steps!r} must be <= min_steps={min_steps!r}"
            )
        self.threshold, self.min_steps, self.patience = float(threshold), min_steps, patience
        self.loss_fraction = float(loss_fraction)
        self.far_threshold, self.far_steps = float(far_threshold), far_steps
        super().__init__()

    def applies(self) -> bool:
        return not self.setup.line_search

    def not_applying_because(self) -> str:
        return line_search_note(self.setup) if self.setup.line_search else ""

    def _initial_state(self) -> dict:
        return {
            "since": None,
            "far_since": None,
            "since_lr": None,
            "count": 0,
            "initial_loss": None,
            "max_lr": None,
            "fired": False,
        }

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if is_finite(obs.loss) and st["initial_loss"] is None:
            st["initial_loss"] = abs(float(obs.loss))
        if is_finite(obs.lr):
            st["max_lr"] = max(st["max_lr"] or 0.0, float(obs.lr))
        ratios, _ = update_ratios(obs)
        ratio = median(ratios.tolist()) if len(ratios) else math.nan  # a few: sorted() wins
        if unmoved_cause(obs, self.setup.adaptive) is not None:
            ratio = math.nan  # no learning rate would move them: not this rule's finding
        annealed = is_finite(obs.lr) and obs.lr < 0.5 * st["max_lr"]
        converged = (
            is_finite(obs.loss)
            and st["initial_loss"] is not None
            and abs(obs.loss) < self.loss_fraction * st["initial_loss"]
        )
        if not (ratio < self.threshold) or annealed or converged:
            st["since"], st["far_since"], st["count"], st["fired"] = None, None, 0, False
            return []
        rising = is_finite(obs.lr) and st["since_lr"] is not None and obs.lr > 1.01 * st["since_lr"]
        if st["since"] is None or rising:  # a warm-up: small updates are its first steps
            st["since"], st["since_lr"], st["count"], st["far_since"] = obs.step, obs.lr, 0, None
        if ratio >= self.far_threshold:
            st["far_since"] = None
        elif st["far_since"] is None:
            st["far_since"] = obs.step
        st["count"] += 1
        self.suspect = f"median update ratio {ratio:.2g}"
        long_enough = obs.step - st["since"] >= self.min_steps or (
            st["far_since"] is not None and obs.step - st["far_since"] >= self.far_steps
        )
        if st["fired"] or st["count"] < self.patience or not long_enough:
            return []
        st["fired"] = True
        lr = f" at a learning rate of {obs.lr:.3g}" if is_finite(obs.lr) else ""
        return [
            self.finding(
                obs,
                "warning",
                f"Updates are too small to train: the median weight matrix changes by "
                f"{ratio:.2g}x its norm per step{lr} (healthy: ~1e-3) since step {st['since']}, "
                "while the loss is still high; raise the learning rate (try 10-100x), and check "
                "the scheduler and which parameters the optimizer holds.",
                value=ratio,
                threshold=self.threshold,
            )
        ]


class AllZero(Detector):
    """A weight matrix, gradient or layer output that is entirely zero, and stays so.

    Rule: on sampled steps, each case needing ``patience`` sampled steps in a row:

    * a weight matrix whose weights *and* gradient are all zero: it can never
      move again (a zero-initialised layer before a ReLU): error;
    * a weight matrix whose gradient is all zero while the loss is not: nothing
      reaches it (a detached branch, a dead layer after it): warning;
    * a layer whose output is all zero (seen when activations are observed): warning.

    A 16-bit backward pass flushed whole to zero with no loss scaling (every 16-bit
    gradient zero, the output layer's too, for a loss above zero) is no dead layer's:
    the format lost the gradients, ``gradient_underflow``'s finding, and the second case
    leaves those steps to it.

    A bias or weight that merely starts at zero (biases, LoRA's B matrix) moves
    at the first step and is never flagged.

    Sources: SageMaker Debugger ``all_zero`` (100% of the values zero).

    Args:
        patience: Consecutive sampled steps a tensor must stay all zero.
    """

    name = "all_zero"
    needs = frozenset({"grads", "weights"})
    base_interval = 16
    advice = "re-initialise the layer (no zero or constant init)"

    def __init__(self, *, patience: int = 2) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"streaks": {}, "reported": []}

    def _bump(self, key: str, hit: bool) -> bool:
        """Count ``key``'s streak; True once when it reaches the patience."""
        st = self.state
        if not hit:
            st["streaks"].pop(key, None)
            return False
        st["streaks"][key] = st["streaks"].get(key, 0) + 1
        if st["streaks"][key] >= self.patience and key not in st["reported"]:
            st["reported"].append(key)
            return True
        return False

    def _update(self, obs: Observation) -> list[Finding]:
        # Each case reports its first tensor (nearest the input: the likely cause) per step,
        # counting the others, rather than one finding per tensor.
        hits: dict[str, list[str]] = {"stuck": [], "grad": [], "act": []}
        loss_nonzero = not is_finite(obs.loss) or obs.loss != 0
        mats = np.flatnonzero(obs.is_matrix) if obs.is_matrix is not None else []
        grads = obs.grad_norm
        # a 16-bit backward pass flushed whole, unscaled: gradient_underflow's finding
        flush = grads is not None and flushed(obs, self.setup)
        for i in mats:
            name = obs.names[i]
            w_zero = bool(obs.weight_norm[i] == 0)
            g_zero = grads is not None and bool(grads[i] == 0)
            if self._bump(f"stuck|{name}", w_zero and g_zero):
                hits["stuck"].append(name)
            elif self._bump(f"grad|{name}", g_zero and not (w_zero or flush) and loss_nonzero):
                hits["grad"].append(name)
        if obs.act_max is not None:
            for name, kind, m in zip(obs.act_names, obs.act_kinds, obs.act_max, strict=True):
                if kind == "layer" and self._bump(f"act|{name}", bool(m == 0)):
                    hits["act"].append(name)
        findings: list[Finding] = []
        for case, names in hits.items():
            if not names:
                continue
            name = names[0]
            more = f" (and {len(names) - 1} more after it)" if len(names) > 1 else ""
            severity, message = {
                "stuck": (
                    "error",
                    f"Weight {name}{more} is all zeros and so is its gradient (step {obs.step}): "
                    "it can never move away from zero, and every unit after it sees the same "
                    "input; initialise it randomly (never zeros or a constant).",
                ),
                "grad": (
                    "warning",
                    f"The gradient of {name}{more} has been all zeros on {self.patience} sampled "
                    f"steps up to step {obs.step}: no signal reaches it (a layer after it is "
                    "dead or zero, or its output is detached from the loss); check the layers "
                    "after it and any .detach() / torch.no_grad() in forward.",
                ),
                "act": (
                    "warning",
                    f"The output of {name}{more} has been all zeros on {self.patience} sampled "
                    f"steps up to step {obs.step}: every layer after it sees a constant; check "
                    "its weights and inputs (zero init, a mask, a dead input).",
                ),
            }[case]
            findings.append(
                self.finding(obs, severity, message, value=float(len(names)), where=name)
            )
        return findings
