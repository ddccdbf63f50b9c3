"""The recovery ladder: skip a bad step, cool the learning rate, roll back to a healthy
snapshot, and only then stop. Framework-free: the adapters skip, scale and restore; this
module decides which, when, and says so in findings.

Each rung escalates when the one below has not helped:

1. **skip**: a step whose loss or gradients are non-finite, or past the detectors' bar
   (``loss_spike``, ``exploding_gradients``), is not applied;
2. **cool down**: ``cool_after`` skips within ``window`` steps scale the learning rate by
   ``cool_factor`` for ``cool_steps`` steps, on top of the user's schedule;
3. **roll back**: ``rollback_after`` more skips during a cool-down, or an error the skip
   could not prevent (weights gone non-finite, a loss climbing for a stretch), restores
   the last healthy snapshot and goes on with the next batches (those since the
   snapshot are skipped), cooled again;
4. **stop**: a roll back needed after ``max_rollbacks`` of them, or with no snapshot.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Finding, Severity
from stethoscope.ledger import RECOVERY
from stethoscope.policy import Decision

if TYPE_CHECKING:
    from stethoscope.snapshots import SnapshotStore

__all__ = [
    "DAMAGE",
    "GRADIENT_PAST_BAR",
    "LOSS_PAST_BAR",
    "NONFINITE_GRADIENT",
    "NONFINITE_LOSS",
    "REASONS",
    "RECOVERABLE",
    "RECOVERY",
    "Ladder",
    "Recoverer",
    "Recovery",
    "Rung",
    "parse_recover",
    "skip_reason",
]

#: Detectors whose errors the ladder answers (by a skip already made, or a roll back)
#: instead of stopping: what a bad batch or a learning-rate excursion produces. Any other
#: error stops as ``stop_on`` says.
RECOVERABLE = frozenset(
    {
        "nonfinite_loss",
        "nonfinite_gradients",
        "nonfinite_weights",
        "exploding_gradients",
        "loss_spike",
        "unstable_loss",
        "large_updates",
    }
)

#: Detectors whose warning already says the weights went wrong, not only a step: a
#: loss that has climbed back up and stayed there for a stretch, updates as large as
#: the weights for several samples. No skip can undo that; a roll back can. (A language
#: model starts at ln V, so ``unstable_loss``'s error, twice the initial loss, may
#: never come: its warning is the signal.)
DAMAGE = frozenset({"unstable_loss", "large_updates"})

#: Why a step is not applied, as the code a verdict carries (0: apply). The larger,
#: the worse: ranks that disagree take the largest.
LOSS_PAST_BAR, GRADIENT_PAST_BAR, NONFINITE_GRADIENT, NONFINITE_LOSS = 1, 2, 3, 4
#: Each code in words.
REASONS = {
    LOSS_PAST_BAR: "the loss is past the loss_spike bar",
    GRADIENT_PAST_BAR: "the gradient norm is past the exploding_gradients bar",
    NONFINITE_GRADIENT: "a gradient is non-finite",
    NONFINITE_LOSS: "the loss is non-finite",
}
#: Each code with the values that made it.
_WHAT = {
    LOSS_PAST_BAR: "the loss {loss:.4g} was past the loss_spike bar {loss_bar:.4g}",
    GRADIENT_PAST_BAR: "the gradient norm {norm:.3g} was past the exploding_gradients bar "
    "{grad_bar:.3g}",
    NONFINITE_GRADIENT: "a gradient was non-finite",
    NONFINITE_LOSS: "the loss was {loss}",
}


def skip_reason(code: int, *, loss: float, norm: float, loss_bar: float, grad_bar: float) -> str:
    """Why a step whose verdict was ``code`` was skipped, with the values that made it."""
    return _WHAT[code].format(loss=loss, norm=norm, loss_bar=loss_bar, grad_bar=grad_bar)


_SNAPSHOT_PLACES = ("auto", "memory", "disk")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Recovery: {name}={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What ``recover=`` does: the rungs of the ladder and when each is climbed.

    Args:
        cool_after: Skipped steps within ``window`` steps that start a cool-down.
        window: Steps over which skips are counted.
        cool_factor: The learning rate is multiplied by this during a cool-down.
        cool_steps: Steps a cool-down lasts (the user's schedule goes on underneath).
        rollback_after: Skipped steps during a cool-down that roll back.
        max_rollbacks: Roll backs in a run; the next one needed stops training.
        snapshot_every: Steps between snapshots, taken only when the run was healthy
            (no warning on an applied step in those steps). One is taken at the start.
        keep_snapshots: Snapshots kept at most (the oldest go first).
        snapshot_in: ``"memory"`` (host memory), ``"disk"`` (``snapshot_dir``, or a
            temporary directory), or ``"auto"``: memory for state under
            ``memory_limit_bytes``, else disk.
        snapshot_dir: Where ``"disk"`` snapshots go.
        memory_limit_bytes: The ``"auto"`` bound on a snapshot kept in memory.

    Raises:
        ValueError: A bad value, named with the valid range.
    """

    cool_after: int = 3
    window: int = 100
    cool_factor: float = 0.1
    cool_steps: int = 200
    rollback_after: int = 3
    max_rollbacks: int = 3
    snapshot_every: int = 100
    keep_snapshots: int = 2
    snapshot_in: str = "auto"
    snapshot_dir: str | os.PathLike[str] | None = None
    memory_limit_bytes: int = 2 * 1024**3

    def __post_init__(self) -> None:
        for name in ("cool_after", "window", "cool_steps", "rollback_after", "snapshot_every"):
            _positive_int(name, getattr(self, name))
        _positive_int("keep_snapshots", self.keep_snapshots)
        _positive_int("max_rollbacks", self.max_rollbacks, minimum=0)
        _positive_int("memory_limit_bytes", self.memory_limit_bytes, minimum=0)
        factor = self.cool_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(f"Recovery: cool_factor={factor!r} must be a number in (0, 1)")
        if self.snapshot_in not in _SNAPSHOT_PLACES:
            raise ValueError(
                f"Recovery: snapshot_in={self.snapshot_in!r} is not valid; use one of "
                f"{', '.join(map(repr, _SNAPSHOT_PLACES))}"
            )
        if self.snapshot_dir is not None:
            if not isinstance(self.snapshot_dir, (str, os.PathLike)):
                raise ValueError(f"Recovery: snapshot_dir={self.snapshot_dir!r} must be a path")
            object.__setattr__(self, "snapshot_dir", os.fspath(self.snapshot_dir))


