"""The suite's tables, built once as rows of strings, rendered with rich or as markdown."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.faults.metrics import (
    FAMILY_ORDER,
    Summary,
    Verdict,
    judge,
    judge_baseline,
    meets_target,
    summarize,
)
from benchmarks.faults.results import BASELINES, RunResult
from benchmarks.faults.scenarios import (
    FAMILIES,
    SETTINGS,
    TARGET_LATENCY,
    TARGET_RECALL,
    Scenario,
)

__all__ = ["Table", "build_comparison", "build_tables", "render_markdown", "render_rich"]

BASELINE_TITLES = {
    "early_stopping": "EarlyStopping",
    "spike_detection": "SpikeDetection",
    "terminate_on_nan": "TerminateOnNaN",
    "nan_check": "NaN check",
}


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    right: set[int] = field(default_factory=set)  # right-aligned column indices


def model_label(sc: Scenario) -> str:
    m = sc.model
    if m.arch == "mlp":
        extra = "+BN" if m.batchnorm else ""
        return f"MLP {m.depth}x{m.width} {m.activation}{extra}"
    if m.arch == "cnn":
        parts = [name for name, on in (("BN", m.batchnorm), ("dropout", m.dropout)) if on]
        return " ".join(["CNN", "+".join(parts)]) if parts else "CNN"
    if m.arch == "gan":
        return f"GAN {m.width}"
    return f"GRU {m.width}"


def _frac(k: int, n: int) -> str:
    return f"{k}/{n}" if n else "—"


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _lat(s: Summary) -> str:
    text = _num(s.median_latency)
    if s.latencies and len(s.latencies) > 1 and min(s.latencies) != max(s.latencies):
        text += f" [{min(s.latencies)}–{max(s.latencies)}]"
    if s.late:
        text += f" ({s.late} late)"
    return text


def _firsts(d: dict[str, list[int]]) -> str:
    """``detector +median offset ×runs``, most frequent first."""
    parts = []
    for det, offs in sorted(d.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        med = statistics.median(offs)
        text = f"{det} {'+' if med >= 0 else ''}{_num(med)}"
        parts.append(text + (f" ×{len(offs)}" if len(offs) > 1 else ""))
    return ", ".join(parts) or "—"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(d.items())) or "—"


def _cell(s: Summary | None) -> str:
    """recall · median latency, with early stops: a compact baseline cell."""
    if s is None:
        return "n/a"
    text = f"{_frac(s.detected, s.runs)} · {_num(s.median_latency)}"
    if s.early:
        text += f" (early {s.early})"
    return text


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def verdicts_for(
    scenarios: Sequence[Scenario], runs: Sequence[RunResult], watcher: str, baseline: bool
) -> list[Verdict]:
    by_name = {s.name: s for s in scenarios}
    out = []
    for r in runs:
        sc = by_name[r.scenario]
        v = judge_baseline(sc, r, watcher) if baseline else judge(sc, r, watcher)
        if v is not None:
            out.append(v)
    return out


def build_tables(
    scenarios: Sequence[Scenario],
    runs: Sequence[RunResult],
    settings: Sequence[str],
    *,
    available: set[str],
    overhead: Sequence[dict[str, Any]] = (),
    spike_note: str | None = None,
    baselines: Mapping[str, str] = BASELINES,
) -> tuple[list[Table], dict[str, Any]]:
    """Every table of the report, and the numbers behind them for the JSON output.

    ``baselines`` describes the baselines the runs' framework ran (their report order).
    """
    main = "adaptive" if "adaptive" in settings else settings[0]
    trained = {r.scenario for r in runs}  # a framework that cannot make a fault skips it
    scenarios = [s for s in scenarios if s.name in trained]
    faults = [s for s in scenarios if not s.healthy]
    controls = [s for s in scenarios if s.healthy]
    ours = verdicts_for(scenarios, runs, main, baseline=False)
    per_sc = summarize(scenarios, ours, "scenario")
    base_names = [b for b in baselines if any(b in r.baselines for r in runs)]
    base_v = {b: verdicts_for(scenarios, runs, b, baseline=True) for b in base_names}
    base_sc = {b: summarize(scenarios, v, "scenario") for b, v in base_v.items()}
    seeds = sorted({r.seed for r in runs})
    tables: list[Table] = []
    numbers: dict[str, Any] = {"main_setting": main}

    # -- per fault scenario ----------------------------------------------------------------
    t = Table(
        f"Fault scenarios: stethoscope, {main} setting ({len(seeds)} seed(s) each)",
        [
            "scenario",
            "model",
            "expected detector",
            "onset + window",
            "recall",
            "latency: median [range]",
            "first alarm",
            "misdiagnosed runs: detectors",
            "alarms before onset",
            "target",
        ],
        right={4},
    )
    for sc in faults:
        s = per_sc.get(sc.name, Summary())
        missing = [d for d in sc.expect if d not in available]
        exp = sc.expect_label + (
            " (not available)" if missing and len(missing) == len(sc.expect) else ""
        )
        ok = meets_target(sc, s)
        onset = "best val" if sc.onset == "best_val" else str(sc.onset)
        t.rows.append(
            [
                sc.name,
                model_label(sc),
                exp,
                f"{onset} + {sc.window}",
                _frac(s.detected, s.runs),
                _lat(s),
                _firsts(s.first_alarms),
                f"{s.misdiagnosed}: {_counts(s.misdiagnoses)}" if s.misdiagnosed else "0",
                f"{s.early}: {_counts(s.early_detectors)}" if s.early else "0",
                "✓" if ok else "✗",
            ]
        )
    t.notes.append(
        f"Targets (issue 3): recall >= {TARGET_RECALL:.0%} and median latency <= "
        + ", ".join(f"{v} ({k})" for k, v in TARGET_LATENCY.items())
        + " steps. Latency counts runs detected after the window too (late)."
    )
    tables.append(t)

    # -- per detector and overall ------------------------------------------------------------
    per_det = summarize(scenarios, ours, "detector")
    overall = summarize(scenarios, ours, "all").get("all", Summary())
    t = Table(
        f"Per expected detector and overall ({main})",
        [
            "expected detector",
            "available",
            "scenarios",
            "recall",
            "median latency",
            "misdiagnosed runs",
        ],
        right={2, 3, 4, 5},
    )
    labels: list[str] = []
    for sc in faults:
        if sc.expect_label not in labels:
            labels.append(sc.expect_label)
    for label in labels:
        s = per_det[label]
        names = label.split(" | ")
        avail = (
            "yes"
            if all(n in available for n in names)
            else ("partly" if any(n in available for n in names) else "no")
        )
        n_sc = sum(1 for sc in faults if sc.expect_label == label)
        t.rows.append(
            [
                label,
                avail,
                str(n_sc),
                f"{_frac(s.detected, s.runs)} ({_pct(s.recall)})",
                _lat(s),
                _frac(s.misdiagnosed, s.runs),
            ]
        )
    t.rows.append(
        [
            "overall (fault runs)",
            "",
            str(len(faults)),
            f"{_frac(overall.detected, overall.runs)} ({_pct(overall.recall)})",
            _lat(overall),
            _frac(overall.misdiagnosed, overall.runs),
        ]
    )
    t.rows.append(
        [
            "healthy controls: false alarms",
            "",
            str(len(controls)),
            f"{_frac(overall.false_alarm_runs, overall.healthy_runs)} runs",
            "",
            _counts(overall.false_alarms),
        ]
    )
    tables.append(t)
    numbers["overall"] = overall.to_dict()
    numbers["per_detector"] = {k: v.to_dict() for k, v in per_det.items()}
    numbers["per_scenario"] = {k: v.to_dict() for k, v in per_sc.items()}

    # -- healthy controls ------------------------------------------------------------------
    t = Table(
        "Healthy controls: runs with any warning or error (false alarms)",
        ["control", "trap", "stethoscope", *(BASELINE_TITLES[b] + " stops" for b in base_names)],
    )
    for sc in controls:
        s = per_sc.get(sc.name, Summary())
        row = [
            sc.name,
            sc.description,
            f"{_frac(s.false_alarm_runs, s.healthy_runs)}"
            + (f": {_counts(s.false_alarms)}" if s.false_alarms else ""),
        ]
        for b in base_names:
            bs = base_sc[b].get(sc.name, Summary())
            row.append(
                _frac(bs.false_alarm_runs, bs.healthy_runs)
                + (f": {_counts(bs.false_alarms)}" if bs.false_alarms else "")
            )
        t.rows.append(row)
    tables.append(t)

    # -- baselines, per scenario and per family ------------------------------------------------
    if base_names:
        t = Table(
            "What users use today, on the same runs: recall · median latency (steps)",
            [
                "scenario",
                "family",
                f"stethoscope ({main})",
                *(BASELINE_TITLES[b] for b in base_names),
            ],
        )
        for sc in faults:
            row = [sc.name, sc.family, _cell(per_sc.get(sc.name))]
            row += [_cell(base_sc[b].get(sc.name)) for b in base_names]
            t.rows.append(row)
        t.notes += [f"- {BASELINE_TITLES[b]}: {baselines[b]}" for b in base_names]
        t.notes.append(
            "A baseline's detection is the first step at which it stops training, whatever "
            "the reason (they name no cause); 'early' counts runs it stopped before the fault's "
            "onset (it never saw the fault)."
        )
        if spike_note:
            t.notes.append(spike_note)
        tables.append(t)

        fam_ours = summarize(scenarios, ours, "family")
        fam_base = {b: summarize(scenarios, v, "family") for b, v in base_v.items()}
        t = Table(
            "Per fault family: recall · median latency; healthy row: runs stopped",
            [
                "family",
                "what",
                "runs",
                f"stethoscope ({main})",
                *(BASELINE_TITLES[b] for b in base_names),
            ],
        )
        for fam in FAMILY_ORDER:
            if fam == "healthy":
                s = fam_ours.get(fam)
                if s is None:
                    continue
                row = [
                    "healthy",
                    "false alarms / stops",
                    str(s.healthy_runs),
                    _frac(s.false_alarm_runs, s.healthy_runs),
                ]
                row += [
                    _frac(fam_base[b][fam].false_alarm_runs, fam_base[b][fam].healthy_runs)
                    if fam in fam_base[b]
                    else "—"
                    for b in base_names
                ]
                t.rows.append(row)
                continue
            if fam not in fam_ours:
                continue
            s = fam_ours[fam]
            row = [fam, FAMILIES[fam], str(s.runs), _cell(s)]
            row += [_cell(fam_base[b].get(fam)) for b in base_names]
            t.rows.append(row)
        tables.append(t)
        numbers["baselines"] = {
            b: {
                "per_family": {k: v.to_dict() for k, v in fam_base[b].items()},
                "per_scenario": {k: v.to_dict() for k, v in base_sc[b].items()},
            }
            for b in base_names
        }

    # -- the three settings ----------------------------------------------------------------------
    if len(settings) > 1:
        t = Table(
            "Adaptive sampling, shown: the same runs under three sampling settings",
            [
                "setting",
                "recall",
                "median latency: NaN/Inf + spikes",
                "median latency: divergence + silent",
                "false alarms",
                "misdiagnosed runs",
                "steps reading gradients",
                *(f"overhead, {o['scenario']}" for o in overhead),
            ],
        )
        numbers["settings"] = {}
        for setting in settings:
            v = verdicts_for(scenarios, runs, setting, baseline=False)
            fam = summarize(scenarios, v, "family")
            allv = summarize(scenarios, v, "all").get("all", Summary())
            fast = [x for f in ("nonfinite", "spike") if f in fam for x in fam[f].latencies]
            slow = [x for f in ("divergence", "silent") if f in fam for x in fam[f].latencies]
            steps = sum(r.steps for r in runs if setting in r.probe_counts)
            grads = sum(
                r.probe_counts[setting].get("grads", 0) for r in runs if setting in r.probe_counts
            )
            row = [
                setting,
                f"{_frac(allv.detected, allv.runs)} ({_pct(allv.recall)})",
                _num(_median(fast)),
                _num(_median(slow)),
                _frac(allv.false_alarm_runs, allv.healthy_runs),
                _frac(allv.misdiagnosed, allv.runs),
                _pct(grads / steps if steps else None),
            ]
            for o in overhead:
                row.append(_overhead_cell(o, setting))
            t.rows.append(row)
            numbers["settings"][setting] = {
                "overall": allv.to_dict(),
                "latency_fast": fast,
                "latency_slow": slow,
                "grad_steps_fraction": grads / steps if steps else None,
            }
        t.notes += [f"- {k}: {SETTINGS[k]}" for k in settings]
        t.notes.append(
            "'steps reading gradients': the fraction of all the suite's training steps (faults "
            "and controls) on which the setting's sampler asked for gradient norms."
        )
        for o in overhead:
            run = o.get("adaptive_run")
            text = (
                f"Overhead on {o['scenario']} ({o['plain_ms']:.2f} ms per plain step): per-step "
                f"time over plain Lightning, median [IQR] of {o['rounds']} interleaved 16-step "
                f"segments in one fit; 'adaptive' is its steady state on a healthy run "
                f"(= sparse's schedule)"
            )
            if run is not None:
                start = o["variants"].get("adaptive (start)")
                text += (
                    f"; its {o['start_window']}-step start-up window costs "
                    f"{_ratio(start['ratio'])}, so a {run['steps']}-step healthy run pays "
                    f"{100 * run['overhead']:+.1f}% with the adaptive default"
                )
            t.notes.append(text + ".")
        tables.append(t)

        per_setting = {
            setting: summarize(scenarios, verdicts_for(scenarios, runs, setting, False), "scenario")
            for setting in settings
        }
        t = Table(
            "Per fault scenario and setting: recall · median latency (steps)",
            ["scenario", "family", *settings],
        )
        for sc in faults:
            t.rows.append(
                [sc.name, sc.family, *(_cell(per_setting[st].get(sc.name)) for st in settings)]
            )
        tables.append(t)
    return tables, numbers


def build_comparison(
    scenarios: Sequence[Scenario],
    runs: Mapping[str, Sequence[RunResult]],
    settings: Sequence[str],
) -> Table:
    """The frameworks side by side: per scenario and setting, stethoscope's recall ·
    median latency (and misdiagnosed runs); per control, the runs with a false alarm."""
    columns = [(fw, st) for st in settings for fw in runs]
    per = {
        (fw, st): summarize(scenarios, verdicts_for(scenarios, runs[fw], st, False), "scenario")
        for fw, st in columns
    }
    fam = {
        (fw, st): summarize(scenarios, verdicts_for(scenarios, runs[fw], st, False), "family")
        for fw, st in columns
    }
    t = Table(
        "Frameworks side by side: recall · median latency (steps), misdiagnosed runs; "
        "controls: runs with a false alarm",
        ["scenario", "family", *(f"{fw} ({st})" for fw, st in columns)],
    )

    def fault_cell(s: Summary | None) -> str:
        if s is None or not s.runs:
            return "—"
        return _cell(s) + (f", misdiagnosed {s.misdiagnosed}" if s.misdiagnosed else "")

    def control_cell(s: Summary | None) -> str:
        if s is None or not s.healthy_runs:
            return "—"
        text = _frac(s.false_alarm_runs, s.healthy_runs)
        return text + (f": {_counts(s.false_alarms)}" if s.false_alarms else "")

    for sc in scenarios:
        cell = control_cell if sc.healthy else fault_cell
        t.rows.append([sc.name, sc.family, *(cell(per[c].get(sc.name)) for c in columns)])
    for family in FAMILY_ORDER:
        if not any(family in fam[c] for c in columns):
            continue
        cell = control_cell if family == "healthy" else fault_cell
        t.rows.append([f"all {family}", family, *(cell(fam[c].get(family)) for c in columns)])
    t.notes.append(
        "Each framework trains the same scenario specs on the same data with its own "
        "initialisation, optimizer and data order: the runs are twins, not copies."
    )
    return t


def _median(xs: list[int]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(r: dict[str, float]) -> str:
    return (
        f"{100 * (r['median'] - 1):+.1f}% [{100 * (r['q1'] - 1):+.1f}, {100 * (r['q3'] - 1):+.1f}]"
    )


def _overhead_cell(o: dict[str, Any], setting: str) -> str:
    v = o["variants"].get(setting)
    return "—" if v is None else _ratio(v["ratio"])


def render_rich(tables: Sequence[Table], header: Sequence[str], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console(width=200)
    for line in header:
        console.print(line, highlight=False)
    for t in tables:
        rt = RichTable(title=t.title, title_justify="left", show_lines=False)
        for i, c in enumerate(t.columns):
            rt.add_column(c, justify="right" if i in t.right else "left", overflow="fold")
        for row in t.rows:
            rt.add_row(*row)
        console.print(rt)
        for n in t.notes:
            console.print(n, highlight=False, markup=False)
        console.print()


def render_markdown(tables: Sequence[Table], header: Sequence[str]) -> str:
    out = [*header, ""]
    for t in tables:
        out.append(f"**{t.title}**")
        out.append("")
        out.append("| " + " | ".join(t.columns) + " |")
        out.append(
            "|" + "|".join("---:" if i in t.right else "---" for i in range(len(t.columns))) + "|"
        )
        for row in t.rows:
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        if t.notes:
            out.append("")
            out += t.notes
        out.append("")
    return "\n".join(out)
