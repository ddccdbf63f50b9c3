"""The rungs of the recovery ladder, climbed for one run: skip, cool down, roll back,
stop. Pure bookkeeping: it is told what happened and answers with findings and the next
act."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from stethoscope.findings import RECOVERY, Finding
from stethoscope.recovery.settings import Recovery
from stethoscope.recovery.skipped import BatchName, SkippedBatch

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
    cool_scale: float = 1.0  # the factor on the learning rate while cooling
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
    bad_data_at: int = -(10**9)  # the last step skipped for its batch's non-finite inputs
    transients: int = 0  # steps judged bad whose replay was fine
    #: While cooling after a roll back: the learning rates the snapshot had, per optimizer
    #: and parameter group, above which no step goes (see :meth:`Ladder.lr_ceiling`).
    ceiling: list[list[float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The state as plain values, for a checkpoint."""
        state = asdict(self)
        state["skips"] = list(self.skips)
        return state

    @classmethod
    def of(cls, state: dict[str, Any], cool_factor: float) -> _State:
        """The state a checkpoint holds (:meth:`as_dict`); what an older one lacks keeps
        its start value (``cool_factor``: the cool-down's scale)."""
        s = cls()
        s.skips = deque(int(v) for v in state.get("skips", ()))
        s.cool_from = state.get("cool_from")
        s.cool_until = int(state.get("cool_until", -1))
        s.cool_scale = float(state.get("cool_scale", cool_factor))
        s.skips_cooling = int(state.get("skips_cooling", 0))
        s.rollbacks = int(state.get("rollbacks", 0))
        s.counts.update(state.get("counts", {}))
        s.history = [Rung(**r) for r in state.get("history", ())]
        for name in ("trouble", "rolled_back_at", "onset", "troubled_at", "applied_at"):
            setattr(s, name, int(state.get(name, getattr(s, name))))
        s.bad_data_at = int(state.get("bad_data_at", s.bad_data_at))
        s.in_a_row = int(state.get("in_a_row", 0))
        s.transients = int(state.get("transients", 0))
        s.ceiling = state.get("ceiling")
        return s


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
        # the last steps not applied: skipped (kept past a roll back, which forgets the
        # skips it counted), skipped again, or skipped by a GradScaler
        self._unapplied: deque[int] = deque(maxlen=64)
        self._replaced: deque[int] = deque(maxlen=64)  # steps applied from their replay
        #: Why the last roll back the ladder asked for is needed.
        self.rollback_why = ""

    # -- what happened --------------------------------------------------------------------
    def skipped(
        self,
        step: int,
        epoch: int,
        why: str,
        batch: BatchName | None = None,
        *,
        bad_data: bool = False,
    ) -> tuple[list[Finding], str | None]:
        """Step ``step`` (on ``batch``, when known) was not applied because ``why``.
        ``bad_data``: the batch's own inputs hold NaN or Inf, which explain the step
        whatever the weights: it is no sign that the update before it did harm (the same
        bad batch served twice in a row, across an epoch's end, would otherwise roll
        back). It counts toward a cool-down like any skip.
        Returns the findings and what to do next: None, ``"rollback"`` or ``"stop"``."""
        s, cfg = self.s, self.settings
        s.skips.append(step)  # the weights stay healthy: no block on the next snapshot
        self._unapplied.append(step)
        while s.skips and s.skips[0] <= step - cfg.window:
            s.skips.popleft()
        self._troubled(step)
        s.in_a_row += 1
        if bad_data:
            s.bad_data_at = step
        kept = "the weights and the optimizer's state stay as they were"
        named = f" ({batch})" if batch is not None else ""
        said = f"skipped step {step}{named}: {why}; {kept}"
        found = [self._act(step, epoch, "skip", said, "info")]
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

    def transient(self, step: int, epoch: int, why: str, batch: BatchName | None) -> Finding:
        """Step ``step`` was judged bad (``why``), but computed again from the same state
        with the same batch it was fine, and that second computation was applied."""
        s = self.s
        s.transients += 1
        self._replaced.append(step)
        named = f" ({batch})" if batch is not None else ""
        return self._act(
            step,
            epoch,
            "replay",
            f"step {step}{named} was judged bad ({why}), but computed again from the same "
            "state with the same batch it was fine: a transient fault of the machine (its "
            "device or memory), not the data; the second computation was applied "
            f"({s.transients} transient fault{'s' if s.transients > 1 else ''} in this run)",
            "warning",
        )

    def skipped_again(self, step: int, epoch: int, before: SkippedBatch) -> Finding:
        """Step ``step`` trains on a batch skipped before (by this run, or the run it
        resumes): it is not applied either. It says nothing new about the weights."""
        self._unapplied.append(step)
        return self._act(
            step,
            epoch,
            "skip",
            f"skipped step {step} ({before.batch}): it was skipped at step {before.step} "
            f"({before.why}), and is skipped again",
            "info",
        )

    def applied(self, step: int) -> None:
        """Step ``step``'s update was applied."""
        self.s.applied_at = step
        self.s.in_a_row = 0

    def was_skipped(self, step: int) -> bool:
        """Whether ``step`` was not applied: one of the last skips, or a step something
        else skipped (:meth:`not_applied`)."""
        return step in self.s.skips or step in self._unapplied

    def harmless(self, step: int) -> bool:
        """Whether what was judged of step ``step`` did the weights no harm: the step was
        not applied, or what was applied is its replay, not what was judged."""
        return self.was_skipped(step) or step in self._replaced

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
        replaced: list[list[float]] | None = None,
        *,
        start: bool = False,
    ) -> list[Finding]:
        """The adapter restored the snapshot of ``to_step`` at ``step`` (``what``: what it
        restored; ``learning_rates``: the ones it restored, per optimizer and parameter
        group, ``replaced``: those they replaced; ``because``: why; ``start``: the one
        taken when training started, before step ``to_step``, where the others hold the
        state after theirs). The ladder cools down again from here, below the restored
        learning rates.

        How it cools. When the learning rate had risen (2x or more) since the snapshot, a
        spike explains the damage: for ``cool_steps`` the learning rate goes no higher
        than the snapshot's, and is not scaled down. Otherwise, and when that was not
        enough (a roll back during a cool-down after one), it is scaled by
        ``cool_factor`` as well."""
        s, n = self.s, self.settings.skip_ahead
        again = self.cooling(step) and s.ceiling is not None
        risen = _risen(replaced, learning_rates)
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
                f"rolled back to the snapshot {'taken before' if start else 'of'} step "
                f"{to_step} ({what}): the updates of steps "
                f"{to_step if start else to_step + 1}…{step} are discarded and training "
                "goes on with the "
                f"next batch (roll back {s.rollbacks} of {self.settings.max_rollbacks})"
                + (f", because {because}" if because else "")
                + (f"; the next {n} batches are skipped (skip_ahead)" if n else ""),
                "warning",
            )
        ]
        if risen >= 2.0 and not again:
            found.append(self._cap(step, epoch, risen))
        else:
            found.append(self._cool(step, epoch, "after the roll back"))
        s.ceiling = [list(map(float, group)) for group in learning_rates or ()] or None
        return found

    # -- what to do -----------------------------------------------------------------------
    def cooling(self, step: int) -> bool:
        return self.s.cool_from is not None and step < self.s.cool_until

    def lr_scale(self, step: int) -> float:
        """The factor on the learning rate at ``step``: while cooling, ``cool_factor``
        (1 for a cool-down that only caps it, see :meth:`rolled_back`)."""
        return self.s.cool_scale if self.cooling(step) else 1.0

    def lr_ceiling(self, step: int) -> list[list[float]] | None:
        """The learning rates no update at ``step`` goes above before the cool-down's
        factor, per optimizer and parameter group, or None: while cooling after a roll
        back, those of the snapshot it went to. The schedule (or whatever set the
        learning rate) may still be where it did the damage, a spike that lasts longer
        than the stretch rolled back: the cool-down starts from the snapshot's learning
        rate, not from the spike's."""
        return self.s.ceiling if self.cooling(step) else None

    def rate_taken(self, step: int, lr: float | None) -> float | None:
        """The first optimizer's first group's learning rate ``lr`` as the update of
        ``step`` takes it: capped at the snapshot's and scaled by the cool-down's factor
        while cooling (as the adapters apply :meth:`lr_ceiling` and :meth:`lr_scale`)."""
        if lr is None or not self.cooling(step):
            return lr
        ceiling = self.lr_ceiling(step)
        if ceiling and ceiling[0]:
            lr = min(lr, ceiling[0][0])
        return lr * self.lr_scale(step)

    def snapshot_due(self, step: int) -> bool:
        """Whether to snapshot after ``step``: on the cadence, and healthy since the last
        ``snapshot_every`` steps (no warning on a step that was applied; skipped steps
        and cool-downs leave the weights healthy, and a snapshot skipped for them would
        leave only an old one to roll back to)."""
        every = self.settings.snapshot_every
        return step % every == 0 and step - self.s.trouble >= every

    def skipping_ahead(self, step: int) -> str | None:
        """Why step ``step`` is skipped, when it is among the ``skip_ahead`` steps after
        the last roll back; else None."""
        back, n = self.s.rolled_back_at, self.settings.skip_ahead
        if not 0 < step - back <= n:
            return None
        return f"one of the {n} batches after the roll back at step {back} (skip_ahead)"

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
        return self.s.as_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s = _State.of(state, self.settings.cool_factor)

    # -- the signs of damage --------------------------------------------------------------
    def _troubled(self, step: int) -> None:
        """Trouble at ``step``: it begins a new stretch of trouble after ``window`` quiet
        steps (harm done without a sign, by a spike's applied steps, can take dozens of
        steps to show: it is still the same trouble)."""
        s = self.s
        if step - s.troubled_at >= self.settings.window:
            s.onset = step
        s.troubled_at = max(s.troubled_at, step)

    def _damaged_by_last_update(self, step: int) -> bool:
        """Whether the two steps after an applied one were both skipped: one bad batch is
        skipped and the next is fine, but weights an update harmed are judged bad on the
        next batches too (a learning-rate spike, a poisoned momentum). A step its batch's
        inputs explain (see :meth:`skipped`) is no sign of the weights."""
        s = self.s
        return (
            s.in_a_row == 2
            and s.applied_at == step - 2
            and s.bad_data_at < step - 1
            and self._weights_moved_since_rollback()
        )

    def _weights_moved_since_rollback(self) -> bool:
        s = self.s
        return s.rollbacks == 0 or s.applied_at > s.rolled_back_at

    # -- the rungs ------------------------------------------------------------------------
    def _begin_cooling(self, step: int, scale: float) -> None:
        s = self.s
        s.cool_from, s.cool_until, s.skips_cooling = step, step + 1 + self.settings.cool_steps, 0
        s.cool_scale = scale

    def _cool(self, step: int, epoch: int, why: str) -> Finding:
        s, cfg = self.s, self.settings
        self._begin_cooling(step, cfg.cool_factor)
        return self._act(
            step,
            epoch,
            "cool",
            f"{why}: the learning rate is scaled by {cfg.cool_factor:g} for {cfg.cool_steps} "
            f"steps (to step {s.cool_until - 1}), on top of the schedule",
            "warning",
        )

    def _cap(self, step: int, epoch: int, risen: float) -> Finding:
        """A cool-down after a roll back that follows a rise of the learning rate: the
        snapshot's learning rate at most, not scaled down."""
        s, cfg = self.s, self.settings
        self._begin_cooling(step, 1.0)
        return self._act(
            step,
            epoch,
            "cool",
            f"after the roll back: the learning rate had risen {risen:.3g}x above the "
            f"snapshot's, so for {cfg.cool_steps} steps (to step {s.cool_until - 1}) it "
            "goes no higher than the snapshot's, whatever the schedule says",
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


def _risen(now: list[list[float]] | None, then: list[list[float]] | None) -> float:
    """How many times the largest learning rate of ``now`` is its group's in ``then``
    (1 when either is unknown, or a group's was 0)."""
    ratios = [
        a / b
        for groups_now, groups_then in zip(now or (), then or (), strict=False)
        for a, b in zip(groups_now, groups_then, strict=False)
        if b > 0
    ]
    return max(ratios, default=1.0)
