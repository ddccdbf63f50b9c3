"""Command line of the fault-injection suite: ``python -m benchmarks.faults --help``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.faults.runner import FRAMEWORKS, ONE_FIT_PER_SETTING, run_all, suite
from benchmarks.faults.scenarios import BUDGETS, SAMPLING, SCENARIOS, SETTINGS, Scenario, select

DEFAULT_SEEDS = 3
OVERHEAD_CONTROLS = ("healthy_standardized", "healthy_cnn_bn_dropout")
OVERHEAD_ROUNDS = 30
QUICK_OVERHEAD_ROUNDS = 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults",
        description="Inject known faults into small training runs and report how well "
        "stethoscope's detectors, and the checks users write today, find them.",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help=f"seeds per scenario (default {DEFAULT_SEEDS}, 1 with --quick)",
    )
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument(
        "--setting",
        choices=(*SETTINGS, "all", "budgets"),
        default="adaptive",
        help="sampling setting(s): 'all' runs the three (in the same fits in Lightning, one "
        "fit each in Keras) and measures their per-step overhead on healthy controls "
        "(Lightning)",
    )
    p.add_argument("--quick", action="store_true", help="1 seed and a short overhead measurement")
    p.add_argument("--json", metavar="PATH", help="write every run, verdict and number")
    p.add_argument("--markdown", action="store_true", help="print GitHub-markdown tables")
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    p.add_argument("--no-overhead", action="store_true", help="with --setting all: skip timing")
    p.add_argument(
        "--overhead-rounds",
        type=int,
        default=None,
        help=f"interleaved rounds per control (default {OVERHEAD_ROUNDS}, "
        f"{QUICK_OVERHEAD_ROUNDS} with --quick)",
    )
    p.add_argument(
        "--separate-fits",
        action="store_true",
        help="one fit per setting instead of all settings watching one fit (to check that "
        "they do not influence each other; slower)",
    )
    p.add_argument(
        "--framework",
        choices=(*FRAMEWORKS, "all"),
        default="lightning",
        help="which implementation trains the scenarios; 'all' runs each in turn and adds "
        "a table with the frameworks side by side",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch / TensorFlow op threads (default 1)"
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--report-from",
        metavar="PATH",
        help="print the report of a --json file again (e.g. --markdown for the README), "
        "judged with the current scenario specs, without training",
    )
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    return args


def _list(scenarios: Sequence[Scenario]) -> None:
    for sc in scenarios:
        what = "control" if sc.healthy else f"{sc.expect_label} in [{sc.onset}, +{sc.window}]"
        print(f"{sc.name:28s} {sc.family:10s} {what:55s} {sc.description}")


def environment() -> dict[str, Any]:
    """Date, Python and CPU: what every framework's run shares."""
    from benchmarks._machine import machine

    return machine()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:
        with open(args.report_from) as f:
            payload = json.load(f)
    else:
        names = [n for n in args.only.split(",") if n]
        try:
            scenarios = select(names)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.list:
            _list(scenarios)
            return 0
        shown = sys.argv[1:] if argv is None else list(argv)
        command = " ".join(["python -m benchmarks.faults", *shown])
        frameworks = FRAMEWORKS if args.framework == "all" else (args.framework,)
        payloads = [collect(args, scenarios, command, fw) for fw in frameworks]
        payload = payloads[0] if len(payloads) == 1 else {"frameworks": payloads}
    render(payload, markdown=args.markdown)
    if args.json and not args.report_from:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


