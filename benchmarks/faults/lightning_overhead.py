"""Per-step cost of the three sampling settings, on a healthy control, in ONE fit.

The method is that of ``benchmarks/overhead.py``, cut down to what the comparison
needs. Separate runs on a shared 2-core machine differ by more than the effect, so
one ``Trainer.fit`` of a healthy control (its model, data and optimizer as the
suite trains them) runs many rounds of 16-step segments, ``plain, A, plain, B,
plain, C, plain`` with ``A, B, C`` a fresh shuffle of ``every``, ``sparse`` and
``adaptive`` each round, and every third round one more segment, ``adaptive
(start)``, of the adaptive sampler's whole start-up window. A gating callback hands
each step's hooks to the stethoscope that owns the step (none, for ``plain``).

* ``every``, ``sparse`` and ``adaptive`` are one ``LightningStethoscope(sinks=[],
  stop_on=None, ...)`` each for the whole fit, with the arguments of their setting;
  they first see an untimed pre-roll together, which takes ``adaptive`` past its
  start-up window, so its segments show its steady state on a healthy run (which
  is ``sparse``'s schedule: it differs only after a suspicion).
* ``adaptive (start)`` is a fresh adaptive stethoscope per segment, set up at the
  segment's first step, whose sampler starts there: every step at first, then every
  2, 4, 8 … steps until the base intervals (the window a real run pays once, at its
  start). It is torn down at the segment's end.

A step is timed from one ``on_train_batch_start`` to the next: forward, backward,
optimizer, every hook, the next in-memory batch. A segment's ratio is its mean step
time over the mean of the two plain segments around it; the report gives the
median and interquartile range of those ratios, and the ms per step. From them it
estimates the overhead of a whole healthy run of ``N`` steps with the adaptive
default: ``(W * (start - 1) + (N - W) * (steady - 1)) / N`` for a start-up window of
``W`` steps. A first warm-up round is not counted (``--quick`` skips it).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks._dispatch import call_hook
from benchmarks.faults.data import make_data
from benchmarks.faults.lightning_suite import (
    ON_ONE_CPU,
    SuiteModule,
    make_loader,
    setting_kwargs,
)
from benchmarks.faults.scenarios import Scenario
from benchmarks.overhead import Segment, StepClock, schedule
from stethoscope import LightningStethoscope

__all__ = ["measure_overhead"]

PLAIN = "plain"
STEADY = ("every", "sparse", "adaptive")
START = "adaptive (start)"
SEGMENT = 16
START_EVERY = 3  # rounds
RUN_STEPS = 1000  # the healthy run whose whole-run overhead is estimated


def _start_window(cb: LightningStethoscope) -> int:
    """Steps until an adaptive sampler, hot at the start of a run, reaches its base intervals."""
    sampler = cb.monitor.sampler
    return sampler.hot_steps * (max(sampler.base.values()) - 1).bit_length()


def _overridden(cls: type) -> tuple[list[str], list[str]]:
    """The hooks ``cls`` overrides: per-step ones, and the rest."""
    step_hooks = {
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_zero_grad",
        "on_before_optimizer_step",
        "on_train_batch_end",
    }
    names = [
        n
        for n in dir(Callback)
        if (n.startswith("on_") or n in ("setup", "teardown"))
        and callable(getattr(Callback, n))
        and getattr(cls, n) is not getattr(Callback, n)
    ]
    return [n for n in names if n in step_hooks], [n for n in names if n not in step_hooks]


class _Gate(Callback):
    """Hands each step's hooks to the stethoscope that owns the step; run hooks to all."""

    def __init__(self, segments: Sequence[Segment], steady: dict[str, LightningStethoscope]):
        self.steady = steady
        self.owner = [s.variant for s in segments for _ in range(s.length)]
        self.starts = {s.start: s for s in segments}
        self.active: list[LightningStethoscope] = []
        self.fresh: LightningStethoscope | None = None
        self.fresh_runs: list[LightningStethoscope] = []
        _, self.run_hooks = _overridden(LightningStethoscope)
        self.fresh_ends = -1

    def _run_hook(self, name: str, *args: Any, **kwargs: Any) -> None:
        if name in self.run_hooks:
            for cb in self.steady.values():
                getattr(cb, name)(*args, **kwargs)

    def _step_hook(
        self, name: str, trainer: L.Trainer, pl_module: Any, *args: Any, **kwargs: Any
    ) -> None:
        for cb in self.active:  # every step hook, as Lightning calls them: being called costs
            call_hook(cb, name, trainer, *args, **kwargs)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.fresh is not None and step == self.fresh_ends:
            self.fresh.on_train_end(trainer, pl_module)
            self.fresh.teardown(trainer, pl_module, "fit")
            self.fresh = None
        key = self.owner[step] if step < len(self.owner) else PLAIN
        if key == START and step in self.starts:
            fresh = LightningStethoscope(sinks=[], stop_on=None)
            fresh.setup(trainer, pl_module, "fit")
            fresh.on_fit_start(trainer, pl_module)
            fresh.on_train_start(trainer, pl_module)
            fresh.monitor.sampler.load_state_dict({"hot_since": step})  # its run starts now
            self.fresh, self.fresh_ends = fresh, step + self.starts[step].length
            self.fresh_runs.append(fresh)
        if key == "preroll":
            self.active = list(self.steady.values())
        elif key in self.steady:
            self.active = [self.steady[key]]
        elif key == START:
            self.active = [self.fresh]
        else:
            self.active = []
        self._step_hook("on_train_batch_start", trainer, pl_module, batch, batch_idx)


