"""Precision detectors: low-precision training that quietly stops learning.

Each judges a number against the limits of the dtype it is held in (see
:mod:`stethoscope.number_formats`): an update smaller than half a unit in the last place
of its weight, a gradient below the smallest normal value, a loss scale that keeps
falling, a value nearing the largest finite one. In a run that holds nothing in a 16-bit
format (``TrainingSetup.low_precision``) they are finished at once: they are never run,
and what they read is never measured.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from stethoscope.advice import DEEPSPEED_SCALER, TrainingSetup, epsilon_advice
from stethoscope.detectors._underflow import flushed as backward_flushed
from stethoscope.detectors._underflow import gradient_dtypes
from stethoscope.detectors._underflow import half as _half
from stethoscope.detectors.base import Detector, SetupCheck, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.number_formats import E4M3, E5M2, FORMATS, HALF
from stethoscope.observation import Observation

__all__ = [
    "EpsilonUnderflow",
    "Fp8Readiness",
    "GradientUnderflow",
    "LossScaleCollapse",
    "OverflowRisk",
    "RoundedUpdates",
]


def _master_weights(setup: TrainingSetup) -> str:
    """How this framework keeps float32 weights under 16-bit compute."""
    if setup.framework == "keras":
        return 'keep float32 variables (the "mixed_bfloat16" dtype policy, not "bfloat16")'
    if setup.framework == "lightning":
        return 'keep float32 master weights (precision="bf16-mixed", not "bf16-true")'
    return "keep float32 master weights and compute in 16 bits (mixed precision)"


def _loss_scaling(setup: TrainingSetup) -> str:
    """How this framework scales the loss (or, under a loss scaler, a larger scale), or
    trains in bfloat16 instead."""
    if setup.loss_scaled:  # float16 gradients, scaled and yet too small
        deepspeed = setup.loss_scaler == DEEPSPEED_SCALER  # its own arguments say how
        larger = (
            " (DeepSpeedStrategy's initial_scale_power, or a shorter loss_scale_window, "
            "after which the scale grows)"
            if deepspeed
            else ""
        )
        bf16 = ' (precision="bf16-mixed")' if deepspeed else ""
        return (
            f"the loss is already scaled ({setup.loss_scaler}): a larger scale keeps more "
            f"of them{larger}, or train in bfloat16{bf16}, which keeps float32's range"
        )
    if setup.framework == "keras":
        return (
            'scale the loss (the "mixed_float16" dtype policy wraps the optimizer in a '
            'LossScaleOptimizer), or train in bfloat16 ("mixed_bfloat16"), which keeps '
            "float32's range"
        )
    if setup.framework == "lightning":
        return (
            'scale the loss (precision="16-mixed" keeps float32 weights and uses a '
            'GradScaler), or train in bfloat16 (precision="bf16-mixed"), which keeps '
            "float32's range"
        )
    return "scale the loss (mixed precision with a loss scaler), or train in bfloat16"


def _sentence(clause: str) -> str:
    return clause[:1].upper() + clause[1:]


def _nothing_moved(lost: np.ndarray, dtype: str) -> str:
    """A clause for when no element of any 16-bit matrix moved: more than rounding, the
    optimizer's own arithmetic in that dtype may cancel every update (empty otherwise)."""
    if not len(lost) or lost.min() < 1.0:
        return ""
    return (
        f" No element of any {dtype} matrix moved at all: beyond rounding, the optimizer's "
        f"own arithmetic in {dtype} may cancel every update (Adam's beta_2=0.999 is 1.0 in "
        "bfloat16, and its bias correction then 0)."
    )


class _LowPrecision(Detector):
    """A detector that judges only a run holding something in 16 bits."""

    def applies(self) -> bool:
        return self.setup.low_precision