def collect(
    args: argparse.Namespace,
    scenarios: Sequence[Scenario],
    command: str,
    framework: str | None = None,
) -> dict[str, Any]:
    """Run the suite as ``args`` say with ``framework`` (default ``args.framework``);
    everything the report needs, as JSON-ready data."""
    from stethoscope.detectors import DETECTORS

    framework = framework or args.framework
    impl = suite(framework)
    impl.quiet()
    impl.configure(args.threads)
    n_seeds = args.seeds or (1 if args.quick else DEFAULT_SEEDS)
    seeds = list(range(n_seeds))
    named = {"all": SAMPLING, "budgets": BUDGETS}
    settings = named.get(args.setting, (args.setting,))
    if "adaptive" in settings:
        settings = ("adaptive", *(s for s in settings if s != "adaptive"))

    def log(msg: str) -> None:
        print(f"[{framework}] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    runs = run_all(
        scenarios,
        seeds,
        settings,
        baselines=not args.no_baselines,
        separate=args.separate_fits,
        framework=framework,
        log=log,
    )
    suite_wall = time.perf_counter() - t0
    overhead: list[dict[str, Any]] = []
    if len(settings) > 1 and not args.no_overhead and framework == "lightning":
        from benchmarks.faults.lightning_overhead import measure_overhead

        rounds = args.overhead_rounds or (QUICK_OVERHEAD_ROUNDS if args.quick else OVERHEAD_ROUNDS)
        controls = OVERHEAD_CONTROLS[:1] if args.quick else OVERHEAD_CONTROLS
        by_name = {s.name: s for s in SCENARIOS}
        for name in controls:
            overhead.append(
                measure_overhead(by_name[name], rounds=rounds, warmup=not args.quick, log=log)
            )
    env = environment()
    env.update(impl.environment())
    env["command"] = command
    return {
        "environment": env,
        "config": {
            "framework": framework,
            "seeds": seeds,
            "settings": list(settings),
            "scenarios": [s.name for s in scenarios],
            "separate_fits": args.separate_fits or framework in ONE_FIT_PER_SETTING,
        },
        "wall_s": time.perf_counter() - t0,
        "suite_wall_s": suite_wall,
        "available_detectors": sorted(DETECTORS),
        "spike_detection_note": impl.SPIKE_DETECTION,
        "overhead": overhead,
        "runs": [r.to_dict() for r in runs],
    }


def render(payload: dict[str, Any], *, markdown: bool) -> dict[str, Any]:
    """Print the report of ``payload`` (from :func:`collect` or its JSON); return its numbers.

    A payload of several frameworks (``{"frameworks": [...]}``) prints each framework's
    report in turn, then the frameworks side by side. Runs are judged with the scenario
    specs of this checkout.
    """
    if "frameworks" not in payload:
        return _render_one(payload, markdown=markdown)
    from benchmarks.faults.report import build_comparison, render_markdown, render_rich
    from benchmarks.faults.results import RunResult

    parts = payload["frameworks"]
    numbers = {}
    for part in parts:
        fw = part["config"].get("framework", "lightning")
        print(f"\n## {fw.capitalize()}\n" if markdown else f"\n=== {fw} ===\n")
        numbers[fw] = _render_one(part, markdown=markdown)
    names = [
        n
        for n in parts[0]["config"]["scenarios"]
        if all(n in p["config"]["scenarios"] for p in parts)
    ]
    settings = [
        s
        for s in parts[0]["config"]["settings"]
        if all(s in p["config"]["settings"] for p in parts)
    ]
    runs = {
        p["config"].get("framework", "lightning"): [RunResult.from_dict(r) for r in p["runs"]]
        for p in parts
    }
    table = build_comparison(select(names), runs, settings)
    header = ["Both frameworks, the same scenarios, seeds and settings."]
    if markdown:
        print("\n## Side by side\n")
        print(render_markdown([table], header))
    else:
        print("\n=== side by side ===\n")
        render_rich([table], header)
    payload["numbers"] = numbers
    return numbers


def _versions(env: dict[str, Any]) -> str:
    """``torch 2.x, lightning 2.y`` (or keras, tensorflow), and the op threads."""
    if "versions" in env:
        versions, threads = env["versions"], env["threads"]
    else:  # a JSON file from before the Keras implementation
        versions, threads = (
            f"torch {env['torch']}, lightning {env['lightning']}",
            env["torch_threads"],
        )
    return f"{versions}, Python {env['python']}; {threads} op thread(s)"


