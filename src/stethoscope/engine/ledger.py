"""The ledger of a run: every finding counted in its epoch, sent to the sinks, summed up."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stethoscope.detectors.base import Detector
from stethoscope.engine.sampler import Intervals
from stethoscope.findings import RECOVERY, SAMPLER, Finding, Severity
from stethoscope.observation import Observation
from stethoscope.sinks.base import Sink
from stethoscope.summary import EpochSummary, SummaryRow, epoch_extent

__all__ = ["Ledger"]

#: Whose findings are all sent, repeats too: each says what was done at that step.
_ACTS = frozenset({SAMPLER, RECOVERY})

_STATUS = {Severity.INFO: "info", Severity.WARNING: "warning", Severity.ERROR: "error"}


class Ledger:
    """Where judged findings go: each is counted in its epoch, and sent to the sinks unless
    an identical one went out recently; at each epoch's end the counts become the
    summary. A sink that raises is warned about once and never costs the run.

    Args:
        sinks: Where findings go.
        repeat_after: Steps before an identical finding (same detector, where and
            severity) is sent to the sinks again; repeats are still counted.
    """

    def __init__(self, sinks: Sequence[Sink], *, repeat_after: int) -> None:
        self.sinks: list[Sink] = list(sinks)
        #: The sinks that see every observation (those that override ``Sink.observe``).
        self.observers: list[Sink] = [s for s in self.sinks if type(s).observe is not Sink.observe]
        self.repeat_after = repeat_after
        #: Whether this process writes to the sinks (off rank zero it does not).
        self.writes = True
        #: When each kind of finding last went to the sinks (checkpointed).
        self.last_sent: dict[str, int] = {}
        self._sink_failed: set[int] = set()
        # the last line on the quiet detectors: their names, schedule, and the line
        self._kept_quiet: tuple[list[str], Intervals | None, SummaryRow] | None = None
        # see _quiet_epoch: the detectors, those silent, their rows and the others' names
        self._quiet_rows: tuple[Sequence[Detector], tuple, list[SummaryRow], list[str]] | None = (
            None
        )
        self.new_epoch(escalations=0)

    # -- findings ------------------------------------------------------------------------
    def enter(self, f: Finding, *, hold: list[Finding] | None = None) -> None:
        """Count ``f`` in the epoch; send it to the sinks unless it repeats a recent one.

        Args:
            hold: Off rank zero, where to keep it for the ranks' next meeting instead (a
                finding from this rank's own data, which rank zero has not seen).
        """
        stats = self._epoch.setdefault(f.detector, {"count": 0, "worst": f, "by_severity": {}})
        stats["count"] += 1
        stats["by_severity"][f.severity.value] = stats["by_severity"].get(f.severity.value, 0) + 1
        if f.severity > stats["worst"].severity:
            stats["worst"] = f
        if f.detector in _ACTS:  # what was done, by kind (the recovery ladder's rungs)
            acts = stats.setdefault("acts", {})
            acts[f.where] = acts.get(f.where, 0) + 1
        key = f"{f.detector}|{f.where}|{f.severity.value}"
        if f.rank:
            key += f"|{f.rank}"  # the same problem on another rank is news of its own
        last = self.last_sent.get(key)
        if last is not None and 0 <= f.step - last < self.repeat_after and f.detector not in _ACTS:
            return  # an identical finding went out recently: count it, do not flood the sinks
        self.last_sent[key] = f.step
        if hold is not None and not self.writes:
            hold.append(f)
        else:
            self.call_sinks("emit", f)

    def saw_step(self, step: int, *, grads: bool, loss: bool = True) -> None:
        """Count ``step`` in the epoch (``grads``: its gradients were judged; ``loss``: its
        loss was)."""
        self._steps.add(step)
        if grads:
            self._grad_steps.add(step)
        if loss:
            self._loss_steps.add(step)

    def saw_steps(self, steps: list[int]) -> None:
        """Count quiet ``steps`` in the epoch: their losses were judged, nothing else."""
        self._steps.update(steps)
        self._loss_steps.update(steps)

    def call_sinks(self, method: str, *args: Any) -> None:
        """Call ``method`` on every sink (on rank zero), each call isolated."""
        self._call(self.sinks, method, *args)

    def observe(self, obs: Observation, interval: int) -> None:
        """Hand ``obs`` to the sinks that observe (on rank zero), each call isolated."""
        self._call(self.observers, "observe", obs, interval)

    def _call(self, sinks: Sequence[Sink], method: str, *args: Any) -> None:
        if not self.writes:
            return
        for sink in sinks:
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # a sink must never cost the training run
                if id(sink) not in self._sink_failed:
                    self._sink_failed.add(id(sink))
                    warnings.warn(
                        f"stethoscope: {type(sink).__name__}.{method}() failed with {exc!r}; "
                        "training goes on and the other sinks still receive findings",
                        RuntimeWarning,
                        stacklevel=4,
                    )

    # -- epochs ------------------------------------------------------------------------------
    def new_epoch(self, *, escalations: int) -> None:
        """Start counting a new epoch (``escalations``: the sampler's count so far)."""
        self._epoch: dict[str, dict[str, Any]] = {}
        self._steps: set[int] = set()
        self._grad_steps: set[int] = set()
        self._loss_steps: set[int] = set()
        self._escalations = escalations

    def escalations_from(self, escalations: int) -> None:
        """Count this epoch's escalations from the sampler's count ``escalations``."""
        self._escalations = escalations

    def summary(
        self,
        epoch: int,
        *,
        detectors: Sequence[Detector],
        interval: Callable[[str], int],
        escalations: int,
        hot: bool,
        stopped_by: Finding | None,
        budget: str = "",
        blind: Mapping[str, str] | None = None,
    ) -> EpochSummary:
        """The summary of the epoch so far, as plain data.

        Args:
            detectors: The detectors that take part in this run, in order.
            interval: Each detector's current sampling interval, by name.
            escalations: The sampler's escalations so far in the run.
            hot: Whether the sampler still samples every step.
            stopped_by: The finding that stopped the run, if any.
            budget: What the overhead budget bought, a clause for a healthy verdict
                (``"; every 64 steps ..."``), or empty.
            blind: Detectors silent for want of what they need, with what the run
                lacks (see ``Detector.blind_to``): a row each instead of "nothing found".
        """
        rows: list[SummaryRow] = []
        quiet: list[str] = []
        blind = blind or {}
        if not self._epoch:  # a quiet epoch: no detector found anything
            blind_rows, quiet = self._quiet_epoch(detectors, blind)
            rows.extend(blind_rows)
            detectors = ()
        for d in detectors:
            stats = self._epoch.get(d.name)
            if stats is None and d.name in blind:
                verdict = f"silent: {blind[d.name]}"
                rows.append(SummaryRow(detector=d.name, status="info", verdict=verdict))
                continue
            if stats is None:
                quiet.append(d.name)
                continue
            rows.append(self._row(d, stats, interval(d.name), stopped_by))
        order = ("error", "warning", "info", "ok")
        rows.sort(key=lambda r: order.index(r.status))
        if SAMPLER in self._epoch:
            escalated = escalations - self._escalations
            rows.append(
                SummaryRow(
                    detector=SAMPLER,
                    status="info",
                    count=self._epoch[SAMPLER]["count"],
                    verdict=(f"escalated {escalated}x this epoch; " if escalated else "")
                    + ("still sampling hot" if hot else "back at base intervals"),
                )
            )
        if RECOVERY in self._epoch:
            rows.append(_recovery_row(self._epoch[RECOVERY]))
        if quiet:
            rows.append(self._quiet_row(quiet, interval))
        return EpochSummary(
            epoch=epoch,
            steps=len(self._steps),
            rows=tuple(rows),
            verdict=self._verdict(stopped_by, budget),
            quiet=tuple(quiet),
            stopped_by=stopped_by.to_dict(json_safe=True) if stopped_by else None,
            dropped=self._dropped(),
            first_step=min(self._steps, default=None),
            last_step=max(self._steps, default=None),
        )

    def _quiet_epoch(
        self, detectors: Sequence[Detector], blind: Mapping[str, str]
    ) -> tuple[list[SummaryRow], list[str]]:
        """Where no detector found anything: a row for each one silent for want of what it
        needs, and the names of the others. The same from one epoch to the next while the
        detectors and those silent are (a full-batch run ends an epoch every step), so
        kept and given again."""
        key = tuple(blind.items())
        kept = self._quiet_rows
        if kept is None or kept[0] is not detectors or kept[1] != key:
            rows = [
                SummaryRow(detector=d.name, status="info", verdict=f"silent: {blind[d.name]}")
                for d in detectors
                if d.name in blind
            ]
            kept = detectors, key, rows, [d.name for d in detectors if d.name not in blind]
            self._quiet_rows = kept
        return kept[2], kept[3]

    def _quiet_row(self, quiet: list[str], interval: Callable[[str], int]) -> SummaryRow:
        """The line on the detectors that found nothing this epoch. It is the same from one
        epoch to the next while they and their schedule are (a full-batch run ends an
        epoch every step), so it is kept and given again."""
        kept = self._kept_quiet
        schedule = interval if isinstance(interval, Intervals) else None
        if (
            kept is not None
            and schedule is not None
            and schedule.same(kept[1])
            and kept[0] == quiet
        ):
            return kept[2]
        intervals = sorted({interval(n) for n in quiet})
        every = str(intervals[0]) if len(intervals) == 1 else f"{intervals[0]}-{intervals[-1]}"
        row = SummaryRow(
            detector=f"{len(quiet)} others",
            status="ok",
            where=None,
            verdict=f"nothing found (every {every} steps)",
        )
        self._kept_quiet = (quiet, schedule, row)
        return row

    def _dropped(self) -> dict[str, int]:
        """Findings each sink gave up on so far, by sink name (see ``Sink.dropped``)."""
        if not self.writes:
            return {}
        names = [type(s).__name__ for s in self.sinks]
        out: dict[str, int] = {}
        for i, (name, sink) in enumerate(zip(names, self.sinks, strict=True)):
            try:
                n = sink.dropped
            except Exception:  # a sink's property must not cost the summary either
                continue
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                out[name if names.count(name) == 1 else f"{name}[{i}]"] = n
        return out

    @staticmethod
    def _row(
        detector: Detector, stats: dict[str, Any], interval: int, stopped_by: Finding | None
    ) -> SummaryRow:
        worst: Finding = stats["worst"]
        verdict = detector.advice_for(worst)
        if stopped_by is not None and stopped_by.detector == detector.name:
            verdict = f"stopped training at step {stopped_by.step}; {verdict}"
        return SummaryRow(
            detector=detector.name,
            status=_STATUS[worst.severity],
            count=stats["count"],
            value=worst.value,
            threshold=worst.threshold,
            where=worst.where,
            interval=interval,
            verdict=verdict,
        )

    def _verdict(self, stopped_by: Finding | None, budget: str = "") -> str:
        seen = self._steps
        extent = epoch_extent(len(seen), min(seen, default=None), max(seen, default=None))
        if stopped_by is not None:
            f = stopped_by
            where = f" in {f.where}" if f.where else ""
            return f"Stopped at step {f.step} by {f.detector} ({f.severity}){where}."
        counts = {s: 0 for s in Severity}
        for name, stats in self._epoch.items():
            if name != SAMPLER:
                for sev, n in stats["by_severity"].items():
                    counts[Severity(sev)] += n
        if counts[Severity.ERROR] or counts[Severity.WARNING]:
            judged = [s for n, s in self._epoch.items() if n not in _ACTS]
            stats = max(judged or [self._epoch[RECOVERY]], key=lambda s: s["worst"].severity.rank)
            worst = stats["worst"]
            verdict = (
                f"{counts[Severity.ERROR]} error(s), {counts[Severity.WARNING]} warning(s) in "
                f"{extent}; worst: {worst.detector} at step {worst.step}"
            )
            if RECOVERY in self._epoch:  # and training went on: say how
                verdict += f"; recovered: {_recovery_row(self._epoch[RECOVERY]).verdict}"
            return verdict
        return (
            f"Healthy: no warnings in {extent} "
            f"({self._loss_checked()}, gradients on {_steps(len(self._grad_steps))}{budget})"
        )

    def _loss_checked(self) -> str:
        """How often the epoch's loss was judged, in words (a custom train step that never
        computes it through the framework gives the loss detectors nothing)."""
        n = len(self._loss_steps)
        if n == len(self._steps):
            return "loss checked every step"
        if n == 0:
            return "no loss seen, so the loss was not checked"
        return f"loss checked on {_steps(n)}"

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"last_sent": dict(self.last_sent)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_sent = dict(state.get("last_sent", {}))


#: How the epoch summary words each act of the recovery ladder, by count.
_ACT_WORDS = {
    "skip": ("skipped {n} step", "skipped {n} steps"),
    "cool": ("cooled the LR once", "cooled the LR {n}x"),
    "restore_lr": ("restored the LR", "restored the LR {n}x"),
    "rollback": ("rolled back once", "rolled back {n}x"),
    "replay": ("met a transient fault", "met {n} transient faults"),
    "stop": ("then stopped", "then stopped"),
}


def _recovery_row(stats: dict[str, Any]) -> SummaryRow:
    """The ladder's row: what it did this epoch, by act."""
    acts = stats.get("acts", {})
    words = [
        (one if acts[act] == 1 else many).format(n=acts[act])
        for act, (one, many) in _ACT_WORDS.items()
        if acts.get(act)
    ]
    return SummaryRow(
        detector=RECOVERY,
        status=_STATUS[stats["worst"].severity],
        count=stats["count"],
        verdict=", ".join(words),
    )


def _steps(n: int) -> str:
    """``n`` steps, in words: "1 step", "4 steps"."""
    return f"{n} step" if n == 1 else f"{n} steps"
