"""Gradient magnitude: explosions and vanishing."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.advice import clipping_advice, warmup_advice
from stethoscope.detectors._stats import MAD_TO_SIGMA, is_finite, median, push
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation, global_norm

__all__ = ["ExplodingGradients", "VanishingGradients"]


class ExplodingGradients(Detector):
    """The global gradient norm jumps far above its own recent level.

    Rule: after ``warmup`` sampled steps, the global L2 gradient norm (before
    clipping) is compared with the median of its last ``window`` sampled values,
    in log space. It is an explosion when it is at least ``factor`` times that
    median *and* more than ``z`` robust standard deviations (MAD) above it, *and*
    at least as large as the run's initial gradient norm. A norm ``initial_factor``
    times the run's initial norm needs no z-score: a run that diverges from its
    first step has no calm history for one (its norms swing 10x from step to
    step). One such step is a warning; ``patience`` in a row, or one ``factor**2``
    times the median, is an error. Under an adaptive optimizer (Adam, RMSprop…; see
    ``TrainingSetup.adaptive``) only ``patience`` in a row are: it normalises each
    parameter's step, so one hard batch's gradient, however large, moves the weights
    no further than any other step, and a converged fine-tune meets such batches.

    In a game (``TrainingSetup.adversarial``: a GAN) a lone jump is no finding, only a
    suspicion, unless it is ``factor**2`` times the median under a plain optimizer: a
    player's gradient is as large as the other player's last move makes it. A DCGAN's
    discriminator, measured on the CPU (pytorch/examples' hyperparameters, 16x16 images,
    a discriminator four times as wide as its generator):
    its norm from 2.3 to 145 over 384 batches, up to 11x its own recent median from one
    batch to the next, on a run that learns; judged on its own (a baseline per player)
    it jumps as far. ``patience`` in a row is an error, as everywhere.

    Sources: Megatron flags gradients 10x their usual size (``factor=10``); the
    robust z of 6 is OLMo-core's spike rule; requiring the initial norm keeps a
    converged run, whose tiny gradients jump by orders of magnitude on a hard
    batch, from crying wolf. Calibrated on the run itself because no fixed norm
    fits every model (AutoTrainer's first/last ratio of 70 fires on healthy deep nets).
    The evidence behind ``initial_factor`` and the other defaults: docs/detectors.md.

    Args:
        factor: How many times the recent median a norm must reach.
        z: Robust z-score the log norm must also exceed.
        warmup: Sampled steps used to learn the initial level before judging.
        window: Sampled steps in the rolling baseline.
        patience: Consecutive explosive samples that make it an error.
        initial_factor: How many times the run's initial norm waives the z-score.
    """

    name = "exploding_gradients"
    needs = frozenset({"grads"})
    bars = "grad_norm"
    base_interval = 16
    advice = "lower the LR, add warm-up or clip gradients"

    def current_advice(self) -> str:
        if self.setup.clipping:  # clipping bounds the update already: the cause is upstream
            return "lower the LR or add warm-up (gradients are clipped already)"
        return self.advice

    def __init__(
        self,
        *,
        factor: float = 10.0,
        z: float = 6.0,
        warmup: int = 5,
        window: int = 32,
        patience: int = 3,
        initial_factor: float = 20.0,
    ) -> None:
        check_positive(self.name, "factor", factor)
        if factor <= 1:
            raise ValueError(f"{self.name}: factor={factor!r} must be > 1")
        check_positive(self.name, "z", z)
        for arg, v in (("warmup", warmup), ("window", window), ("patience", patience)):
            check_positive(self.name, arg, v, integer=True)
        check_positive(self.name, "initial_factor", initial_factor)
        if initial_factor < factor:
            raise ValueError(
                f"{self.name}: initial_factor={initial_factor!r} must be >= factor={factor!r}"
            )
        self.factor, self.z = float(factor), float(z)
        self.initial_factor = float(initial_factor)
        self.warmup, self.window, self.patience = warmup, window, patience
        self._bar_cache: tuple[tuple | None, float] = (None, math.inf)
        super().__init__()

    def _initial_state(self) -> dict:
        # log10 norms; ``initial`` is frozen after the warm-up
        return {"history": [], "initial": None, "seen": 0, "streak": 0, "last": None}

    def _baseline(self) -> tuple[float, float]:
        """The median log10 norm of the window, and the margin (in decades) above it that
        an explosion must pass when the z-score applies."""
        hist = self.state["history"]
        center = median(hist)
        spread = MAD_TO_SIGMA * median([abs(h - center) for h in hist])
        return center, max(math.log10(self.factor), self.z * spread)

    def threshold(self) -> float | None:
        """The global gradient norm above which the next step is an explosion (a warning
        or worse), or None while the detector is still learning the run's level.

        The recovery ladder skips a step past it. It folds the rule's two cases into
        one number: above the median by the z-score margin (and above the initial norm),
        or ``initial_factor`` times the initial norm and ``factor`` times the median.
        """
        st = self.state
        if st["seen"] < self.warmup or st["initial"] is None or self.setup.adversarial:
            return None  # a game's lone jump is no explosion: no step is skipped for one
        key = (st["seen"], st["initial"])  # the bar moves only when the detector runs
        if self._bar_cache[0] == key:
            return self._bar_cache[1]
        center, margin = self._baseline()
        with_z = max(center + margin, st["initial"])
        far = max(st["initial"] + math.log10(self.initial_factor), center + math.log10(self.factor))
        self._bar_cache = (key, 10 ** min(with_z, far))
        return self._bar_cache[1]

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        norms = obs.grad_norm
        total = global_norm(norms)
        if not (math.isfinite(total) and total > 0):
            return []  # non-finite: nonfinite_gradients owns it; zero: nothing to compare
        log_norm = math.log10(total)
        last, st["last"] = st["last"], [float(v) for v in norms]
        hist = st["history"]
        findings: list[Finding] = []
        if st["seen"] >= self.warmup:
            center, margin = self._baseline()
            over = log_norm - center
            if log_norm - st["initial"] >= math.log10(self.initial_factor):
                margin = math.log10(self.factor)  # far above where the run started: no z
            if over > margin / 2:
                self.suspect = f"gradient norm {total:.3g} is {10**over:.3g}x its recent median"
            if over <= margin or log_norm < st["initial"]:
                st["streak"] = 0
            else:
                st["streak"] += 1
                at_once = over >= 2 * math.log10(self.factor) and not self.setup.adaptive
                severe = at_once or st["streak"] >= self.patience
                # in a game a lone jump is the other player's move: a suspicion (set above)
                if severe or not self.setup.adversarial:
                    where = _largest_jump(obs.names, norms, last, self.factor)
                    findings.append(
                        self.finding(
                            obs,
                            "error" if severe else "warning",
                            f"Gradient norm {total:.3g} is {10**over:.3g}x its recent median "
                            f"{10**center:.3g} at step {obs.step} (it jumps first in {where}, "
                            "in backward order): the learning rate is likely too high for "
                            f"this point of training; lower it, {warmup_advice(self.setup)}, "
                            f"or {clipping_advice(self.setup)}.",
                            value=total,
                            threshold=10 ** (center + margin),
                            where=where,
                        )
                    )
        st["seen"] += 1
        push(hist, log_norm, self.window)
        if st["seen"] == self.warmup:
            st["initial"] = median(hist)
        return findings


def _largest_jump(
    names: tuple[str, ...], norms: np.ndarray, last: list[float] | None, factor: float
) -> str:
    """Where the gradient first jumps in backward order, else where it grew most.

    Among the parameters whose gradient norm grew ``factor``-fold since the last
    sample, the one nearest the output (last registered) is where the jump
    entered the backward pass. Without a previous sample: the largest norm.
    """
    if last is None or len(last) != len(norms):
        return names[int(np.nanargmax(norms))]
    prev = np.maximum(np.asarray(last, dtype=np.float64), 1e-30)
    growth = np.where(np.isfinite(norms), norms / prev, -np.inf)
    jumped = np.flatnonzero(growth >= factor)
    return names[int(jumped[-1]) if len(jumped) else int(np.argmax(growth))]


class VanishingGradients(Detector):
    """Gradients too small to train while the loss is still high.

    Rule: a sampled step is "vanishing" when either the root-mean-square gradient
    over all parameters is below ``rms_threshold`` per unit of loss (SageMaker
    Debugger ``vanishing_gradient``: mean |g| < 1e-7; the RMS bounds the mean |g|
    from above), or the first weight matrix's gradient norm is below
    ``first_layer_threshold`` per unit of loss and below ``ratio`` times the last
    one's (AutoTrainer: 1e-4 and 1e-3). Thresholds scale with the loss because a
    converged model has tiny gradients for a tiny loss: SageMaker's absolute
    1e-7 fires on any classifier trained to a loss of ~1e-6. Either only counts
    while the loss is still above ``loss_fraction`` of its initial level.
    ``patience`` vanishing samples in a row raise a warning.

    Args:
        rms_threshold: Global gradient RMS, per unit of loss, below which
            gradients have vanished.
        first_layer_threshold: Gradient norm of the first weight matrix, per unit
            of loss, below which it counts as starved.
        ratio: First-over-last weight-matrix gradient norm ratio below which
            the signal is lost on the way back.
        loss_fraction: The loss must still be above this fraction of its initial
            level (the median of the first ``patience`` sampled losses).
        patience: Consecutive vanishing samples that raise a warning.
    """

    name = "vanishing_gradients"
    needs = frozenset({"grads"})
    base_interval = 16
    advice = "ReLU/He init, normalisation or residuals"

    def __init__(
        self,
        *,
        rms_threshold: float = 1e-7,
        first_layer_threshold: float = 1e-4,
        ratio: float = 1e-3,
        loss_fraction: float = 0.1,
        patience: int = 3,
    ) -> None:
        check_positive(self.name, "rms_threshold", rms_threshold)
        check_positive(self.name, "first_layer_threshold", first_layer_threshold)
        check_fraction(self.name, "ratio", ratio)
        check_fraction(self.name, "loss_fraction", loss_fraction)
        check_positive(self.name, "patience", patience, integer=True)
        self.rms_threshold = float(rms_threshold)
        self.first_layer_threshold = float(first_layer_threshold)
        self.ratio = float(ratio)
        self.loss_fraction = float(loss_fraction)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"losses": [], "initial_loss": None, "streak": 0, "fired": False}

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        norms = obs.grad_norm
        if not np.all(np.isfinite(norms)) or len(norms) == 0:
            return []
        if is_finite(obs.loss) and st["initial_loss"] is None:
            st["losses"].append(float(obs.loss))
            if len(st["losses"]) >= self.patience:
                st["initial_loss"] = median(st["losses"])
        if (
            is_finite(obs.loss)
            and st["initial_loss"] is not None
            and abs(obs.loss) < self.loss_fraction * abs(st["initial_loss"])
        ):
            st["streak"] = 0  # converged: small gradients are expected
            return []
        verdict = self._vanishing(obs, norms)
        if verdict is None:
            st["streak"], st["fired"] = 0, False
            return []
        st["streak"] += 1
        self.suspect = f"gradient {verdict[1]:.2g} below {verdict[2]:.0e}"
        if st["streak"] < self.patience or st["fired"]:
            return []
        st["fired"] = True
        message, value, threshold, where = verdict
        return [
            self.finding(obs, "warning", message, value=value, threshold=threshold, where=where)
        ]

    def _vanishing(self, obs: Observation, norms: np.ndarray):
        numel = obs.numel if obs.numel is not None else np.ones_like(norms)
        rms = global_norm(norms) / math.sqrt(max(float(np.sum(numel)), 1.0))
        fix = (
            "use ReLU-family activations, He/Xavier initialisation, normalisation layers or "
            "residual connections, and check the learning rate is not tiny"
        )
        # Thresholds are per unit of loss: a converged model's gradients shrink with its
        # loss (cross-entropy: |dL/dlogit| ~ 2 x loss), which is not vanishing.
        scale = abs(obs.loss) if is_finite(obs.loss) and obs.loss != 0 else 1.0
        if rms < self.rms_threshold * scale:
            return (
                f"Gradients have vanished at step {obs.step}: RMS gradient {rms:.2g} for a loss "
                f"of {scale:.3g} (< {self.rms_threshold:.0e} per unit of loss); {fix}.",
                rms,
                self.rms_threshold * scale,
                None,
            )
        mats = np.flatnonzero(obs.is_matrix) if obs.is_matrix is not None else np.array([], int)
        if len(mats) < 2:
            return None
        first, last = float(norms[mats[0]]), float(norms[mats[-1]])
        if first < self.first_layer_threshold * scale and first < self.ratio * last:
            return (
                f"Gradients vanish on the way back at step {obs.step}: {obs.names[mats[0]]} gets "
                f"a gradient norm of {first:.2g}, {last / max(first, 1e-300):.2g}x smaller than "
                f"{obs.names[mats[-1]]}, so the first layers barely learn; {fix}.",
                first,
                self.first_layer_threshold * scale,
                obs.names[mats[0]],
            )
        return None
