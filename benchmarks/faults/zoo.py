"""The zoo: healthy workloads unlike the fault suite's, and what stethoscope says on each.

``zoo_models.py`` rebuilds the ``pytorch/examples`` programs in Lightning (a DCGAN, a
VAE, a GCN and a GAT, a word language model, an LBFGS time series in float64, a
siamese network, REINFORCE and actor-critic, forward-forward, a polynomial regression,
a ResNet and the MNIST CNN, in float32 and under bf16 autocast). Every one trains
healthily, so every warning or error stethoscope reports on them is a false alarm.

For each workload and seed it trains two fits from the same seed, one watched by
``LightningStethoscope(sinks=[CapturingSink()])`` with its defaults and one plain, and
reports:

* trains: the workload's metric (its ``trace``) at the start and the end of the plain
  fit (the median of its first and of its last tenth), and whether it moved the right
  way;
* findings: every warning and error of the watched fit (``detector: severity@step`` and
  the message's first words; the steps of each seed), the infos counted; a crash in the
  fit is caught and reported with the stethoscope frame it came from;
* bit-for-bit: whether the two fits end with the same parameters and buffers, byte for
  byte, and the same trace (``stopped@N`` when stethoscope stopped the watched fit);
* time: the watched fit's CPU seconds over the plain one's (the process's, one thread:
  steadier than wall time on a shared machine; ``!`` past 1.05x), the same for wall
  time, and stethoscope's CPU milliseconds per optimizer step; medians of ``--repeats``
  alternating pairs (``ABBA`` order) on the first seed. ``--profile`` cProfiles a plain
  and a watched fit instead and lists what grew.

stethoscope runs with its defaults, ``stop_on="error"`` included: an error finding stops
the watched fit, which the bit-for-bit column then shows as ``stopped@N``.

Run (one core, as the workloads were sized for)::

    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo                 # 3 seeds
    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo --only gcn,vae --seeds 1
    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo --only word_lm --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from benchmarks.faults.lightning_suite import ON_ONE_CPU, quiet
from benchmarks.faults.zoo_models import WORKLOADS, Workload
from stethoscope import LightningStethoscope
from stethoscope.findings import Finding, Severity
from stethoscope.testing import CapturingSink

__all__ = [
    "Fit",
    "Row",
    "StepClock",
    "chosen",
    "crash_text",
    "fit",
    "main",
    "render",
    "run_all",
    "run_workload",
]

_WORDS = 9  # of a finding's message, in the table
#: How stethoscope words a Python warning that detectors sit a run out, said once on
#: purpose (``engine/schedule.py``; the loss detectors of a step that returns no loss).
_SITTING_OUT = re.compile(r"cannot judge this run|are off for this run|returned no scalar loss")


@dataclass
class Fit:
    """What one fit left: its time, metric trace, final state and, watched, its findings."""

    seconds: float
    #: The process's CPU seconds (one thread: steadier than wall time on a shared machine).
    cpu: float
    trace: list[float]
    state: dict[str, bytes]
    steps: int
    findings: list[Finding] = field(default_factory=list)
    crash: str | None = None
    #: Python warnings from stethoscope during the fit, but for the notices below.
    warnings: list[str] = field(default_factory=list)
    #: Its warnings that detectors sit this run out (a game, a language model, LBFGS, a
    #: training step that returns no loss): said once on purpose, as ``blind_to`` is.
    notices: list[str] = field(default_factory=list)

    def problems(self) -> list[Finding]:
        """The warnings and errors."""
        return [f for f in self.findings if f.severity >= Severity.WARNING]


class StepClock(L.Callback):
    """Appends the process's CPU time to ``times`` at each training batch's start.

    It comes first among the callbacks, so the time between two batches' starts holds
    all that a step costs, stethoscope's hooks, the validation and the epoch's end
    included: the same step of a plain and a watched fit (bit for bit the same
    training) can be compared.
    """

    def __init__(self, times: list[float]) -> None:
        self.times = times

    def on_train_batch_start(self, *args: Any) -> None:
        self.times.append(time.process_time())


def _state(module: torch.nn.Module) -> dict[str, bytes]:
    """Every parameter and buffer as bytes (NaN-safe equality)."""
    return {
        k: v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def crash_text(exc: BaseException) -> str:
    """``Type: message``, and where: the innermost stethoscope frame, if any."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/stethoscope/" in f.filename.replace("\\", "/")]
    where = frames[-1] if not ours else ours[-1]
    who = "stethoscope" if ours else "workload"
    name = where.filename.replace("\\", "/").rsplit("/src/", 1)[-1]
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return f"{who} crash: {text[:200]} (at {name}:{where.lineno} in {where.name})"