def _fits_note(settings: int, *, separate: bool, own_fit: bool) -> str:
    """How the fits of a run were shared among the settings and the baselines."""
    parts = []
    if settings > 1:
        parts.append(
            "one fit per setting, the same training run each time"
            if separate
            else "all settings watching the same fits"
        )
    if own_fit:
        parts.append("the baselines in a fit of their own, without the stethoscope")
    return f" ({'; '.join(parts)})" if parts else ""


def _render_one(payload: dict[str, Any], *, markdown: bool) -> dict[str, Any]:
    from benchmarks.faults.report import build_tables, render_markdown, render_rich
    from benchmarks.faults.results import FRAMEWORK_BASELINES, RunResult

    env, cfg = payload["environment"], payload["config"]
    framework = cfg.get("framework", "lightning")
    scenarios = select(cfg["scenarios"])
    runs = [RunResult.from_dict(r) for r in payload["runs"]]
    settings = cfg["settings"]
    available = set(payload["available_detectors"])
    overhead = payload["overhead"]
    wanted = sorted({d for sc in scenarios for d in sc.expect})
    missing = [d for d in wanted if d not in available]
    n_fault = sum(not s.healthy for s in scenarios)
    suite_wall, wall = payload["suite_wall_s"], payload["wall_s"]
    separate = cfg["separate_fits"]
    fits = len(runs) * (len(settings) if separate else 1)
    # frameworks that train one fit per setting train the baselines' fit apart too
    own_fit = framework in ONE_FIT_PER_SETTING and any(r.baselines for r in runs)
    fits += len(runs) if own_fit else 0
    header = [
        f"{env['date']}; {_versions(env)} on {env['cpu']} ({env['cpu_count']} CPUs). "
        f"`{env['command']}`, {framework}: {n_fault} fault scenarios and "
        f"{len(scenarios) - n_fault} healthy controls x {len(cfg['seeds'])} seed(s) = "
        f"{len(runs)} runs, {fits} fits in {suite_wall / 60:.1f} min"
        + (f", overhead timing {(wall - suite_wall) / 60:.1f} min" if overhead else "")
        + _fits_note(len(settings), separate=separate, own_fit=own_fit)
        + ".",
    ]
    if len(settings) > 1 and not overhead and framework != "lightning":
        header.append(
            "Per-step overhead is measured for Lightning only (lightning_overhead.py); "
            "for Keras see benchmarks/overhead.py."
        )
    if missing:
        header.append(
            "Expected detectors not available in stethoscope.detectors.DETECTORS (their "
            f"scenarios show recall 0): {', '.join(missing)}."
        )
    noted = [r for r in runs if r.notes]
    if noted:
        header.append(
            f"{len(noted)} run(s) with notes: "
            + "; ".join(f"{r.scenario}/seed {r.seed}: {r.notes[0]}" for r in noted[:3])
            + ("; …" if len(noted) > 3 else "")
        )
    errors = [r for r in runs if r.error]
    if errors:
        header.append(
            f"{len(errors)} fit(s) raised: "
            + "; ".join(f"{r.scenario}/seed {r.seed}: {r.error}" for r in errors[:5])
        )
    spike_note = (
        payload["spike_detection_note"]
        or "SpikeDetection is Lightning's own callback (lightning.pytorch.callbacks), used as "
        "shipped with its defaults."
    )
    tables, numbers = build_tables(
        scenarios,
        runs,
        settings,
        available=available,
        overhead=overhead,
        spike_note=spike_note,
        baselines=FRAMEWORK_BASELINES[framework],
    )
    if markdown:
        print(render_markdown(tables, header))
    else:
        render_rich(tables, header)
    payload["numbers"] = numbers
    return numbers


if __name__ == "__main__":
    sys.exit(main())
