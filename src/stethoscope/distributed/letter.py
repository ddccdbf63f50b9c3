"""What one rank tells the others at a meeting besides its numbers: the findings it
raised, and the reasons behind its decisions, as JSON of a bounded size."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stethoscope.findings import Finding

__all__ = ["Letter"]


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