def fit(
    workload: Workload,
    seed: int,
    *,
    watched: bool,
    steps: int | None = None,
    profile: cProfile.Profile | None = None,
    clock: list[float] | None = None,
) -> Fit:
    """One seeded ``Trainer.fit`` of ``workload``, watched by stethoscope's defaults or not.

    Args:
        workload: What to train.
        seed: Seeds Python, NumPy and torch (``L.seed_everything``) and the data.
        watched: Whether a ``LightningStethoscope(sinks=[CapturingSink()])`` rides along.
        steps: Its length (default: the benchmark's, ``workload.steps``).
        profile: A profiler enabled around ``trainer.fit`` only.
        clock: Where to append the process's CPU time at the fit's start, at each
            training batch's start and at the fit's end (see :class:`StepClock`).
    """
    L.seed_everything(seed, verbose=False)
    sink = CapturingSink()
    crash, module, steps_done = None, None, 0
    seconds = cpu = 0.0
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # a crash anywhere, stethoscope's constructor included, is a result
            built = workload.build(seed, workload.steps if steps is None else steps)
            module = built.module
            callbacks: list[L.Callback] = [] if clock is None else [StepClock(clock)]
            if watched:
                callbacks.append(LightningStethoscope(sinks=[sink]))
            trainer = L.Trainer(
                **ON_ONE_CPU,
                deterministic=True,
                default_root_dir=tmp,
                callbacks=callbacks,
                **built.trainer,
            )
            t0, c0 = time.perf_counter(), time.process_time()
            if clock is not None:
                clock.append(c0)
            if profile is not None:
                profile.enable()
            try:
                trainer.fit(built.module, built.train, built.val)
            finally:
                if profile is not None:
                    profile.disable()
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                if clock is not None:
                    clock.append(c0 + cpu)
                steps_done = trainer.global_step
        except Exception as exc:
            crash = crash_text(exc)
    ours = [
        str(w.message)
        for w in caught
        if "/stethoscope/" in str(w.filename).replace("\\", "/")
        or str(w.message).startswith("stethoscope:")
    ]
    return Fit(
        seconds=seconds,
        cpu=cpu,
        trace=[] if module is None else list(module.trace),
        state={} if module is None else _state(module),
        steps=steps_done,
        findings=list(sink.findings),
        crash=crash,
        warnings=sorted({w for w in ours if not _SITTING_OUT.search(w)}),
        notices=sorted({w for w in ours if _SITTING_OUT.search(w)}),
    )


