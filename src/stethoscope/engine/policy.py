"""What to do about findings: a pure function of the findings and the policy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stethoscope.findings import Finding, Severity

__all__ = ["NOTHING", "Decision", "Policy", "StopOn", "decide", "first_to_act", "parse_policy"]

#: ``None`` (never), ``"error"``, ``"warning"``, or a set of detector names.
StopOn = str | Iterable[str] | None

_LEVELS = ("error", "warning")
_CHOICES = "use None, 'error', 'warning', or a set of detector names"


@dataclass(frozen=True)
class Policy:
    """A parsed ``stop_on`` / ``raise_on`` value: a minimum severity or a set of names."""

    min_severity: Severity | None = None
    detectors: frozenset[str] = frozenset()

    def matches(self, finding: Finding) -> bool:
        if finding.detector in self.detectors:
            return finding.severity >= Severity.WARNING
        return self.min_severity is not None and finding.severity >= self.min_severity


@dataclass(frozen=True)
class Decision:
    """The outcome for one step: continue, stop gracefully, or raise; and, when a
    recovery ladder answers some detectors, their warnings and errors (``spared``), which
    stop nothing here."""

    stop: bool = False
    raise_: bool = False
    reason: Finding | None = None
    spared: tuple[Finding, ...] = ()


#: What a healthy step decides.
NOTHING = Decision()


def parse_policy(value: StopOn, *, argument: str, known: Iterable[str]) -> Policy:
    """Validate a ``stop_on``/``raise_on`` value.

    Raises:
        ValueError: naming the bad value and the valid choices.
    """
    if value is None:
        return Policy()
    if isinstance(value, str):
        if value not in _LEVELS:
            raise ValueError(f"{argument}={value!r} is not valid; {_CHOICES}")
        return Policy(min_severity=Severity(value))
    if not isinstance(value, Iterable):
        raise ValueError(f"{argument}={value!r} is not valid; {_CHOICES}")
    names = frozenset(value)
    known = set(known)
    unknown = sorted(repr(n) for n in names if not isinstance(n, str) or n not in known)
    if unknown:
        raise ValueError(
            f"{argument} names unknown detectors [{', '.join(unknown)}]; "
            f"known: {', '.join(sorted(known))}"
        )
    return Policy(detectors=names)


def decide(
    findings: Sequence[Finding],
    stop_on: Policy,
    raise_on: Policy,
    spare: frozenset[str] = frozenset(),
) -> Decision:
    """Stop or raise on the first finding that matches; ``raise_on`` wins over ``stop_on``.

    Findings of the detectors in ``spare`` (those a recovery ladder answers) never stop or
    raise: their warnings and errors come back in ``Decision.spared``.
    """
    spared = tuple(f for f in findings if f.detector in spare and f.severity >= Severity.WARNING)
    if spared:
        findings = [f for f in findings if f.detector not in spare]
    for finding in findings:
        if raise_on.matches(finding):
            return Decision(stop=True, raise_=True, reason=finding, spared=spared)
    for finding in findings:
        if stop_on.matches(finding):
            return Decision(stop=True, reason=finding, spared=spared)
    return Decision(spared=spared) if spared else Decision()


def first_to_act(earlier: Decision, later: Decision) -> Decision:
    """Of two steps' decisions, the one to act on: a raise before a stop, else the
    earlier stop."""
    if later.raise_ and not earlier.raise_:
        return later
    return earlier if earlier.stop else later
