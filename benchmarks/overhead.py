"""Per-step overhead of LightningStethoscope on the CPU, measured inside one process.

Four ways to train the same model are compared, step for step:

* ``plain``: Lightning with no callback;
* ``stethoscope``: ``LightningStethoscope(sinks=[])``: default detectors, sampler
  and policy; ``sinks=[]`` only silences the console (the default ConsoleSink
  prints nothing on a healthy run but the epoch summary, outside the timed steps);
* ``detect_anomaly``: autograd anomaly mode, as ``Trainer(detect_anomaly=True)``
  sets it;
* ``naive``: a callback that reads ``p.grad.norm().item()`` for every parameter in
  ``on_before_optimizer_step`` and checks ``math.isfinite``;

plus ``stethoscope (calibration)``: a fresh ``LightningStethoscope(sinks=[])``
over its first 128 steps, where the sampler reads gradients on every step at
first and backs off to its base intervals (16 and 32 steps).

How. Shared machines are noisy: the same plain run varies by a quarter between
runs, and on a small VM the speed of whole stretches of a second or less jumps
by as much. Ratios from separate runs, or from separate short ``Trainer`` runs
(two plain 37-step blocks a second apart differ by ±9% at the interquartile
range), cannot resolve a few percent. So each model trains in ONE
``trainer.fit`` and the variants take turns in segments of 32 steps (the longest
base interval): ``plain, A, plain, B, plain, ...``, the others in a shuffled order
each round, for many rounds. A gating callback hands each step's hooks to the callbacks of the
variant that owns the step (none, for ``plain``) and turns autograd anomaly
mode on for the ``detect_anomaly`` steps, with the same call that
``Trainer(detect_anomaly=True)`` makes around its loop
(``torch.autograd.set_detect_anomaly``). A step is timed from one
``on_train_batch_start`` to the next, so it includes the forward and backward
passes, the optimizer step, every hook and fetching the next (pre-built,
in-memory) batch. Each segment's ratio is taken against the mean of the two
plain segments around it; the report gives the median and interquartile range
of those ratios. A first, warm-up round is dropped (``--quick`` skips it).

The steady-state ``stethoscope`` is one instance for the whole run. It runs
alone through an untimed pre-roll past its 128-step calibration window, then
sees only its own segments; its state (detector baselines, sampler schedule)
lives in its ``Monitor``, and ``setup`` runs once. Its schedule follows the
global step, and segments start half-way between its samples, so each
segment holds exactly one gradient sample, in its middle. Each calibration
segment gets a fresh instance, set up at the segment's first step (about 0.1 ms,
which a real run pays at fit start instead), with the sampler's calibration
starting at that step. Those runs start on a model that earlier steps have
already trained, not on a fresh one as a real run does: their detectors
calibrate on a small loss, and may report what they would not at a real start
(the report lists what they found); the sampling schedule, which sets the cost,
is the same. The synthetic task is learnable, so the run stays healthy; the
report counts the findings to show it.

Run:
    python -m benchmarks.overhead                      # both models, ~7 min on 2 cores
    python -m benchmarks.overhead --quick              # smoke run, under a minute
    python -m benchmarks.overhead --model mlp --rounds 100 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks._dispatch import STEP_HOOKS, call_hook
from benchmarks._machine import machine
from stethoscope import LightningStethoscope
from stethoscope.record import RunRecord

THREADS = 2
SEED = 0
CALIBRATION_EVERY = 3  # rounds
POOL_BATCHES = 64  # distinct synthetic batches per model, cycled
DEFAULT_ROUNDS = {"mlp": 100, "cnn": 14}  # about 4 and 2.5 minutes on 2 cores
QUICK_ROUNDS = 2

PLAIN = "plain"
STETHOSCOPE = "stethoscope"
ANOMALY = "detect_anomaly"
NAIVE = "naive"
CALIBRATION = "stethoscope (calibration)"
RECORDED = "stethoscope + record"
VARIANTS = (PLAIN, STETHOSCOPE, RECORDED, ANOMALY, NAIVE, CALIBRATION)

DESCRIPTIONS = {
    PLAIN: "Lightning with no callback but the benchmark's own: the clock and the idle gate "
    "(a few microseconds a step, in every variant)",
    STETHOSCOPE: "LightningStethoscope(sinks=[]): the defaults (every detector, the adaptive "
    "sampler, stop_on='error') past calibration; sinks=[] only keeps this output clean: the "
    "default ConsoleSink prints nothing on a healthy run but the epoch summary, which falls "
    "outside the timed steps",
    RECORDED: "LightningStethoscope(sinks=[], record=DIR): the same defaults, also keeping the "
    "run's record (every loss, the sampled statistics, distributions every 512 steps, written "
    "about once a second); a steady instance of its own, past calibration",
    ANOMALY: "autograd anomaly mode, switched on as Trainer(detect_anomaly=True) does",
    NAIVE: "callback: p.grad.norm().item() + math.isfinite for every parameter, every step",
    CALIBRATION: "a fresh LightningStethoscope(sinks=[]) over its first {n} steps (sampler hot: "
    "gradients every step, then every 2, 4, 8 steps)",
}


# -- models and data -----------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_size: int
    signal: float  # strength of the class pattern in the synthetic inputs
    title: str


MODELS = {
    "mlp": ModelSpec("mlp", mlp, (784,), 128, 0.1, "MLP 784-512-512-10, batch 128"),
    "cnn": ModelSpec(
        "cnn", cnn, (3, 32, 32), 64, 0.5, "CNN conv32-pool-conv64-pool-linear on 3x32x32, batch 64"
    ),
}


def synthetic_batches(spec: ModelSpec, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` learnable batches: Gaussian noise plus a faint pattern of each sample's class."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, *spec.input_shape, generator=g)
    batches = []
    for _ in range(n):
        y = torch.randint(0, 10, (spec.batch_size,), generator=g)
        x = torch.randn(spec.batch_size, *spec.input_shape, generator=g) + spec.signal * patterns[y]
        batches.append((x.contiguous(), y))
    return batches


class _Cycle(Dataset):
    """Pre-built batches, cycled: a loader with no collation cost."""

    def __init__(self, pool: Sequence[tuple[torch.Tensor, ...]], length: int) -> None:
        self.pool, self.length = pool, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.pool[i % len(self.pool)]


class Task(L.LightningModule):
    """Cross-entropy classification with Adam."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# -- callbacks -----------------------------------------------------------------------


