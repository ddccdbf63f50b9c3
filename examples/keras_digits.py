"""Train an MLP on scikit-learn's digits with Keras 3, and let stethoscope listen.

    python examples/keras_digits.py --fault none      # a healthy run: nothing to report
    python examples/keras_digits.py --fault lr        # learning rate far too high
    python examples/keras_digits.py --fault nan       # a corrupt batch holds a NaN
    python examples/keras_digits.py --fault vanishing # deep sigmoid net, tiny init
    python examples/keras_digits.py --fault spike     # one batch unnormalised (x100)
    python examples/keras_digits.py --fault stall     # learning rate 1e-7: nothing learns

The twin of ``lightning_digits.py``, on Keras' TensorFlow backend (or any backend
KerasStethoscope supports, chosen with KERAS_BACKEND). The digits ship inside
scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads

import keras
import numpy as np
from sklearn.datasets import load_digits

from stethoscope import KerasStethoscope
from stethoscope.sinks import ConsoleSink, JSONLSink
from stethoscope.testing import CapturingSink

FAULTS = {
    "none": "a healthy run",
    "lr": "SGD with a learning rate far too high (lr=3.0, momentum 0.9)",
    "nan": "one corrupt input batch at step 150 holds a NaN",
    "vanishing": "a 10-layer sigmoid network initialised with tiny weights",
    "spike": "one batch at step 150 is not normalised (inputs x100)",
    "stall": "a learning rate of 1e-7: the loss cannot move",
}
ONSET = 150


def digits_stream(batch_size: int, epochs: int, seed: int, fault: str):
    """The 1797 8x8 digits, standardised per feature, in a fresh order for every epoch,
    laid end to end: with ``shuffle=False`` global step ``s`` trains on rows
    ``s * batch_size`` onwards, so the data faults land exactly on step ``ONSET``.
    Returns the inputs, the labels and the steps per epoch."""
    x, y = load_digits(return_X_y=True)
    x = ((x - x.mean(0)) / (x.std(0) + 1e-6)).astype("float32")
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(len(x)) for _ in range(epochs + 1)]
    xs, ys = np.concatenate([x[o] for o in orders]), np.concatenate([y[o] for o in orders])
    onset = slice(ONSET * batch_size, (ONSET + 1) * batch_size)
    if fault == "nan":
        xs[onset.start, 0] = np.nan
    if fault == "spike":
        xs[onset] *= 100
    return xs, ys.astype("int64"), math.ceil(len(x) / batch_size)


def model_for(fault: str) -> keras.Model:
    if fault == "vanishing":
        # torch's default init scaled by 0.05, as in the Lightning twin
        tiny = keras.initializers.RandomUniform(-0.05 / 8, 0.05 / 8)
        layers = [
            keras.layers.Dense(64, activation="sigmoid", kernel_initializer=tiny) for _ in range(10)
        ]
        body = [*layers, keras.layers.Dense(10, kernel_initializer=tiny)]
    else:
        body = [
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    model = keras.Sequential([keras.Input((64,)), *body], name="digits_mlp")
    if fault == "lr":
        optimizer = keras.optimizers.SGD(3.0, momentum=0.9)
    else:
        optimizer = keras.optimizers.Adam(1e-7 if fault == "stall" else 1e-3)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=sorted(FAULTS), default="none")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default=None, help="also write findings to this JSONL file")
    parser.add_argument(
        "--record", default=None, help="keep the run's record in this directory, and report it"
    )
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(args.seed)
    print(f"Training a digits MLP with fault '{args.fault}': {FAULTS[args.fault]}")
    captured = CapturingSink()
    sinks = [ConsoleSink(), captured] + ([JSONLSink(args.jsonl)] if args.jsonl else [])
    model = model_for(args.fault)
    stethoscope = KerasStethoscope(sinks=sinks, record=args.record)
    x, y, steps = digits_stream(args.batch_size, args.epochs, args.seed, args.fault)
    model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=steps,
        shuffle=False,
        callbacks=[stethoscope],
        verbose=2,
    )

    steps = int(model.optimizer.iterations)
    problems = [f for f in captured.findings if f.severity != "info"]
    if not problems:
        print(f"stethoscope: no problem found in {steps} steps.")
    else:
        first = problems[0]
        stopped = " and stopped training" if stethoscope.stopped_by is not None else ""
        print(
            f"stethoscope caught {first.detector} ({first.severity}) at step {first.step}"
            f"{stopped}; {len(problems)} finding(s) in all, detectors: "
            f"{', '.join(sorted(captured.detectors()))}."
        )
    if args.record:
        print_report(args.record)
    return 0


def print_report(record: str) -> None:
    """Write the record's report and say where it is and how to look again."""
    from stethoscope.record.report import write_report

    html = write_report(record)[0]
    print(
        f"The run's report: {html}  (again: stethoscope report {record}; live: "
        f"stethoscope watch {record})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
