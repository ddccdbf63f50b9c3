"""Activations: dead ReLU units and saturated tanh / sigmoid units."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.detectors._stats import is_finite, sign_bit
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation
from stethoscope.statistics import SATURATION_BOUNDS

__all__ = ["DeadRelu", "SaturatedActivation"]


class DeadRelu(Detector):
    """Layers whose units have stopped passing any signal.

    Rule: a unit is dead when its weight-gradient row was exactly zero on each
    of the last ``window`` sampled steps, that is, no sample of any of those
    batches activated it, and those batches held at least ``min_samples``
    samples in all (when the adapter reports batch sizes; else ``window`` steps
    do): with small batches the look goes back further. A layer whose dead
    fraction exceeds ``threshold`` is a warning; a layer with every unit dead is
    an error (nothing below it can learn any more).

    Counting is per unit, never per value: a healthy ReLU layer has ~50% zeros
    in every batch but few dead units (0-6%). A dead unit's weight-gradient row
    (and bias gradient) is exactly zero whatever computes the ReLU, ``nn.ReLU``
    or ``F.relu``, so no activation hook is needed. Layers not followed by a
    ReLU-like function never have an exactly zero row, unless the whole gradient
    is: a loss that passes back nothing (a classifier whose softmax is exactly
    one-hot, in float32, on every sample of the batch; a cross-entropy that clipped
    every probability it read) zeroes every row of every layer. Such a step (every
    parameter's gradient norm exactly 0, when they were measured) says nothing
    about which units are dead, and is skipped.

    A run whose loss takes both signs on the steps it looks at in the first
    ``SIGN_STEPS`` steps (the sampler's hot start shows it most of them) is a policy
    gradient's (``-log_prob x advantage``), and its inputs are the states its agent
    visits, which move with its policy: a unit they never excite is unvisited, not dead
    (an actor-critic on a cart-pole, measured: 41 of its first layer's 128 units excited
    by the states it visits, 120 by some state within the pole's bounds). Such a run is
    left alone, said once (an info).

    Sources: SageMaker Debugger ``dead_relu`` (a unit active < 1% of the time is
    dead; fire when > 50% of a layer is); CS231n: "as much as 40% of your network
    can be dead" when the learning rate is too high. Why ``min_samples=512``:
    docs/detectors.md.

    Args:
        threshold: Dead fraction of a layer's units above which it is a warning.
        window: Consecutive sampled steps with a zero gradient row that make a unit dead.
        min_samples: Samples those steps must hold in all, when batch sizes are known.
    """

    name = "dead_relu"
    needs = frozenset({"units"})
    #: The gradient norms: a step whose gradient is zero everywhere is skipped.
    wants = frozenset({"grads"})
    base_interval = 16
    advice = "lower the LR; LeakyReLU/GELU or He init"
    #: The steps whose losses may show that the loss takes both signs.
    SIGN_STEPS = 128

    def __init__(self, *, threshold: float = 0.5, window: int = 8, min_samples: int = 512) -> None:
        check_fraction(self.name, "threshold", threshold)
        check_positive(self.name, "window", window, integer=True)
        check_positive(self.name, "min_samples", min_samples, integer=True)
        self.threshold, self.window, self.min_samples = float(threshold), window, min_samples
        super().__init__()

    def _initial_state(self) -> dict:
        # per layer: for each unit, how many sampled steps in a row its row was zero
        # (int32 bytes while running, cheap to turn into an array; a list in state_dict);
        # the worst severity already reported for that layer (0: none); and the samples of
        # the recent sampled steps, newest last (0: unknown), as far back as a look goes
        # signs: the sign bits of the losses seen in the first SIGN_STEPS (see sign_bit)
        return {"streaks": {}, "reported": {}, "samples": [], "signs": 0}

    def finished(self, step: int) -> bool:
        return self.state["signs"] == 3

    def _look(self, samples: int) -> tuple[int, int]:
        """Record this step's samples; the sampled steps a unit must be zero on to be dead,
        and the samples they held (0: unknown)."""
        sizes = self.state["samples"]
        sizes.append(int(samples))
        total, known = 0, True
        for steps, n in enumerate(reversed(sizes), start=1):
            total += n
            known = known and n > 0  # an unknown size: the steps alone decide
            if steps >= self.window and (not known or total >= self.min_samples):
                del sizes[: len(sizes) - steps]  # older steps will never be needed again
                return steps, total if known else 0
        return 2**31 - 1, 0  # not yet enough steps or samples: no unit is dead yet

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["streaks"] = {k: _streak(v).tolist() for k, v in state["streaks"].items()}
        return state

    def _update(self, obs: Observation) -> list[Finding]:
        norms = obs.grad_norm
        if norms is not None and len(norms) and not np.any(norms):
            return []  # no gradient anywhere: every row is zero, dead or not
        st = self.state
        if st["signs"] == 3:
            return []  # a policy gradient's run: left alone
        if obs.step < self.SIGN_STEPS and is_finite(obs.loss):
            st["signs"] |= sign_bit(obs.loss)
            if st["signs"] == 3:
                return [self._visited(obs)]
        findings: list[Finding] = []
        look, samples = self._look(obs.unit_samples)
        for layer, zero in zip(obs.unit_names, obs.unit_zero, strict=True):
            zero = np.asarray(zero, dtype=bool)
            old = st["streaks"].get(layer)
            streak = _streak(old) if old is not None else None
            if streak is None or len(streak) != len(zero):
                streak = np.zeros(len(zero), np.int32)
            streak = np.where(zero, np.minimum(streak + 1, 2**30), 0).astype(np.int32)
            st["streaks"][layer] = streak.tobytes()
            if len(zero) == 0:
                continue
            dead = float(np.mean(streak >= look))
            if zero.mean() > self.threshold and dead <= self.threshold:
                self.suspect = f"{zero.mean():.0%} of the units of {layer} got no gradient"
            rank = 2 if dead >= 1.0 else 1 if dead > self.threshold else 0
            if rank == 0:
                st["reported"].pop(layer, None)
                continue
            if rank <= st["reported"].get(layer, 0) or findings:
                continue  # already said; or a layer nearer the input already explains this step
            st["reported"][layer] = rank
            n = len(zero)
            span = f"the last {look} sampled steps" + (f" ({samples} samples)" if samples else "")
            what = (
                f"All {n} units of {layer} are dead"
                if rank == 2
                else f"In {layer}, {dead:.0%} of the {n} units are dead"
            )
            findings.append(
                self.finding(
                    obs,
                    "error" if rank == 2 else "warning",
                    f"{what}: no sample activated them in any batch of {span} (step {obs.step}), "
                    "so they output 0 and no longer learn; usual causes are a learning rate too "
                    "high or large negative biases: lower the LR, use LeakyReLU/GELU, or He "
                    "initialisation.",
                    value=dead,
                    threshold=self.threshold,
                    where=layer,
                )
            )
        return findings

    def _visited(self, obs: Observation) -> Finding:
        """The info that the run is left alone: its loss takes both signs."""
        return self.finding(
            obs,
            "info",
            f"dead_relu leaves this run alone: the loss took both signs in its first "
            f"{self.SIGN_STEPS} steps ({obs.loss:.4g} at step {obs.step}, after losses of the "
            "other sign), as a policy gradient's does (-log_prob x return or advantage), "
            "whose inputs are the states its agent visits: they move with its policy, so a "
            "unit none of them excites is unvisited, not dead.",
            value=obs.loss,
            where="loss",
        )


def _streak(value: bytes | list) -> np.ndarray:
    """A layer's streaks as an array, from the running bytes or a restored list."""
    if isinstance(value, bytes):
        return np.frombuffer(value, np.int32)
    return np.asarray(value, np.int32)


class SaturatedActivation(Detector):
    """tanh / sigmoid units pushed into their flat tails, where gradients vanish.

    Rule: the fraction of an activation's inputs beyond the saturation bound
    (|x| >= 5 for tanh, |x| >= 10 for the logistic sigmoid: where the local
    gradient is under 1/5000 of its peak) is measured on sampled steps. Above
    ``threshold`` on ``patience`` sampled steps in a row is a warning.

    The sigmoid that makes a binary or multi-label model's output is left alone where
    the loss is that output's log-likelihood (``binary_cross_entropy`` of its
    probabilities, told by the ``predictions`` statistic: the loss equals their BCE): the
    gradient through both is ``p - y``, which its tails do not shrink, so a confident
    classifier is not a saturated one.

    Sources: DeepDiagnosis (> 50% of tanh / sigmoid inputs with |x| >= 5);
    SageMaker Debugger ``saturated_activation`` (bounds ±9.5 for tanh and
    (-23, 17) for sigmoid, layer fraction 50%). Only ``nn.Tanh`` / ``nn.Sigmoid``
    modules (Keras: ``activation="tanh"`` layers) are observed; a ``torch.tanh``
    call inside ``forward`` is invisible to hooks.

    Args:
        threshold: Saturated fraction of an activation's inputs that is too much.
        patience: Consecutive sampled steps above it that raise a warning.
    """

    name = "saturated_activation"
    needs = frozenset({"activations"})
    wants = frozenset({"predictions"})  # whether the output's sigmoid is its likelihood's
    base_interval = 16
    advice = "smaller init/LR, normalise inputs, or ReLU"

    def __init__(self, *, threshold: float = 0.5, patience: int = 3) -> None:
        check_fraction(self.name, "threshold", threshold)
        check_positive(self.name, "patience", patience, integer=True)
        self.threshold, self.patience = float(threshold), patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"streaks": {}, "reported": []}

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        findings: list[Finding] = []
        output = _likelihood_output(obs)
        for name, kind, frac in zip(obs.act_names, obs.act_kinds, obs.act_saturated, strict=True):
            if kind not in SATURATION_BOUNDS or not np.isfinite(frac) or name == output:
                continue
            if frac <= self.threshold:
                st["streaks"][name] = 0
                if name in st["reported"]:
                    st["reported"].remove(name)
                continue
            st["streaks"][name] = streak = st["streaks"].get(name, 0) + 1
            self.suspect = f"{frac:.0%} of the inputs of {name} ({kind}) are saturated"
            if streak < self.patience or name in st["reported"] or findings:
                continue
            st["reported"].append(name)
            bound = SATURATION_BOUNDS[kind]
            findings.append(
                self.finding(
                    obs,
                    "warning",
                    f"Saturated {kind}: {frac:.0%} of the inputs of {name} are beyond "
                    f"±{bound:g} at step {obs.step}, where its gradient is almost zero, so "
                    "those units have stopped learning; usual causes are weights initialised "
                    "too large, unnormalised inputs or a learning rate too high: use "
                    "Xavier/Glorot init, normalise the inputs, add normalisation layers, or "
                    "switch to ReLU-family activations.",
                    value=float(frac),
                    threshold=self.threshold,
                    where=name,
                )
            )
        return findings


def _likelihood_output(obs: Observation) -> str | None:
    """The sigmoid that makes the model's output, where the step's loss is the binary
    cross-entropy of that output's probabilities (None: not so, or not measured): the last
    sigmoid the activations name, the output being within [0, 1]."""
    loss, bce = obs.loss, obs.bce_as_probs
    if not obs.output_in_unit or loss is None or bce is None:
        return None
    if not (math.isfinite(loss) and math.isfinite(bce)):
        return None
    if not math.isclose(loss, bce, rel_tol=1e-3, abs_tol=1e-7):
        return None
    sigmoids = [n for n, k in zip(obs.act_names, obs.act_kinds, strict=True) if k == "sigmoid"]
    return sigmoids[-1] if sigmoids else None
