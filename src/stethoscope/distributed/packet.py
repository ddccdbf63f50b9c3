"""The bytes of one meeting: named vectors every rank lays out alike, then the letter;
one all-gather carries them, and every rank unpacks the same result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stethoscope.distributed.letter import Letter

__all__ = ["MAIL_BYTES", "Entry", "Gathered", "Packet"]

#: Bytes of each rank's letter. Findings that do not fit wait for the next meeting (and
#: the epoch end meets until no rank has any left), so none is lost.
MAIL_BYTES = 4096

_LENGTH = 8  # the letter's length, an int64, ends the statistics


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