def _forward(name: str, kind: str) -> Callable[..., None]:
    def hook(self: _Gate, *args: Any, **kwargs: Any) -> None:
        getattr(self, kind)(name, *args, **kwargs)

    hook.__name__ = name
    return hook


for _name in ("on_before_backward", "on_after_backward", "on_before_zero_grad"):
    setattr(_Gate, _name, _forward(_name, "_step_hook"))
for _name in ("on_before_optimizer_step", "on_train_batch_end"):
    setattr(_Gate, _name, _forward(_name, "_step_hook"))
for _name in (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_exception",
):
    setattr(_Gate, _name, _forward(_name, "_run_hook"))


def _quartiles(xs: Sequence[float]) -> dict[str, float]:
    if len(xs) == 1:
        return {"q1": xs[0], "median": xs[0], "q3": xs[0], "n": 1}
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"q1": q1, "median": q2, "q3": q3, "n": len(xs)}


def measure_overhead(
    sc: Scenario,
    *,
    rounds: int,
    warmup: bool = True,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Per-step overhead of every setting on healthy control ``sc``; see the module doc."""
    if not sc.healthy:
        raise ValueError(f"{sc.name} is not a healthy control")
    torch.manual_seed(seed)
    arrays = make_data(sc.data, seed)
    model = SuiteModule(sc, arrays)
    steady = {s: LightningStethoscope(sinks=[], stop_on=None, **setting_kwargs(s)) for s in STEADY}
    start_n = _start_window(steady["adaptive"])
    preroll = start_n + SEGMENT
    segments = schedule(
        rounds,
        SEGMENT,
        start_n,
        preroll,
        random.Random(seed),
        warmup,
        variants=STEADY,
        occasional=START,
        every=START_EVERY,
        preroll_owner="preroll",
    )
    total = segments[-1].start + segments[-1].length
    gate, clock = _Gate(segments, steady), StepClock()
    trainer = L.Trainer(
        max_steps=total + 1,  # +1: the last timed step ends at the next batch start
        max_epochs=-1,
        **ON_ONE_CPU,
        gradient_clip_val=sc.train.clip,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock, gate],
    )
    train = make_loader(arrays.x, arrays.y, sc.train.batch_size, seed)
    log(f"overhead on {sc.name}: {total} steps, {rounds} rounds of {SEGMENT}-step segments")
    gc.collect()
    gc.freeze()  # collections during the run walk only what the run makes
    t0 = time.perf_counter()
    try:
        trainer.fit(model, train)
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - t0
    ms = clock.step_ms()

    def mean_ms(seg: Segment) -> float:
        return statistics.fmean(ms[s] for s in range(seg.start, seg.start + seg.length))

    out: dict[str, Any] = {"scenario": sc.name, "rounds": rounds, "steps": total, "wall_s": wall}
    out["start_window"] = start_n
    counted = [(i, seg) for i, seg in enumerate(segments) if seg.round >= 1]
    plain = [
        ms[s]
        for _, seg in counted
        if seg.variant == PLAIN
        for s in range(seg.start, seg.start + seg.length)
    ]
    out["plain_ms"] = statistics.median(plain)
    variants: dict[str, Any] = {}
    for key in (*STEADY, START):
        ratios, own = [], []
        for i, seg in counted:
            if seg.variant != key:
                continue
            ref = statistics.fmean([mean_ms(segments[i - 1]), mean_ms(segments[i + 1])])
            ratios.append(mean_ms(seg) / ref)
            own.extend(ms[s] for s in range(seg.start, seg.start + seg.length))
        if ratios:
            variants[key] = {"ratio": _quartiles(ratios), "median_ms": statistics.median(own)}
    out["variants"] = variants
    if "adaptive" in variants and START in variants:
        steady_r = variants["adaptive"]["ratio"]["median"]
        start_r = variants[START]["ratio"]["median"]
        n = RUN_STEPS
        out["adaptive_run"] = {
            "steps": n,
            "overhead": (start_n * (start_r - 1) + (n - start_n) * (steady_r - 1)) / n,
        }
    return out
