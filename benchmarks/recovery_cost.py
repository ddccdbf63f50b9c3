"""What ``recover=True`` costs on a healthy Lightning run, and what one snapshot and one
roll back cost, on the CPU (2 threads).

Two measurements:

* **the ladder's own work, timed inside the run**: every call of the gate's verdict
  (the step's loss, its global gradient norm, the detectors' bars), of the wrapper
  around ``optimizer.step`` beyond the optimizer itself, and of the after-step hook
  (snapshots included), summed over a fit of the benchmark MLP and divided by its
  steps, against the median step;
* **paired fits**: the same model trained ``--rounds`` times with the default callback
  and with ``recover=True``, alternately, each fit ``--steps`` steps; the ratio of
  their median step times, round by round (noisier: a fit's speed varies by a few %).

Then one snapshot and one roll back of the MLP (1.9 M parameters with Adam) and of a
larger MLP (~50 M parameters), timed directly.

Run:
    python -m benchmarks.recovery_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks._machine import machine
from benchmarks.overhead import MODELS, SEED, StepClock, Task, _Cycle, _quiet, synthetic_batches
from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning import recovery as lightning_recovery

THREADS = 2


class _Timers:
    """Wall time spent in the ladder's hooks, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - began
                self.calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _fit(callback: LightningStethoscope, pool: list, steps: int) -> list[float]:
    torch.manual_seed(SEED)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        max_epochs=-1,
        callbacks=[clock, callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Task(MODELS["mlp"].build()), DataLoader(_Cycle(pool, steps + 2), batch_size=None))
    ms = clock.step_ms()
    return [ms[s] for s in sorted(ms) if s >= 64]  # past the sampler's calibration


def ladder_work(pool: list, steps: int) -> dict[str, Any]:
    """The ladder's own time per step, measured inside one fit."""
    timers = _Timers()
    gate, rec = lightning_recovery.StepGate, lightning_recovery.LightningRecovery
    timers.wrap(gate, "_why", "verdict (loss, gradient norm, bars)")
    timers.wrap(gate, "saw_loss", "reading the loss")
    timers.wrap(rec, "after_step", "after the step (snapshots included)")
    timers.wrap(lightning_recovery.Snapshots, "take", "snapshots")
    try:
        step_ms = _fit(LightningStethoscope(sinks=[], recover=True), pool, steps)
    finally:
        timers.restore()
    median_ms = statistics.median(step_ms)
    per_step = {k: 1e6 * v / steps for k, v in timers.seconds.items()}
    return {"median_step_ms": median_ms, "us_per_step": per_step, "calls": dict(timers.calls)}


def paired(pool: list, steps: int, rounds: int) -> list[float]:
    """Median step time with recover=True over the default callback's, per round."""
    ratios = []
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        medians = {}
        for recover in order:
            medians[recover] = statistics.median(
                _fit(LightningStethoscope(sinks=[], recover=recover), pool, steps)
            )
        ratios.append(medians[True] / medians[False])
    return ratios


def snapshot_cost(width: int) -> dict[str, float]:
    """One snapshot and one roll back of an MLP of ``width`` units trained one step."""
    torch.manual_seed(SEED)
    net = nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 10)
    )
    task = Task(net)
    callback = LightningStethoscope(sinks=[], recover=True)
    pool = synthetic_batches(MODELS["mlp"], 2, SEED)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    snaps: dict[str, float] = {}

    class Measure(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            recovery = callback._recovery
            began = time.perf_counter()
            recovery.snapshots.take(trainer.global_step, trainer, module, callback.monitor)
            snap, state = recovery.snapshots.newest()  # on the CPU: landed already
            snaps["snapshot_ms"] = 1e3 * (time.perf_counter() - began)
            snaps["snapshot_mb"] = snap.nbytes / 1e6
            began = time.perf_counter()
            recovery.snapshots.put_back(state, trainer, module, callback.monitor)
            snaps["rollback_ms"] = 1e3 * (time.perf_counter() - began)

    trainer.callbacks.append(Measure())
    trainer.fit(task, DataLoader(_Cycle(pool, 4), batch_size=None))
    snaps["parameters_m"] = sum(p.numel() for p in net.parameters()) / 1e6
    return snaps


def _keras_spec(name: str) -> Any:
    """The Keras benchmark model ``name``: the overhead benchmark's MLP, or ``bn-cnn``,
    its CNN with a BatchNormalization after each convolution and a Dropout before the
    head (state a training step assigns before its verdict, which a skip puts back)."""
    import dataclasses

    import keras

    from benchmarks.keras_overhead import MODELS as KERAS_MODELS

    if name == "mlp":
        return KERAS_MODELS["mlp"]

    def bn_cnn() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.MaxPooling2D(2),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10),
            ],
            name="bn_cnn",
        )

    title = "CNN conv32-bn-pool-conv64-bn-pool-dropout-dense on 32x32x3, batch 64"
    return dataclasses.replace(KERAS_MODELS["cnn"], name="bn-cnn", build=bn_cnn, title=title)