class StepClock(Callback):
    """Records ``perf_counter`` and the global step at every ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter())
        self.steps.append(trainer.global_step)

    def step_ms(self) -> dict[int, float]:
        """Milliseconds of every step that another batch start followed, by global step."""
        t = self.times
        return {self.steps[i]: 1e3 * (t[i + 1] - t[i]) for i in range(len(t) - 1)}


class NaiveGradCheck(Callback):
    """What one writes by hand: a host read of every gradient norm, every step."""

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        for name, p in pl_module.named_parameters():
            if p.grad is not None and not math.isfinite(p.grad.norm().item()):
                raise FloatingPointError(f"non-finite gradient in {name}")


# -- the schedule ----------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive steps from global step ``start``, owned by ``variant``."""

    variant: str
    round: int  # -1: pre-roll, 0: warm-up
    start: int
    length: int


def schedule(
    rounds: int,
    segment: int,
    calib_n: int,
    preroll: int,
    rng: random.Random,
    warmup: bool,
    *,
    variants: Sequence[str] = (STETHOSCOPE, ANOMALY, NAIVE),
    occasional: str = CALIBRATION,
    every: int = CALIBRATION_EVERY,
    preroll_owner: str = STETHOSCOPE,
) -> list[Segment]:
    """The pre-roll, then per round ``plain, A, plain, B, ..., plain`` (A, B, ... shuffled).

    ``variants`` run every round in ``segment`` steps; ``occasional`` joins them every
    ``every`` rounds, in ``calib_n`` steps (a start-up window).
    """
    segments = [Segment(preroll_owner, -1, 0, preroll)]
    step = preroll
    for rnd in range(0 if warmup else 1, rounds + 1):
        others = list(variants)
        if rnd % every == 1:
            others.append(occasional)
        rng.shuffle(others)
        for key in [PLAIN, *(k for other in others for k in (other, PLAIN))]:
            n = calib_n if key == occasional else segment
            segments.append(Segment(key, rnd, step, n))
            step += n
    return segments


