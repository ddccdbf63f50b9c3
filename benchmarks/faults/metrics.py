"""Scoring: from the findings of runs to recall, false alarms, misdiagnoses and latency.

Definitions (the same for every framework and sampling setting):

* An **alarm** is a finding of severity ``warning`` or ``error``; ``info`` findings
  (the sampler's own notices, hints) never count, for or against.
* **Detected** (a fault run): an alarm from one of the scenario's ``expect``
  detectors at a step in ``[onset, onset + window]``. **Recall** is the fraction of
  a group's fault runs that are detected. A run that crashed is not detected.
* **Latency** (a fault run): the step of the first alarm from an ``expect``
  detector at or after the onset, minus the onset. It is counted for every run in
  which that alarm came at all, inside the window or after it (``late``), so that a
  slow detector shows its real latency instead of none. Medians are over those runs.
* **Misdiagnosed** (a fault run): at least one alarm, at any step, from a detector
  outside ``expect`` and ``collateral``. Runs with ``stop_on=None`` go on after the
  first error, so this counts every collateral a longer run would show: a worst case.
* **Early** (a fault run with onset > 0): an alarm, from any detector, before the
  onset, while the run was still healthy.
* **False alarm** (a healthy control): any alarm at all.
* **First alarm** (a fault run): the detector of the first alarm at or after the onset
  and its step relative to the onset: what a user with ``stop_on="warning"`` would
  read first.

Baselines stop training rather than name a cause, so for them a "finding" is the
first step at which they stop (or would stop) training: detected when it lies in
the window, early when it comes before the onset (the run would have ended before
the fault), a false alarm on a healthy control. They have no misdiagnoses.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.faults.results import RunResult
from benchmarks.faults.scenarios import FAMILIES, TARGET_RECALL, Scenario

__all__ = ["Summary", "Verdict", "judge", "judge_baseline", "summarize"]

ALARM = frozenset({"warning", "error"})


@dataclass(frozen=True)
class Verdict:
    """How one watcher (a setting or a baseline) did on one run."""

    scenario: str
    seed: int
    watcher: str
    healthy: bool
    onset: int | None = None
    detected: bool = False
    latency: int | None = None
    misdiagnoses: tuple[str, ...] = ()
    early: tuple[str, ...] = ()
    false_alarms: tuple[str, ...] = ()
    first_alarm: str | None = None
    first_alarm_at: int | None = None  # its step, relative to the onset
    error: str | None = None


def _alarms(findings: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((f for f in findings if f["severity"] in ALARM), key=lambda f: f["step"])


def judge(sc: Scenario, run: RunResult, setting: str) -> Verdict:
    """The verdict on the stethoscope findings of ``setting`` in ``run``."""
    alarms = _alarms(run.findings.get(setting, []))
    first, first_at = None, None
    if alarms:  # the first alarm from the onset on (the first of all for a control)
        later = [f for f in alarms if run.onset is None or f["step"] >= run.onset] or alarms
        first, first_at = later[0]["detector"], later[0]["step"] - (run.onset or 0)
    base = dict(
        scenario=sc.name,
        seed=run.seed,
        watcher=setting,
        healthy=sc.healthy,
        onset=run.onset,
        first_alarm=first,
        first_alarm_at=first_at,
        error=run.error,
    )
    if sc.healthy:
        return Verdict(**base, false_alarms=tuple(sorted({f["detector"] for f in alarms})))
    onset = run.onset
    mis = tuple(sorted({f["detector"] for f in alarms if f["detector"] not in sc.accepted}))
    if onset is None:  # e.g. no validation epoch ran: the onset is unknown, nothing matches
        return Verdict(**base, misdiagnoses=mis)
    early = tuple(sorted({f["detector"] for f in alarms if f["step"] < onset}))
    hits = [f["step"] for f in alarms if f["detector"] in sc.expect and f["step"] >= onset]
    latency = hits[0] - onset if hits else None
    detected = latency is not None and latency <= sc.window and run.error is None
    return Verdict(**base, detected=detected, latency=latency, misdiagnoses=mis, early=early)


def judge_baseline(sc: Scenario, run: RunResult, name: str) -> Verdict | None:
    """The verdict on baseline ``name`` in ``run``; None if it did not run."""
    if name not in run.baselines:
        return None
    stop = run.baselines[name]
    base = dict(scenario=sc.name, seed=run.seed, watcher=name, healthy=sc.healthy, onset=run.onset)
    label = f"{stop['reason']}@{stop['step']}" if stop else None
    if sc.healthy:
        return Verdict(**base, false_alarms=(stop["reason"],) if stop else (), first_alarm=label)
    if stop is None or run.onset is None:
        return Verdict(**base)
    if stop["step"] < run.onset:
        return Verdict(**base, early=(stop["reason"],), first_alarm=label)
    latency = stop["step"] - run.onset
    return Verdict(
        **base,
        detected=latency <= sc.window and run.error is None,
        latency=latency,
        first_alarm=label,
    )


@dataclass
class Summary:
    """Counts and medians over a group of verdicts."""

    runs: int = 0
    detected: int = 0
    latencies: list[int] = field(default_factory=list)
    late: int = 0
    misdiagnosed: int = 0
    misdiagnoses: dict[str, int] = field(default_factory=dict)
    early: int = 0
    early_detectors: dict[str, int] = field(default_factory=dict)
    healthy_runs: int = 0
    false_alarm_runs: int = 0
    false_alarms: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    first_alarms: dict[str, list[int]] = field(default_factory=dict)

    @property
    def recall(self) -> float | None:
        return self.detected / self.runs if self.runs else None

    @property
    def median_latency(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def add(self, v: Verdict, window: int | None = None) -> None:
        self.errors += v.error is not None
        if v.healthy:
            self.healthy_runs += 1
            self.false_alarm_runs += bool(v.false_alarms)
            for d in v.false_alarms:
                self.false_alarms[d] = self.false_alarms.get(d, 0) + 1
            return
        self.runs += 1
        self.detected += v.detected
        if v.first_alarm is not None and v.first_alarm_at is not None:
            self.first_alarms.setdefault(v.first_alarm, []).append(v.first_alarm_at)
        if v.latency is not None:
            self.latencies.append(v.latency)
            self.late += window is not None and v.latency > window
        self.misdiagnosed += bool(v.misdiagnoses)
        for d in v.misdiagnoses:
            self.misdiagnoses[d] = self.misdiagnoses.get(d, 0) + 1
        self.early += bool(v.early)
        for d in v.early:
            self.early_detectors[d] = self.early_detectors.get(d, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "detected": self.detected,
            "recall": self.recall,
            "median_latency": self.median_latency,
            "latencies": self.latencies,
            "late": self.late,
            "misdiagnosed_runs": self.misdiagnosed,
            "misdiagnoses": self.misdiagnoses,
            "early_runs": self.early,
            "early_detectors": self.early_detectors,
            "healthy_runs": self.healthy_runs,
            "false_alarm_runs": self.false_alarm_runs,
            "false_alarms": self.false_alarms,
            "errors": self.errors,
            "first_alarms": self.first_alarms,
        }


def summarize(
    scenarios: Sequence[Scenario], verdicts: Sequence[Verdict], key: str
) -> dict[str, Summary]:
    """Group ``verdicts`` by ``key``: ``scenario``, ``detector``, ``family`` or ``all``."""
    by_name = {s.name: s for s in scenarios}
    groups: dict[str, Summary] = {}
    for v in verdicts:
        sc = by_name[v.scenario]
        if key == "scenario":
            k = sc.name
        elif key == "detector":
            k = "healthy controls" if sc.healthy else sc.expect_label
        elif key == "family":
            k = sc.family
        elif key == "all":
            k = "all"
        else:
            raise ValueError(f"key={key!r}; use 'scenario', 'detector', 'family' or 'all'")
        groups.setdefault(k, Summary()).add(v, None if sc.healthy else sc.window)
    return groups


def meets_target(sc: Scenario, s: Summary) -> bool | None:
    """Whether a scenario's summary meets issue 3's targets (None for a control)."""
    if sc.healthy:
        return s.false_alarm_runs == 0
    med = s.median_latency
    return (
        s.recall is not None
        and s.recall >= TARGET_RECALL
        and med is not None
        and sc.target_latency is not None
        and med <= sc.target_latency
    )


FAMILY_ORDER = (*FAMILIES, "healthy")