def _keras_fit(
    recover: bool, steps: int, timers: _Timers | None = None, model_name: str = "mlp"
) -> list[float]:
    """One Keras fit of a benchmark model (a fresh model and callback); its step times
    past the sampler's calibration, in ms."""
    import keras
    import numpy as np

    from benchmarks.keras_overhead import StepClock as KerasClock
    from benchmarks.keras_overhead import synthetic
    from stethoscope import KerasStethoscope

    spec = _keras_spec(model_name)
    keras.utils.set_random_seed(SEED)
    model = spec.build()
    model.compile(
        keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = synthetic(spec, 64, SEED)
    reps = -(-steps // 64)
    x, y = np.concatenate([x] * reps), np.concatenate([y] * reps)
    clock = KerasClock()
    callback = KerasStethoscope(sinks=[], stop_on=None, recover=recover)
    model.fit(
        x[: steps * spec.batch_size],
        y[: steps * spec.batch_size],
        batch_size=spec.batch_size,
        shuffle=False,
        verbose=0,
        callbacks=[clock, callback],
    )
    t = clock.times
    return [1e3 * (t[i + 1] - t[i]) for i in range(64, len(t) - 1)]


def keras_ladder(steps: int, rounds: int, model_name: str = "mlp") -> dict[str, Any]:
    """Keras: the host's share of the ladder timed inside one fit, and paired fits (the
    verdict and the cond around the update run inside the traced step)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from stethoscope.callbacks._keras import recovery as keras_recovery

    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    timers = _Timers()
    timers.wrap(keras_recovery.KerasRecovery, "settle", "settling each step's verdict")
    timers.wrap(keras_recovery.KerasRecovery, "after_step", "after the step (bars, snapshots)")
    try:
        step_ms = _keras_fit(True, steps, model_name=model_name)
    finally:
        timers.restore()
    ratios = []
    for r in range(rounds):
        medians = {}
        for recover in [False, True] if r % 2 == 0 else [True, False]:
            medians[recover] = statistics.median(_keras_fit(recover, steps, model_name=model_name))
        ratios.append(medians[True] / medians[False])
    per_step = {k: 1e6 * v / steps for k, v in timers.seconds.items()}
    return {
        "median_step_ms": statistics.median(step_ms),
        "us_per_step": per_step,
        "ratios": ratios,
        "title": _keras_spec(model_name).title,
    }


def keras_snapshot_cost(width: int) -> dict[str, float]:
    """One snapshot and one roll back of a Keras MLP of ``width`` units with Adam, after
    a short fit."""
    import keras
    import numpy as np

    from stethoscope import KerasStethoscope
    from stethoscope.callbacks._keras.recovery import KerasRecovery

    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = np.random.default_rng(SEED).normal(size=(256, 784)).astype("float32")
    y = np.zeros(256, dtype="int64")
    callback = KerasStethoscope(sinks=[], recover=True)
    model.fit(x, y, batch_size=128, verbose=0, callbacks=[callback])
    ladder = KerasRecovery(callback.recoverer, callback._act)
    ladder.model = model
    began = time.perf_counter()
    ladder._take(2)
    snapshot_ms = 1e3 * (time.perf_counter() - began)
    began = time.perf_counter()
    ladder._put_back(ladder.snapshots.newest()[1])
    rollback_ms = 1e3 * (time.perf_counter() - began)
    snap = ladder.snapshots.kept[-1]
    ladder.close()
    return {
        "parameters_m": model.count_params() / 1e6,
        "snapshot_ms": snapshot_ms,
        "snapshot_mb": snap.nbytes / 1e6,
        "rollback_ms": rollback_ms,
    }


def keras_lines(work: dict[str, Any], steps: int) -> list[str]:
    lines = [
        "",
        f"Keras 3 (TensorFlow), {work['title']}, Adam; median step "
        f"{work['median_step_ms']:.2f} ms.",
        "",
        "| the ladder's host work (recover=True, healthy run) | µs per step |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in work["us_per_step"].items()]
    total = sum(work["us_per_step"].values())
    ratios = work["ratios"]
    lines += [
        f"| all of it | {total:.1f} ({total / 10 / work['median_step_ms']:.2f}% of a step) |",
        "",
        f"Paired Keras fits of {steps} steps, recover=True / default, median step time, per "
        f"round: {', '.join(f'{r:.3f}x' for r in ratios)} (median "
        f"{statistics.median(ratios):.3f}x).",
        "",
        "| Keras model | parameters | one snapshot | its size | one roll back |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, width in (("MLP 784-512-512-10", 512), ("MLP 784-5000-5000-10", 5000)):
        c = keras_snapshot_cost(width)
        lines.append(
            f"| {name} | {c['parameters_m']:.1f} M | {c['snapshot_ms']:.1f} ms | "
            f"{c['snapshot_mb']:.0f} MB | {c['rollback_ms']:.1f} ms |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery_cost", description=__doc__)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--framework", choices=("both", "lightning", "keras"), default="both")
    p.add_argument("--keras-model", choices=("mlp", "bn-cnn"), default="mlp")
    args = p.parse_args(argv)
    if args.framework == "keras":
        work = keras_ladder(args.steps, args.rounds, args.keras_model)
        lines = keras_lines(work, args.steps)
        m = machine()
        lines += ["", f"{m['date']}; " + ", ".join(f"{k} {v}" for k, v in m.items() if k != "date")]
        print("\n".join(lines))
        return 0
    torch.set_num_threads(THREADS)
    _quiet()
    pool = synthetic_batches(MODELS["mlp"], 64, SEED)
    work = ladder_work(pool, args.steps)
    ratios = paired(pool, args.steps, args.rounds)
    small, large = snapshot_cost(512), snapshot_cost(5000)
    total = sum(work["us_per_step"].values()) - work["us_per_step"].get("snapshots", 0.0)
    lines = [
        f"MLP 784-512-512-10, batch 128, Adam; median step {work['median_step_ms']:.2f} ms.",
        "",
        "| the ladder's work (recover=True, healthy run) | µs per step |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in work["us_per_step"].items()]
    lines += [
        f"| all of it | {total:.1f} ({total / 10 / work['median_step_ms']:.2f}% of a step) |",
        "",
        f"Paired fits of {args.steps} steps, recover=True / default, median step time, per "
        f"round: {', '.join(f'{r:.3f}x' for r in ratios)} (median "
        f"{statistics.median(ratios):.3f}x).",
        "",
        "| model | parameters | one snapshot | its size | one roll back |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, c in (("MLP 784-512-512-10", small), ("MLP 784-5000-5000-10", large)):
        lines.append(
            f"| {name} | {c['parameters_m']:.1f} M | {c['snapshot_ms']:.1f} ms | "
            f"{c['snapshot_mb']:.0f} MB | {c['rollback_ms']:.1f} ms |"
        )
    if args.framework == "both":
        lines += keras_lines(keras_ladder(args.steps, args.rounds), args.steps)
    m = machine()
    lines += ["", f"{m['date']}; " + ", ".join(f"{k} {v}" for k, v in m.items() if k != "date")]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
