"""Overhead of LightningStethoscope's defaults in the ways people train, in one process.

``benchmarks/overhead.py`` measures the defaults on the benchmark MLP and CNN with
automatic optimization, one batch per optimizer step. Users also train with:

* ``accumulate``: ``Trainer(accumulate_grad_batches=4)``: four batches per optimizer step;
* ``compile``: the module's network wrapped in ``torch.compile`` (inductor);
* ``manual``: manual optimization with two optimizers (one per half of the network, each
  stepped every batch): Lightning's global step counts both, two per batch;

and ``default`` is the plain recipe again, measured the same way for comparison. Each
set-up trains the benchmark MLP in one ``trainer.fit``, plain and stethoscope segments
taking turns (``plain, stethoscope, plain, ...``) as in ``overhead.py``: a gate hands
each batch's hooks to the stethoscope during its segments only. Here the schedule is
counted in batches, not in global steps, since the two differ in ``accumulate`` and
``manual``: every segment spans 32 global steps (the longest base interval), so it
holds as many samples of every detector whatever the set-up. A batch is timed from one
``on_train_batch_start`` to the next. Each stethoscope segment's mean is divided by
the mean of the two plain segments around it; the report gives the median, the
interquartile range and a bootstrap 95% interval of those ratios, and the noise floor
(a plain segment against the plain segments two away).

The steady-state stethoscope is one instance, through an untimed pre-roll past its
calibration window, as in ``overhead.py``. With ``compile``, the stethoscope's
layer-output hooks, attached on sampled steps only, are part of what the compiled graph
depends on: what that costs is part of what is measured.

Run:
    python -m benchmarks.setups                     # every set-up, ~8 min on 2 cores
    python -m benchmarks.setups --setup manual --rounds 20
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from benchmarks._dispatch import STEP_HOOKS, call_hook
from benchmarks.overhead import (
    MODELS,
    PLAIN,
    POOL_BATCHES,
    STETHOSCOPE,
    THREADS,
    Segment,
    Task,
    _Cycle,
    _median_ci,
    _quartiles,
    _quiet,
    calibration_steps,
    environment,
    gradient_interval,
    synthetic_batches,
)
from stethoscope import LightningStethoscope

SEED = 0
DEFAULT_ROUNDS = 40
QUICK_ROUNDS = 2


@dataclass(frozen=True)
class Setup:
    name: str
    title: str
    steps_per_batch: float  # global steps a batch moves Lightning's step by
    trainer_kwargs: dict[str, Any]
    build: Callable[[nn.Module], L.LightningModule]


class TwoOptimizers(Task):
    """Manual optimization: one backward, then two Adams, one per half of the network."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        first, second = self.optimizers()
        loss = nn.functional.cross_entropy(self.net(x), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        params = list(self.parameters())
        half = len(params) // 2
        return [torch.optim.Adam(params[:half], lr=1e-3), torch.optim.Adam(params[half:], lr=1e-3)]


def _compiled(net: nn.Module) -> L.LightningModule:
    return Task(torch.compile(net))


SETUPS = {
    s.name: s
    for s in (
        Setup("default", "automatic optimization (as overhead.py)", 1.0, {}, Task),
        Setup(
            "accumulate",
            "accumulate_grad_batches=4",
            0.25,
            {"accumulate_grad_batches": 4},
            Task,
        ),
        Setup("compile", "torch.compile(net) (inductor)", 1.0, {}, _compiled),
        Setup("manual", "manual optimization, two optimizers", 2.0, {}, TwoOptimizers),
    )
}


class BatchClock(Callback):
    """``perf_counter`` at every ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.times.append(time.perf_counter())

    def batch_ms(self) -> list[float]:
        t = self.times
        return [1e3 * (t[i + 1] - t[i]) for i in range(len(t) - 1)]


_RUN_HOOKS = ("setup", "on_train_start", "on_train_epoch_end", "on_train_end", "teardown")


class BatchGate(Callback):
    """Hands each batch's hooks to the stethoscope during its segments; the run-level
    hooks always. It also clocks the time spent inside the stethoscope's batch hooks,
    batch by batch (``host_us``): on an unsampled batch, that is all it costs."""

    def __init__(self, owners: Sequence[str], steady: LightningStethoscope) -> None:
        self.owners, self.steady = owners, steady
        self.batch = -1
        self.active = False
        self.sampled: list[bool] = []
        self.host_us: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch += 1
        self.active = self.batch < len(self.owners) and self.owners[self.batch] == STETHOSCOPE
        self.host_us.append(0.0)
        if self.active:
            t0 = time.perf_counter()
            call_hook(self.steady, "on_train_batch_start", trainer, *args[1:])
            self.host_us[-1] += 1e6 * (time.perf_counter() - t0)
        self.sampled.append(self.active and self.steady._measures.sampled)


def _forward(name: str, *, always: bool) -> Callable[..., None]:
    def hook(self: BatchGate, *args: Any, **kwargs: Any) -> None:
        if always:
            getattr(self.steady, name)(*args, **kwargs)
        elif self.active:
            t0 = time.perf_counter()
            call_hook(self.steady, name, args[0], *args[2:], **kwargs)
            self.host_us[-1] += 1e6 * (time.perf_counter() - t0)

    hook.__name__ = name
    return hook


for _name in STEP_HOOKS:
    setattr(BatchGate, _name, _forward(_name, always=False))
for _name in _RUN_HOOKS:
    setattr(BatchGate, _name, _forward(_name, always=True))


def run_setup(
    setup: Setup,
    rounds: int,
    warmup: bool,
    log: Callable[[str], None],
    budget: float | None = None,
) -> dict:
    torch.manual_seed(SEED)
    spec = MODELS["mlp"]
    task = setup.build(spec.build())
    pool = synthetic_batches(spec, POOL_BATCHES, SEED + 1)
    steady = LightningStethoscope(sinks=[], stop_on=None, overhead_budget=budget)
    every = gradient_interval(steady)
    calib = calibration_steps(steady)
    per_step = 1 / setup.steps_per_batch  # batches per global step
    segment = round(every * per_step)  # batches holding `every` global steps
    # past calibration, and a multiple of the batches per optimizer step
    preroll = round((calib + 1 + (every // 2 - calib - 1) % every) * per_step)
    if per_step > 1:
        preroll = -(-preroll // round(per_step)) * round(per_step)
    segments = [Segment(STETHOSCOPE, -1, 0, preroll)]
    for rnd in range(0 if warmup else 1, rounds + 1):  # plain, stethoscope, plain, ...
        for key in (PLAIN, STETHOSCOPE):
            segments.append(Segment(key, rnd, segments[-1].start + segments[-1].length, segment))
    segments.append(Segment(PLAIN, rounds, segments[-1].start + segments[-1].length, segment))
    owners = [s.variant for s in segments for _ in range(s.length)]
    total = len(owners)
    gate, clock = BatchGate(owners, steady), BatchClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=total + 1,
        callbacks=[clock, gate],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        **setup.trainer_kwargs,
    )
    loader = DataLoader(_Cycle(pool, total + 2), batch_size=None, shuffle=False)
    gc.collect()
    gc.freeze()
    log(f"{setup.name}: {total} batches, segments of {segment}, {rounds} rounds")
    t0 = time.perf_counter()
    try:
        trainer.fit(task, loader)
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - t0
    ms = clock.batch_ms()
    if len(ms) < total:
        raise RuntimeError(f"{setup.name}: {len(ms)} batches timed, expected {total}")
    return {
        "setup": setup.name,
        "title": setup.title,
        "overhead_budget": budget,
        "stretch": steady.monitor.sampler.stretch,
        "budget_measured": steady.monitor.budget.measured if steady.monitor.budget else None,
        "wall_s": wall,
        "global_steps": trainer.global_step,
        "batches": total,
        **_ratios(segments, ms, gate.sampled),
        "unsampled_host_us": _host_us(segments, gate),
        "findings": {
            row.detector: row.count
            for summary in [*steady.summaries, steady.monitor.summary(-1)]
            for row in summary.rows
            if row.status != "ok"
        },
    }


def _ratios(segments: Sequence[Segment], ms: Sequence[float], sampled: Sequence[bool]) -> dict:
    def times(seg: Segment) -> list[float]:
        return list(ms[seg.start : seg.start + seg.length])

    def mean(i: int) -> float:
        return statistics.fmean(times(segments[i]))

    ratios, null, unsampled, plain_ms = [], [], [], []
    for i, seg in enumerate(segments):
        if seg.round < 1:
            continue
        if seg.variant == PLAIN:
            plain_ms += times(seg)
            if 2 <= i < len(segments) - 2:
                null.append(mean(i) / ((mean(i - 2) + mean(i + 2)) / 2))
            continue
        before, after = times(segments[i - 1]), times(segments[i + 1])
        ref = (statistics.fmean(before) + statistics.fmean(after)) / 2
        ratios.append(statistics.fmean(times(seg)) / ref)
        ref_median = (statistics.median(before) + statistics.median(after)) / 2
        unsampled += [
            ms[b] / ref_median for b in range(seg.start, seg.start + seg.length) if not sampled[b]
        ]
    return {
        "plain_ms_per_batch": statistics.median(plain_ms),
        "ratio": {**_quartiles(ratios), "ci95": _median_ci(ratios), "n": len(ratios)},
        "noise": {**_quartiles(null), "ci95": _median_ci(null), "n": len(null)} if null else None,
        "unsampled_batch_ratio": statistics.median(unsampled) if unsampled else None,
    }


def _host_us(segments: Sequence[Segment], gate: BatchGate) -> dict[str, float]:
    """The time inside the stethoscope's hooks on its unsampled batches, in microseconds."""
    us = [
        gate.host_us[b]
        for seg in segments
        if seg.variant == STETHOSCOPE and seg.round >= 1
        for b in range(seg.start, seg.start + seg.length)
        if not gate.sampled[b]
    ]
    return {**_quartiles(us), "mean": statistics.fmean(us), "n": len(us)}


def markdown(results: Sequence[dict], env: dict[str, Any], wall_s: float) -> str:
    lines = [
        "| set-up | budget: stretch, cost it measured | plain ms/batch | "
        "stethoscope / plain: median [IQR] | 95% CI | "
        "unsampled batches / plain median | host µs in the hooks, unsampled batch: median "
        "[IQR] | noise floor: median [IQR] | findings |",
        "|---|---|---:|---|---|---:|---|---|---|",
    ]
    for r in results:
        q, n, h = r["ratio"], r["noise"], r["unsampled_host_us"]
        noise = f"{n['median']:.3f}x [{n['q1']:.3f}–{n['q3']:.3f}]" if n else "—"
        found = ", ".join(f"{k} {v}" for k, v in sorted(r["findings"].items())) or "none"
        budget = "none"
        if r["overhead_budget"] is not None:
            seen = r["budget_measured"]
            budget = f"{r['overhead_budget']:.1%}: {r['stretch']}x, " + (
                f"{seen:.2%}" if seen is not None else "not measured"
            )
        lines.append(
            f"| {r['setup']}: {r['title']} | {budget} | {r['plain_ms_per_batch']:.2f} | "
            f"{q['median']:.3f}x [{q['q1']:.3f}–{q['q3']:.3f}] | "
            f"{q['ci95'][0]:.3f}–{q['ci95'][1]:.3f} | {r['unsampled_batch_ratio']:.3f}x | "
            f"{h['median']:.0f} [{h['q1']:.0f}–{h['q3']:.0f}] | {noise} | {found} |"
        )
    lines += [
        "",
        f"{env['date']}; torch {env['torch']}, lightning {env['lightning']}, {THREADS} torch "
        f"threads on {env['cpu']} ({env['cpu_count']} CPUs). `{env['command']}`: "
        f"{wall_s / 60:.1f} min. The benchmark MLP (784-512-512-10, batch 128).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.setups",
        description="LightningStethoscope's overhead with gradient accumulation, "
        "torch.compile and manual optimization, paired in one process.",
    )
    p.add_argument("--setup", choices=(*SETUPS, "all"), default="all")
    p.add_argument("--rounds", type=int, default=None, help=f"default {DEFAULT_ROUNDS}")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds: a smoke run")
    p.add_argument("--json", metavar="PATH", help="also write every number")
    p.add_argument(
        "--budgets",
        default="0.01",
        help="comma-separated overhead budgets (fractions, 'none' for none) to run each "
        "set-up under, e.g. none,0.05,0.01,0.005 (default: 0.01, the callback's default)",
    )
    args = p.parse_args(argv)
    _quiet()
    torch.set_num_threads(THREADS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    names = list(SETUPS) if args.setup == "all" else [args.setup]
    env = environment()
    shown = sys.argv[1:] if argv is None else list(argv)
    env["command"] = " ".join(["python -m benchmarks.setups", *shown])

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    budgets = [
        None if b.strip().lower() == "none" else float(b) for b in args.budgets.split(",") if b
    ]
    results = [
        run_setup(SETUPS[n], rounds, not args.quick, log, budget)
        for n in names
        for budget in budgets
    ]
    wall = time.perf_counter() - t0
    print(markdown(results, env, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
