"""Overhead of KerasStethoscope's defaults in the ways people train Keras, in one process.

``benchmarks/keras_overhead.py`` measures the defaults on the benchmark MLP and CNN with
Keras' own train step, one step per execution, on TensorFlow. Users also train with:

* ``train_step``: a model with a ``train_step`` of its own (``compute_loss`` and
  ``optimizer.apply``, as Keras' guide writes one; TensorFlow backend);
* ``spe8``: ``compile(steps_per_execution=8)``: eight steps per call of the train
  function, callbacks once per execution;

and ``default`` is Keras' own step again, measured the same way. Run it with
``KERAS_BACKEND=torch`` for the torch backend (``default`` only: Keras takes no
``steps_per_execution`` above 1 there).

How: as in ``keras_overhead.py``, each segment is its own ``fit`` on the same model,
plain and stethoscope segments taking turns, several stethoscope instances taking turns
at theirs (a traced function's speed is a draw that lasts its life). A segment is
``segment`` timed steps plus an untimed execution on each side; an execution is timed
from one ``on_train_batch_begin`` to the next and divided by its steps. Each stethoscope
segment's mean is divided by the mean of the plain segments around it.

Run:
    python -m benchmarks.keras_setups                       # TensorFlow, every set-up
    KERAS_BACKEND=torch python -m benchmarks.keras_setups   # the torch backend
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

from benchmarks.keras_overhead import StepClock
from benchmarks.overhead import _median_ci, _quartiles
from stethoscope import KerasStethoscope

THREADS = 2
SEED = 0
BATCH = 128
POOL = 64  # distinct batches
DEFAULT_ROUNDS = 30


class OwnStep(keras.Sequential):
    """A Sequential with a train step of its own, as Keras' guide writes one."""

    def train_step(self, data: Any) -> dict[str, Any]:
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


SETUPS = {
    "default": "Keras' own train step",
    "train_step": "a train_step of the model's own (TensorFlow)",
    "spe8": "steps_per_execution=8",
}


def build(setup: str) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    layers = [
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ]
    model = OwnStep(layers) if setup == "train_step" else keras.Sequential(layers)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=8 if setup == "spe8" else 1,
    )
    return model


def _fit(model: keras.Model, x: Any, y: Any, steps: int, callbacks: list) -> list[float]:
    """``steps`` timed steps and an untimed execution on each side; ms per step of each
    timed execution."""
    k = model.steps_per_execution
    clock = next(c for c in callbacks if isinstance(c, StepClock))
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        steps_per_epoch=steps + 2 * k,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    t = clock.times
    return [1e3 * (t[i + 1] - t[i]) / k for i in range(1, len(t) - 1)]


def run_setup(
    setup: str, rounds: int, segment: int, instances: int, log: Any, budget: float | None = None
) -> dict:
    model = build(setup)
    k = model.steps_per_execution
    segment = max(segment, k) // k * k
    rng = np.random.default_rng(SEED)
    patterns = rng.normal(size=(10, 784)).astype("float32")
    n = (segment + 2 * k) * BATCH
    y = rng.integers(0, 10, n)
    x = rng.normal(size=(n, 784)).astype("float32") + 0.1 * patterns[y]
    clock = StepClock()
    steadies = [
        KerasStethoscope(sinks=[], stop_on=None, overhead_budget=budget) for _ in range(instances)
    ]
    # past each one's calibration window, untimed; with a budget, past the windows of 256
    # steps in which it measures and settles
    preroll = 256 if budget is None else 256 + 2 * 256
    for steady in steadies:
        for _ in range(preroll // segment + 1):
            _fit(model, x, y, segment, [clock, steady])
    plain_ms, ratios = [], []
    previous = _fit(model, x, y, segment, [clock])
    t0 = time.perf_counter()
    for r in range(rounds):
        own = _fit(model, x, y, segment, [clock, steadies[r % instances]])
        after = _fit(model, x, y, segment, [clock])
        ref = (statistics.fmean(previous) + statistics.fmean(after)) / 2
        ratios.append(statistics.fmean(own) / ref)
        plain_ms += after
        previous = after
        if r % 10 == 0:
            log(f"{setup}: round {r + 1}/{rounds} ({time.perf_counter() - t0:.0f} s)")
    return {
        "setup": setup,
        "title": SETUPS[setup],
        "backend": keras.backend.backend(),
        "overhead_budget": budget,
        "stretch": [s.monitor.sampler.stretch for s in steadies],
        "plain_ms_per_step": statistics.median(plain_ms),
        "ratio": {**_quartiles(ratios), "ci95": _median_ci(ratios), "n": len(ratios)},
        "alarms": sorted(
            {
                row.detector
                for steady in steadies
                for summary in steady.summaries
                for row in summary.rows
                if row.status in ("warning", "error")
            }
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.keras_setups", description=__doc__)
    p.add_argument("--setup", choices=(*SETUPS, "all"), default="all")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--segment", type=int, default=32, help="timed steps per fit")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--budget",
        type=_budget,
        default=0.01,
        help="overhead_budget, or 'none' (default: 0.01, the callback's default)",
    )
    args = p.parse_args(argv)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(THREADS)
        tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    elif backend == "torch":
        import torch

        torch.set_num_threads(THREADS)
    names = list(SETUPS) if args.setup == "all" else [args.setup]
    if backend != "tensorflow":  # its own step uses tf.GradientTape; Keras runs one step
        names = [n for n in names if n == "default"]  # per execution on the torch backend

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = [
        run_setup(n, args.rounds, args.segment, args.instances, log, args.budget) for n in names
    ]
    wall = time.perf_counter() - t0
    lines = [
        "| backend | set-up | plain ms/step | stethoscope / plain: median [IQR] | 95% CI | "
        "warnings or errors |",
        "|---|---|---:|---|---|---|",
    ]
    for r in results:
        q = r["ratio"]
        title = r["title"] + (
            f", overhead_budget={r['overhead_budget']} (stretch {r['stretch']})"
            if r["overhead_budget"] is not None
            else ""
        )
        lines.append(
            f"| {r['backend']} | {r['setup']}: {title} | {r['plain_ms_per_step']:.2f} | "
            f"{q['median']:.3f}x [{q['q1']:.3f}–{q['q3']:.3f}] | "
            f"{q['ci95'][0]:.3f}–{q['ci95'][1]:.3f} | {', '.join(r['alarms']) or 'none'} |"
        )
    lines.append(
        f"\nkeras {keras.__version__}, backend {backend}, {THREADS} threads; {wall / 60:.1f} min; "
        f"{args.rounds} rounds of plain and stethoscope fits of {args.segment} timed steps, "
        f"{args.instances} stethoscope instances taking turns; the benchmark MLP, batch {BATCH}."
    )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "results": results}, f, indent=1)
    return 0


def _budget(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)


if __name__ == "__main__":
    sys.exit(main())
