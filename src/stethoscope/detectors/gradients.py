"""Gradient magnitude: explosions and vanishing."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.advice import clipping_advice, warmup_advice
from stethoscope.detectors._stats import MAD_TO_SIGMA, is_finite, median, push
from stethoscope.detectors._underflow import underflow_format
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

    A calm run, one whose norm stays under ``initial_factor`` times its initial norm
    (below the waiver above), judges a jump by whether it comes back from it: a hard
    batch is absorbed within a step or two (its step may throw the weights off for the
    next), weights a learning rate threw off stay up. There a jump is a suspicion (the
    sampler then measures every step) and ``patience`` in a row an error; two in a row
    ``factor**2`` times the median are an error (a plain optimizer took two steps that
    far), one is a suspicion like any other: whether the run comes back shows at the
    next step. Measured on a linear regression under SGD on the raw features x, x^2,
    x^3, x^4 of x ~ N(0, 1) (pytorch/examples'), every step seen: its norm 10-95x its
    recent median on one step in twenty (a batch holding a sample past 3 sigma,
    x^4 > 81), back at its level within two steps, every time, on a run whose loss falls
    100-fold; as it goes on fitting, the median falls and the same batches reach 100-270x
    (Keras, 2560 steps), and come back as well. Its norms start high and fall as it fits,
    so its jumps stay under ``initial_factor`` times the first; a run that climbs from
    its first steps does not.

    In a game (``TrainingSetup.adversarial``: a GAN) a lone jump is no finding, only a
    suspicion, unless it is ``factor**2`` times the median under a plain optimizer: a
    player's gradient is as large as the other player's last move makes it. A DCGAN's
    discriminator, measured on the CPU (pytorch/examples' hyperparameters, 16x16 images,
    a discriminator four times as wide as its generator):
    its norm from 2.3 to 145 over 384 batches, up to 11x its own recent median from one
    batch to the next, on a run that learns; judged on its own (a baseline per player)
    it jumps as far. ``patience`` in a row is an error, as everywhere.

    Where the batches vary in size (``grad_samples``, the samples behind a step's
    gradients, differs over the window), a jump must also be one of the norm per sample,
    judged by the same rule on its own history: the gradient of a loss summed over its
    samples grows with their number (an actor-critic on a cart-pole, each episode a batch
    of 8 to 335 steps, measured: its norm from 0.3 to 2600 over 150 episodes as it learns
    to balance, its norm per sample within 0.03 to 8), and a loss averaged over them does
    not, so a norm that follows the
    batch's size is no explosion, whichever the loss does. Said once, an info, where it
    keeps the run from a finding. Batches of one size make both rules one.

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
        # log10 norms; ``initial`` is frozen after the warm-up. per_sample: log10 of each
        # norm over its samples (None: unknown), sizes: those samples (0: unknown), both
        # alongside history; per_initial: the per-sample initial; told: the info said
        return {
            "history": [],
            "initial": None,
            "seen": 0,
            "streak": 0,
            "last": None,
            "per_sample": [],
            "sizes": [],
            "per_initial": None,
            "told": False,
            "names": None,
            "restarted": False,
            "jumped_in": None,
            "episode": None,
            "tail": [],
        }

    def _baseline(self, hist: list[float] | None = None) -> tuple[float, float]:
        """The median log10 norm of the window (``hist``: another history of the same
        kind), and the margin (in decades) above it that an explosion must pass when the
        z-score applies."""
        hist = self.state["history"] if hist is None else hist
        center = median(hist)
        spread = MAD_TO_SIGMA * median([abs(h - center) for h in hist])
        return center, max(math.log10(self.factor), self.z * spread)

    def _jump(self, hist: list[float], initial: float, value: float) -> tuple[float, float, bool]:
        """How far ``value`` (log10) is above the median of ``hist``, the margin it must
        pass to be an explosion, and whether it does (and is at least ``initial``)."""
        center, margin = self._baseline(hist)
        if value - initial >= math.log10(self.initial_factor):
            margin = math.log10(self.factor)  # far above where the run started: no z
        over = value - center
        return over, margin, over > margin and value >= initial

    def _per_sample(self, samples: int) -> bool:
        """Whether a step of ``samples`` samples is judged per sample too: every size of
        the window is known and they are not all this one."""
        st = self.state
        sizes = st.get("sizes", [])
        return (
            samples > 0
            and st.get("per_initial") is not None
            and len(sizes) == len(st["history"])
            and all(n > 0 for n in sizes)
            and any(n != samples for n in sizes)
        )

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
        bar = self._bar(st["history"], st["initial"])
        sizes = st.get("sizes", [])
        if self._per_sample(max(sizes, default=0)):
            # batches of several sizes: a norm is an explosion past the per-sample bar
            # too, for a batch of a size not known before the step; the window's largest
            bar = max(bar, self._bar(st["per_sample"], st["per_initial"]) * max(sizes))
        self._bar_cache = (key, bar)
        return bar

    def _bar(self, hist: list[float], initial: float) -> float:
        """The rule's two cases folded into one number, for a history of log10 norms."""
        center, margin = self._baseline(hist)
        with_z = max(center + margin, initial)
        far = max(initial + math.log10(self.initial_factor), center + math.log10(self.factor))
        return 10 ** min(with_z, far)

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        norms = obs.grad_norm
        total = global_norm(norms)
        if not (math.isfinite(total) and total > 0):
            return []  # non-finite: nonfinite_gradients owns it; zero: nothing to compare
        log_norm = math.log10(total)
        samples = int(obs.grad_samples or 0)
        per = math.log10(total / samples) if samples > 0 else None
        last, st["last"] = st["last"], [float(v) for v in norms]
        hist = st["history"]
        findings: list[Finding] = []
        new = self._newly_trained(obs.names, norms, total)
        if new:  # the window measured other parameters
            findings += self._restart(obs, new)
        elif st["seen"] >= self.warmup:
            over, margin, explodes = self._jump(hist, st["initial"], log_norm)
            # the same of the norm per sample, where the batches' sizes vary
            each = (
                self._jump(st["per_sample"], st["per_initial"], per)
                if per is not None and self._per_sample(samples)
                else (over, margin, explodes)
            )
            if over > margin / 2 and each[0] > each[1] / 2:
                self.suspect = f"gradient norm {total:.3g} is {10**over:.3g}x its recent median"
            if not explodes:
                self._came_back()
            elif not each[2]:
                self._came_back()
                findings += self._follows_the_batch(obs, total, over, samples)
            else:
                st["streak"] += 1
                jump = min(over, each[0])
                st["episode"] = max(st.get("episode") or jump, jump)
                # A calm run (its norm under initial_factor times its initial one)
                # judges a jump by whether it comes back from it: a hard batch is
                # absorbed within a step or two (its step may throw the weights off for
                # the next), weights a learning rate threw off stay up. So there only
                # ``patience`` in a row count, or two ``factor**2`` times the median (a
                # plain optimizer took two steps that far); one such is a suspicion, as a
                # converged regression's outlier batch reaches 270x. Far above where it
                # started a run diverges (its norms swing from its first steps): each
                # jump counts, one ``factor**2`` a warning at once. In a game a jump is
                # the other player's move.
                calm = log_norm - st["initial"] < math.log10(self.initial_factor)
                at_once = jump >= 2 * math.log10(self.factor) and not self.setup.adaptive
                at_once = at_once and not self._in_tail(jump)
                severe = st["streak"] >= self.patience or (
                    at_once and (st["streak"] > 1 or not calm)
                )
                quiet = self.setup.adversarial or calm
                lone = quiet and not severe
                if st["streak"] == 1:  # where it entered, against the calm sample before
                    st["jumped_in"] = _largest_jump(obs.names, norms, last, self.factor)
                if not lone:
                    center = log_norm - over
                    where = st.get("jumped_in") or _largest_jump(
                        obs.names, norms, last, self.factor
                    )
                    per_sample = (
                        f", {10 ** each[0]:.3g}x per sample (a batch of {samples})"
                        if each[0] != over
                        else ""
                    )
                    in_a_row = (
                        f", {st['streak']} sampled steps in a row" if st["streak"] > 1 else ""
                    )
                    findings.append(
                        self.finding(
                            obs,
                            "error" if severe else "warning",
                            f"Gradient norm {total:.3g} is {10**over:.3g}x its recent median "
                            f"{10**center:.3g}{per_sample} at step {obs.step}{in_a_row} (it "
                            f"jumps first in {where}, in backward order): the learning rate "
                            f"is likely too "
                            f"high for this point of training; lower it, "
                            f"{warmup_advice(self.setup)}, or {clipping_advice(self.setup)}.",
                            value=total,
                            threshold=10 ** (center + margin),
                            where=where,
                        )
                    )
        self._keep(log_norm, per, samples)
        return findings

    def _came_back(self) -> None:
        """A sample back within the margin: the jumps before it (if any) were absorbed;
        the largest joins the tail, kept for ``window`` samples."""
        st = self.state
        if st["streak"] and st.get("episode") is not None:
            tail = st.setdefault("tail", [])
            tail.append([st["seen"], st["episode"]])
        st["streak"], st["episode"] = 0, None

    def _in_tail(self, jump: float) -> bool:
        """Whether a jump of ``jump`` decades over the median is no larger than one the
        run came back from within the last ``window`` samples."""
        st = self.state
        tail = [t for t in st.get("tail", []) if st["seen"] - t[0] < self.window]
        st["tail"] = tail
        return any(jump <= over for _, over in tail)

    def _newly_trained(self, names: tuple[str, ...], norms: np.ndarray, total: float) -> list[str]:
        """The parameters that have a gradient now and had none at the last sample, where
        they carry most of the norm (over half its square): the next stage of layer-wise
        training, a part unfrozen. [] otherwise: a parameter that comes and goes with
        little of the norm (an expert of a mixture) changes nothing."""
        before, self.state["names"] = self.state.get("names"), list(names)
        if before is None or list(names) == before:
            return []
        known = set(before)
        new = np.array([n not in known for n in names], dtype=bool)
        share = float(np.sum(np.square(norms[new], dtype=np.float64))) / total**2
        return [n for n, is_new in zip(names, new, strict=True) if is_new] if share > 0.5 else []

    def _restart(self, obs: Observation, new: list[str]) -> list[Finding]:
        """Start the window again: its norms were of other parameters. Said once, an info."""
        st = self.state
        judged = st["seen"] >= self.warmup
        st.update(history=[], seen=0, initial=None, streak=0, per_sample=[], sizes=[])
        st["per_initial"] = None
        if st.get("restarted") or not judged:  # in the warm-up: nothing was judged yet
            return []
        st["restarted"] = True
        more = f" and {len(new) - 1} more" if len(new) > 1 else ""
        return [
            self.finding(
                obs,
                "info",
                f"exploding_gradients starts its baseline again at step {obs.step}: the "
                f"parameters that receive gradients changed ({new[0]}{more} now have one "
                "and carry most of the norm: the next stage of layer-wise training, or a "
                "part unfrozen), so the norms before measured other parameters.",
                value=global_norm(obs.grad_norm),
                where=new[0],
            )
        ]

    def _keep(self, log_norm: float, per: float | None, samples: int) -> None:
        """Take a step's norm into the window, its norm per sample and size beside it."""
        st = self.state
        st["seen"] += 1
        aligned = len(st.setdefault("sizes", [])) == len(st["history"])
        push(st["history"], log_norm, self.window)
        if aligned:  # a checkpoint from before the sizes were kept: never aligned again
            push(st.setdefault("per_sample", []), per, self.window)
            push(st["sizes"], samples, self.window)
        if st["seen"] == self.warmup:
            st["initial"] = median(st["history"])
            known = [v for v in st["per_sample"] if v is not None]
            aligned = len(known) == len(st["history"])
            st["per_initial"] = median(known) if known and aligned else None

    def _follows_the_batch(
        self, obs: Observation, total: float, over: float, samples: int
    ) -> list[Finding]:
        """A jump of the norm that its batch's size explains, said once."""
        st = self.state
        if st.get("told"):
            return []
        st["told"] = True
        sizes = [*st["sizes"], samples]
        return [
            self.finding(
                obs,
                "info",
                f"exploding_gradients judges this run's gradient norm per sample too: its "
                f"batches vary in size ({min(sizes)} to {max(sizes)} samples over its last "
                f"{len(sizes)} measured steps), and the norm of {total:.3g} at step "
                f"{obs.step}, {10**over:.3g}x its recent median, came with a batch of "
                f"{samples}, so that per sample it did not jump: the gradient of a loss "
                "summed over its samples (reduction='sum', an episode's terms) grows with "
                "their number, which is no explosion.",
                value=total,
                where="gradients",
            )
        ]


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
    ``patience`` vanishing samples in a row raise a warning. A gradient held in a
    16-bit format with no loss scaling, whose root-mean-square is below the format's
    smallest normal value (float16: 6.1e-5), is subnormal or flushed to zero there: the
    format lost it, ``gradient_underflow``'s finding, and this rule leaves it alone.

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
            if underflow_format(obs, self.setup, np.ones(len(norms), bool), rms) is not None:
                return None  # 16-bit gradients below the format's normal range: precision's
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
            per_element = first / math.sqrt(max(float(numel[mats[0]]), 1.0))
            if underflow_format(obs, self.setup, mats[:1], per_element) is not None:
                return None
            return (
                f"Gradients vanish on the way back at step {obs.step}: {obs.names[mats[0]]} gets "
                f"a gradient norm of {first:.2g}, {last / max(first, 1e-300):.2g}x smaller than "
                f"{obs.names[mats[-1]]}, so the first layers barely learn; {fix}.",
                first,
                self.first_layer_threshold * scale,
                obs.names[mats[0]],
            )
        return None
