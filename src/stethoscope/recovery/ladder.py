"""The rungs of the recovery ladder, climbed for one run: skip, cool down, roll back,
stop. Pure bookkeeping: it is told what happened and answers with findings and the next
act."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from stethoscope.findings import RECOVERY, Finding
from stethoscope.recovery.settings import Recovery

__all__ = ["Ladder", "Rung"]


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
    trouble: int = -(10**9)  # the last step with a warning on an applied step
    onset: int = -(10**9)  # the first step of the trouble under way (a skip or a warning)
    troubled_at: int = -(10**9)  # the last step with a skip or a warning
    rolled_back_at: int = -(10**9)  # the step of the last roll back
    applied_at: int = -(10**9)  # the last step whose update was applied
    in_a_row: int = 0  # steps skipped since the last applied one
    #: While cooling after a roll back: the learning rates the snapshot had, per optimizer
    #: and parameter group, above which no step goes (see :meth:`Ladder.lr_ceiling`).
    ceiling: list[list[float]] | None = None


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
        #: Why the last roll back the ladder asked for is needed.
        self.rollback_why = ""

    # -- what happened --------------------------------------------------------------------
    def skipped(self, step: int, epoch: int, why: str) -> tuple[list[Finding], str | None]:
        """Step ``step`` was not applied because ``why``. Returns the findings and what
        to do next: None, ``"rollback"`` or ``"stop"``."""
        s, cfg = self.s, self.settings
        s.skips.append(step)  # the weights stay healthy: no block on the next snapshot
        while s.skips and s.skips[0] <= step - cfg.window:
            s.skips.popleft()
        self._troubled(step)
        s.in_a_row += 1
        kept = "the weights and the optimizer's state stay as they were"
        found = [self._act(step, epoch, "skip", f"skipped step {step}: {why}; {kept}", "info")]
        if s.in_a_row >= cfg.window:
            why = f"every one of the last {s.in_a_row} steps was skipped"
            found.append(self._stop(step, epoch, why))
            return found, "stop"
        if self._damaged_by_last_update(step):
            why = (
                f"steps {step - 1} and {step}, the two after step {s.applied_at}'s update, "
                "were both judged bad: the weights that update left are suspect"
            )
            return found, self._need_rollback(step, epoch, why, found)
        if not self._weights_moved_since_rollback():
            # the roll back restored healthy weights and none was applied since: what is
            # skipped is the data, which another roll back would not mend
            return found, None
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
        self._troubled(finding.step)
        self.s.trouble = step
        found: list[Finding] = []
        why = f"{finding.detector} ({finding.severity}) at step {finding.step}"
        return found, self._need_rollback(step, epoch, why, found)

    def applied(self, step: int) -> None:
        """Step ``step``'s update was applied."""
        self.s.applied_at = step
        self.s.in_a_row = 0

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
            self._troubled(step)
            self.s.trouble = max(self.s.trouble, step)
        return self._end_of_cooling(step, epoch)

    def rolled_back(
        self,
        step: int,
        epoch: int,
        to_step: int,
        what: str,
        learning_rates: list[list[float]] | None = None,
        because: str | None = None,
    ) -> list[Finding]:
        """The adapter restored the snapshot of ``to_step`` at ``step`` (``what``: what it
        restored; ``learning_rates``: the ones it restored, per optimizer and parameter
        group; ``because``: why). The ladder cools down again from here, below those
        learning rates."""
        s = self.s
        s.rollbacks += 1
        s.rolled_back_at = step
        s.skips.clear()
        s.skips_cooling = 0
        s.trouble = step
        self._troubled(step)
        found = [
            self._act(
                step,
                epoch,
                "rollback",
                f"rolled back to the snapshot of step {to_step} ({what}): the updates of "
                f"steps {to_step + 1}…{step} are discarded and training goes on with the "
                f"next batch (roll back {s.rollbacks} of {self.settings.max_rollbacks})"
                + (f", because {because}" if because else ""),
                "warning",
            )
        ]
        found.append(self._cool(step, epoch, "after the roll back"))
        s.ceiling = [list(map(float, group)) for group in learning_rates or ()] or None
        return found

    # -- what to do -----------------------------------------------------------------------
    def cooling(self, step: int) -> bool:
        return self.s.cool_from is not None and step < self.s.cool_until

    def lr_scale(self, step: int) -> float:
        """The factor on the learning rate at ``step``: ``cool_factor`` while cooling."""
        return self.settings.cool_factor if self.cooling(step) else 1.0

    def lr_ceiling(self, step: int) -> list[list[float]] | None:
        """The learning rates no update at ``step`` goes above before the cool-down's
        factor, per optimizer and parameter group, or None: while cooling after a roll
        back, those of the snapshot it went to. The schedule (or whatever set the
        learning rate) may still be where it did the damage, a spike that lasts longer
        than the stretch rolled back: the cool-down starts from the snapshot's learning
        rate, not from the spike's."""
        return self.s.ceiling if self.cooling(step) else None

    def snapshot_due(self, step: int) -> bool:
        """Whether to snapshot after ``step``: on the cadence, and healthy since the last
        ``snapshot_every`` steps (no warning on a step that was applied; skipped steps
        and cool-downs leave the weights healthy, and a snapshot skipped for them would
        leave only an old one to roll back to)."""
        every = self.settings.snapshot_every
        return step % every == 0 and step - self.s.trouble >= every

    def trusted(self, snapshot_step: int) -> bool:
        """Whether the snapshot of ``snapshot_step`` may be rolled back to: the trouble
        under way began at least ``trust_after`` steps after it. A snapshot is taken after
        a stretch without a warning, but the update that did the damage may be in it: a
        learning-rate spike's first step is applied before any bar moves, and its harm
        shows on the next steps."""
        return self.s.onset - snapshot_step >= self.settings.trust_after

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
            "onset": s.onset,
            "troubled_at": s.troubled_at,
            "rolled_back_at": s.rolled_back_at,
            "applied_at": s.applied_at,
            "in_a_row": s.in_a_row,
            "ceiling": s.ceiling,
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
        s.onset = int(state.get("onset", s.onset))
        s.troubled_at = int(state.get("troubled_at", s.troubled_at))
        s.applied_at = int(state.get("applied_at", s.applied_at))
        s.in_a_row = int(state.get("in_a_row", 0))
        s.ceiling = state.get("ceiling")
        self.s = s

    # -- the signs of damage --------------------------------------------------------------
    def _troubled(self, step: int) -> None:
        """Trouble at ``step``: it begins a new stretch of trouble after a quiet one."""
        s = self.s
        if step - s.troubled_at >= self.settings.snapshot_every:
            s.onset = step
        s.troubled_at = max(s.troubled_at, step)

    def _damaged_by_last_update(self, step: int) -> bool:
        """Whether the two steps after an applied one were both skipped: one bad batch is
        skipped and the next is fine, but weights an update harmed are judged bad on the
        next batches too (a learning-rate spike, a poisoned momentum)."""
        s = self.s
        return s.in_a_row == 2 and s.applied_at == step - 2 and self._weights_moved_since_rollback()

    def _weights_moved_since_rollback(self) -> bool:
        s = self.s
        return s.rollbacks == 0 or s.applied_at > s.rolled_back_at

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
        s.ceiling = None
        why = "the cool-down is over: the learning rate follows the schedule again"
        return [self._act(step, epoch, "restore_lr", why, "info")]

    def _need_rollback(self, step: int, epoch: int, why: str, found: list[Finding]) -> str:
        s, cfg = self.s, self.settings
        if s.rollbacks >= cfg.max_rollbacks:
            found.append(self._stop(step, epoch, f"{why}, after {s.rollbacks} roll backs"))
            return "stop"
        self.rollback_why = why
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
