"""What one training run of a scenario produced: plain data, shared by every framework."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BASELINES", "FRAMEWORK_BASELINES", "KERAS_BASELINES", "RunResult"]

#: The baselines the Lightning implementation runs beside stethoscope, with what each one is.
BASELINES: dict[str, str] = {
    "early_stopping": "Lightning EarlyStopping(monitor='train_loss', check_finite=True), "
    "defaults otherwise (patience 3); it checks at each training epoch end",
    "spike_detection": "Lightning SpikeDetection() defaults (window 10, rtol 2, "
    "finite_only=True: a NaN/Inf loss counts as a spike); every step",
    "nan_check": "a hand-written callback: if not torch.isfinite(loss): stop, every step",
}

#: The Keras implementation's baselines: Keras' own callbacks and the same hand-written check.
KERAS_BASELINES: dict[str, str] = {
    "early_stopping": "Keras EarlyStopping(monitor='loss', patience=3) (Lightning's patience; "
    "Keras' default is 0), defaults otherwise; it checks the epoch's mean loss at each epoch "
    "end and has no check_finite: a NaN loss is only no improvement",
    "terminate_on_nan": "Keras TerminateOnNaN() defaults: stops when logs['loss'] (the running "
    "mean of the epoch's batch losses) is NaN or Inf, every step",
    "nan_check": "a hand-written callback: if not math.isfinite(logs['loss']): stop, every step "
    "(the batch loss is not handed to callbacks; the running mean turns non-finite with the "
    "first non-finite batch, so this is the same check as TerminateOnNaN)",
}

#: Per framework, the baselines its implementation runs, in report order.
FRAMEWORK_BASELINES: dict[str, dict[str, str]] = {
    "lightning": BASELINES,
    "keras": KERAS_BASELINES,
}


@dataclass
class RunResult:
    """One ``fit`` of one scenario with one seed.

    Args:
        scenario: The scenario's name.
        seed: The seed of data, initialisation and shuffling.
        framework: Which implementation ran it.
        steps: Optimizer steps actually taken.
        steps_per_epoch: Batches per training epoch.
        onset: The onset step, resolved (``"best_val"`` becomes a step); None for a
            healthy control.
        findings: Per sampling setting, every finding the stethoscope emitted, as
            ``Finding.to_dict(json_safe=True)``.
        probe_counts: Per setting, per probe (``grads``, ``weights`` …), the steps on
            which the sampler asked for it.
        baselines: Per baseline, ``{"step": s, "reason": r}`` for the first step at
            which it stopped (or would have stopped) training, or None.
        val_losses: ``[step, loss]`` per validation epoch (steps taken before it).
        wall_s: Seconds the fit took.
        error: The exception, if the fit raised (then the run counts as missed).
        notes: Remarks that do not invalidate the run (e.g. a baselines' fit that parted
            from the watched one by float rounding).
    """

    scenario: str
    seed: int
    framework: str
    steps: int = 0
    steps_per_epoch: int = 0
    onset: int | None = None
    findings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    probe_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    baselines: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    val_losses: list[list[float]] = field(default_factory=list)
    wall_s: float = 0.0
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        return cls(**d)
