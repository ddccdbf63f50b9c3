"""Distributed runs, framework-free: where the ranks meet, what they exchange, how they agree.

The ranks of a distributed run meet on the steps they all agree on: the sampled steps
of the sampler's schedule (a pure function of the step and of the sampler's state,
which itself only changes at a meeting, so it is the same on every rank), plus every
:data:`SYNC_EVERY` steps, at each validation and at each epoch end. At a meeting each
rank contributes one fixed-size byte packet to ONE all-gather: its held decisions as
the flags of :data:`FLAGS`, the statistics the meeting carries (laid out from their
declarations in :mod:`stethoscope.statistics`), then a letter (JSON) with the findings
it raised since the last meeting and the reasons behind its decisions. Every rank
unpacks the same bytes, so every rank reaches the same verdict from them; rank zero
writes the findings.

:class:`RankMeeting` runs the meetings; the adapter only hands it the framework's
all-gather (``strategy.all_gather`` in Lightning); everything here is numpy and the
standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stethoscope.findings import Finding
from stethoscope.observation import Observation
from stethoscope.policy import Decision
from stethoscope.statistics import EVENT, EVERY_STEP, GATHERED, STATISTICS, AcrossRanks, Statistic

if TYPE_CHECKING:
    from stethoscope.monitor import Monitor

__all__ = [
    "FLAGS",
    "MAIL_BYTES",
    "SYNC_EVERY",
    "Entry",
    "Gathered",
    "Held",
    "Letter",
    "Packet",
    "RankMeeting",
]

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
#: Bytes of each rank's letter. Findings that do not fit wait for the next meeting (and
#: the epoch end meets until no rank has any left), so none is lost.
MAIL_BYTES = 4096

_LENGTH = 8  # the letter's length, an int64, ends the statistics

#: Each observation field that a meeting can carry, with its statistic's declaration.
_STATISTIC_OF: dict[str, Statistic] = {
    f.name: s
    for s in STATISTICS.values()
    if s.across_ranks in (AcrossRanks.GATHERED, AcrossRanks.POOLED)
    for f in s.fields
}


@dataclass(frozen=True)
class Entry:
    """One named vector of a meeting's packet.

    Args:
        size: Its elements (the same on every rank).
        op: How the ranks combine it: ``sum``, ``max``, ``any`` (a flag), or ``rank``
            (kept per rank).
        dtype: ``float64``, or ``int64`` for values compared bit for bit.
    """

    size: int
    op: str = "sum"
    dtype: str = "float64"


@dataclass
class Held:
    """What a rank of a distributed run holds until the ranks next meet.

    The rank's :class:`~stethoscope.monitor.Monitor` fills it as it judges; the
    :class:`RankMeeting` empties it into the rank's packet.

    Args:
        findings: Findings raised from this rank's own data that rank zero has not seen
            (off rank zero only).
        decision: This rank's decision to stop (or raise), if any: the first, or a raise
            after a stop.
        why: Why this rank wants to sample faster, if it does.
        spared: With ``recover=``, the warnings and errors the recovery ladder answers
            instead of the policy (see ``Decision.spared``), until the ranks agree on
            them.
    """

    findings: list[Finding] = field(default_factory=list)
    decision: Decision | None = None
    why: str | None = None
    spared: list[Finding] = field(default_factory=list)


@dataclass
class Letter:
    """What one rank tells the others at a meeting, besides its declared statistics.

    Args:
        findings: Findings it raised since the last meeting (from its own data).
        reason: The finding behind its decision to stop or raise, if any.
        why: Why it wants to sample faster, if it does.
        rollback: With ``recover=``, the finding for which it asks every rank to roll back.
    """

    findings: list[Finding] = field(default_factory=list)
    reason: Finding | None = None
    why: str | None = None
    rollback: Finding | None = None

    def encode(self, capacity: int) -> tuple[bytes, int]:
        """The letter as at most ``capacity`` bytes of JSON, and how many findings fit.

        The reason and the why always fit (a message too long for the letter is cut);
        findings are added in order while they fit.
        """
        head: dict[str, Any] = {"reason": _as_dict(self.reason), "why": self.why}
        if self.rollback is not None:  # rare: no room taken from the findings otherwise
            head["rollback"] = _as_dict(self.rollback)
        text = json.dumps({**head, "findings": []})
        while len(text.encode()) > capacity:  # only a pathological message gets here
            reason = head["reason"]
            if reason and len(reason["message"]) > 80:
                reason["message"] = reason["message"][: len(reason["message"]) // 2] + "..."
            elif head.get("rollback") and len(head["rollback"]["message"]) > 80:
                message = head["rollback"]["message"]
                head["rollback"]["message"] = message[: len(message) // 2] + "..."
            elif head["why"] and len(head["why"]) > 80:
                head["why"] = head["why"][: len(head["why"]) // 2] + "..."
            else:
                raise ValueError(f"a letter of {capacity} bytes cannot hold {text!r}")
            text = json.dumps({**head, "findings": []})
        used = len(text.encode())
        parts: list[str] = []
        for f in self.findings:
            item = json.dumps(_as_dict(f))
            if used + len(item.encode()) + 2 > capacity:
                if parts:
                    break
                item = json.dumps(_cut(f, capacity - used - 2))  # a lone giant: cut to fit
                if used + len(item.encode()) + 2 > capacity:
                    break  # not even cut: it waits for a letter with more room
            parts.append(item)
            used += len(item.encode()) + 2
        body = text[:-3] + "[" + ", ".join(parts) + "]}"
        return body.encode(), len(parts)

    @classmethod
    def decode(cls, data: bytes) -> Letter:
        if not data:
            return cls()
        d = json.loads(data.decode())
        reason, rollback = d.get("reason"), d.get("rollback")
        return cls(
            findings=[Finding.from_dict(f) for f in d.get("findings", [])],
            reason=Finding.from_dict(reason) if reason else None,
            why=d.get("why"),
            rollback=Finding.from_dict(rollback) if rollback else None,
        )


def _as_dict(f: Finding | None) -> dict[str, Any] | None:
    # NaN and Inf survive: json writes and reads them (a NaN loss keeps its value)
    return None if f is None else f.to_dict()


def _cut(f: Finding, room: int) -> dict[str, Any]:
    """``f`` with its message shortened so that its JSON takes at most ``room`` bytes."""
    d = f.to_dict()
    over = len(json.dumps(d).encode()) - room
    message = d["message"].encode()[: max(len(d["message"].encode()) - over - 3, 0)]
    d["message"] = message.decode(errors="ignore") + "..."
    return d


class Packet:
    """The layout of one meeting's packet: the entries, then the letter.

    Every rank builds the same layout for the same meeting (the sizes are fixed by the
    model and by the agreed schedule), which is what lets one all-gather carry it.

    Args:
        entries: Each named vector, in packing order.
        mail_bytes: Bytes reserved for the letter.

    Raises:
        ValueError: A size is negative, or an op or dtype unknown.

    Example:
        >>> p = Packet({"stop": Entry(1, "any"), "busy": Entry(1, "rank")})
        >>> mine = p.pack({"stop": 0.0, "busy": 0.02})
        >>> theirs = p.pack({"stop": 1.0, "busy": 0.09})
        >>> g = p.unpack(np.stack([mine, theirs]))
        >>> g.reduced("stop"), g.ranks("stop"), g.per_rank["busy"][:, 0].tolist()
        (True, [1], [0.02, 0.09])
    """

    def __init__(self, entries: Mapping[str, Entry], *, mail_bytes: int = MAIL_BYTES) -> None:
        for name, e in entries.items():
            if not isinstance(e.size, int) or e.size < 0:
                raise ValueError(f"size of {name!r} is {e.size!r}; it must be an integer >= 0")
            if e.op not in _OPS:
                raise ValueError(f"op of {name!r} is {e.op!r}; use one of {sorted(_OPS)}")
            if e.dtype not in ("float64", "int64"):
                raise ValueError(f"dtype of {name!r} is {e.dtype!r}; use 'float64' or 'int64'")
        self.entries = dict(entries)
        self.mail_bytes = mail_bytes
        self._offsets: dict[str, int] = {}
        at = 0
        for name, e in self.entries.items():
            self._offsets[name] = at
            at += 8 * e.size  # float64 and int64 alike
        self._mail_at = at + _LENGTH
        self.nbytes = self._mail_at + mail_bytes

    def pack(self, values: Mapping[str, Any], letter: bytes = b"") -> np.ndarray:
        """This rank's packet (uint8): ``values`` by name (missing ones are zeros), then
        ``letter`` (see :meth:`Letter.encode`)."""
        if len(letter) > self.mail_bytes:
            raise ValueError(f"a letter of {len(letter)} bytes exceeds {self.mail_bytes}")
        out = np.zeros(self.nbytes, dtype=np.uint8)
        for name, e in self.entries.items():
            value = np.asarray(values.get(name, np.zeros(e.size)), dtype=e.dtype).reshape(-1)
            if value.size != e.size:
                raise ValueError(f"{name!r} has {value.size} elements; this packet holds {e.size}")
            at = self._offsets[name]
            out[at : at + 8 * e.size] = value.view(np.uint8)
        length = np.array([len(letter)], np.int64).view(np.uint8)
        out[self._mail_at - _LENGTH : self._mail_at] = length
        out[self._mail_at : self._mail_at + len(letter)] = np.frombuffer(letter, dtype=np.uint8)
        return out

    def unpack(self, gathered: np.ndarray) -> Gathered:
        """Every rank's packet, stacked ``(world_size, nbytes)``, as entries and letters."""
        gathered = np.ascontiguousarray(gathered, dtype=np.uint8)
        if gathered.ndim != 2 or gathered.shape[1] != self.nbytes:
            raise ValueError(
                f"gathered packets have shape {gathered.shape}; expected (ranks, {self.nbytes})"
            )
        per_rank: dict[str, np.ndarray] = {}
        for name, e in self.entries.items():
            at = self._offsets[name]
            raw = np.ascontiguousarray(gathered[:, at : at + 8 * e.size])
            per_rank[name] = raw.view(e.dtype).reshape(len(gathered), e.size)
        letters = []
        for row in gathered:
            length = int(row[self._mail_at - _LENGTH : self._mail_at].view(np.int64)[0])
            letters.append(Letter.decode(row[self._mail_at : self._mail_at + length].tobytes()))
        ops = {name: e.op for name, e in self.entries.items()}
        return Gathered(per_rank=per_rank, letters=letters, ops=ops)


