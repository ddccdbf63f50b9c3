"""Where the ranks meet, and how they agree: every rank sends what its monitor held since
the last meeting, with the statistics the meeting carries, and every rank acts alike on
what all of them sent."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from stethoscope.distributed.letter import Letter
from stethoscope.distributed.packet import MAIL_BYTES, Entry, Gathered, Packet
from stethoscope.engine import Decision
from stethoscope.findings import Finding
from stethoscope.observation import Observation
from stethoscope.statistics import (
    EVENT,
    EVERY_STEP,
    GATHERED,
    REPLICATED,
    STATISTICS,
    AcrossRanks,
    Statistic,
)

if TYPE_CHECKING:
    from stethoscope.engine import Monitor

__all__ = ["FLAGS", "SYNC_EVERY", "RankMeeting"]

#: The decisions a rank took alone since the last meeting and held until this one, and
#: how the ranks combine them: ``any`` (a flag) or ``max``.
FLAGS: dict[str, str] = {
    "stop": "any",  # a finding matched stop_on: every rank stops on this step
    "raise": "any",  # a finding matched raise_on: every rank raises on this step
    "escalate": "any",  # a rank saw something suspicious: every rank samples hot from here
    "backlog": "max",  # findings still waiting in a rank's outbox: meet again at an epoch end
    "rollback": "any",  # recover=: an error on an applied step: every rank rolls back
}

#: The longest run of unsampled steps between two meetings. With the default detectors
#: every sixteenth step is sampled anyway; this bounds how late a rank's decision to stop
#: is agreed when the detectors are all every-step ones.
SYNC_EVERY = 16

#: Each observation field that a meeting can carry, with its statistic's declaration.
_STATISTIC_OF: dict[str, Statistic] = {
    f.name: s
    for s in STATISTICS.values()
    if s.across_ranks in (AcrossRanks.GATHERED, AcrossRanks.POOLED)
    for f in s.fields
}


class RankMeeting:
    """Where the ranks of a distributed run meet: one all-gather, the same verdict on
    every rank.

    At a meeting every rank sends what its monitor held since the last one (its
    :class:`Held`: decisions and, off rank zero, findings) and the statistics the meeting
    carries; then rank zero records the other ranks' findings, every rank escalates if
    any wanted to, and every rank stops (or raises) if any wanted to, for the earliest of
    their reasons. The gathered statistics are then judged alike on every rank.

    Args:
        monitor: This rank's monitor, already told its place (``Monitor.distribute``).
        all_gather: The framework's collective: this rank's packet (a 1-D uint8 array)
            in, every rank's packet out, stacked ``(world_size, nbytes)`` in rank order.
            Every rank calls it at the same meetings (see :meth:`due`).
        mail_bytes: Bytes of each rank's letter.
        recoverer: With ``recover=``, the rank's recovery ladder
            (:class:`~stethoscope.recovery.Recoverer`): an error it answers on an
            applied step, held by one rank, rolls every rank back alike.

    Example:
        >>> meeting = RankMeeting(monitor, gather)  # doctest: +SKIP
        >>> if meeting.due(step):  # doctest: +SKIP
        ...     decision = meeting.meet(step, epoch, {"rank_busy": 0.02})
    """

    def __init__(
        self,
        monitor: Monitor,
        all_gather: Callable[[np.ndarray], np.ndarray],
        *,
        mail_bytes: int = MAIL_BYTES,
        recoverer: Any = None,
    ) -> None:
        self.monitor = monitor
        self.all_gather = all_gather
        self.mail_bytes = mail_bytes
        self.recoverer = recoverer
        # the detectors that read more than the every-step statistics decide where ranks
        # meet: those that apply to the run, known once it has started (see _meeting)
        self._sampled: frozenset[str] | None = None
        self._packets: dict[tuple, Packet] = {}
        self._pending = False
        #: The detectors that judge only what every rank holds alike (rank zero judges
        #: them for all): a finding of theirs is where a fault arrived, not where it began.
        self._of_all = frozenset(d.name for d in monitor.detectors if d.needs <= REPLICATED)

    @property
    def pending(self) -> bool:
        """Whether some rank still held findings its letter could not carry at the last
        meeting (at an epoch end, meet again until none does)."""
        return self._pending

    def due(self, step: int) -> bool:
        """Whether the ranks meet at ``step``: a sampled step of the agreed schedule, or
        every :data:`SYNC_EVERY` steps. Never in a single process.

        The schedule depends only on the step and on the sampler's state, which changes
        only at meetings and on gathered statistics (the same on every rank), so every
        rank gives the same answer: no rank waits in a collective the others skip.
        """
        if self.monitor.world_size == 1:
            return False
        if step % SYNC_EVERY == 0:
            return True
        if self._sampled is None:
            self._sampled = frozenset(
                d.name
                for d in self.monitor.detectors
                if d.needs - EVERY_STEP - EVENT and d.applies()  # applies: from the setup
            )
        return not self._sampled.isdisjoint(self.monitor.due(step))

    def gathers(self, step: int) -> frozenset[str]:
        """The statistics gathered from every rank at ``step``'s meeting: those the
        detectors due there need or want."""
        if self.monitor.world_size == 1:
            return frozenset()
        due = self.monitor.due(step)
        return frozenset(
            p
            for d in self.monitor.detectors
            if d.name in due
            for p in (d.needs | d.wants) & GATHERED
        )

    def meet(self, step: int, epoch: int, shared: Mapping[str, Any] | None = None) -> Decision:
        """Meet at ``step``: send this rank's held decisions, findings and ``shared``;
        act on what every rank sent; judge the shared statistics. Call it on every rank.

        Args:
            shared: This rank's values of the statistics the meeting carries, by
                observation field: a gathered statistic's first field as this rank's
                number or vector (the others, the same on every rank, are passed as is);
                each field of a pooled statistic as ``(sum, count)``.

        Returns:
            The decision every rank takes: a raise (from any rank or the shared
            statistics) wins over a stop.
        """
        shared = dict(shared or {})
        held = self.monitor.held
        want = held.decision
        rollback = self.recoverer.rollback_asked(held.spared) if self.recoverer else None
        held.spared.clear()
        letter = Letter(
            findings=held.findings,
            reason=want.reason if want is not None else None,
            why=held.why,
            rollback=rollback,
        )
        body, sent = letter.encode(self.mail_bytes)
        values: dict[str, Any] = {
            "stop": float(want is not None),
            "raise": float(want is not None and want.raise_),
            "escalate": float(held.why is not None),
            "backlog": float(len(held.findings) - sent),
            "rollback": float(rollback is not None),
        }
        entries = {name: Entry(1, op) for name, op in FLAGS.items()}
        for name, value in shared.items():
            entry = _entry(name, value)
            if entry is not None:
                entries[name] = entry
                values[name] = value
        packet = self._packet(entries)
        gathered = packet.unpack(self.all_gather(packet.pack(values, body)))
        del held.findings[:sent]
        held.decision, held.why = None, None
        self._pending = bool(gathered.reduced("backlog"))
        agreed = self._agree(step, epoch, gathered)
        if len(entries) == len(FLAGS):
            return agreed
        judged = self._judge_shared(step, epoch, shared, gathered)
        if agreed.raise_ or (agreed.stop and not judged.raise_):
            return agreed
        return judged

    def _packet(self, entries: dict[str, Entry]) -> Packet:
        key = tuple(entries.items())
        packet = self._packets.get(key)
        if packet is None:
            packet = self._packets[key] = Packet(entries, mail_bytes=self.mail_bytes)
        return packet

    def _agree(self, step: int, epoch: int, gathered: Gathered) -> Decision:
        """Act on what every rank sent: the same decision on every rank."""
        monitor = self.monitor
        others = [gathered.letters[r] for r in range(gathered.world_size) if r != monitor.rank]
        monitor.receive(f for letter in others for f in letter.findings)
        hot = gathered.ranks("escalate")
        if hot:
            r = hot[0]
            monitor.escalate(step, epoch, f"rank {r}: {gathered.letters[r].why}")
        for flag in ("raise", "stop"):
            reasons = [
                gathered.letters[r].reason
                for r in gathered.ranks(flag)
                if gathered.letters[r].reason is not None
            ]
            if reasons:
                reason = min(reasons, key=self._origin_first)
                monitor.note_stop(reason)
                return Decision(stop=True, raise_=flag == "raise", reason=reason)
        asked = [gathered.letters[r].rollback for r in gathered.ranks("rollback")]
        asked = [f for f in asked if f is not None]
        if asked and self.recoverer is not None:  # the same ladder step on every rank
            return self.recoverer.rollback_agreed(min(asked, key=self._origin_first))
        return Decision()

    def _origin_first(self, finding: Finding) -> tuple[int, bool, int]:
        """The order in which the ranks' reasons point at a fault's origin: the earliest
        step first; at the same step, a rank's own data (its loss, its batch) before what
        every rank holds alike (a NaN loss on rank 1 reaches every rank's gradients at that
        very step's all-reduce, where rank zero finds it); then the lowest rank."""
        return finding.step, finding.detector in self._of_all, finding.rank

    def _judge_shared(
        self, step: int, epoch: int, shared: dict[str, Any], gathered: Gathered
    ) -> Decision:
        """Judge the statistics every rank now holds alike."""
        obs = Observation(step=step, epoch=epoch, rank=self.monitor.rank)
        pooled_missing = False
        for name, value in shared.items():
            statistic = _STATISTIC_OF.get(name)
            if name not in gathered.per_rank:  # the same on every rank: passed as is
                setattr(obs, name, value)
            elif statistic.across_ranks is AcrossRanks.POOLED:
                mean = gathered.mean_of(name)
                setattr(obs, name, mean)
                pooled_missing |= mean is None and name == statistic.marker
            else:  # gathered: a number per rank gives a vector, a vector a matrix
                per_rank = gathered.per_rank[name]
                setattr(obs, name, per_rank[:, 0] if np.ndim(value) == 0 else per_rank)
        if pooled_missing:
            return Decision()  # e.g. no rank had a validation loss: nothing to judge
        return self.monitor.observe_shared(obs)


def _entry(name: str, value: Any) -> Entry | None:
    """How field ``name`` travels in a packet; None for a field the same on every rank."""
    statistic = _STATISTIC_OF.get(name)
    if statistic is None:
        raise ValueError(
            f"{name!r} is not a field of a statistic the ranks gather or pool; those are: "
            f"{sorted(_STATISTIC_OF)}"
        )
    if statistic.across_ranks is AcrossRanks.POOLED:
        return Entry(2, "sum")
    if name != statistic.marker:
        return None
    dtype = next(f.dtype for f in statistic.fields if f.name == name)
    return Entry(int(np.size(value)), "rank", dtype)
