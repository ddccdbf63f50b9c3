"""What a rank of a distributed run holds back until the ranks next meet: the engine's
outbox, which the rank meeting (:mod:`stethoscope.distributed`) empties."""

from __future__ import annotations

from dataclasses import dataclass, field

from stethoscope.engine.policy import Decision
from stethoscope.findings import Finding

__all__ = ["Held"]


@dataclass
class Held:
    """What a rank of a distributed run holds until the ranks next meet.

    The rank's :class:`~stethoscope.engine.monitor.Monitor` fills it as it judges; the
    :class:`~stethoscope.distributed.RankMeeting` empties it into the rank's packet.

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
