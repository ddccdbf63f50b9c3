"""The start of training: weights, activations or an initial loss that say the model
started badly."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.detectors._stats import is_finite, median
from stethoscope.detectors.base import Detector, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["PoorInitialization"]


class PoorInitialization(Detector):
    """Weights, activations or the initial loss that say the model started badly.

    Rule: on the observations of the first ``steps`` steps, each check at most
    once:

    * weight scale: for each layer with units, ``var(w) x fan_in`` outside
      [``min_scale``, ``max_scale``]. Fan-in scaled schemes give 1/3 (PyTorch's
      default), 1 (LeCun, Glorot for square layers) or 2 (He); a raw N(0, 1)
      init gives the fan-in itself. A plain variance ratio across layers, as
      SageMaker Debugger uses, fires on healthy nets whose fan-ins differ.
    * activations: the root-mean-square output of the first and the most
      extreme layer with units differ by more than ``activation_ratio``: the
      signal explodes or dies with depth.
    * initial loss: when ``num_classes`` (K) is given, the median of the first
      3 losses above ``max(2 ln K, ln K + 1)``; a fresh classifier should score
      about ``ln K`` (CS231n).

    Sources: SageMaker Debugger ``poor_weight_initialization`` (activation
    variance ratio > 10 over the first 10 steps); CS231n (initial loss -ln(1/K));
    DeepDiagnosis (weight variance outside [1e-5, 10]).

    Args:
        num_classes: Number of classes of a classification task, for the loss check.
        steps: The checks run on observations before this step.
        min_scale: Smallest healthy ``var(w) x fan_in``.
        max_scale: Largest healthy ``var(w) x fan_in``.
        activation_ratio: Largest healthy ratio of layer output RMS across depth.
    """

    name = "poor_initialization"
    needs = frozenset({"weights"})
    wants = frozenset({"outputs"})
    base_interval = 16
    advice = "use fan-in scaled init (He / Glorot)"

    def __init__(
        self,
        *,
        num_classes: int | None = None,
        steps: int = 10,
        min_scale: float = 1e-3,
        max_scale: float = 10.0,
        activation_ratio: float = 1000.0,
    ) -> None:
        if num_classes is not None:
            check_positive(self.name, "num_classes", num_classes, integer=True)
            if num_classes < 2:
                raise ValueError(f"{self.name}: num_classes={num_classes!r} must be >= 2")
        check_positive(self.name, "steps", steps, integer=True)
        check_positive(self.name, "min_scale", min_scale)
        check_positive(self.name, "max_scale", max_scale)
        check_positive(self.name, "activation_ratio", activation_ratio)
        if activation_ratio <= 1:
            raise ValueError(f"{self.name}: activation_ratio={activation_ratio!r} must be > 1")
        if max_scale <= min_scale:
            raise ValueError(
                f"{self.name}: max_scale={max_scale!r} must be > min_scale={min_scale!r}"
            )
        self.num_classes, self.steps = num_classes, steps
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.activation_ratio = float(activation_ratio)
        super().__init__()

    def _initial_state(self) -> dict:
        return {"losses": [], "done": []}  # done: the checks already judged

    def finished(self, step: int) -> bool:
        return step >= self.steps

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if obs.step >= self.steps:
            return []
        findings: list[Finding] = []
        if "weights" not in st["done"] and obs.fan_in is not None:
            st["done"].append("weights")
            findings += self._weights(obs)
        if "activations" not in st["done"] and obs.act_rms is not None:
            st["done"].append("activations")
            findings += self._activations(obs)
        if self.num_classes and "loss" not in st["done"] and is_finite(obs.loss):
            st["losses"].append(float(obs.loss))
            if len(st["losses"]) >= 3:
                st["done"].append("loss")
                findings += self._loss(obs, median(st["losses"]))
        return findings

    def _weights(self, obs: Observation) -> list[Finding]:
        units = np.flatnonzero(np.isfinite(obs.fan_in) & (obs.numel > 0))
        if len(units) == 0:
            return []
        norms = obs.weight_norm
        if obs.prev_weight_norm is not None:  # the initialisation, where it was measured
            norms = np.where(np.isfinite(obs.prev_weight_norm), obs.prev_weight_norm, norms)
        var = np.square(norms[units]) / obs.numel[units]
        scale = var * obs.fan_in[units]
        bad = np.flatnonzero((scale > self.max_scale) | ((scale < self.min_scale) & (var > 0)))
        if len(bad) == 0:
            return []
        i = bad[np.argmax(np.abs(np.log10(scale[bad])))]
        s, name = float(scale[i]), obs.names[units[i]]
        big = s > self.max_scale
        std, fan = math.sqrt(var[i]), obs.fan_in[units[i]]
        return [
            self.finding(
                obs,
                "warning",
                f"Layer weight {name} starts with values of std {std:.3g} for a fan-in of "
                f"{fan:.0f}: "
                f"var x fan_in = {s:.3g}, {'above' if big else 'below'} the healthy "
                f"{self.min_scale:g}-{self.max_scale:g} (He: 2, Glorot/LeCun: ~1), so "
                f"activations {'grow' if big else 'shrink'} layer by layer"
                f"{' and saturate or explode' if big else ' and gradients vanish'}; use a fan-in "
                "scaled init (nn.init.kaiming_normal_ for ReLU, xavier_normal_ for tanh).",
                value=s,
                threshold=self.max_scale if big else self.min_scale,
                where=name,
            )
        ]

    def _activations(self, obs: Observation) -> list[Finding]:
        layers = [
            (n, float(r))
            for n, k, r in zip(obs.act_names, obs.act_kinds, obs.act_rms, strict=True)
            if k == "layer" and np.isfinite(r) and r > 0
        ]
        if len(layers) < 2:
            return []
        first_name, first = layers[0]
        name, rms = max(layers[1:], key=lambda nr: abs(math.log(nr[1] / first)))
        ratio = max(rms / first, first / rms)
        if ratio <= self.activation_ratio:
            return []
        grows = rms > first
        return [
            self.finding(
                obs,
                "warning",
                f"Activations {'explode' if grows else 'die out'} with depth at step {obs.step}: "
                f"the output RMS of {name} is {rms:.3g} against {first:.3g} in {first_name} "
                f"({ratio:.3g}x, healthy < {self.activation_ratio:g}x); use a fan-in scaled "
                "init (He for ReLU, Glorot for tanh), normalisation layers or residual "
                "connections.",
                value=ratio,
                threshold=self.activation_ratio,
                where=name,
            )
        ]

    def _loss(self, obs: Observation, loss: float) -> list[Finding]:
        chance = math.log(self.num_classes)
        bound = max(2 * chance, chance + 1)
        if loss <= bound:
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The initial loss {loss:.3g} is far above chance level ln({self.num_classes}) = "
                f"{chance:.3g} for {self.num_classes} classes: the untrained model is confidently "
                "wrong, so its final layer or its inputs are badly scaled; initialise the last "
                "layer smaller (or its bias to the class log-priors) and check input scaling.",
                value=loss,
                threshold=bound,
                where="loss",
            )
        ]