class _ShareStreak(_LowPrecision):
    """A rule on a per-tensor share: a 16-bit tensor's share of something at or past
    ``fraction`` on ``patience`` measured steps in a row, said once per streak (what
    :class:`RoundedUpdates` and :class:`GradientUnderflow` judge).

    Args:
        fraction: The share.
        patience: Consecutive measured steps at or past it.
    """

    def __init__(self, *, fraction: float, patience: int) -> None:
        check_fraction(self.name, "fraction", fraction)
        check_positive(self.name, "patience", patience, integer=True)
        self.fraction, self.patience = float(fraction), patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"count": 0, "since": None, "fired": False}

    def _worst(
        self, obs: Observation, shares: np.ndarray, judged: np.ndarray, what: str
    ) -> tuple[int, np.ndarray] | None:
        """The tensor to name and which tensors are past the share, on the step the
        streak is long enough to say (None on every other step). ``what``: the suspicion
        a step of the streak raises before that, of ``{share}`` and ``{name}``."""
        st = self.state
        if not judged.any():
            return None
        past = judged & (shares >= self.fraction)
        if not past.any():
            st["count"], st["since"], st["fired"] = 0, None, False
            return None
        st["count"] += 1
        if st["since"] is None:
            st["since"] = obs.step
        if st["fired"]:  # said once: a suspicion now would keep the sampler hot for good
            return None
        worst = int(np.flatnonzero(past)[np.argmax(shares[past])])
        self.suspect = what.format(share=shares[worst], name=obs.names[worst])
        if st["count"] < self.patience:
            return None
        st["fired"] = True
        return worst, past


class RoundedUpdates(_ShareStreak):
    """Updates that round away: a 16-bit weight the optimizer step leaves as it was.

    A bfloat16 weight keeps 8 significant bits: an update smaller than half of 2**-7 of
    the weight (about 0.4%) rounds to nothing, and with Adam at a small learning rate most
    of a layer can stop moving while the loss stays finite.

    Rule: for each weight matrix held in a 16-bit dtype, the share of its elements that
    the step left exactly as they were although their gradient was not zero
    (``update_lost``). A warning when one reaches ``fraction`` on ``patience`` measured
    steps in a row; the finding names the worst such matrix and its dtype.

    Args:
        fraction: Share of a matrix's elements whose updates rounded away.
        patience: Consecutive measured steps at or past it.
    """

    name = "rounded_updates"
    needs = frozenset({"precision"})
    base_interval = 16
    advice = "fp32 master weights; raise the LR; stochastic rounding"

    def __init__(self, *, fraction: float = 0.5, patience: int = 3) -> None:
        super().__init__(fraction=fraction, patience=patience)

    def applies(self) -> bool:
        # master copies keep what the 16-bit weights round away
        return super().applies() and not self.setup.master_weights

    def current_advice(self) -> str:
        return "bf16-mixed; raise the LR" if self.setup.framework == "lightning" else self.advice

    def _update(self, obs: Observation) -> list[Finding]:
        if obs.update_lost is None:  # a step whose update was not applied (recovery)
            return []
        lost = np.asarray(obs.update_lost, dtype=np.float64)
        judged = _half(obs) & np.asarray(obs.is_matrix, dtype=bool) & np.isfinite(lost)
        said = self._worst(obs, lost, judged, "{share:.0%} of {name}'s updates rounded away")
        if said is None:
            return []
        worst, past = said
        st = self.state
        share, dtype = float(lost[worst]), obs.dtypes[worst]
        fmt = FORMATS[dtype]
        return [
            self.finding(
                obs,
                "warning",
                f"The weights of {obs.names[worst]} are held in {dtype}, and the optimizer step "
                f"left {share:.0%} of them exactly as they were although their gradient was not "
                f"zero (step {obs.step}; {int(past.sum())} of {int(judged.sum())} "
                f"{dtype} weight matrices past {self.fraction:.0%} since step {st['since']}). "
                f"{dtype} keeps {fmt.bits} significant bits: an update under "
                f"{fmt.eps / 2:.2%} of the weight it moves rounds away, so those weights "
                f"have stopped learning.{_nothing_moved(lost[judged], dtype)} "
                f"{_sentence(_master_weights(self.setup))}, raise the learning rate, or use "
                "stochastic rounding or Kahan summation in the optimizer.",
                value=share,
                threshold=self.fraction,
                where=obs.names[worst],
            )
        ]