_OPS = ("sum", "max", "any", "rank")


@dataclass
class Gathered:
    """One meeting's entries from every rank, and every rank's letter.

    Args:
        per_rank: Each entry as ``(world_size, size)``, row ``r`` from rank ``r``.
        letters: Each rank's letter, in rank order.
        ops: How the ranks combine each entry (see :class:`Entry`).
    """

    per_rank: dict[str, np.ndarray]
    letters: list[Letter]
    ops: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.letters)

    def reduced(self, name: str) -> Any:
        """Entry ``name`` combined across ranks as its op says; a scalar entry gives a
        scalar (``any``: a bool), a vector a vector, ``rank`` the per-rank matrix."""
        op = self.ops[name]
        x = self.per_rank[name]
        if op == "sum":
            out = x.sum(axis=0)
        elif op == "max":
            out = x.max(axis=0)
        elif op == "any":
            out = (x != 0).any(axis=0)
        else:
            return x
        return out.item() if out.size == 1 else out

    def ranks(self, name: str) -> list[int]:
        """The ranks that set flag ``name`` (``any``) or hold its maximum (``max``)."""
        x = self.per_rank[name].reshape(self.world_size, -1)
        if self.ops[name] == "max":
            top = x.max()
            return [int(r) for r in np.flatnonzero((x == top).any(axis=1))]
        return [int(r) for r in np.flatnonzero((x != 0).any(axis=1))]

    def mean_of(self, name: str) -> float | None:
        """A pooled entry (a sum, then a count, on each rank) as the global mean: ``None``
        when no rank counted anything."""
        total, count = self.reduced(name)
        return float(total) / float(count) if count > 0 else None


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
        # the detectors that read more than the every-step statistics decide where ranks meet
        self._sampled = frozenset(d.name for d in monitor.detectors if d.needs - EVERY_STEP - EVENT)
        self._packets: dict[tuple, Packet] = {}
        self._pending = False

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
        return not self._sampled.isdisjoint(self.monitor.due(step))

    def gathers(self, step: int) -> frozenset[str]:
        """The statistics gathered from every rank at ``step``'s meeting: those the
        detectors due there need."""
        if self.monitor.world_size == 1:
            return frozenset()
        due = self.monitor.due(step)
        return frozenset(
            p for d in self.monitor.detectors if d.name in due for p in d.needs & GATHERED
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
                # the earliest: a NaN on one rank spreads to every replica at the next
                # all-reduce, and the rank it began on is the one to look at
                reason = min(reasons, key=lambda f: (f.step, f.rank))
                monitor.note_stop(reason)
                return Decision(stop=True, raise_=flag == "raise", reason=reason)
        asked = [gathered.letters[r].rollback for r in gathered.ranks("rollback")]
        asked = [f for f in asked if f is not None]
        if asked and self.recoverer is not None:  # the same ladder step on every rank
            return self.recoverer.rollback_agreed(min(asked, key=lambda f: (f.step, f.rank)))
        return Decision()

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
