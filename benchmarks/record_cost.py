"""What ``record=`` costs, accounted for inside one long run of each framework.

Recording adds two kinds of work to a run the callback already watches:

* **host work every step**: the recorder keeps each step's loss and, on sampled steps,
  the per-layer numbers the detectors were given; about once a second it writes them
  to SQLite. Timed directly: every call of the recorder (its ``observe``, which
  includes the writes, ``emit`` and ``epoch_end``).
* **the distribution steps**: every ``RunRecorder.every`` steps (512 by default) the
  adapter also histograms every weight and gradient. In Lightning the reductions run
  on the host thread (the CPU computes them as they are called), so they are timed
  directly too. In Keras they run inside the traced train step: their cost is how much
  longer a distribution step takes than the other steps with the same detectors due
  (steps at multiples of the longest base interval), times how many there are.

Both are summed over the steady state (after the sampler's calibration window and the
first distribution steps, where graphs are traced) and divided by its wall time. A
paired comparison of separate runs (``benchmarks/overhead.py``) cannot resolve a cost
of a few tenths of a percent, and its per-segment median hides a cost that falls on one
segment in sixteen; this accounting can.

Run:
    python -m benchmarks.record_cost                # both frameworks, ~2 minutes
    python -m benchmarks.record_cost --steps 4096   # shorter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._machine import machine
from benchmarks.recovery_cost import _Timers

#: Steps left out at the start: the sampler's calibration (128 steps) and the first
#: distribution steps, where Keras traces the step that histograms.
SETTLE = 1024
RECORDER_CALLS = ("observe", "emit", "epoch_end")


def lightning_cost(steps: int, directory: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.overhead import MODELS, SEED, StepClock, Task, _Cycle, _quiet, synthetic_batches
    from stethoscope import LightningStethoscope
    from stethoscope.callbacks._lightning import reductions
    from stethoscope.record import writer

    torch.set_num_threads(2)
    _quiet()
    timers = _Timers()
    for name in RECORDER_CALLS:
        timers.wrap(writer.RunRecorder, name, f"recorder.{name}")
    for name in ("before_step", "at_end", "decode"):
        timers.wrap(reductions.Distributions, name, "distributions")

    class Settle(L.Callback):
        """Forgets what the timers saw before the steady state."""

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == SETTLE:
                timers.seconds.clear()
                timers.calls.clear()

    torch.manual_seed(SEED)
    spec = MODELS["mlp"]
    callback = LightningStethoscope(sinks=[], stop_on=None, record=directory)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=SETTLE + steps + 1,
        callbacks=[clock, Settle(), callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    pool = synthetic_batches(spec, 64, SEED)
    try:
        data = DataLoader(_Cycle(pool, SETTLE + steps + 2), batch_size=None)
        trainer.fit(Task(spec.build()), data)
    finally:
        timers.restore()
    first = clock.steps.index(SETTLE)
    wall = clock.times[-1] - clock.times[first]
    n = len(clock.times) - 1 - first
    return _account(
        "Lightning",
        spec.title,
        wall,
        n,
        {k: v for k, v in timers.seconds.items() if k.startswith("recorder.")},
        timers.seconds.get("distributions", 0.0),
        timers.calls.get("distributions", 0) // 3,
        callback,
    )


def keras_cost(steps: int, directory: str) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks.keras_overhead import MODELS, SEED, StepClock, synthetic
    from stethoscope import KerasStethoscope
    from stethoscope.record import writer

    tf.config.threading.set_intra_op_parallelism_threads(2)
    timers = _Timers()
    for name in RECORDER_CALLS:
        timers.wrap(writer.RunRecorder, name, f"recorder.{name}")

    class Settle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if batch == SETTLE:
                timers.seconds.clear()
                timers.calls.clear()

    spec = MODELS["mlp"]
    keras.utils.set_random_seed(SEED)
    model = spec.build()
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    total = SETTLE + steps + 1
    x, y = synthetic(spec, 64, SEED)
    reps, rows = -(-total // 64), total * spec.batch_size
    x = np.concatenate([x] * reps)[:rows]
    y = np.concatenate([y] * reps)[:rows]
    callback = KerasStethoscope(sinks=[], stop_on=None, record=directory)
    clock = StepClock()
    try:
        model.fit(
            x,
            y,
            batch_size=spec.batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[clock, Settle(), callback],
        )
    finally:
        timers.restore()
    times = clock.times
    wall = times[-1] - times[SETTLE]
    n = len(times) - 1 - SETTLE
    step_s = {s: times[s + 1] - times[s] for s in range(SETTLE, len(times) - 1)}
    every = callback.recorder.wants_every
    longest = max(callback.monitor.sampler.base.values())
    histogram = [t for s, t in step_s.items() if s % every == 0]
    same_plan = [t for s, t in step_s.items() if s % longest == 0 and s % every]
    extra = max(0.0, statistics.median(histogram) - statistics.median(same_plan))
    result = _account(
        "Keras",
        spec.title,
        wall,
        n,
        {k: v for k, v in timers.seconds.items() if k.startswith("recorder.")},
        extra * len(histogram),
        len(histogram),
        callback,
    )
    result["distribution_step_ms"] = 1e3 * statistics.median(histogram)
    result["same_plan_step_ms"] = 1e3 * statistics.median(same_plan)
    return result


def _account(
    framework: str,
    model: str,
    wall: float,
    steps: int,
    recorder: dict[str, float],
    distributions_s: float,
    distribution_steps: int,
    callback: Any,
) -> dict[str, Any]:
    host = sum(recorder.values())
    return {
        "framework": framework,
        "model": model,
        "steps": steps,
        "step_ms": 1e3 * wall / steps,
        "host_us_per_step": 1e6 * host / steps,
        "distribution_steps": distribution_steps,
        "distributions_us_per_step": 1e6 * distributions_s / steps,
        "host_pct": 100 * host / wall,
        "distributions_pct": 100 * distributions_s / wall,
        "total_pct": 100 * (host + distributions_s) / wall,
        "escalations": callback.monitor.sampler.escalations,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| framework | steady steps | step | recorder (host) | distributions | recording in all |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['framework']} ({r['model']}) | {r['steps']} | {r['step_ms']:.2f} ms | "
            f"{r['host_us_per_step']:.1f} µs ({r['host_pct']:.2f}%) | "
            f"{r['distribution_steps']} steps, {r['distributions_us_per_step']:.1f} µs/step "
            f"({r['distributions_pct']:.2f}%) | **{r['total_pct']:.2f}%** |"
        )
    for r in results:
        if "distribution_step_ms" in r:
            lines.append(
                f"\n{r['framework']}: a distribution step takes "
                f"{r['distribution_step_ms']:.2f} ms, "
                f"a step with the same detectors due {r['same_plan_step_ms']:.2f} ms."
            )
    escalated = [r["framework"] for r in results if r["escalations"]]
    if escalated:
        lines.append(f"\nThe sampler escalated in: {', '.join(escalated)} (not a steady state).")
    m = machine()
    lines += ["", f"{m['date']}; " + ", ".join(f"{k} {v}" for k, v in m.items() if k != "date")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.record_cost", description=__doc__)
    p.add_argument("--steps", type=int, default=8192, help="steady-state steps per framework")
    p.add_argument("--framework", choices=("both", "lightning", "keras"), default="both")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.framework in ("both", "lightning"):
            results.append(lightning_cost(args.steps, f"{tmp}/lightning"))
        if args.framework in ("both", "keras"):
            results.append(keras_cost(args.steps, f"{tmp}/keras"))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    began = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    sys.exit(code)