class GradientUnderflow(_ShareStreak):
    """Gradients that underflow in float16: subnormal, or flushed to zero.

    float16's smallest normal value is 6.1e-5; below it a gradient keeps fewer bits, and
    below 3e-8 it is zero. Without loss scaling, small gradients are lost this way while
    the loss stays finite: the layer learns from what is left.

    Rule: for each gradient held in a 16-bit dtype, the share of its elements that are
    subnormal in it (``grad_subnormal``). A float32 weight's gradient computed in
    float16 (``torch.autocast`` in the training step, with no loss scaler: see
    ``TrainingSetup.computes_in``) is judged as float16's: its elements that are float16
    subnormals, exactly (on float16's grid; a float32 value lands there by chance one
    time in thousands). A warning when one reaches ``fraction`` on
    ``patience`` measured steps in a row; the finding names the worst gradient, its dtype,
    and the share that is exactly zero beside it. (A gradient of exact zeros alone is a
    dead unit's or an unused input's: subnormals are the mark of an underflow.) A
    backward pass flushed whole leaves no subnormal: with no loss scaling and a finite
    loss above zero, every element of every 16-bit gradient exactly zero, the output
    layer's too (which a dead unit or an unused input leaves standing), counts as all of
    them past ``fraction``.

    Args:
        fraction: Share of a gradient's elements that are subnormal.
        patience: Consecutive measured steps at or past it.
    """

    name = "gradient_underflow"
    needs = frozenset({"precision"})
    base_interval = 16
    advice = "scale the loss (16-mixed) or train in bf16"

    def __init__(self, *, fraction: float = 0.05, patience: int = 2) -> None:
        super().__init__(fraction=fraction, patience=patience)

    def current_advice(self) -> str:
        if self.setup.loss_scaled:
            return "a larger loss scale, or bf16"
        if self.setup.framework == "keras":
            return "scale the loss (mixed_float16) or mixed_bfloat16"
        return self.advice

    def _update(self, obs: Observation) -> list[Finding]:
        subnormal = np.asarray(obs.grad_subnormal, dtype=np.float64)
        judged = _half(obs, self.setup) & np.isfinite(subnormal)
        flushed = obs.grad_zero is not None and backward_flushed(obs, self.setup, judged)
        shares = np.where(judged, 1.0, subnormal) if flushed else subnormal
        what = "{name}'s gradient is zero" if flushed else "{share:.0%} of {name}'s is subnormal"
        said = self._worst(obs, shares, judged, what)
        if said is None:
            return []
        worst, past = said
        st = self.state
        share, dtype = float(subnormal[worst]), gradient_dtypes(obs, self.setup)[worst]
        fmt = FORMATS[dtype]
        # an autocast backward pass's gradient, cast up to its float32 weight's dtype
        held = obs.dtypes[worst]
        cast = f" (computed under autocast, held in {held})" if held != dtype else ""
        zero = float(np.asarray(obs.grad_zero, dtype=np.float64)[worst])
        what = (
            f"The {dtype} gradients{cast} underflow to zero: every element of all "
            f"{int(judged.sum())} {dtype} gradients, the output layer's too, is exactly zero "
            f"at step {obs.step} (since step {st['since']}) although the loss is "
            f"{obs.loss:.3g} and no loss scaling is on: the backward pass fell below "
            f"{fmt.smallest:.2g} and flushed to zero"
            if flushed
            else f"The {dtype} gradient of {obs.names[worst]}{cast} underflows: {share:.0%} of its "
            f"elements are subnormal (below {fmt.tiny:.2g}, keeping fewer than "
            f"{fmt.bits} significant bits) and {zero:.0%} are exactly zero at step "
            f"{obs.step} ({int(past.sum())} of {int(judged.sum())} {dtype} gradients "
            f"past {self.fraction:.0%} since step {st['since']})"
        )
        return [
            self.finding(
                obs,
                "warning",
                f"{what}. What flushes to zero never trains; {_loss_scaling(self.setup)}.",
                value=1.0 if flushed else share,
                threshold=self.fraction,
                where=obs.names[worst],
            )
        ]


