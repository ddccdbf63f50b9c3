"""Per-step overhead of KerasStethoscope on the CPU (TensorFlow backend), in one process.

The same MLP and CNN as the Lightning rows of ``benchmarks/overhead.py``, trained
with Keras 3 and compared step for step:

* ``plain``: ``model.fit`` with no callback but the benchmark's clock;
* ``stethoscope``: ``KerasStethoscope(sinks=[], stop_on=None)``, the defaults, past
  its calibration window and the overhead budget's first windows;
* ``stethoscope + record``: the same with ``record=DIR``, the run's record kept;
* ``TerminateOnNaN``: ``keras.callbacks.TerminateOnNaN()``;
* ``check_numerics``: ``tf.debugging.enable_check_numerics()`` (every op's output
  checked; the train function is retraced with it on, and again with it off);
* ``batch-end no-op``: a callback whose ``on_train_batch_end`` does nothing. Keras
  dispatches batch-end callbacks on a thread unless one of them overrides that hook;
  then it waits for each one, every batch (``keras/src/callbacks/callback_list.py``).
  This row is the price of that alone, which KerasStethoscope and TerminateOnNaN pay.

How. A Keras callback cannot be switched on and off inside one ``fit`` (the
stethoscope's reductions are part of the traced train step), so each segment is
its own ``fit`` of ``segment + 2`` steps on the same model, continuing its training.
``--instances`` stethoscope instances (4) take turns at the stethoscope's segments, each
living through all of its own (its schedule follows the optimizer's step count): each
traces its own train functions, and a traced function's speed is a draw that lasts its
life (the same graph traced anew runs up to ~6% apart here), while the plain segments trace a
new plain function after every stethoscope segment. The report gives each instance's
median ratio too. The variants take turns ``plain, A, plain,
B, ...`` with the others shuffled each round (the schedule of ``overhead.py``). A
step is timed from one ``on_train_batch_begin`` to the next, so the first step of
each fit (where the function is traced) and its last step are not timed: every
fit times ``segment`` steps. Each segment's ratio is taken against the mean of the
two plain segments around it; the report gives the median, interquartile range
and a bootstrap 95% interval of those ratios.

Run:
    python -m benchmarks.keras_overhead              # both models, ~6 min on 2 cores
    python -m benchmarks.keras_overhead --quick      # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

from benchmarks.overhead import PLAIN, Segment, _median_ci, _quartiles, schedule
from stethoscope import KerasStethoscope

THREADS = 2
SEED = 0
POOL_BATCHES = 64
DEFAULT_ROUNDS = {"mlp": 40, "cnn": 10}
QUICK_ROUNDS = 2

STETHOSCOPE = "stethoscope"
RECORDED = "stethoscope + record"
TERMINATE = "TerminateOnNaN"
NUMERICS = "check_numerics"
NOOP = "batch-end no-op"
VARIANTS = (PLAIN, STETHOSCOPE, RECORDED, TERMINATE, NUMERICS, NOOP)

DESCRIPTIONS = {
    PLAIN: "model.fit with no callback but the benchmark's clock (on_train_batch_begin only)",
    STETHOSCOPE: "KerasStethoscope(sinks=[], stop_on=None): every detector, the adaptive "
    "sampler, past its calibration window and the budget's first windows",
    RECORDED: "the same, also keeping the run's record (record=DIR: every loss, the sampled "
    "statistics, distributions every 512 steps, written to SQLite once a second); each fit "
    "reopens the record, a cost per fit, not per step",
    TERMINATE: "keras.callbacks.TerminateOnNaN(): reads the logged loss after every batch",
    NUMERICS: "tf.debugging.enable_check_numerics(): every op's output checked",
    NOOP: "a callback with an empty on_train_batch_end: Keras then waits for the batch-end "
    "callbacks of every batch instead of running them on a thread",
}


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp",
    )


def cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ],
        name="cnn",
    )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], keras.Model]
    input_shape: tuple[int, ...]
    batch_size: int
    signal: float
    title: str


MODELS = {
    "mlp": ModelSpec("mlp", mlp, (784,), 128, 0.1, "MLP 784-512-512-10, batch 128"),
    "cnn": ModelSpec(
        "cnn", cnn, (32, 32, 3), 64, 0.5, "CNN conv32-pool-conv64-pool-dense on 32x32x3, batch 64"
    ),
}


def synthetic(spec: ModelSpec, n_batches: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable data: Gaussian noise plus a faint pattern of each sample's class."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(10, *spec.input_shape)).astype("float32")
    n = n_batches * spec.batch_size
    y = rng.integers(0, 10, n)
    x = rng.normal(size=(n, *spec.input_shape)).astype("float32") + spec.signal * patterns[y]
    return x, y.astype("int64")


class StepClock(keras.callbacks.Callback):
    """``perf_counter`` at every ``on_train_batch_begin`` (never a batch-end hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.times = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.times.append(time.perf_counter())


class BatchEndNoop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        pass


def run_model(
    spec: ModelSpec, rounds: int, segment: int, warmup: bool, log: Any, instances: int = 4
) -> dict:
    keras.utils.set_random_seed(SEED)
    model = spec.build()
    model.compile(
        keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = synthetic(spec, POOL_BATCHES, SEED)
    # several instances take turns, so the stethoscope's steps average over several traces
    # as the plain ones do (a traced function's speed is a draw: see the module docstring)
    steadies = [KerasStethoscope(sinks=[], stop_on=None) for _ in range(instances)]
    records = Path(tempfile.mkdtemp(prefix="stethoscope-bench-"))
    recorded = [
        KerasStethoscope(sinks=[], stop_on=None, record=records / f"run{k}")
        for k in range(instances)
    ]
    clock = StepClock()
    rng = random.Random(SEED)
    # untimed: past the stethoscope's calibration window (128 steps), and past the windows
    # of 256 steps in which the overhead budget measures the sampled steps and settles (the
    # first stretches as far as the cost asks, the second confirms), as it has in any run
    # of more than a few thousand steps. No longer: the shared model, trained on its 64
    # batches by every instance in turn, would memorise them and spike sooner
    preroll = 256 + 2 * 256
    segs = schedule(
        rounds,
        segment,
        segment,
        preroll,
        rng,
        warmup,
        variants=(STETHOSCOPE, RECORDED, TERMINATE, NUMERICS, NOOP),
        occasional=STETHOSCOPE,
        every=10**9,  # no occasional variant
    )
    extra = {
        TERMINATE: [keras.callbacks.TerminateOnNaN()],
        NOOP: [BatchEndNoop()],
    }
    times: list[tuple[Segment, list[float]]] = []
    turns: dict[int, int] = {}  # segment index -> the stethoscope instance that ran it
    recorded_turns = 0
    t0 = time.perf_counter()
    for i, seg in enumerate(segs):
        owner = seg.variant
        if seg.round < 0:  # the pre-roll: every instance past its calibration window
            for steady in (*steadies, *recorded):
                _fit(model, spec, x, y, preroll, [clock, steady])
            times.append((seg, []))
            continue
        callbacks = [clock, *extra.get(owner, [])]
        if owner == STETHOSCOPE:
            turns[i] = len(turns) % instances
            callbacks.append(steadies[turns[i]])
        if owner == RECORDED:
            callbacks.append(recorded[recorded_turns % instances])
            recorded_turns += 1
        if owner == NUMERICS:
            tf.debugging.enable_check_numerics()
            model.train_function = None
        _fit(model, spec, x, y, seg.length, callbacks)
        if owner == NUMERICS:
            tf.debugging.disable_check_numerics()
            model.train_function = None
        t = clock.times
        ms = [1e3 * (t[k + 1] - t[k]) for k in range(1, len(t) - 1)]  # steps 1 .. length
        times.append((seg, ms))
        if i % 20 == 0:
            log(f"{spec.name}: segment {i + 1}/{len(segs)} ({time.perf_counter() - t0:.0f} s)")
    health = {
        "findings_steady": _findings(*steadies),
        "escalations_steady": sum(s.monitor.sampler.escalations for s in steadies),
        "stretch": [s.monitor.sampler.stretch for s in steadies],
        "record_bytes": sum(f.stat().st_size for f in records.rglob("record.sqlite*")),
    }
    shutil.rmtree(records, ignore_errors=True)
    return {
        "model": spec.name,
        "title": spec.title,
        "rounds": rounds,
        "instances": instances,
        **summarise(times, turns),
        "stethoscope_health": health,
    }


def _fit(model: keras.Model, spec: ModelSpec, x: Any, y: Any, steps: int, callbacks: list) -> None:
    """Train ``steps`` timed steps, in fits of at most POOL_BATCHES steps (the data's
    length); each fit runs two more, untimed (the first and the last)."""
    for chunk in range(0, steps, POOL_BATCHES - 2):
        model.fit(
            x,
            y,
            batch_size=spec.batch_size,
            epochs=1,
            steps_per_epoch=min(POOL_BATCHES - 2, steps - chunk) + 2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )


def _findings(*cbs: KerasStethoscope) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in (s for cb in cbs for s in cb.summaries):
        for row in s.rows:
            if row.status in ("warning", "error"):
                out[row.detector] = out.get(row.detector, 0) + row.count
    return out


def summarise(
    times: Sequence[tuple[Segment, list[float]]], turns: dict[int, int]
) -> dict[str, Any]:
    """Per variant, step times and ratios to the plain segments around each segment;
    ``turns`` (segment index -> stethoscope instance) adds each instance's median ratio."""
    out: dict[str, Any] = {"variants": {}}
    measured = [(i, seg, ms) for i, (seg, ms) in enumerate(times) if seg.round >= 1]
    for key in VARIANTS:
        mine = [(i, ms) for i, seg, ms in measured if seg.variant == key]
        all_ms = [t for _, ms in mine for t in ms]
        entry: dict[str, Any] = {
            "median_ms": statistics.median(all_ms),
            "mean_ms": statistics.fmean(all_ms),
            "steps_timed": len(all_ms),
            "segments": len(mine),
        }
        if key != PLAIN:
            ratios = []
            for i, ms in mine:
                before, after = times[i - 1], times[i + 1]
                assert before[0].variant == after[0].variant == PLAIN
                ref = statistics.fmean([statistics.fmean(before[1]), statistics.fmean(after[1])])
                ratios.append(statistics.fmean(ms) / ref)
            entry["ratio_of_means"] = {**_quartiles(ratios), "ci95": _median_ci(ratios)}
            if key == STETHOSCOPE:  # each instance's own median: the spread of the draws
                by_instance: dict[int, list[float]] = {}
                for (i, _), r in zip(mine, ratios, strict=True):
                    by_instance.setdefault(turns[i], []).append(r)
                entry["per_instance"] = [
                    statistics.median(by_instance[k]) for k in sorted(by_instance)
                ]
        out["variants"][key] = entry
    null = []
    for i, seg, ms in measured:
        if seg.variant != PLAIN or not 2 <= i < len(times) - 2:
            continue
        a, b = times[i - 2], times[i + 2]
        if a[0].variant == b[0].variant == PLAIN and a[0].round == b[0].round == seg.round:
            null.append(statistics.fmean(ms) / statistics.fmean([*a[1], *b[1]]))
    if null:
        out["plain_vs_plain"] = {**_quartiles(null), "ci95": _median_ci(null), "n": len(null)}
    return out


def markdown(results: list[dict[str, Any]], wall_s: float, segment: int) -> str:
    lines = [
        "| model | variant | median ms/step | mean ms/step | ratio vs plain: median [IQR] "
        "| 95% CI of that median |",
        "|---|---|---:|---:|---|---|",
    ]
    for res in results:
        for key in VARIANTS:
            e = res["variants"][key]
            cells = [res["model"], key, f"{e['median_ms']:.2f}", f"{e['mean_ms']:.2f}"]
            if key == PLAIN:
                cells += ["1 (reference)", ""]
            else:
                r = e["ratio_of_means"]
                cells += [
                    f"{r['median']:.3f}x [{r['q1']:.3f}-{r['q3']:.3f}]",
                    f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        f"keras {keras.__version__}, tensorflow {tf.__version__} ({THREADS} threads); "
        f"{wall_s / 60:.1f} min. One fit per segment of {segment} timed steps, variants "
        "interleaved plain, A, plain, B, ...; each ratio against the two plain segments "
        "around it.",
        "",
    ]
    notes += [f"- {k}: {DESCRIPTIONS[k]}" for k in VARIANTS]
    for res in results:
        null = res.get("plain_vs_plain")
        h = res["stethoscope_health"]
        draws = ", ".join(f"{r:.3f}x" for r in res["variants"][STETHOSCOPE]["per_instance"])
        notes.append(
            f"{res['model']}: each stethoscope instance's median ratio: {draws}; the "
            f"budget's stretch at the end: {', '.join(f'{k}x' for k in h['stretch'])}."
        )
        notes.append(
            f"{res['model']}: the records held {h['record_bytes'] / 1e6:.1f} MB at the end."
        )
        if null:
            notes.append(
                f"{res['model']}: noise floor (plain vs plain two segments away) "
                f"{null['median']:.3f}x [{null['q1']:.3f}-{null['q3']:.3f}], n={null['n']}. "
                f"Steady-state findings: {h['findings_steady'] or 'none'}; "
                f"escalations {h['escalations_steady']}."
            )
    return "\n".join(lines + notes)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.keras_overhead", description=__doc__)
    p.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--segment", type=int, default=32, help="timed steps per fit")
    p.add_argument("--instances", type=int, default=4, help="stethoscope instances taking turns")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    models = ("mlp", "cnn") if args.model == "both" else (args.model,)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = []
    for m in models:
        rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS[m])
        results.append(
            run_model(MODELS[m], rounds, args.segment, not args.quick, log, args.instances)
        )
    wall = time.perf_counter() - t0
    print(markdown(results, wall, args.segment))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
