"""What a detector reports: plain data, no framework."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

__all__ = ["FIELDS", "RECOVERY", "SAMPLER", "Finding", "Severity", "TrainingProblem"]

#: The ``detector`` field of the info findings the sampler reports (it is no detector).
SAMPLER = "sampler"
#: The ``detector`` field of the findings the recovery ladder reports.
RECOVERY = "recovery"


def _comparable(other: object) -> Severity | None:
    """``other`` as a Severity to order against, or None: a severity's name compares as
    the severity (``finding.severity >= "warning"``), not as the string it also is, by
    which "error" sorts below "warning"."""
    if isinstance(other, Severity):
        return other
    if isinstance(other, str):
        try:
            return Severity(other)
        except ValueError:
            return None
    return None


class Severity(str, Enum):
    """How bad a finding is. Ordered: ``INFO < WARNING < ERROR``."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def __lt__(self, other: object) -> bool:
        other = _comparable(other)
        if other is None:
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        other = _comparable(other)
        if other is None:
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        other = _comparable(other)
        if other is None:
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        other = _comparable(other)
        if other is None:
            return NotImplemented
        return self.rank >= other.rank

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Severity | str, *, argument: str = "severity") -> Severity:
        """Return ``value`` as a Severity, or raise naming the valid choices."""
        if isinstance(value, Severity):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(s.value) for s in cls)
            raise ValueError(
                f"{argument}={value!r} is not a severity; use one of {choices}"
            ) from None


_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


@dataclass(frozen=True)
class Finding:
    """One observation a detector judged worth reporting.

    The field names are a stable schema: the JSONL and CSV sinks use them as keys
    and columns.

    Args:
        step: Global optimizer step at which it was observed (0-based).
        epoch: Training epoch (0-based).
        detector: Stable snake_case detector name, e.g. ``"nonfinite_loss"``.
        severity: ``info``, ``warning`` or ``error``.
        message: One sentence a user can act on: what, where, how bad, the likely
            cause and the usual fix.
        value: The measured quantity, if any.
        threshold: The bound it crossed, if any.
        where: Layer or parameter name, ``"loss"``, ``"input"`` … if it applies.
        rank: Process rank (0 when not distributed); under Keras' ``MirroredStrategy``
            (one process), the replica whose shard of the batch it came from.
    """

    step: int
    epoch: int
    detector: str
    severity: Severity
    message: str
    value: float | None = None
    threshold: float | None = None
    where: str | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "severity", Severity.parse(self.severity))
        for name in ("step", "epoch", "rank"):  # numpy integers from adapters break json
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("value", "threshold"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, float(v))

    def to_dict(self, *, json_safe: bool = False) -> dict[str, Any]:
        """The finding as a dict keyed by :data:`FIELDS`.

        Args:
            json_safe: Replace non-finite ``value``/``threshold`` with ``None`` so
                the result is strict JSON (the message still says NaN or Inf).
        """
        d = asdict(self)
        d["severity"] = self.severity.value
        if json_safe:
            for name in ("value", "threshold"):
                v = d[name]
                if v is not None and not math.isfinite(v):
                    d[name] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        return cls(**{k: d[k] for k in FIELDS if k in d})


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Finding))


class TrainingProblem(RuntimeError):
    """Raised by a callback when a finding matches ``raise_on``.

    Attributes:
        finding: The finding that triggered it.
    """

    def __init__(self, finding: Finding) -> None:
        super().__init__(
            f"{finding.detector} ({finding.severity}) at step {finding.step}: {finding.message}"
        )
        self.finding = finding

    def __reduce__(self):  # keep picklable across processes
        return (type(self), (self.finding,))