class LossScaleCollapse(_LowPrecision):
    """A loss scaler whose scale collapses, skipping step after step.

    A dynamic loss scaler (a GradScaler, a ``LossScaleOptimizer``) multiplies the loss
    before the backward pass so that small float16 gradients survive, skips each step
    whose scaled gradients overflow and halves its scale. A few skips at the start find
    the scale; a scale that keeps falling means the gradients overflow even unscaled,
    and each skipped step trains nothing.

    Rule: a warning when the scale falls below ``floor`` (the loss is then scaled down,
    not up), or when the scaler skipped at least ``skip_fraction`` of the steps of the
    last ``window`` steps measured (at least ``window`` of them). The finding gives the
    scale's path and the skipped share.

    Args:
        floor: The scale below which it has collapsed.
        skip_fraction: Share of recent steps skipped.
        window: Steps the skipped share is taken over.
    """

    name = "loss_scale_collapse"
    needs = frozenset({"loss_scale"})
    base_interval = 4  # one number read: a scale can halve 4 times between reads
    advice = "find the overflow; train in bf16"

    def __init__(self, *, floor: float = 1.0, skip_fraction: float = 0.5, window: int = 64) -> None:
        check_positive(self.name, "floor", floor)
        check_fraction(self.name, "skip_fraction", skip_fraction)
        check_positive(self.name, "window", window, integer=True)
        self.floor, self.skip_fraction, self.window = float(floor), float(skip_fraction), window
        super().__init__()

    def applies(self) -> bool:
        return self.setup.loss_scaled

    def _initial_state(self) -> dict:
        # recent: [steps, skipped] per measurement, newest last, covering >= window steps
        return {"first": None, "peak": None, "recent": [], "fired": False}

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        scale = obs.loss_scale
        if scale is None or not np.isfinite(scale):
            return []
        if st["first"] is None:
            st["first"] = scale
        st["peak"] = max(st["peak"] or scale, scale)
        recent = deque(st["recent"])
        recent.append([int(obs.scale_steps), int(obs.scale_skipped)])
        while len(recent) > 1 and sum(s for s, _ in list(recent)[1:]) >= self.window:
            recent.popleft()
        st["recent"] = [list(r) for r in recent]
        steps = sum(s for s, _ in recent)
        skipped = sum(k for _, k in recent)
        share = skipped / steps if steps else 0.0
        collapsed = scale < self.floor
        skipping = steps >= self.window and share >= self.skip_fraction
        if not (collapsed or skipping):
            st["fired"] = False
            return []
        if st["fired"]:  # said once: a suspicion now would keep the sampler hot for good
            return []
        st["fired"] = True
        why = (
            f"below {self.floor:g}: the loss is scaled down, not up"
            if collapsed
            else f"and the scaler skipped {skipped} of the last {steps} steps"
        )
        return [
            self.finding(
                obs,
                "warning",
                f"The loss scale has fallen from {st['first']:.6g} (its peak "
                f"{st['peak']:.6g}) to {scale:.3g} (2^{np.log2(scale):.0f}) by step "
                f"{obs.step}, {why}; {skipped} of the last {steps} steps were skipped for an "
                "Inf or NaN in the scaled gradients. Skipped steps train nothing, and a scale "
                "that keeps falling means the gradients overflow even unscaled: find the op "
                "that overflows in float16 (an exp, a large matmul, a sum of squares), keep "
                "it in float32, or train in bfloat16, which needs no loss scale.",
                value=scale,
                threshold=self.floor,
            )
        ]