_RUN_HOOKS = ("setup", "on_train_start", "on_train_epoch_end", "teardown", "on_exception")


class Gate(Callback):
    """Hands each step's hooks to the callbacks of the variant that owns the step.

    Run-level hooks (``setup``, train start and end, epoch end, ``teardown``) go to
    the steady-state stethoscope, which lives through the whole fit. Each
    calibration segment gets a fresh stethoscope, set up when its first step starts.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        steady: LightningStethoscope,
        recorded: LightningStethoscope,
    ) -> None:
        self.steady, self.recorded = steady, recorded
        self.owner: list[str] = [s.variant for s in segments for _ in range(s.length)]
        self.starts = {s.start for s in segments}
        self.naive = NaiveGradCheck()
        self.calibration_runs: list[LightningStethoscope] = []
        self.active: list[Callback] = []
        self.anomaly = False
        # what the steady instance did on its own steps, recorded as it happened
        self.sampled: dict[int, bool] = {}
        self.hot: set[int] = set()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        key = self.owner[step] if step < len(self.owner) else PLAIN  # the untimed last step
        if key == CALIBRATION and step in self.starts:
            # stop_on=None: a fresh instance calibrating on an already trained model may find
            # what a real start would not (the report lists it); it must not end the benchmark
            fresh = LightningStethoscope(sinks=[], stop_on=None)
            fresh.setup(trainer, pl_module, "fit")
            fresh.on_train_start(trainer, pl_module)
            fresh.monitor.sampler.load_state_dict({"hot_since": step})  # its run starts now
            self.calibration_runs.append(fresh)
        if key == STETHOSCOPE:
            self.active = [self.steady]
        elif key == RECORDED:
            self.active = [self.recorded]
        elif key == NAIVE:
            self.active = [self.naive]
        elif key == CALIBRATION:
            self.active = [self.calibration_runs[-1]]
        else:
            self.active = []
        if self.anomaly != (key == ANOMALY):
            self.anomaly = key == ANOMALY
            torch.set_anomaly_enabled(self.anomaly, True)  # as set_detect_anomaly(mode) does
        for cb in self.active:
            call_hook(cb, "on_train_batch_start", trainer, batch, batch_idx)
        if key == STETHOSCOPE:
            self.sampled[step] = self.steady._measures.sampled
            if self.steady.monitor.sampler.hot:
                self.hot.add(step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.anomaly = False
        torch.set_anomaly_enabled(False, True)
        self.steady.on_train_end(trainer, pl_module)
        self.recorded.on_train_end(trainer, pl_module)


def _step_hook(name: str) -> Callable[..., None]:
    def hook(self: Gate, trainer: L.Trainer, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        for cb in self.active:
            call_hook(cb, name, trainer, *args, **kwargs)

    hook.__name__ = name
    return hook


def _run_hook(name: str) -> Callable[..., None]:
    def hook(self: Gate, *args: Any, **kwargs: Any) -> None:
        getattr(self.steady, name)(*args, **kwargs)
        getattr(self.recorded, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in STEP_HOOKS:
    setattr(Gate, _name, _step_hook(_name))
for _name in _RUN_HOOKS:
    setattr(Gate, _name, _run_hook(_name))


# -- one model -----------------------------------------------------------------------


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", module="lightning_utilities.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")


def calibration_steps(cb: LightningStethoscope) -> int:
    """Steps until the sampler, hot at the start of a run, reaches its base intervals."""
    sampler = cb.monitor.sampler
    return sampler.hot_steps * (max(sampler.base.values()) - 1).bit_length()


def gradient_interval(cb: LightningStethoscope) -> int:
    """The longest base interval: how often a healthy run reads gradients."""
    return max(cb.monitor.sampler.base.values())


def _findings(callbacks: Sequence[LightningStethoscope]) -> dict[str, int]:
    """Findings the callbacks recorded, by detector (sampler notices included)."""
    counts: dict[str, int] = {}
    for cb in callbacks:
        for summary in [*cb.summaries, cb.monitor.summary(-1)]:
            for row in summary.rows:
                if row.status != "ok":
                    counts[row.detector] = counts.get(row.detector, 0) + row.count
    return counts


@dataclass(frozen=True)
class Config:
    rounds: dict[str, int]
    segment: int
    models: tuple[str, ...]
    warmup: bool = True  # a first round, not counted
    seed: int = SEED
    precision: str = "32-true"  # the Trainer's: "bf16-true" runs the precision detectors


def run_model(spec: ModelSpec, cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    task = Task(spec.build())
    pool = synthetic_batches(spec, POOL_BATCHES, cfg.seed + 1)
    steady = LightningStethoscope(sinks=[], stop_on=None)  # its findings are reported, not acted on
    calib_n = calibration_steps(steady)
    every = gradient_interval(steady)
    # The pre-roll takes the steady instance past calibration (it leaves its hot state
    # when it observes step calib_n) and ends half-way between two gradient samples.
    preroll = calib_n + 1 + (every // 2 - calib_n - 1) % every
    rounds = cfg.rounds[spec.name]
    rng = random.Random(cfg.seed)
    segments = schedule(
        rounds,
        cfg.segment,
        calib_n,
        preroll,
        rng,
        cfg.warmup,
        variants=(STETHOSCOPE, RECORDED, ANOMALY, NAIVE),
    )
    total = segments[-1].start + segments[-1].length
    record_dir = Path(tempfile.mkdtemp(prefix="stethoscope-bench-"))
    recorded = LightningStethoscope(sinks=[], stop_on=None, record=record_dir / "run")
    gate = Gate(segments, steady, recorded)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=total + 1,  # +1: the last timed step ends at the next batch start
        max_epochs=-1,
        callbacks=[clock, gate],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        precision=cfg.precision,
    )
    loader = DataLoader(_Cycle(pool, total + 2), batch_size=None, shuffle=False)
    # Move everything alive now out of the collector's sight: collections during the
    # run then walk only what the run itself makes, whichever variant's step they hit.
    gc.collect()
    gc.freeze()
    log(
        f"{spec.name}: {total} steps ({preroll} pre-roll; {rounds} rounds"
        f"{' after a warm-up round' if cfg.warmup else ''}; segments of {cfg.segment} steps, "
        f"{calib_n} for calibration)"
    )
    t0 = time.perf_counter()
    try:
        trainer.fit(task, loader)
    finally:
        gc.unfreeze()
    log(f"{spec.name}: {time.perf_counter() - t0:.0f}s")

    ms = clock.step_ms()
    if sorted(ms) != list(range(total)):
        raise RuntimeError(f"timed steps {min(ms)}..{max(ms)} ({len(ms)}), expected 0..{total - 1}")
    result = summarise(segments, ms, gate.sampled, gate.hot)
    result["record"] = _record_cost(result, recorded)
    shutil.rmtree(record_dir, ignore_errors=True)
    result["model"] = spec.name
    result["title"] = spec.title
    result["rounds"] = rounds
    result["calibration_steps"] = calib_n
    result["stethoscope_health"] = {
        "findings_steady": _findings([steady]),
        "escalations_steady": steady.monitor.sampler.escalations,
        "findings_calibration_runs": _findings(gate.calibration_runs),
        "calibration_runs": len(gate.calibration_runs),
    }
    return result


def _record_cost(result: dict[str, Any], recorded: LightningStethoscope) -> dict[str, Any]:
    """What recording adds to the same stethoscope, round by round (the two variants'
    segments of one round against the same plain reference), and the record's size."""
    with_record = result["variants"][RECORDED]["per_segment_ratio_of_means"]
    without = result["variants"][STETHOSCOPE]["per_segment_ratio_of_means"]
    paired = [a / b for a, b in zip(with_record, without, strict=True)]
    path = recorded.recorder.path
    size = sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    with RunRecord(path) as record:
        steps = len(record.losses().steps)
    return {
        "vs_stethoscope": {**_quartiles(paired), "ci95": _median_ci(paired), "n": len(paired)},
        "bytes": size,
        "steps": steps,
        "bytes_per_1000_steps": size / steps * 1000 if steps else None,
    }


