"""The recovery ladder's one hook into the engine: the findings the policy spares
become rungs, and the ladder's acts are reported through the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stethoscope.engine import Decision
from stethoscope.findings import RECOVERY, Finding, Severity
from stethoscope.observation import Observation
from stethoscope.recovery.ladder import Ladder
from stethoscope.recovery.settings import DAMAGE, RECOVERABLE, Recovery
from stethoscope.recovery.skipped import BatchName, SkippedBatch, SkippedData
from stethoscope.recovery.snapshots import Snapshot, SnapshotStore

__all__ = ["Recoverer"]


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
        keep_skipped: Called with each batch skipped (the run's record keeps them).
    """

    def __init__(
        self,
        monitor: Any,
        settings: Recovery,
        keep_skipped: Callable[[SkippedBatch], None] | None = None,
    ) -> None:
        self.monitor = monitor
        self.ladder = Ladder(settings)
        monitor.spare(RECOVERABLE)
        #: A roll back the adapter owes, at the end of the step that asked for it.
        self.rollback_due: str | None = None
        #: The last step whose optimizer step was applied or skipped (see :meth:`settle`).
        self.settled = -1
        self._pending: list[Finding] = []  # errors judged before their step was settled
        #: The batches the run skipped (kept in the checkpoint and the record).
        self.skipped_data = SkippedData(keep_skipped)

    def skipped(
        self,
        step: int,
        epoch: int,
        why: str,
        batch: BatchName | None = None,
        replay: str | None = None,
        *,
        bad_data: bool = False,
    ) -> Decision:
        """The adapter did not apply step ``step``, on ``batch`` (when it knows which),
        because ``why``; ``replay``: ``"reproduces"`` when the step was computed again
        from the same state with the same batch and judged bad again; ``bad_data``: the
        batch's inputs hold NaN or Inf (see ``Ladder.skipped``)."""
        said = why
        if replay == "reproduces":
            said += (
                "; computed again from the same state with the same batch, it was judged "
                "bad again: the batch (or the numerics), not the machine"
            )
        if batch is not None:
            self.skipped_data.add(SkippedBatch(step, batch, why, replay))
        found, action = self.ladder.skipped(step, epoch, said, batch, bad_data=bad_data)
        return self._act(found, action, why)

    def transient(self, step: int, epoch: int, why: str, batch: BatchName | None) -> None:
        """Step ``step`` was judged bad (``why``), but its replay was fine and applied."""
        self.monitor.tell([self.ladder.transient(step, epoch, why, batch)])

    def skip_again(self, epoch: int, index: int) -> SkippedBatch | None:
        """The batch the run this one resumes skipped at ``index`` of ``epoch``, if any: a
        step that trains on it again is skipped again (see :meth:`skipped_again`)."""
        return self.skipped_data.at(epoch, index)

    @property
    def skips_again(self) -> bool:
        """Whether batches the run this one resumes skipped wait to be skipped again."""
        return self.skipped_data.remembered

    def not_the_same(self, step: int, epoch: int, before: SkippedBatch) -> None:
        """Step ``step`` trains where ``before`` was skipped, on another batch: the
        loader's order changed since, and it is not skipped."""
        said = (
            f"Step {step} trains on batch {before.batch.index} of epoch {epoch}, where the "
            f"batch skipped at step {before.step} was, but on other samples (its "
            f"fingerprint was {before.batch.fingerprint}): the loader's order changed, "
            "so it is not skipped."
        )
        self.monitor.tell([Finding(step, epoch, RECOVERY, "info", said, where="resume")])

    def cannot_skip_again(
        self, step: int, epoch: int, batches: list[SkippedBatch], how: str
    ) -> None:
        """A run resumed at step ``step`` cannot know the ``batches`` the run it resumes
        skipped past its checkpoint when they come back (``how`` the data is ordered):
        they are not skipped again, and it says so."""
        named = "; ".join(str(b.batch) for b in batches[:3]) + ("; ..." if len(batches) > 3 else "")
        which = "1 batch" if len(batches) == 1 else f"{len(batches)} batches"
        said = (
            f"The run this one resumes skipped {which} past step {step} ({named}), not "
            f"skipped again here: {how}, so a batch's place in an epoch does not say which "
            "samples it holds."
        )
        self.monitor.tell([Finding(step, epoch, RECOVERY, "info", said, where="resume")])

    def ahead(self, step: int) -> str | None:
        """Why step ``step`` is skipped before it is judged: one of the ``skip_ahead``
        batches after a roll back (see :meth:`skipped_ahead`), or None."""
        return self.ladder.skipping_ahead(step)

    def rate_taken(self, step: int, lr: float | None) -> float | None:
        """``lr``, the first group's learning rate, as the update of ``step`` takes it
        (cooled by the ladder; see :meth:`Ladder.rate_taken`)."""
        return self.ladder.rate_taken(step, lr)

    def skipped_ahead(self, step: int, why: str, batch: BatchName | None) -> None:
        """The adapter did not apply step ``step``, skipped ahead after a roll back: kept
        with the skipped batches, without a finding of its own (the roll back said so)."""
        self.ladder.not_applied(step)
        if batch is not None:
            self.skipped_data.add(SkippedBatch(step, batch, why))

    def remember(self, batches: list[SkippedBatch]) -> None:
        """Batches a run this one resumes skipped past its checkpoint (from the record):
        where they come back, they are skipped again."""
        self.skipped_data.remember(batches)

    def drop_unapplied_update(self, obs: Observation) -> None:
        """A step whose update was not applied moved no weight: its update statistics (all
        zero) say nothing of the layers, and would read as updates too small to learn
        (``small_updates``) or as updates rounded away (``rounded_updates``), so they are
        dropped before the step is judged."""
        if obs.update_norm is not None and self.ladder.was_skipped(obs.step):
            obs.drop_update()

    def skipped_again(self, step: int, epoch: int, before: SkippedBatch) -> None:
        """The adapter did not apply step ``step``, whose batch was skipped before."""
        self.monitor.tell([self.ladder.skipped_again(step, epoch, before)])

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
        troubled = any(not self.ladder.harmless(f.step) for f in settled)
        found = self.ladder.saw(step, epoch, troubled=troubled)
        out = self._answer([f for f in decision.spared if f.step <= self.settled], found)
        return out if out.stop or not decision.stop else decision

    def settle(self, step: int) -> Decision:
        """The optimizer step of ``step`` was applied or skipped: answer the errors that
        waited for it."""
        self.settled = step
        if not self.ladder.was_skipped(step):
            self.ladder.applied(step)
        if not self._pending:  # every step of a healthy run: nothing waited
            return _CARRY_ON
        ready = [f for f in self._pending if f.step <= step]
        self._pending = [f for f in self._pending if f.step > step]
        if any(not self.ladder.harmless(f.step) for f in ready):
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
            if self.ladder.harmless(f.step):
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

    def carried_on(self, step: int, epoch: int) -> None:
        """Step ``step`` went by with no trouble of its own: a cool-down may end."""
        self.monitor.tell(self.ladder.saw(step, epoch, troubled=False))

    def rolled_back(
        self,
        step: int,
        epoch: int,
        to_step: int,
        what: str,
        learning_rates: list[list[float]] | None = None,
        replaced: list[list[float]] | None = None,
        *,
        start: bool = False,
    ) -> None:
        """The adapter restored the snapshot of ``to_step`` (and ``learning_rates``, in
        place of ``replaced``; ``start``: the one taken before step ``to_step``, when
        training started)."""
        because, self.rollback_due = self.rollback_due, None
        found = self.ladder.rolled_back(
            step, epoch, to_step, what, learning_rates, because, replaced, start=start
        )
        self.monitor.tell(found)

    def roll_back(
        self,
        step: int,
        epoch: int,
        snapshots: SnapshotStore,
        put_back: Callable[[dict[str, Any]], list[list[float]] | None],
        what: str,
        learning_rates: Callable[[], list[list[float]]] | None = None,
    ) -> Decision:
        """Pay the roll back owed at ``step``: ``put_back`` restores the newest healthy
        snapshot's state (``what`` says what that holds) and returns the learning rates it
        restored (per optimizer and parameter group; the cool-down stays below them);
        ``learning_rates`` reads them (before the restore: whether they had risen).
        Passed over: the newest, when the last roll back went to it only lately (see
        :meth:`Ladder.newest_suspect`), and any taken too shortly before the trouble
        began (see :meth:`Ladder.trusted`). With none left, training stops."""
        if self.ladder.newest_suspect(step):
            snapshots.discard_newest()
        while snapshots.kept and not self._trusted(snapshots.kept[-1]):
            snapshots.discard_newest()
        newest = snapshots.newest()
        if newest is None:
            return self.no_snapshot(step, epoch)
        snap, state = newest
        replaced = learning_rates() if learning_rates is not None else None
        restored = put_back(state)
        self.rolled_back(step, epoch, snap.step, what, restored, replaced, start=snap.first)
        return _CARRY_ON

    def _trusted(self, snapshot: Snapshot) -> bool:
        return snapshot.first or self.ladder.trusted(snapshot.step)

    def no_snapshot(self, step: int, epoch: int) -> Decision:
        """The roll back owed has nowhere to go: stop."""
        why, self.rollback_due = self.rollback_due or "a roll back was needed", None
        return self._act([self.ladder.stop_without_snapshot(step, epoch, why)], "stop", why)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ladder's state and the batches skipped."""
        return {**self.ladder.state_dict(), "skipped_batches": self.skipped_data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ladder.load_state_dict(state)
        self.skipped_data.load_state_dict(state.get("skipped_batches", []))

    def _act(self, found: list[Finding], action: str | None, why: str) -> Decision:
        self.monitor.tell(found)
        if action == "rollback":
            self.rollback_due = self.ladder.rollback_why or why
        if action != "stop":
            return Decision()
        reason = found[-1]
        self.monitor.note_stop(reason)
        return Decision(stop=True, raise_=self.monitor.raises_on(reason), reason=reason)