def parse_recover(value: Any) -> Recovery | None:
    """``recover=``: ``False``/``None`` (off), ``True`` (the default ladder) or a
    :class:`Recovery`.

    Raises:
        ValueError: Anything else, named with the valid choices.
    """
    if value is None or value is False:
        return None
    if value is True:
        return Recovery()
    if isinstance(value, Recovery):
        return value
    if value is Recovery:
        raise ValueError("recover=Recovery is the class; use recover=Recovery() or True")
    raise ValueError(
        f"recover={value!r} is not valid; use False (off), True (the default ladder) or "
        "stethoscope.Recovery(...)"
    )


@dataclass(frozen=True)
class Rung:
    """One act of the ladder: what was done at which step, and why."""

    step: int
    act: str  # "skip", "cool", "restore_lr", "rollback", "stop"
    why: str


@dataclass
class _State:
    skips: deque[int] = field(default_factory=deque)  # recent skipped steps
    cool_from: int | None = None  # the step the cool-down began, while cooling
    cool_until: int = -1  # the first step at the user's learning rate again
    skips_cooling: int = 0  # skipped steps since the cool-down began
    rollbacks: int = 0
    counts: dict[str, int] = field(
        default_factory=lambda: {"skip": 0, "cool": 0, "rollback": 0, "stop": 0}
    )
    history: list[Rung] = field(default_factory=list)
    trouble: int = -(10**9)  # the last step with a skip or a warning
    rolled_back_at: int = -(10**9)  # the step of the last roll back