class OverflowRisk(_LowPrecision):
    """A 16-bit tensor nearing its dtype's largest value: an overflow not yet happened.

    float16 overflows past 65504. A layer whose output (or a gradient) climbs toward it
    turns into Inf a few doublings later, and the run is lost or the loss scaler starts
    to skip; bfloat16 shares float32's range, so in practice only float16 is at risk.

    Rule: for each layer output and each gradient held in a 16-bit dtype, its largest
    magnitude against the dtype's maximum. A warning when it reaches ``1 / margin`` of
    it, once per tensor.

    Args:
        margin: How far below the maximum the warning comes (16: at 1/16 of it, four
            doublings before the overflow).
    """

    name = "overflow_risk"
    needs = frozenset({"outputs"})
    wants = frozenset({"precision"})
    base_interval = 16
    advice = "keep that layer in fp32; normalise; bf16"

    def __init__(self, *, margin: float = 16.0) -> None:
        check_positive(self.name, "margin", margin)
        if margin <= 1:
            raise ValueError(f"{self.name}: margin={margin!r} must be greater than 1")
        self.margin = float(margin)
        super().__init__()

    def _initial_state(self) -> dict:
        return {"warned": []}

    def _update(self, obs: Observation) -> list[Finding]:
        near: list[tuple[float, str, str, float, str]] = []
        if obs.act_max is not None:
            for name, kind, dtype, peak in zip(
                obs.act_names, obs.act_kinds, obs.act_dtypes, obs.act_max, strict=False
            ):
                what = "output" if kind == "layer" else f"{kind} input"
                near += self._near(name, what, dtype, float(peak))
        if obs.grad_peak is not None:
            for name, dtype, peak in zip(obs.names, obs.dtypes, obs.grad_peak, strict=False):
                near += self._near(name, "gradient", dtype, float(peak))
        fresh = [n for n in near if n[1] not in self.state["warned"]]
        if not fresh:
            return []
        ratio, key, what, peak, dtype = max(fresh)
        self.state["warned"].extend(n[1] for n in fresh)
        fmt = FORMATS[dtype]
        others = f" ({len(fresh) - 1} more tensors past it)" if len(fresh) > 1 else ""
        return [
            self.finding(
                obs,
                "warning",
                f"The {what} of {key.split('|', 1)[1]} ({dtype}) reached {peak:.4g} at step "
                f"{obs.step}, {ratio:.0%} of {dtype}'s largest value {fmt.max:g}{others}: "
                f"no overflow yet, but {np.log2(fmt.max / peak):.1f} more doublings make an "
                "Inf. Keep that layer in float32, normalise its input, or train in bfloat16, "
                "which keeps float32's range.",
                value=peak,
                threshold=fmt.max / self.margin,
                where=key.split("|", 1)[1],
            )
        ]

    def _near(
        self, name: str, what: str, dtype: str, peak: float
    ) -> list[tuple[float, str, str, float, str]]:
        if dtype not in HALF or not np.isfinite(peak):
            return []
        ratio = peak / FORMATS[dtype].max
        return [(ratio, f"{what}|{name}", what, peak, dtype)] if ratio >= 1 / self.margin else []