@dataclass
class Row:
    """One workload's line of the table, over its seeds."""

    name: str
    metric: str
    higher_is_better: bool
    #: Per seed: (start, end) of the plain fit's trace.
    trains: list[tuple[float, float]] = field(default_factory=list)
    #: Per seed: the watched fit.
    watched: list[Fit] = field(default_factory=list)
    #: Per seed: "yes", "NO (…)", "stopped@N" or "-" (the plain fit failed).
    same: list[str] = field(default_factory=list)
    #: The first seed's timed fits: (wall, CPU) seconds each.
    plain_times: list[tuple[float, float]] = field(default_factory=list)
    watched_times: list[tuple[float, float]] = field(default_factory=list)
    #: The first seed's steps (optimizer steps, Lightning's ``global_step``).
    steps: int = 0
    plain_crash: str | None = None

    def _median(self, which: int) -> tuple[float, float] | None:
        if not self.plain_times or not self.watched_times:
            return None
        p = statistics.median(t[which] for t in self.plain_times)
        w = statistics.median(t[which] for t in self.watched_times)
        return p, w

    @property
    def ratio(self) -> float | None:
        """Watched over plain, CPU seconds (medians)."""
        m = self._median(1)
        return None if m is None else m[1] / m[0]

    @property
    def wall_ratio(self) -> float | None:
        m = self._median(0)
        return None if m is None else m[1] / m[0]

    @property
    def extra_ms(self) -> float | None:
        """stethoscope's CPU milliseconds per optimizer step."""
        m = self._median(1)
        return None if m is None or not self.steps else 1000 * (m[1] - m[0]) / self.steps

    def healthy(self) -> bool:
        """Whether every seed's metric moved the right way."""
        if not self.trains:
            return False
        ok = [(e > s) if self.higher_is_better else (e < s) for s, e in self.trains]
        return all(ok)


