"""The loss curve: single-batch spikes, no progress, and instability."""

from __future__ import annotations

import math

from stethoscope.detectors._stats import (
    SortedWindow,
    is_finite,
    push,
    restarts_clock,
    robust_sigma,
    sign_bit,
)
from stethoscope.detectors.base import (
    Detector,
    Losses,
    Rates,
    Steps,
    check_fraction,
    check_positive,
)
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["LossNotDecreasing", "LossSpike", "UnstableLoss"]


def _completes_signs(state: dict, loss: float, span: int) -> bool:
    """Whether ``loss``, counted among the first ``span`` losses, would make them take
    both signs (``state["signs"]``: the bits of those counted so far)."""
    return state["counted"] < span and (state["signs"] | sign_bit(loss)) == 3


def _count_sign(state: dict, loss: float, span: int) -> bool:
    """Count ``loss`` among the first ``span`` losses: whether they take both signs now,
    and did not before."""
    if state["counted"] >= span or state["signs"] == 3:
        return False
    state["counted"] += 1
    state["signs"] |= sign_bit(loss)
    return state["signs"] == 3


def _signs_from(state: dict, restored: dict, span: int, judging: bool) -> None:
    """A checkpoint from before the signs were counted: a detector that was ``judging``
    is past its first ``span`` losses, whose signs are unknown but passed."""
    if "counted" not in restored and judging:
        state["counted"] = span


def _no_floor(detector: Detector, obs: Observation, span: int, rule: str) -> Finding:
    """The info that ``detector`` leaves the run alone: its first ``span`` losses took
    both signs, ``obs``'s the last of them."""
    return detector.finding(
        obs,
        "info",
        f"{detector.name} leaves this run alone: the loss took both signs within its first "
        f"{span} steps ({obs.loss:.4g} at step {obs.step}, after losses of the other sign), "
        "as a policy-gradient loss (-log_prob x return or advantage, an agent's) does, or "
        f"another loss with no floor at zero and no scale, against which {rule} says "
        "nothing of how training goes.",
        value=obs.loss,
        where="loss",
    )