class Fp8Readiness(Detector):
    """Whether the run's weights and gradients would survive fp8: a report for a run that
    is not in fp8 yet, judged only when asked for (``default_detectors(fp8_readiness={})``).

    fp8 training (Transformer Engine's recipe) holds the weights in e4m3 and the
    gradients in e5m2, each tensor scaled so that its largest magnitude meets the
    format's largest value. What lies more than a format's dynamic range below that
    rounds to zero, silently: a layer whose values spread wider than e4m3's 2**17 (or
    e5m2's 2**32) loses them, and the run diverges where bfloat16 converges. Under delayed
    scaling the scale comes from earlier steps, and a tensor that outgrows it saturates.

    Rule: on ``patience`` measured steps in a row, a weight matrix whose weights lose at
    least ``fraction`` of their non-zero elements in e4m3, or whose gradient loses that
    share in e5m2; or a gradient whose largest magnitude grew ``growth`` times from one
    measured step to the next. A warning once, naming the worst layers.

    Args:
        fraction: Share of a tensor's non-zero elements that would round to zero.
        patience: Consecutive measured steps at or past it.
        growth: Growth of a gradient's largest magnitude between measured steps.
    """

    name = "fp8_readiness"
    needs = frozenset({"fp8"})
    base_interval = 64
    opt_in = True
    advice = "keep those layers in bf16 under fp8"

    def __init__(self, *, fraction: float = 0.01, patience: int = 2, growth: float = 16.0) -> None:
        check_fraction(self.name, "fraction", fraction)
        check_positive(self.name, "patience", patience, integer=True)
        check_positive(self.name, "growth", growth)
        if growth <= 1:
            raise ValueError(f"{self.name}: growth={growth!r} must be greater than 1")
        self.fraction, self.patience, self.growth = float(fraction), patience, float(growth)
        super().__init__()

    def _initial_state(self) -> dict:
        return {"count": 0, "amax": {}, "fired": False}

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        under = np.asarray(obs.fp8_underflow, dtype=np.float64).reshape(-1, 4)
        amax = np.asarray(obs.fp8_amax, dtype=np.float64).reshape(-1, 2)
        matrix = np.asarray(obs.is_matrix, dtype=bool)
        # the hybrid recipe: weights in e4m3 (column 0), gradients in e5m2 (column 3)
        lost = np.where(matrix, np.fmax(under[:, 0], under[:, 3]), np.nan)
        grew = []
        for name, peak in zip(obs.names, amax[:, 1].tolist(), strict=True):
            before = st["amax"].get(name)
            if before and np.isfinite(peak) and peak >= self.growth * before:
                grew.append((peak / before, name))
            if np.isfinite(peak) and peak > 0:
                st["amax"][name] = peak
        past = np.flatnonzero(lost >= self.fraction)
        if not len(past) and not grew:
            st["count"] = 0
            return []
        st["count"] += 1
        if st["fired"]:  # said once: a suspicion now would keep the sampler hot for good
            return []
        self.suspect = f"{len(past)} layers lose values in fp8"
        if st["count"] < self.patience and not grew:
            return []
        st["fired"] = True
        parts = []
        if len(past):
            worst = sorted(past, key=lambda i: -lost[i])[:3]
            shown = ", ".join(
                f"{obs.names[i]} ({under[i, 0]:.1%} of its weights in e4m3, "
                f"{under[i, 3]:.1%} of its gradient in e5m2)"
                for i in worst
            )
            parts.append(
                f"{len(past)} of {int(matrix.sum())} weight matrices would lose at least "
                f"{self.fraction:.0%} of their values to zero under per-tensor scaling: "
                f"{shown}. Their values spread wider than e4m3's {E4M3.max / E4M3.smallest:.0e}"
                f" (e5m2's {E5M2.max / E5M2.smallest:.0e}) between the largest and the "
                "smallest"
            )
        if grew:
            ratio, name = max(grew)
            parts.append(
                f"the gradient of {name} grew {ratio:.0f}x between measured steps: under "
                "delayed scaling, its values above the old largest saturate"
            )
        return [
            self.finding(
                obs,
                "warning",
                f"Not ready for fp8 at step {obs.step}: {'; and '.join(parts)}. Keep those "
                "layers in bfloat16 when the rest trains in fp8, or use finer scaling "
                "(per block, or current scaling) for them.",
                value=float(np.nanmax(lost)) if len(past) else None,
                threshold=self.fraction,
                where=obs.names[int(past[np.argmax(lost[past])])] if len(past) else grew[0][1],
            )
        ]


class EpsilonUnderflow(SetupCheck):
    """An optimizer's epsilon that is zero in the 16-bit dtype of the weights it updates.

    Adam (and RMSprop, Adagrad...) divides each step by ``sqrt(v) + eps``, and keeps ``v``,
    the mean of the squared gradients, in the weight's dtype. In float16 a gradient
    element under about 2.4e-4 (or zero) leaves ``v`` at zero; with the default
    ``eps=1e-8``, itself zero in float16, its step divides by zero and the weight turns NaN
    or infinite, on the first steps. bfloat16 keeps float32's range and is not concerned.

    Rule: from the setup (``TrainingSetup.small_epsilon``, when the epsilon rounds to
    zero): a warning once, at the first step whose gradients are measured. A smaller
    epsilon that is not zero is no finding (the runs measured with one do not all
    diverge), but ``nonfinite_weights`` names it as the cause if the weights go bad.
    """

    name = "epsilon_underflow"
    advice = "set eps=1e-4, or fp32 weights"

    def applies(self) -> bool:
        risk = self.setup.small_epsilon
        return risk is not None and risk.zero

    def current_advice(self) -> str:
        return (
            "set epsilon=1e-4, or fp32 variables"
            if self.setup.framework == "keras"
            else self.advice
        )

    def _said(self, obs: Observation) -> Finding:
        risk = self.setup.small_epsilon
        fmt = FORMATS[risk.dtype]
        return self.finding(
            obs,
            "warning",
            f"{risk} is 0 in {risk.dtype}: the optimizer keeps each weight's second "
            f"moment in {risk.dtype}, where a gradient element under about "
            f"{np.sqrt(fmt.smallest):.2g} (or zero) leaves it at zero, and a step there "
            f"divides by zero, turning the weight NaN or infinite (step {obs.step}); "
            f"{epsilon_advice(self.setup)}.",
            value=risk.value,
            threshold=fmt.smallest / 2,
            where=risk.optimizer,
        )