class Ladder:
    """Climbs the rungs for one run. The adapter tells it what happened (:meth:`skipped`,
    :meth:`failed`, :meth:`saw`) and asks what to do (:meth:`lr_scale`,
    :meth:`snapshot_due`); each act comes back as findings, and a roll back or a stop
    as the word ``"rollback"`` or ``"stop"``.

    Args:
        settings: The ladder's thresholds.
    """

    def __init__(self, settings: Recovery) -> None:
        self.settings = settings
        self.s = _State()
        self._unapplied: deque[int] = deque(maxlen=64)  # steps a GradScaler skipped

    # -- what happened --------------------------------------------------------------------
    def skipped(self, step: int, epoch: int, why: str) -> tuple[list[Finding], str | None]:
        """Step ``step`` was not applied because ``why``. Returns the findings and what
        to do next: None, ``"rollback"`` or ``"stop"``."""
        s, cfg = self.s, self.settings
        s.skips.append(step)  # the weights stay healthy: no block on the next snapshot
        while s.skips and s.skips[0] <= step - cfg.window:
            s.skips.popleft()
        kept = "the weights and the optimizer's state stay as they were"
        found = [self._act(step, epoch, "skip", f"skipped step {step}: {why}; {kept}", "info")]
        if self.cooling(step):
            s.skips_cooling += 1
            if s.skips_cooling >= cfg.rollback_after:
                why = (
                    f"{s.skips_cooling} steps skipped during the cool-down from step {s.cool_from}"
                )
                return found, self._need_rollback(step, epoch, why, found)
        elif len(s.skips) >= cfg.cool_after:
            found.append(self._cool(step, epoch, f"{len(s.skips)} steps skipped in {cfg.window}"))
        return found, None

    def failed(self, step: int, epoch: int, finding: Finding) -> tuple[list[Finding], str]:
        """An error a skip could not prevent (``finding``, on an applied step): roll back,
        or stop when that is no longer possible."""
        self.s.trouble = step
        found: list[Finding] = []
        why = f"{finding.detector} ({finding.severity}) at step {finding.step}"
        return found, self._need_rollback(step, epoch, why, found)

    def was_skipped(self, step: int) -> bool:
        """Whether ``step`` was not applied: a recent skip, or a step something else
        skipped (:meth:`not_applied`)."""
        return step in self.s.skips or step in self._unapplied

    def not_applied(self, step: int) -> None:
        """Step ``step`` was not applied, by another's decision (a GradScaler's): no act of
        the ladder, nothing counted, but its errors did the weights no harm."""
        self._unapplied.append(step)

    def saw(self, step: int, epoch: int, troubled: bool) -> list[Finding]:
        """Step ``step`` was judged (``troubled``: a warning or an error the ladder
        answers): it is unhealthy for snapshots. Reports the end of a cool-down."""
        if troubled:
            self.s.trouble = max(self.s.trouble, step)
        return self._end_of_cooling(step, epoch)

    def rolled_back(self, step: int, epoch: int, to_step: int, what: str) -> list[Finding]:
        """The adapter restored the snapshot of ``to_step`` at ``step`` (``what``: what it
        restored). The ladder cools down again from here."""
        s = self.s
        s.rollbacks += 1
        s.rolled_back_at = step
        s.skips.clear()
        s.skips_cooling = 0
        s.trouble = step
        found = [
            self._act(
                step,
                epoch,
                "rollback",
                f"rolled back to the snapshot of step {to_step} ({what}): the updates of "
                f"steps {to_step + 1}…{step} are discarded and training goes on with the "
                f"next batch (roll back {s.rollbacks} of {self.settings.max_rollbacks})",
                "warning",
            )
        ]
        found.append(self._cool(step, epoch, "after the roll back"))
        return found

    # -- what to do -----------------------------------------------------------------------
    def cooling(self, step: int) -> bool:
        return self.s.cool_from is not None and step < self.s.cool_until

    def lr_scale(self, step: int) -> float:
        """The factor on the learning rate at ``step``: ``cool_factor`` while cooling."""
        return self.settings.cool_factor if self.cooling(step) else 1.0

    def snapshot_due(self, step: int) -> bool:
        """Whether to snapshot after ``step``: on the cadence, and healthy since the last
        ``snapshot_every`` steps (no warning on a step that was applied; skipped steps
        and cool-downs leave the weights healthy, and a snapshot skipped for them would
        leave only an old one to roll back to)."""
        every = self.settings.snapshot_every
        return step % every == 0 and step - self.s.trouble >= every

    def newest_suspect(self, step: int) -> bool:
        """Whether a roll back needed at ``step`` should pass over the newest snapshot:
        the last roll back went to it fewer than ``snapshot_every`` steps ago and the run
        needs another. A snapshot is taken when no warning came for a while, but a step
        that did harm without a warning (a learning-rate spike's first steps, applied
        before any bar moved) is in it, and in the detectors' state it holds: restoring
        it again would only bring the same trouble back, so the older one is used."""
        return step - self.s.rolled_back_at < self.settings.snapshot_every

    @property
    def counts(self) -> dict[str, int]:
        """How many skips, cool-downs, roll backs and stops the run has had."""
        return dict(self.s.counts)

    @property
    def history(self) -> list[Rung]:
        return list(self.s.history)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        s = self.s
        return {
            "skips": list(s.skips),
            "cool_from": s.cool_from,
            "cool_until": s.cool_until,
            "skips_cooling": s.skips_cooling,
            "rollbacks": s.rollbacks,
            "counts": dict(s.counts),
            "history": [asdict(r) for r in s.history],
            "trouble": s.trouble,
            "rolled_back_at": s.rolled_back_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = _State()
        s.skips = deque(int(v) for v in state.get("skips", ()))
        s.cool_from = state.get("cool_from")
        s.cool_until = int(state.get("cool_until", -1))
        s.skips_cooling = int(state.get("skips_cooling", 0))
        s.rollbacks = int(state.get("rollbacks", 0))
        s.counts.update(state.get("counts", {}))
        s.history = [Rung(**r) for r in state.get("history", ())]
        s.trouble = int(state.get("trouble", s.trouble))
        s.rolled_back_at = int(state.get("rolled_back_at", s.rolled_back_at))
        self.s = s

    # -- the rungs ------------------------------------------------------------------------
    def _cool(self, step: int, epoch: int, why: str) -> Finding:
        s, cfg = self.s, self.settings
        s.cool_from, s.cool_until, s.skips_cooling = step, step + 1 + cfg.cool_steps, 0
        return self._act(
            step,
            epoch,
            "cool",
            f"{why}: the learning rate is scaled by {cfg.cool_factor:g} for {cfg.cool_steps} "
            f"steps (to step {s.cool_until - 1}), on top of the schedule",
            "warning",
        )

    def _end_of_cooling(self, step: int, epoch: int) -> list[Finding]:
        s = self.s
        if s.cool_from is None or step < s.cool_until:
            return []
        s.cool_from = None
        why = "the cool-down is over: the learning rate follows the schedule again"
        return [self._act(step, epoch, "restore_lr", why, "info")]

    def _need_rollback(self, step: int, epoch: int, why: str, found: list[Finding]) -> str:
        s, cfg = self.s, self.settings
        if s.rollbacks >= cfg.max_rollbacks:
            found.append(self._stop(step, epoch, f"{why}, after {s.rollbacks} roll backs"))
            return "stop"
        return "rollback"

    def stop_without_snapshot(self, step: int, epoch: int, why: str) -> Finding:
        """The roll back that was needed has no snapshot to go to: stop."""
        return self._stop(step, epoch, f"{why}, and there is no healthy snapshot to roll back to")

    def _stop(self, step: int, epoch: int, why: str) -> Finding:
        return self._act(
            step,
            epoch,
            "stop",
            f"the recovery ladder gave up: {why}. What it did: {self._story()}",
            "error",
        )

    def _story(self) -> str:
        """The ladder's acts in short: the skips counted, every other act listed."""
        acts = self.s.history
        skips = [r.step for r in acts if r.act == "skip"]
        parts = [f"skipped {len(skips)} step{'s' if len(skips) != 1 else ''}"] if skips else []
        if skips:
            parts[0] += f" (from step {skips[0]} to {skips[-1]})" if len(skips) > 1 else ""
        parts += [f"{r.act} at {r.step}" for r in acts if r.act not in ("skip", "restore_lr")]
        return "; ".join(parts) or "nothing"

    def _act(self, step: int, epoch: int, act: str, why: str, severity: str) -> Finding:
        s = self.s
        if act in s.counts:
            s.counts[act] += 1
        s.history.append(Rung(step, act, why))
        message = why[0].upper() + why[1:] + "."
        return Finding(step, epoch, RECOVERY, severity, message, where=act)


def _why(finding: Finding) -> str:
    return f"{finding.detector} ({finding.severity}) at step {finding.step}"


#: A decision that changes nothing (shared: a Decision is immutable).
_CARRY_ON = Decision()


class Recoverer:
    """A monitor's ladder, for the adapters: it reports the ladder's acts through the
    monitor's ledger (to every sink, the record and the epoch summary), turns the errors
    the ladder answers into its rungs instead of a stop, and keeps the roll back the
    adapter owes (:attr:`rollback_due`).

    Args:
        monitor: The callback's monitor; its policy spares :data:`RECOVERABLE` from now.
        settings: The ladder's thresholds.
    """

    def __init__(self, monitor: Any, settings: Recovery) -> None:
        self.monitor = monitor
        self.ladder = Ladder(settings)
        monitor.spared = RECOVERABLE
        #: A roll back the adapter owes, at the end of the step that asked for it.
        self.rollback_due: str | None = None
        #: The last step whose optimizer step was applied or skipped (see :meth:`settle`).
        self.settled = -1
        self._pending: list[Finding] = []  # errors judged before their step was settled

    def skipped(self, step: int, epoch: int, why: str) -> Decision:
        """The adapter did not apply step ``step``, because ``why``."""
        found, action = self.ladder.skipped(step, epoch, why)
        return self._act(found, action, why)

    def review(self, decision: Decision) -> Decision:
        """The monitor judged a step: answer its spared findings (an error on a step
        that was applied asks for a roll back)."""
        if not decision.spared:
            return decision
        step, epoch = decision.spared[-1].step, decision.spared[-1].epoch
        # an error of a step not settled yet (a micro-batch before the optimizer step)
        # waits for the gate's verdict on that step
        self._pending += [f for f in decision.spared if f.step > self.settled]
        # a warning on a step that was applied makes the run unhealthy for snapshots; on a
        # skipped one it did no harm
        settled = [f for f in decision.spared if f.step <= self.settled]
        troubled = any(not self.ladder.was_skipped(f.step) for f in settled)
        found = self.ladder.saw(step, epoch, troubled=troubled)
        out = self._answer([f for f in decision.spared if f.step <= self.settled], found)
        return out if out.stop or not decision.stop else decision

    def settle(self, step: int) -> Decision:
        """The optimizer step of ``step`` was applied or skipped: answer the errors that
        waited for it."""
        self.settled = step
        if not self._pending:  # every step of a healthy run: nothing waited
            return _CARRY_ON
        ready = [f for f in self._pending if f.step <= step]
        self._pending = [f for f in self._pending if f.step > step]
        if any(not self.ladder.was_skipped(f.step) for f in ready):
            self.ladder.saw(step, ready[-1].epoch, troubled=True)
        return self._answer(ready, [])

    def _answer(self, spared: list[Finding], found: list[Finding]) -> Decision:
        """Answer ``spared`` (see :meth:`rollback_asked`); ``found``: the ladder's own
        findings so far."""
        asking = self.rollback_asked(spared)
        if asking is None:
            return self._act(found, None, "")
        more, action = self.ladder.failed(asking.step, asking.epoch, asking)
        return self._act(found + more, action, _why(asking))

    def rollback_asked(self, spared: list[Finding]) -> Finding | None:
        """The first of ``spared`` that asks for a roll back: an error on a step that was
        applied (not skipped), or a warning that the weights have already drifted
        (:data:`DAMAGE`)."""
        for f in spared:
            if self.ladder.was_skipped(f.step):
                continue
            if f.severity < Severity.ERROR and f.detector not in DAMAGE:
                continue
            return f
        return None

    def rollback_agreed(self, finding: Finding) -> Decision:
        """In a distributed run, the ranks agreed that ``finding`` (one rank's, held until
        they met) asks for a roll back: every rank climbs the same rung, so every rank
        rolls back (or stops) alike."""
        found, action = self.ladder.failed(finding.step, finding.epoch, finding)
        return self._act(found, action, _why(finding))

    def rolled_back(self, step: int, epoch: int, to_step: int, what: str) -> None:
        """The adapter restored the snapshot of ``to_step``."""
        self.rollback_due = None
        for f in self.ladder.rolled_back(step, epoch, to_step, what):
            self.monitor.ledger.record(f)

    def roll_back(
        self,
        step: int,
        epoch: int,
        snapshots: SnapshotStore,
        put_back: Callable[[dict[str, Any]], None],
        what: str,
    ) -> Decision:
        """Pay the roll back owed at ``step``: ``put_back`` restores the newest snapshot's
        state (``what`` says what that holds). The newest is passed over when the last roll
        back went to it only lately (see :meth:`Ladder.newest_suspect`); with none left,
        training stops."""
        if self.ladder.newest_suspect(step):
            snapshots.discard_newest()
        newest = snapshots.newest()
        if newest is None:
            return self.no_snapshot(step, epoch)
        snap, state = newest
        put_back(state)
        self.rolled_back(step, epoch, snap.step, what)
        return _CARRY_ON

    def no_snapshot(self, step: int, epoch: int) -> Decision:
        """The roll back owed has nowhere to go: stop."""
        why, self.rollback_due = self.rollback_due or "a roll back was needed", None
        return self._act([self.ladder.stop_without_snapshot(step, epoch, why)], "stop", why)

    def _act(self, found: list[Finding], action: str | None, why: str) -> Decision:
        for f in found:
            self.monitor.ledger.record(f)
        if action == "rollback":
            self.rollback_due = why
        if action != "stop":
            return Decision()
        reason = found[-1]
        self.monitor.note_stop(reason)
        return Decision(stop=True, raise_=self.monitor.raise_on.matches(reason), reason=reason)
