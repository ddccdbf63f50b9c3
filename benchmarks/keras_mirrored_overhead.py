"""Per-step cost of KerasStethoscope under MirroredStrategy: 2 logical CPU devices.

The MLP of ``benchmarks/keras_overhead.py`` (784-512-512-10, Adam) at a global batch
of 128 (64 per replica), trained under ``tf.distribute.MirroredStrategy`` on two
logical CPU devices of one process. Fits of ``segment + 2`` steps take turns, plain
and with ``KerasStethoscope(sinks=[], stop_on=None)`` (one instance for every fit, past
its calibration window), on the same model; a step is timed from one
``on_train_batch_begin`` to the next, as in ``keras_overhead.py``. The stethoscope's
steps are split into those it sampled (its reductions ran in the graph) and the
others; the host reads a sampled step's variables at the start of the next step, so
that cost lands in the step after it.

Run (about 1 minute; not part of ``make bench``):
    python -m benchmarks.keras_mirrored_overhead [--rounds 8] [--segment 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

# logical devices are fixed when TensorFlow initialises: before anything else runs
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from benchmarks.keras_overhead import MODELS, SEED, StepClock, synthetic  # noqa: E402
from stethoscope import KerasStethoscope  # noqa: E402

POOL_BATCHES = 64


class Sampled(keras.callbacks.Callback):
    """After the stethoscope's own hook: whether the step it just launched is sampled."""

    def __init__(self, cb: KerasStethoscope) -> None:
        super().__init__()
        self.cb, self.flags = cb, []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.flags = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        # (first step, batch, sampled step, plan) of this execution
        pending = self.cb._pending
        self.flags.append(pending is not None and pending[0] == pending[2])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.keras_mirrored_overhead")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--segment", type=int, default=32, help="timed steps per fit")
    args = p.parse_args(argv)
    spec = MODELS["mlp"]
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        model = spec.build()
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    x, y = synthetic(spec, POOL_BATCHES, SEED)
    steady = KerasStethoscope(sinks=[], stop_on=None)
    clock, sampled = StepClock(), Sampled(steady)

    def fit(steps: int, callbacks: list) -> list[float]:
        model.fit(
            x,
            y,
            batch_size=spec.batch_size,
            epochs=1,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
            callbacks=[clock, *callbacks],
        )
        t = clock.times
        return [1e3 * (t[k + 1] - t[k]) for k in range(1, len(t) - 1)]  # steps 1 .. n-2

    t0 = time.perf_counter()
    for _ in range(4):  # past the calibration window (untimed)
        fit(POOL_BATCHES, [steady, sampled])
    plain: list[float] = []
    on: list[float] = []
    off: list[float] = []
    after: list[float] = []  # the step after a sampled one: the host reads it then
    for _ in range(args.rounds):
        plain += fit(args.segment + 2, [])
        ms = fit(args.segment + 2, [steady, sampled])
        flags = sampled.flags[1:-1]
        for k, t in enumerate(ms):
            if flags[k]:
                on.append(t)
            elif k > 0 and flags[k - 1]:
                after.append(t)
            else:
                off.append(t)
    wall = time.perf_counter() - t0
    all_steth = on + off + after
    rows = [
        ("plain fit", plain),
        ("stethoscope, every step", all_steth),
        ("stethoscope, unsampled step", off),
        ("stethoscope, sampled step", on),
        ("stethoscope, the step after a sampled one", after),
    ]
    print(
        f"MirroredStrategy, 2 logical CPU devices; {spec.title} (global); keras "
        f"{keras.__version__}, tensorflow {tf.__version__}; {args.rounds} rounds of "
        f"{args.segment} steps; {wall:.0f} s\n"
    )
    print("| | steps | median ms | mean ms |")
    print("|---|---:|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {len(ms)} | {statistics.median(ms):.2f} | {statistics.fmean(ms):.2f} |")
    ratio = statistics.fmean(all_steth) / statistics.fmean(plain)
    print(f"\nmean ratio, stethoscope / plain: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