# -- statistics ----------------------------------------------------------------------


def _quartiles(xs: Sequence[float]) -> dict[str, float]:
    """First quartile, median and third quartile."""
    if len(xs) == 1:
        return {"q1": xs[0], "median": xs[0], "q3": xs[0]}
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"q1": q1, "median": q2, "q3": q3}


def _median_ci(xs: Sequence[float], seed: int = SEED, n: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``xs``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


def summarise(
    segments: Sequence[Segment],
    ms: dict[int, float],
    sampled: dict[int, bool],
    hot: set[int] | frozenset[int] = frozenset(),
) -> dict[str, Any]:
    def times(seg: Segment) -> list[float]:
        return [ms[s] for s in range(seg.start, seg.start + seg.length)]

    def mean_of(seg: Segment) -> float:
        return statistics.fmean(times(seg))

    out: dict[str, Any] = {"variants": {}}
    for key in VARIANTS:
        mine = [(i, seg) for i, seg in enumerate(segments) if seg.variant == key and seg.round >= 1]
        all_ms = [t for _, seg in mine for t in times(seg)]
        entry: dict[str, Any] = {
            "median_ms": statistics.median(all_ms),
            "mean_ms": statistics.fmean(all_ms),
            "steps_timed": len(all_ms),
            "segments": len(mine),
        }
        if key != PLAIN:
            by_mean, by_median, at_base = [], [], []
            split: dict[str, list[float]] = {"sampled": [], "unsampled": []}
            for i, seg in mine:
                before, after = times(segments[i - 1]), times(segments[i + 1])
                assert segments[i - 1].variant == segments[i + 1].variant == PLAIN
                own = times(seg)
                ref_mean = statistics.fmean([statistics.fmean(before), statistics.fmean(after)])
                ref_median = statistics.fmean([statistics.median(before), statistics.median(after)])
                by_mean.append(statistics.fmean(own) / ref_mean)
                by_median.append(statistics.median(own) / ref_median)
                if key == STETHOSCOPE and not any(
                    s in hot for s in range(seg.start, seg.start + seg.length)
                ):
                    at_base.append(by_mean[-1])
                if key == STETHOSCOPE:
                    for s in range(seg.start, seg.start + seg.length):
                        split["sampled" if sampled[s] else "unsampled"].append(ms[s] / ref_median)
            entry["ratio_of_means"] = _quartiles(by_mean)
            entry["ratio_of_means"]["ci95"] = _median_ci(by_mean)
            entry["ratio_of_medians"] = _quartiles(by_median)
            entry["per_segment_ratio_of_means"] = by_mean
            if key == STETHOSCOPE and at_base:
                entry["ratio_of_means_at_base"] = {
                    **_quartiles(at_base),
                    "ci95": _median_ci(at_base),
                    "n": len(at_base),
                    "of": len(by_mean),
                }
            if key == STETHOSCOPE:
                entry["step_ratio_by_kind"] = {
                    k: {"n": len(xs), "median": statistics.median(xs) if xs else None}
                    for k, xs in split.items()
                }
        out["variants"][key] = entry
    # The noise floor: a plain segment against the plain segments two away, as if it
    # were a variant (same round, so the segments between them are one other variant's).
    null = [
        mean_of(seg) / statistics.fmean([mean_of(segments[i - 2]), mean_of(segments[i + 2])])
        for i, seg in enumerate(segments)
        if seg.variant == PLAIN
        and seg.round >= 1
        and 2 <= i < len(segments) - 2
        and segments[i - 2].variant == segments[i + 2].variant == PLAIN
        and segments[i - 2].round == segments[i + 2].round == seg.round
    ]
    if null:
        out["plain_vs_plain"] = {**_quartiles(null), "ci95": _median_ci(null), "n": len(null)}
    out["segments"] = [
        {"variant": seg.variant, "round": seg.round, "start": seg.start, "ms": times(seg)}
        for seg in segments
    ]
    return out


# -- report --------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    return {
        **machine(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _counts(by_detector: dict[str, int]) -> str:
    if not by_detector:
        return "none"
    return ", ".join(f"{n} {name}" for name, n in sorted(by_detector.items()))


def _ratio(r: dict[str, Any]) -> str:
    return f"{r['median']:.3f}x [{r['q1']:.3f}–{r['q3']:.3f}]"


def _ci(r: dict[str, Any]) -> str:
    return f"{r['ci95'][0]:.3f}–{r['ci95'][1]:.3f}"


def markdown(results: list[dict[str, Any]], env: dict[str, Any], cfg: Config, wall_s: float) -> str:
    lines = [
        "| model | variant | median ms/step | mean ms/step | ratio vs plain, segment means: "
        "median [IQR] | 95% CI of that median | ratio vs plain, segment medians: "
        "median [IQR] |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for res in results:
        for key in VARIANTS:
            e = res["variants"][key]
            cells = [res["model"], key, f"{e['median_ms']:.2f}", f"{e['mean_ms']:.2f}"]
            if key == PLAIN:
                cells += ["1 (reference)", "", "1 (reference)"]
            else:
                r = e["ratio_of_means"]
                cells += [_ratio(r), _ci(r), _ratio(e["ratio_of_medians"])]
            lines.append("| " + " | ".join(cells) + " |")
    calib_n = results[0]["calibration_steps"] if results else 128
    rounds = ", ".join(f"{r['model']} {r['rounds']}" for r in results)
    notes = [
        "",
        f"{env['date']}; torch {env['torch']}, lightning {env['lightning']}, "
        f"Python {env['python']}; {env['torch_threads']} torch threads on {env['cpu']} "
        f"({env['cpu_count']} CPUs). `{env['command']}`: {wall_s / 60:.1f} min.",
        "",
        f"Precision {cfg.precision}. One trainer.fit per model; the variants take turns in "
        f"segments of {cfg.segment} steps "
        f"({calib_n} for the calibration row, every {CALIBRATION_EVERY} rounds), each round "
        "plain, A, plain, B, plain, ... with the others shuffled; rounds"
        f"{' after a warm-up round' if cfg.warmup else ' (no warm-up round)'}: {rounds}. "
        "A step is timed from one on_train_batch_start to the next (forward, backward, "
        "optimizer, every hook, the next in-memory batch). Each "
        "segment's ratio is taken against the mean of the two plain segments around it; "
        "the table gives the median and interquartile range of those ratios. Segment means "
        "count every step, including the sampled steps on which the stethoscope reads "
        "gradient norms; medians hide those steps.",
        "",
    ]
    for key in VARIANTS:
        notes.append(f"- {key}: {DESCRIPTIONS[key].format(n=calib_n)}")
    notes.append("")
    for res in results:
        null = res.get("plain_vs_plain")
        if null:
            notes.append(
                f"{res['model']}: noise floor, a plain segment against the plain segments two "
                f"away: {_ratio(null)}, 95% CI of the median {_ci(null)} (n={null['n']})."
            )
    for res in results:
        rec = res["record"]
        notes.append(
            f"{res['model']}: recording, the same stethoscope with record= against without, "
            f"segment by segment in each round: {_ratio(rec['vs_stethoscope'])}, 95% CI "
            f"{_ci(rec['vs_stethoscope'])} (n={rec['vs_stethoscope']['n']}); the record held "
            f"{rec['steps']} steps in {rec['bytes'] / 1e6:.2f} MB, "
            f"{rec['bytes_per_1000_steps'] / 1e3:.0f} kB per 1,000 steps."
        )
    for res in results:
        split = res["variants"][STETHOSCOPE].get("step_ratio_by_kind", {})
        h = res["stethoscope_health"]
        parts = [
            f"{k} steps {v['median']:.3f}x (n={v['n']})"
            for k, v in split.items()
            if v["median"] is not None
        ]
        base = res["variants"][STETHOSCOPE].get("ratio_of_means_at_base")
        if base:
            parts.append(
                f"segments with the sampler at its base intervals (no escalation window): "
                f"{_ratio(base)}, 95% CI {_ci(base)} ({base['n']} of {base['of']} segments)"
            )
        notes.append(
            f"{res['model']}: stethoscope steps vs the median of the plain segments around "
            "them: " + ", ".join(parts) + ". Findings in the steady-state run: "
            f"{_counts(h['findings_steady'])}, sampler escalations: "
            f"{h['escalations_steady']}; in the {h['calibration_runs']} calibration runs: "
            f"{_counts(h['findings_calibration_runs'])}."
        )
    return "\n".join(lines + notes)


# -- CLI -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Per-step overhead of LightningStethoscope against plain Lightning, "
        "detect_anomaly and a naive gradient check, on the CPU, with the variants "
        "interleaved in short segments of one training run.",
    )
    p.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured rounds per model (default: mlp 100, cnn 14; "
        f"{QUICK_ROUNDS} with --quick); a warm-up round comes first, except with --quick",
    )
    p.add_argument(
        "--block-steps",
        type=int,
        default=None,
        help="steps per segment (default: the stethoscope's longest base interval, 32); a "
        "multiple of it, so every segment holds as many samples of every detector",
    )
    p.add_argument("--json", metavar="PATH", help="also write every step time and summary")
    p.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed", "bf16-true"),
        default="32-true",
        help="the Trainer's precision: in bf16-mixed and bf16-true the precision detectors "
        "take part (in bf16-true they judge the weights too)",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds, no warm-up round: a smoke run"
    )
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    every = gradient_interval(LightningStethoscope(sinks=[]))
    if args.block_steps is None:
        args.block_steps = every
    if args.block_steps < every or args.block_steps % every:
        p.error(f"--block-steps must be a multiple of {every}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    torch.set_num_threads(THREADS)
    models = ("mlp", "cnn") if args.model == "both" else (args.model,)
    default = dict.fromkeys(models, QUICK_ROUNDS) if args.quick else DEFAULT_ROUNDS
    cfg = Config(
        rounds={m: args.rounds or default[m] for m in models},
        segment=args.block_steps,
        models=models,
        warmup=not args.quick,
        precision=args.precision,
    )

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    env = environment()
    shown = sys.argv[1:] if argv is None else list(argv)
    env["command"] = " ".join(["python -m benchmarks.overhead", *shown])
    t0 = time.perf_counter()
    results = [run_model(MODELS[m], cfg, log) for m in cfg.models]
    wall = time.perf_counter() - t0
    print(markdown(results, env, cfg, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "config": vars(cfg), "wall_s": wall, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
