"""Runs scenarios for seeds with one framework's implementation, and reports progress."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

from benchmarks.faults.metrics import judge
from benchmarks.faults.results import RunResult
from benchmarks.faults.scenarios import Scenario

__all__ = ["FRAMEWORKS", "ONE_FIT_PER_SETTING", "progress", "run_all", "suite"]

FRAMEWORKS = ("lightning", "keras")

#: Frameworks whose callback can watch a fit only once: their ``run_scenario`` trains one
#: fit per setting itself and checks that the fits were identical.
ONE_FIT_PER_SETTING = frozenset({"keras"})


def suite(framework: str) -> ModuleType:
    """The implementation module of ``framework`` (imported on demand: its framework with it).

    It provides ``run_scenario``, ``quiet()``, ``configure(threads)``, ``environment()``
    and ``SPIKE_DETECTION`` (a note printed under the baselines' table, or None).
    """
    if framework == "lightning":
        from benchmarks.faults import lightning_suite

        return lightning_suite
    if framework == "keras":
        from benchmarks.faults import keras_suite

        return keras_suite
    raise ValueError(f"framework={framework!r}; use one of {FRAMEWORKS!r}")


def _runner(framework: str) -> Callable[..., RunResult]:
    return suite(framework).run_scenario


def run_all(
    scenarios: Sequence[Scenario],
    seeds: Sequence[int],
    settings: Sequence[str] = ("adaptive",),
    *,
    baselines: bool = True,
    separate: bool = False,
    framework: str = "lightning",
    log: Callable[[str], None] | None = None,
) -> list[RunResult]:
    """Every scenario for every seed, one fit each (one fit per setting with ``separate``).

    All settings and baselines watch the same fit unless ``separate``: then each
    setting gets its own fit (the baselines ride in the first), and the results are
    merged; the findings must come out the same, which is what it is for. Frameworks
    in :data:`ONE_FIT_PER_SETTING` always train one fit per setting, in their own
    ``run_scenario``.
    """
    run_scenario = _runner(framework)
    separate = separate and framework not in ONE_FIT_PER_SETTING
    runs: list[RunResult] = []
    for sc in scenarios:
        if framework not in sc.frameworks:
            continue  # the fault cannot be made there
        for seed in seeds:
            if separate:
                parts = [
                    run_scenario(sc, seed, settings=(s,), baselines=baselines and i == 0)
                    for i, s in enumerate(settings)
                ]
                r = parts[0]
                for p in parts[1:]:
                    r.findings.update(p.findings)
                    r.probe_counts.update(p.probe_counts)
                    r.wall_s += p.wall_s
                    r.error = r.error or p.error
                    r.notes += p.notes
            else:
                r = run_scenario(sc, seed, settings=settings, baselines=baselines)
            runs.append(r)
            if log is not None:
                log(progress(sc, r))
    return runs


def progress(sc: Scenario, r: RunResult) -> str:
    """One line on one run: per setting, detected (+latency) or missed, or the false alarms."""
    parts = []
    for setting in r.findings:
        v = judge(sc, r, setting)
        if sc.healthy:
            parts.append(f"{setting}: " + (", ".join(v.false_alarms) or "quiet"))
        else:
            got = "detected" if v.detected else "missed"
            lat = f" +{v.latency}" if v.latency is not None else ""
            mis = f", misdiagnosed {','.join(v.misdiagnoses)}" if v.misdiagnoses else ""
            parts.append(f"{setting}: {got}{lat}{mis}")
    err = f" ERROR {r.error}" if r.error else ""
    return f"{sc.name} seed {r.seed}: {r.steps} steps in {r.wall_s:.1f}s; {'; '.join(parts)}{err}"
