"""Distributed runs, framework-free: what the ranks exchange, and how they combine it.

The ranks of a distributed run meet on the steps they all agree on: the sampled steps
of the sampler's schedule (a pure function of the step and of the sampler's state,
which itself only changes at a meeting, so it is the same on every rank), plus every
:data:`SYNC_EVERY` steps, at each validation and at each epoch end. At a meeting each
rank contributes one fixed-size byte packet to ONE all-gather: the statistics declared
in :data:`REDUCTIONS`, then a letter (JSON) with the findings it raised since the last
meeting and the reasons behind its decisions. Every rank unpacks the same bytes, so
every rank reaches the same verdict from them; rank zero writes the findings.

The adapter only moves the bytes (``strategy.all_gather`` in Lightning); everything
else here is numpy and the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stethoscope.findings import Finding

__all__ = ["MAIL_BYTES", "REDUCTIONS", "SYNC_EVERY", "Gathered", "Letter", "Packet"]

#: Every statistic the ranks exchange, declared once with how the ranks combine it:
#: ``sum``, ``mean``, ``max``, ``any`` (a flag), or ``rank`` (kept per rank, for the
#: detectors that compare ranks). Nothing else is reduced, anywhere.
REDUCTIONS: dict[str, str] = {
    # decisions a rank took alone since the last meeting and held until this one
    "stop": "any",  # a finding matched stop_on: every rank stops on this step
    "raise": "any",  # a finding matched raise_on: every rank raises on this step
    "escalate": "any",  # a rank saw something suspicious: every rank samples hot from here
    "backlog": "max",  # findings still waiting in a rank's outbox: meet again at an epoch end
    # validation: the sum over every rank's batches is the global one
    "val_sum": "sum",
    "val_count": "sum",
    "train_sum": "sum",
    "train_count": "sum",
    # compared across ranks by the distributed detectors
    "busy": "rank",  # straggler: seconds per step each rank spent alone
    "checksums": "rank",  # replica_divergence: one exact checksum per tensor
}
#: Statistics that are not float64: checksums are compared bit for bit, never as floats.
_DTYPES: dict[str, Any] = {"checksums": np.int64}

#: The longest run of unsampled steps between two meetings. With the default detectors
#: every sixteenth step is sampled anyway; this bounds how late a rank's decision to stop
#: is agreed when the detectors are all every-step ones.
SYNC_EVERY = 16
#: Bytes of each rank's letter. Findings that do not fit wait for the next meeting (and
#: the epoch end meets until no rank has any left), so none is lost.
MAIL_BYTES = 4096

_LENGTH = 8  # the letter's length, an int64, ends the statistics


@dataclass
class Letter:
    """What one rank tells the others at a meeting, besides its declared statistics.

    Args:
        findings: Findings it raised since the last meeting (from its own data).
        reason: The finding behind its decision to stop or raise, if any.
        why: Why it wants to sample faster, if it does.
    """

    findings: list[Finding] = field(default_factory=list)
    reason: Finding | None = None
    why: str | None = None

    def encode(self, capacity: int) -> tuple[bytes, int]:
        """The letter as at most ``capacity`` bytes of JSON, and how many findings fit.

        The reason and the why always fit (a message too long for the letter is cut);
        findings are added in order while they fit.
        """
        head: dict[str, Any] = {"reason": _as_dict(self.reason), "why": self.why}
        text = json.dumps({**head, "findings": []})
        while len(text.encode()) > capacity:  # only a pathological message gets here
            reason = head["reason"]
            if reason and len(reason["message"]) > 80:
                reason["message"] = reason["message"][: len(reason["message"]) // 2] + "..."
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
        reason = d.get("reason")
        return cls(
            findings=[Finding.from_dict(f) for f in d.get("findings", [])],
            reason=Finding.from_dict(reason) if reason else None,
            why=d.get("why"),
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
    """The layout of one meeting's packet: the statistics, their sizes, then the letter.

    Every rank builds the same layout for the same meeting (the sizes are fixed by the
    model and by the agreed schedule), which is what lets one all-gather carry it.

    Args:
        sizes: Elements per statistic, in packing order; each name must be declared in
            :data:`REDUCTIONS`.
        mail_bytes: Bytes reserved for the letter.

    Raises:
        ValueError: A statistic is not declared, or a size is negative.

    Example:
        >>> p = Packet({"stop": 1, "busy": 1})
        >>> mine = p.pack({"stop": 0.0, "busy": 0.02})
        >>> theirs = p.pack({"stop": 1.0, "busy": 0.09})
        >>> g = p.unpack(np.stack([mine, theirs]))
        >>> g.reduced("stop"), g.ranks("stop"), g.per_rank["busy"][:, 0].tolist()
        (True, [1], [0.02, 0.09])
    """

    def __init__(self, sizes: Mapping[str, int], *, mail_bytes: int = MAIL_BYTES) -> None:
        for name, n in sizes.items():
            if name not in REDUCTIONS:
                raise ValueError(f"{name!r} is not declared in REDUCTIONS: {sorted(REDUCTIONS)}")
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"size of {name!r} is {n!r}; it must be an integer >= 0")
        self.sizes = dict(sizes)
        self.mail_bytes = mail_bytes
        self._offsets: dict[str, int] = {}
        at = 0
        for name, n in self.sizes.items():
            self._offsets[name] = at
            at += 8 * n  # float64 and int64 alike
        self._mail_at = at + _LENGTH
        self.nbytes = self._mail_at + mail_bytes

    def pack(self, values: Mapping[str, Any], letter: bytes = b"") -> np.ndarray:
        """This rank's packet (uint8): ``values`` by name (missing ones are zeros), then
        ``letter`` (see :meth:`Letter.encode`)."""
        if len(letter) > self.mail_bytes:
            raise ValueError(f"a letter of {len(letter)} bytes exceeds {self.mail_bytes}")
        out = np.zeros(self.nbytes, dtype=np.uint8)
        for name, n in self.sizes.items():
            dtype = _DTYPES.get(name, np.float64)
            value = np.asarray(values.get(name, np.zeros(n)), dtype=dtype).reshape(-1)
            if value.size != n:
                raise ValueError(f"{name!r} has {value.size} elements; this packet holds {n}")
            at = self._offsets[name]
            out[at : at + 8 * n] = value.view(np.uint8)
        length = np.array([len(letter)], np.int64).view(np.uint8)
        out[self._mail_at - _LENGTH : self._mail_at] = length
        out[self._mail_at : self._mail_at + len(letter)] = np.frombuffer(letter, dtype=np.uint8)
        return out

    def unpack(self, gathered: np.ndarray) -> Gathered:
        """Every rank's packet, stacked ``(world_size, nbytes)``, as statistics and letters."""
        gathered = np.ascontiguousarray(gathered, dtype=np.uint8)
        if gathered.ndim != 2 or gathered.shape[1] != self.nbytes:
            raise ValueError(
                f"gathered packets have shape {gathered.shape}; expected (ranks, {self.nbytes})"
            )
        per_rank: dict[str, np.ndarray] = {}
        for name, n in self.sizes.items():
            at = self._offsets[name]
            raw = np.ascontiguousarray(gathered[:, at : at + 8 * n])
            per_rank[name] = raw.view(_DTYPES.get(name, np.float64)).reshape(len(gathered), n)
        letters = []
        for row in gathered:
            length = int(row[self._mail_at - _LENGTH : self._mail_at].view(np.int64)[0])
            letters.append(Letter.decode(row[self._mail_at : self._mail_at + length].tobytes()))
        return Gathered(per_rank=per_rank, letters=letters)


@dataclass
class Gathered:
    """One meeting's statistics from every rank, and every rank's letter.

    Args:
        per_rank: Each statistic as ``(world_size, size)``, row ``r`` from rank ``r``.
        letters: Each rank's letter, in rank order.
    """

    per_rank: dict[str, np.ndarray]
    letters: list[Letter]

    @property
    def world_size(self) -> int:
        return len(self.letters)

    def reduced(self, name: str) -> Any:
        """``name`` combined across ranks as :data:`REDUCTIONS` declares it; a scalar
        statistic gives a scalar (``any``: a bool), a vector a vector."""
        op = REDUCTIONS[name]
        x = self.per_rank[name]
        if op == "sum":
            out = x.sum(axis=0)
        elif op == "mean":
            out = x.mean(axis=0)
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
        if REDUCTIONS[name] == "max":
            top = x.max()
            return [int(r) for r in np.flatnonzero((x == top).any(axis=1))]
        return [int(r) for r in np.flatnonzero((x != 0).any(axis=1))]

    def mean_of(self, total: str, count: str) -> float | None:
        """``sum(total) / sum(count)`` over ranks: a global mean from per-rank sums."""
        n = float(self.reduced(count))
        return float(self.reduced(total)) / n if n > 0 else None