def _ends(trace: Sequence[float]) -> tuple[float, float]:
    """The medians of the first and of the last tenth of ``trace``."""
    if not trace:
        return float("nan"), float("nan")
    k = max(1, len(trace) // 10)
    return statistics.median(trace[:k]), statistics.median(trace[-k:])


def _compare(plain: Fit, watched: Fit) -> str:
    if watched.crash is not None:
        return "crash"
    if watched.steps < plain.steps:
        return f"stopped@{watched.steps}"
    bad = [k for k in plain.state if plain.state[k] != watched.state.get(k)]
    if bad or plain.steps != watched.steps:
        return f"NO ({len(bad)} tensors differ, e.g. {bad[:1]})"
    if plain.trace != watched.trace:
        return "NO (trace differs)"
    return "yes"


def run_workload(
    workload: Any,
    seeds: Sequence[int],
    *,
    repeats: int = 3,
    log: Any = None,
    fit: Callable[..., Fit] = fit,
) -> Row:
    """Every seed's watched and plain fit, then ``repeats`` timing pairs on the first seed
    (the first seed's pair counts as one of them; ``ABBA`` order). ``fit``: how one fit
    of ``workload`` is made (``keras_zoo.fit`` for Keras' workloads)."""
    row = Row(workload.name, workload.metric, workload.higher_is_better)
    for i, seed in enumerate(seeds):
        plain = fit(workload, seed, watched=False)
        watched = fit(workload, seed, watched=True)
        if plain.crash is not None:
            row.plain_crash = plain.crash
        row.trains.append(_ends(plain.trace))
        row.watched.append(watched)
        row.same.append("-" if plain.crash else _compare(plain, watched))
        if i == 0:
            row.plain_times.append((plain.seconds, plain.cpu))
            row.watched_times.append((watched.seconds, watched.cpu))
            row.steps = plain.steps
        if log:
            log(
                f"  {workload.name} seed {seed}: plain {plain.seconds:.1f}s, watched "
                f"{watched.seconds:.1f}s, {len(watched.problems())} warning/error finding(s)"
            )
    for r in range(1, repeats):  # ABBA: watched first in the odd rounds
        order = (True, False) if r % 2 else (False, True)
        for w in order:
            f = fit(workload, seeds[0], watched=w)
            (row.watched_times if w else row.plain_times).append((f.seconds, f.cpu))
    return row


def _finding_lines(row: Row) -> list[str]:
    """``detector: severity@steps first words`` per (detector, severity), steps per seed."""
    keys: dict[tuple[str, str], list[str]] = {}
    messages: dict[tuple[str, str], str] = {}
    for fit_ in row.watched:
        for f in fit_.problems():
            messages.setdefault((f.detector, f.severity.value), f.message)
    for key in messages:
        for fit_ in row.watched:
            steps = [f.step for f in fit_.problems() if (f.detector, f.severity.value) == key]
            keys.setdefault(key, []).append(
                "-" if not steps else str(steps[0]) + (f"(x{len(steps)})" if len(steps) > 1 else "")
            )
    lines = []
    for (det, sev), steps in keys.items():
        words = " ".join(messages[det, sev].split()[:_WORDS])
        lines.append(f"{det}: {sev}@{','.join(steps)} {words}...")
    for i, fit_ in enumerate(row.watched):
        if fit_.crash:
            lines.append(f"[seed {i}] {fit_.crash}")
        for w in fit_.warnings:
            lines.append(f"[seed {i}] python warning: {w[:160]}")
    sitting: set[str] = set()
    for fit_ in row.watched:
        for w in fit_.notices:  # "stethoscope: A and B cannot judge this run (why), so ..."
            names = w.removeprefix("stethoscope: ").split(" cannot judge", 1)[0]
            if " are off for this run" in w:
                names = w.split(", so ", 1)[-1].split(" are off", 1)[0] + " (a game)"
            elif "returned no scalar loss" in w:
                names = "the loss detectors (training_step returns no loss)"
            sitting.add(names)
    if sitting:
        lines.append("sits out: " + "; ".join(sorted(sitting)))
    infos: dict[str, int] = {}
    for fit_ in row.watched:
        for f in fit_.findings:
            if f.severity == Severity.INFO:
                infos[f.detector] = infos.get(f.detector, 0) + 1
    if infos:
        lines.append("infos: " + ", ".join(f"{d} x{n}" for d, n in sorted(infos.items())))
    return lines or ["none"]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(rows: Sequence[Row]) -> str:
    """The table, one block of lines per workload: the headline, each seed's start and end
    metric, then the findings. ``time``: CPU seconds watched over plain (``!`` past 1.05x),
    the wall-time ratio and stethoscope's CPU milliseconds per optimizer step."""
    out = io.StringIO()
    head = (
        f"{'workload':<16} {'trains: metric (direction, verdict)':<42} {'bit-for-bit':<18} "
        f"{'time (cpu, wall, ms/step)'}"
    )
    out.write(head + "\n" + "-" * len(head) + "\n")
    for row in rows:
        arrow = "up" if row.higher_is_better else "down"
        trains = "; ".join(f"{s:.3g} -> {e:.3g}" for s, e in row.trains)
        verdict = "ok" if row.healthy() else "NOT TRAINING"
        flag = "!" if row.ratio is not None and row.ratio > 1.05 else " "
        ms = "-" if row.extra_ms is None else f"{row.extra_ms:+.2f}"
        timing = f"{_x(row.ratio)}{flag} {_x(row.wall_ratio)} {ms}"
        out.write(
            f"{row.name:<16} {f'{row.metric} ({arrow}, {verdict})':<42} "
            f"{','.join(row.same):<18} {timing}\n"
        )
        out.write(f"{'':<16}   {trains}   ({row.steps} steps)\n")
        if row.plain_crash:
            out.write(f"{'':<16}   plain fit: {row.plain_crash}\n")
        for line in _finding_lines(row):
            out.write(f"{'':<16}   {line}\n")
    return out.getvalue()


def _ours(key: tuple[str, int, str]) -> bool:
    return "/stethoscope/" in key[0].replace("\\", "/")


def _entry_time(stats: pstats.Stats) -> float:
    """Cumulative seconds of stethoscope's functions called from outside stethoscope."""
    total = 0.0
    for key, (_, _, _, cumtime, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if _ours(key) and not any(_ours(c) for c in callers):
            total += cumtime
    return total


def _profile(workload: Workload, seed: int, top: int) -> str:
    """Where the watched fit's extra time goes: cProfile both fits of one seed and list the
    functions whose own time grew most (torch's hook dispatch counts, not only stethoscope's
    functions), and stethoscope's own hooks by cumulative time."""
    stats = {}
    for watched in (False, True):
        prof = cProfile.Profile()
        f = fit(workload, seed, watched=watched, profile=prof)
        stats[watched] = (pstats.Stats(prof), f)
    (plain, pf), (watch, wf) = stats[False], stats[True]
    crashed = "".join(
        f"{which} fit: {f.crash}\n" for which, f in (("plain", pf), ("watched", wf)) if f.crash
    )
    grew: list[tuple[float, int, str]] = []
    for key, (_, calls, tottime, _, _) in watch.stats.items():  # type: ignore[attr-defined]
        before = plain.stats.get(key, (0, 0, 0.0, 0, 0))  # type: ignore[attr-defined]
        name = (
            f"{key[0].rsplit('/site-packages/', 1)[-1].rsplit('/src/', 1)[-1]}:{key[1]}({key[2]})"
        )
        grew.append((tottime - before[2], calls - before[1], name))
    grew.sort(reverse=True)
    total_plain = plain.total_tt  # type: ignore[attr-defined]
    total_watch = watch.total_tt  # type: ignore[attr-defined]
    out = io.StringIO(crashed)
    out.seek(len(crashed))
    out.write(
        f"profiled: plain {total_plain:.2f}s, watched {total_watch:.2f}s "
        f"(+{total_watch - total_plain:.2f}s over {wf.steps} steps); unprofiled wall "
        f"{pf.seconds:.2f}s vs {wf.seconds:.2f}s\n"
        f"functions whose own time grew most (seconds, extra calls):\n"
    )
    for dt, dn, name in grew[:top]:
        out.write(f"  {dt:+8.3f}s {dn:+8d}  {name}\n")
    mine = sum(t for t, _, n in grew if "stethoscope/" in n)
    under = _entry_time(watch)
    out.write(
        f"own time in stethoscope's functions: {mine:.3f}s; under its entry points (the "
        f"torch and numpy work it calls included): {under:.3f}s; the rest of the difference "
        "is what its hooks cost torch outside its code, and the machine's noise\n"
    )
    ours = io.StringIO()
    watch.stream = ours  # type: ignore[attr-defined]
    watch.sort_stats("cumulative").print_stats("stethoscope/callbacks/lightning.py", 8)
    out.write(
        "the callback's hooks, cumulative:\n   ncalls" + ours.getvalue().split("ncalls", 1)[-1]
    )
    return out.getvalue()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.zoo",
        description="Healthy pytorch/examples workloads in Lightning: does stethoscope stay "
        "quiet, change nothing, and cost little?",
    )
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per workload (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timing pairs (default 3; 1: no extra)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--profile", action="store_true", help="cProfile one watched fit per workload instead"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = chosen(args.only, WORKLOADS)
    if names is None:
        return 2
    quiet()
    torch.set_num_threads(args.threads)
    if args.profile:
        for n in names:
            print(f"== {n}\n{_profile(WORKLOADS[n], 0, 25)}")
        return 0
    print(run_all([WORKLOADS[n] for n in names], seeds=args.seeds, repeats=args.repeats))
    return 0


def chosen(only: str, workloads: Mapping[str, Any]) -> list[str] | None:
    """The workloads ``--only`` names (every one when empty), or None, said on stderr, when
    it names one there is not."""
    names = [n for n in only.split(",") if n] or list(workloads)
    unknown = [n for n in names if n not in workloads]
    if unknown:
        print(f"unknown workload(s) {unknown!r}; use some of {list(workloads)!r}", file=sys.stderr)
        return None
    return names


def run_all(
    workloads: Sequence[Any], *, seeds: int, repeats: int, run: Callable[..., Row] = run_workload
) -> str:
    """The table of ``workloads``, each run by ``run`` (``keras_zoo.run_workload`` for
    Keras'), with its progress on stderr."""
    rows = []
    for w in workloads:
        t0 = time.perf_counter()
        rows.append(
            run(
                w,
                list(range(seeds)),
                repeats=repeats,
                log=lambda s: print(s, file=sys.stderr, flush=True),
            )
        )
        print(f"  {w.name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return render(rows)


if __name__ == "__main__":
    sys.exit(main())