class LossSpike(Detector):
    """One batch's loss far above the recent level, and above the run's own noise.

    Rule: after ``warmup`` steps, a loss is a spike when its jump above the median
    of the last ``window`` losses is

    * more than ``z`` robust standard deviations (MAD-based),
    * more than ``tail`` times the envelope, the largest jump seen on healthy
      steps (decaying by ``1 - 1/memory`` per step); while the envelope has seen
      ``n < memory`` jumps, ``tail * sqrt(memory / n)`` times it, since the largest
      of a few jumps underestimates the run's tail,
    * at least ``min_jump`` of the run's initial loss (the median of its first
      ``START`` losses: where it started, the scale of the task; a run that learns in
      its first steps has a median of its first 32 far below that),

    and the loss is at least ``ratio`` times that median. A spike is a warning;
    the sampler already escalates when the jump passes half the z-score and half
    the envelope bar.

    A loss that takes both signs within its first ``window`` steps (a policy-gradient
    surrogate, whose value swings with each episode's returns and length) has no scale
    for a jump: that loss is judged (a spike is not counted among them), and the run
    left alone after it, said once (an info). A loss that crosses zero later, as it
    learns (a Gaussian or flow NLL), is judged throughout.

    Sources: OLMo-core's z-score of 6 over 128 steps (it waits for 20 samples, we for 32);
    Lightning's ``SpikeDetection`` asks for 3x the running mean (we ask 2x, and the
    rest does the work). The envelope is ours: minibatch losses are heavy-tailed
    (a converged loss of ~0.005 jumps 10x on a hard batch; batch-8 training with
    label noise jumps 7x), which a MAD cannot see; a spike must be ``tail`` times the
    largest healthy jump of the last ~``memory`` steps. How ``tail``, ``memory`` and
    the young envelope's wider bar were calibrated: docs/detectors.md.

    Args:
        z: Robust z-score above the window median.
        ratio: Minimum loss / median ratio.
        min_jump: Minimum jump as a fraction of the initial loss.
        tail: Minimum jump as a multiple of the envelope of healthy jumps.
        memory: Steps over which the envelope decays by a factor e.
        warmup: Steps before judging.
        window: Steps in the rolling baseline.
    """

    name = "loss_spike"
    needs = frozenset({"loss"})
    bars = "loss"
    base_interval = 1
    #: The first losses whose median is the initial loss.
    START = 8
    advice = "inspect that batch; clip if spikes repeat"

    def current_advice(self) -> str:
        return "inspect that batch" if self.setup.clipping else self.advice

    def __init__(
        self,
        *,
        z: float = 6.0,
        ratio: float = 2.0,
        min_jump: float = 0.1,
        tail: float = 4.0,
        memory: int = 300,
        warmup: int = 32,
        window: int = 128,
    ) -> None:
        for arg, v in (("z", z), ("ratio", ratio), ("min_jump", min_jump), ("tail", tail)):
            check_positive(self.name, arg, v)
        if ratio < 1:
            raise ValueError(f"{self.name}: ratio={ratio!r} must be >= 1 (loss / median)")
        for arg, v in (("memory", memory), ("warmup", warmup), ("window", window)):
            check_positive(self.name, arg, v, integer=True)
        if warmup > window:
            raise ValueError(f"{self.name}: warmup={warmup!r} must be <= window={window!r}")
        self.z, self.ratio, self.min_jump = float(z), float(ratio), float(min_jump)
        self.tail, self.memory = float(tail), memory
        self.warmup, self.window = warmup, window
        self._sorted = SortedWindow()
        super().__init__()

    def _initial_state(self) -> dict:
        # seen: healthy jumps the envelope has learnt from (a young one gets a wider bar);
        # signs, counted: the sign bits of the first ``window`` losses (see sign_bit)
        return {"window": [], "initial": None, "envelope": 0.0, "seen": 0, "signs": 0, "counted": 0}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "seen" not in state and state.get("initial") is not None:
            self.state["seen"] = self.memory  # a checkpoint from before the count: mature
        _signs_from(self.state, state, self.window, state.get("initial") is not None)

    def finished(self, step: int) -> bool:
        return self.state["signs"] == 3

    def _warm(self) -> bool:
        """Whether the warm-up is over: the rule judges from here (until the loss took
        both signs)."""
        st = self.state
        return len(st["window"]) >= self.warmup and st["initial"] is not None and st["signs"] != 3

    def _bar(self, center: float, envelope: float, seen: int) -> float:
        """The jump above ``center`` a spike must pass before the z-score, with an
        envelope ``envelope`` learnt from ``seen`` healthy jumps. A jump past half of it
        is a suspicion (then, and only then, can the z-score matter)."""
        memory = self.memory
        young = 1.0 if seen >= memory else (memory / max(seen, 1)) ** 0.5  # no pow when old
        return max(
            self.tail * envelope * young,
            self.min_jump * abs(self.state["initial"]),
            (self.ratio - 1) * max(center, 0.0),
        )

    def _spike_bar(self, center: float) -> float:
        """The whole jump above ``center`` that makes a spike: the bar, or the z-score."""
        st = self.state
        bar = self._bar(center, st["envelope"], st["seen"])
        return max(bar, self.z * robust_sigma(st["window"], center))

    def threshold(self) -> float | None:
        """The loss above which the next step is a spike, or None while warming up."""
        if not self._warm():
            return None
        center = self._sorted.median(self.state["window"])
        return center + self._spike_bar(center)

    def waits_below(self, steps: int) -> float | None:
        # A jump past half the bar (before the z-score) is a suspicion. Over ``steps``
        # steps the median can fall by at most two places of the sorted window a step, the
        # envelope decays and its count grows: the lowest that bar can get is the bar.
        if not self._warm():
            return None
        st = self.state
        ordered = self._sorted.ordered(st["window"])
        low = ordered[max(0, (len(ordered) - 1) // 2 - 2 * steps)]
        envelope = st["envelope"] * (1.0 - 1.0 / self.memory) ** steps
        return low + self._bar(low, envelope, st["seen"] + steps) / 2

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        # a jump within half the bar can be neither a spike nor a suspicion: it only
        # widens the envelope
        if not self._warm():
            return start
        st = self.state
        win, window, size = st["window"], self._sorted, self.window
        for i in range(start, len(losses)):
            loss = losses[i]
            center = window.median(win)
            jump = loss - center
            if 2 * jump > self._bar(center, st["envelope"], st["seen"]):
                return i
            if _completes_signs(st, loss, size):
                return i  # the run is left alone after it
            _count_sign(st, loss, size)
            self._widen(jump)
            window.push(win, float(loss), size)
        return len(losses)

    def _widen(self, jump: float) -> None:
        """A healthy jump: the envelope decays and takes it in."""
        st = self.state
        st["envelope"] = max(st["envelope"] * (1.0 - 1.0 / self.memory), jump)
        st["seen"] += 1

    def passed_by(self, loss: float) -> float | None:
        """:meth:`threshold` if ``loss`` is past it, else None: what the recovery ladder
        asks every step, cheap on a healthy one (the z-score only for a jump past the
        other bars, as the rule itself does)."""
        if not self._warm():
            return None
        st = self.state
        center = self._sorted.median(st["window"])
        if loss - center <= self._bar(center, st["envelope"], st["seen"]):
            return None
        bar = center + self._spike_bar(center)
        return bar if loss > bar else None

    def _update(self, obs: Observation) -> list[Finding]:
        loss = obs.loss
        if not is_finite(loss) or self.finished(obs.step):
            return []  # nonfinite_loss owns it; keep NaN out of the baseline
        if self.quiet(obs.step, loss, obs.lr):
            return []
        st = self.state
        win = st["window"]
        findings: list[Finding] = []
        if 5 <= len(win) < self.warmup:  # learn the run's healthy jumps during warm-up too
            center = self._sorted.median(win)
            st["envelope"] = max(st["envelope"], loss - center)
            st["seen"] += 1
        if len(win) >= self.warmup:  # and the jump is past half the bar (see quiet)
            center = self._sorted.median(win)
            jump = loss - center
            bar = self._spike_bar(center)
            if jump > bar / 2 and jump > self.min_jump * abs(st["initial"]):
                self.suspect = f"loss {loss:.4g} jumped {jump:.3g} above its median {center:.4g}"
            if jump > bar:
                findings.append(
                    self.finding(
                        obs,
                        "warning",
                        f"Loss spiked to {loss:.4g} at step {obs.step}, {jump:.3g} above the "
                        f"recent median {center:.4g}: a bad batch (corrupt labels or unnormalised "
                        "inputs) or a learning rate too high; inspect that batch, or lower the "
                        "learning rate / clip gradients if spikes repeat.",
                        value=loss,
                        threshold=center + bar,
                        where="loss",
                    )
                )
            else:  # only healthy jumps widen the envelope, so repeated spikes stay visible
                self._widen(jump)
        self._sorted.push(win, float(loss), self.window)
        if st["initial"] is None and len(win) == min(self.START, self.warmup):
            st["initial"] = self._sorted.median(win)
        # a spike's sign says nothing of the loss's floor: it is not counted
        if not findings and _count_sign(st, loss, self.window):
            findings.append(_no_floor(self, obs, self.window, "a jump above its median"))
        return findings


class LossNotDecreasing(Detector):
    """The loss has not moved from where it started.

    Rule: the initial loss is the mean of the first ``window`` losses; the level
    is the mean of the last ``window``. If after ``patience`` steps the best level
    seen is still within ``min_progress`` of the initial loss, training is not
    learning: warning. The patience clock restarts whenever the learning rate has
    doubled since it started, so a warm-up from 0 gets its full patience at a
    real learning rate.

    A loss whose first window takes both signs (a policy-gradient surrogate) has no
    initial level to measure progress from: the run is left alone, said once (an info).

    Sources: SageMaker Debugger ``loss_not_decreasing`` compares single values 10
    steps apart with a 0.1% bar, which noise alone breaks (a 1e-7 learning rate
    lets the loss rise 20% over 10 steps); windowed means and a bar relative to
    the initial loss avoid that, and a converged loss is never "not decreasing".

    Args:
        window: Steps per windowed mean.
        patience: Steps without progress before the warning.
        min_progress: Fraction of the initial loss the best level must have dropped.
    """

    name = "loss_not_decreasing"
    needs = frozenset({"loss"})
    base_interval = 1
    assumes_falling_loss = True
    advice = "raise the LR; check what the optimizer updates"

    def __init__(self, *, window: int = 50, patience: int = 200, min_progress: float = 0.1):
        check_positive(self.name, "window", window, integer=True)
        check_positive(self.name, "patience", patience, integer=True)
        check_fraction(self.name, "min_progress", min_progress)
        if patience < window:
            raise ValueError(f"{self.name}: patience={patience!r} must be >= window={window!r}")
        self.window, self.patience, self.min_progress = window, patience, float(min_progress)
        super().__init__()

    def waits_below(self, steps: int) -> float | None:
        return math.inf  # a warning after hundreds of steps, and no suspicion: it can wait

    def _initial_state(self) -> dict:
        # signs, counted: the sign bits of the first ``window`` losses (see sign_bit)
        return {
            "recent": [],
            "initial": None,
            "best": None,
            "clock_step": None,
            "clock_lr": None,
            "signs": 0,
            "counted": 0,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        _signs_from(self.state, state, self.window, state.get("initial") is not None)

    def finished(self, step: int) -> bool:
        return self.state["signs"] == 3

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        st = self.state
        for i in range(start, len(losses)):
            step = steps[i]
            if restarts_clock(lrs[i], st["clock_lr"]):
                return i  # the clock starts again there
            clock = st["clock_step"] if st["clock_step"] is not None else step
            if len(st["recent"]) + 1 >= self.window and step - clock >= self.patience:
                return i  # a judgement
            if _completes_signs(st, losses[i], self.window):
                return i  # the run is left alone from there
            st["clock_step"] = clock
            _count_sign(st, losses[i], self.window)
            self._push(losses[i])
        return len(losses)

    def _push(self, loss: float) -> bool:
        """Add a finite loss to the window; once it is full, its mean is the level, the
        first level the initial one, the lowest the best. False: not full yet."""
        st = self.state
        push(st["recent"], float(loss), self.window)
        if len(st["recent"]) < self.window:
            return False
        level = sum(st["recent"]) / self.window
        if st["initial"] is None:
            st["initial"] = level
        st["best"] = level if st["best"] is None else min(st["best"], level)
        return True

    def _update(self, obs: Observation) -> list[Finding]:
        loss = obs.loss
        if not is_finite(loss) or self.finished(obs.step):
            return []  # a loss of both signs: left alone
        if self.quiet(obs.step, loss, obs.lr):
            return []
        st = self.state
        if _count_sign(st, loss, self.window):
            return [_no_floor(self, obs, self.window, "progress from its initial level")]
        if st["clock_step"] is None:
            st["clock_step"] = obs.step
        lr = obs.lr
        if restarts_clock(lr, st["clock_lr"]):
            st["clock_step"], st["clock_lr"] = obs.step, float(lr)
        if not self._push(loss):
            return []
        if obs.step - st["clock_step"] < self.patience:
            return []
        initial = st["initial"]
        progress = (initial - st["best"]) / abs(initial) if initial else 1.0
        # the standard error of a difference of two windowed means, relative to the initial
        # loss: only call it "no progress" when batch noise cannot hide the missing progress
        noise = 2 * robust_sigma(st["recent"]) * (2 / self.window) ** 0.5 / abs(initial or 1.0)
        st["clock_step"] = obs.step  # judge again only after another full patience
        if progress + noise >= self.min_progress:
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The loss has not decreased in the {self.patience} steps to {obs.step}: "
                f"best level {st['best']:.4g} vs initial {initial:.4g} "
                f"({100 * progress:.1f}% progress): "
                "the learning rate may be far too small, parameters frozen or missing from the "
                "optimizer, or the labels unrelated to the inputs; try a 10x larger learning "
                "rate and check what the optimizer updates.",
                value=progress,
                threshold=self.min_progress,
                where="loss",
            )
        ]


class UnstableLoss(Detector):
    """The loss climbs back up and stays up: training is diverging or oscillating.

    Rule: the level is the median of the last ``window`` losses (robust to single
    spikes, which ``loss_spike`` reports). When the level sits above the best level
    so far by more than ``rise`` of the initial loss, and by more than 6 standard
    errors of a windowed median (so batch noise cannot do it), for ``patience``
    steps in a row: warning. When the level is above twice the initial loss for
    as long: error, training has diverged.

    A loss whose first window takes both signs (a policy-gradient surrogate, which swings
    with each episode's returns and grows with its length) has no initial level to scale
    a rise by: the run is left alone, said once (an info). One that crosses zero later,
    as it learns (a Gaussian or flow NLL), is judged throughout.

    Sources: Megatron and PaLM treat a loss that stays far above its running level
    as a reason to roll back. Thresholds scale with the run's own initial loss, not
    with the current level, because a converged loss of ~0.005 can rise 1.5x between
    windows on a healthy run. Why ``rise=0.4``: docs/detectors.md.

    Args:
        window: Steps per windowed median.
        rise: Rise above the best level, as a fraction of the initial loss.
        patience: Consecutive steps the rise must last.
    """

    name = "unstable_loss"
    needs = frozenset({"loss"})
    base_interval = 1
    assumes_falling_loss = True
    advice = "lower or decay the LR sooner"

    def __init__(self, *, window: int = 50, rise: float = 0.4, patience: int = 20) -> None:
        check_positive(self.name, "window", window, integer=True)
        check_positive(self.name, "rise", rise)
        check_positive(self.name, "patience", patience, integer=True)
        self.window, self.rise, self.patience = window, float(rise), patience
        self._sorted = SortedWindow()
        super().__init__()

    def _initial_state(self) -> dict:
        # signs, counted: the sign bits of the first ``window`` losses (see sign_bit)
        return {
            "recent": [],
            "initial": None,
            "best": None,
            "streak": 0,
            "diverged": 0,
            "signs": 0,
            "counted": 0,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        _signs_from(self.state, state, self.window, state.get("initial") is not None)

    def finished(self, step: int) -> bool:
        return self.state["signs"] == 3

    def waits_below(self, steps: int) -> float | None:
        # A rise (a suspicion, then a warning) needs the level, a median of the window,
        # ``rise`` of the initial level above its best; the error, a level past twice the
        # initial one. Each loss moves the median at most one place of the sorted window:
        # over ``steps`` losses under ``bar`` the level stays within the window's
        # ``steps``-th places either side of the median (see _level_bounds) and ``bar``.
        # Bounded by the window's extremes instead, a window holding one outlier (an
        # epoch's small last batch of a summed loss) made every step be judged at once.
        st = self.state
        initial, best, recent = st["initial"], st["best"], st["recent"]
        if initial is None:
            # losses that may take both signs are only said of (an info): they may wait
            return None if len(recent) + steps >= self.window else math.inf
        low, high = _level_bounds(self._sorted.ordered(recent), steps)
        bar = min(best, low) + self.rise * abs(initial)
        if high >= bar or (initial > 0 and high > 2 * initial):
            return None
        return min(bar, 2 * initial) if initial > 0 else bar

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        st = self.state
        initial, recent = st["initial"], st["recent"]
        if initial is None or st["streak"] or st["diverged"]:
            return start  # the first window is counted in _update
        rise, window = self.rise * abs(initial), self._sorted
        for i in range(start, len(losses)):
            loss = losses[i]
            # the next level, a median, is at most the next place of the window above the
            # median, or the loss: if that is neither a rise above the best nor past twice
            # the initial level, the step only moves the level (and perhaps the best)
            top = max(_level_bounds(window.ordered(recent), 1)[1], loss)
            if top - st["best"] > rise or (initial > 0 and top > 2 * initial):
                return i
            window.push(recent, float(loss), self.window)
            st["best"] = min(st["best"], window.median(recent))
        return len(losses)

    def _update(self, obs: Observation) -> list[Finding]:
        loss = obs.loss
        if not is_finite(loss) or self.finished(obs.step):
            return []  # a loss of both signs: left alone
        if self.quiet(obs.step, loss, obs.lr):
            return []
        st = self.state
        if _count_sign(st, loss, self.window):
            return [_no_floor(self, obs, self.window, "a rise above its best")]
        self._sorted.push(st["recent"], float(loss), self.window)
        if len(st["recent"]) < self.window:
            return []
        level = self._sorted.median(st["recent"])
        if st["initial"] is None:
            st["initial"] = level
        st["best"] = level if st["best"] is None else min(st["best"], level)
        initial, best = st["initial"], st["best"]
        bar = self.rise * abs(initial)
        if level - best > bar:  # the noise bar only matters past the rise bar: skip the MAD
            noise = 6 * 1.25 * robust_sigma(st["recent"], level) / self.window**0.5
            bar = max(bar, noise)
        rising = level - best > bar
        diverged = initial > 0 and level > 2 * initial
        st["streak"] = st["streak"] + 1 if rising else 0
        st["diverged"] = st["diverged"] + 1 if diverged else 0
        if rising and st["streak"] == 1:
            self.suspect = f"loss level {level:.4g} rose above its best {best:.4g}"
        if st["diverged"] == self.patience:
            return [
                self.finding(
                    obs,
                    "error",
                    f"Training diverged at step {obs.step}: the loss level {level:.4g} has stayed "
                    f"above twice its initial {initial:.4g} for {self.patience} steps; lower "
                    "the learning rate (often 3-10x), add warm-up or gradient clipping, and "
                    "restart from a checkpoint taken before the rise.",
                    value=level,
                    threshold=2 * initial,
                    where="loss",
                )
            ]
        if st["streak"] == self.patience:
            return [
                self.finding(
                    obs,
                    "warning",
                    f"The loss is unstable at step {obs.step}: its level {level:.4g} has stayed "
                    f"{level - best:.3g} above its best {best:.4g} for {self.patience} steps: "
                    "the learning rate is likely too high for this stage (or the data "
                    "distribution shifted); lower it or decay it sooner.",
                    value=level,
                    threshold=best + bar,
                    where="loss",
                )
            ]
        return []


def _level_bounds(ordered: list[float], steps: int) -> tuple[float, float]:
    """Bounds on the median of a full window (sorted: ``ordered``) after ``steps`` more
    values replace its oldest: whatever they are, the median's two middle places move
    at most ``steps`` places each, so the median stays at least the place ``steps``
    below the lower middle, and at most the place ``steps`` above the upper middle or
    the largest new value (which the caller bounds)."""
    n = len(ordered)
    mid = n // 2  # the upper middle place (the median itself for an odd count)
    lower = (n - 1) // 2
    return ordered[max(0, lower - steps)], ordered[min(n - 1, mid + steps)]
