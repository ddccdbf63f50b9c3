"""The recovery table of the fault suite (Keras 3, TensorFlow backend): does
``KerasStethoscope(recover=True)`` keep a fit alive through a transient fault, and end a
persistent one in a stop?

The Keras counterpart of :mod:`benchmarks.faults.recovery`, with its scenarios, its
table and its reading. Each scenario trains the Keras suite's MLP (the Lightning suite's
network: Adam, lr 1e-2, 300 steps of 32 on the Gaussian task, a validation after every
epoch) three ways for each seed, each from ``keras.utils.set_random_seed(seed)`` after
``keras.backend.clear_session()``, so all three start from the same weights:

* the **healthy twin**: the same data, model and seed, without the fault;
* **without recovery**: ``KerasStethoscope(sinks=[sink])`` (``stop_on="error"``);
* **with recovery**: ``KerasStethoscope(sinks=[sink], recover=True)``.

and reports, per way, the steps trained, whether the stethoscope stopped the fit, and
the final validation loss (the last validation), against the twin's. The transient
faults start at step 150: one NaN input batch, one poison batch (inputs x30 and every
label wrong), a stretch of 8 batches with wrong labels, the learning rate x30, x300 and
x3000 for 1, 4 and 16 steps, and SGD's momentum buffers x1000. The persistent ones:
the learning rate 100x too high from the start (900 steps: room for the whole ladder),
and random labels. The healthy control must take no action.

How the faults reach the train step. The data are the Keras suite's pipeline
(``keras_suite.make_dataset``): seeded permutations of the training set laid end to
end and walked by ``fit`` with ``steps_per_epoch``, so the n-th batch the pipeline hands
out is the batch of the fit's n-th train step, whatever the ladder did before it. A
``map`` over the enumerated batches corrupts those of steps 150.. (one NaN input; inputs
x30 and labels (y+1) mod classes; labels (y+1) mod classes), so the twin trains on the
very same batches but those. The learning-rate spike is a callback that sets
``optimizer.learning_rate`` before every batch from the fit's own batch count: a
skipped step does not advance ``optimizer.iterations`` (as with Keras'
``LossScaleOptimizer``), and a roll back restores the learning-rate variable with the
rest of the optimizer's state, which the next batch's setting overrides, as in the
Lightning module.

"Steps" are the batches the fit ran, skipped ones included; under ``recover=True``
``optimizer.iterations`` counts only the updates applied.

Run:
    python -m benchmarks.faults.keras_recovery                 # 3 seeds, about 7 minutes on 2 cores
    python -m benchmarks.faults.keras_recovery --seeds 1 --only nan_batch,healthy
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is first imported
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # the suite injects through tf.data

import keras
import tensorflow as tf

from benchmarks.faults.data import Arrays, make_data
from benchmarks.faults.keras_suite import (
    _Driver,
    _StopAt,
    build_model,
    configure,
    environment,
    make_dataset,
    make_optimizer,
    quiet,
)
from benchmarks.faults.recovery import (
    ONSET,
    POISON,
    Case,
    Outcome,
    markdown,
    recovery_acts,
    run_cases,
)
from benchmarks.faults.scenarios import ModelSpec
from stethoscope import KerasStethoscope
from stethoscope.testing import CapturingSink

#: The faults that live in a batch; the rest of ``Case.fault`` is the learning rate's.
BATCH_FAULTS = ("nan_input", "poison", "corrupt_labels")
VALIDATION_BATCH = 256


# -- faults ---------------------------------------------------------------------------------


def corrupt_batches(data: tf.data.Dataset, case: Case, classes: int) -> tf.data.Dataset:
    """``data`` with the batches of steps ``ONSET .. ONSET + case.steps - 1`` corrupted as
    ``case.fault`` says; the others untouched. The n-th batch is the fit's n-th step."""
    if case.fault not in BATCH_FAULTS:
        return data
    kind, last = case.fault, ONSET + case.steps

    def corrupted(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        if kind == "nan_input":  # one value of the batch, its first
            flat = tf.reshape(x, [-1])
            flat = tf.tensor_scatter_nd_update(flat, [[0]], tf.constant([math.nan], x.dtype))
            return tf.reshape(flat, tf.shape(x)), y
        wrong = tf.math.floormod(y + 1, tf.cast(classes, y.dtype))  # every label wrong
        return (x * 30.0 if kind == "poison" else x), wrong

    def at_step(step: tf.Tensor, batch: tuple[tf.Tensor, tf.Tensor]) -> Any:
        x, y = batch
        hit = tf.logical_and(step >= ONSET, step < last)
        return tf.cond(hit, lambda: corrupted(x, y), lambda: (x, y))

    return data.enumerate().map(at_step)


class LearningRateSpike(keras.callbacks.Callback):
    """Sets the learning rate before every batch: ``factor`` times ``base`` for ``steps``
    steps from ``ONSET``, ``base`` otherwise.

    It counts steps by the driver's batch count, not ``optimizer.iterations`` (which a
    skip leaves and a roll back rewinds), and goes after the stethoscope in the callback
    list, so that it overrides the learning rate a roll back in the stethoscope's
    ``on_train_batch_begin`` has just restored.
    """

    def __init__(self, driver: _Driver, base: float, factor: float, steps: int) -> None:
        super().__init__()
        self.driver, self.base, self.factor, self.steps = driver, base, factor, steps

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        spiking = ONSET <= self.driver.step < ONSET + self.steps
        self.model.optimizer.learning_rate = self.base * (self.factor if spiking else 1.0)


class PoisonMomentum(keras.callbacks.Callback):
    """Multiplies SGD's momentum buffers by ``POISON`` before the batch of ``ONSET``: a
    huge gradient that entered them without the gate seeing it (the Lightning module
    does the same to ``momentum_buffer``)."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self.driver = driver

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.driver.step == ONSET:
            for buffer in self.model.optimizer.momentums:
                buffer.assign(buffer * POISON)


# -- one fit --------------------------------------------------------------------------------


def fresh_model(case: Case, arrays: Arrays, seed: int) -> keras.Sequential:
    """The suite's MLP, compiled, from ``seed``: the same weights in each of the three ways."""
    keras.backend.clear_session()  # the same layer names (and seeded draws) in every fit
    keras.config.disable_interactive_logging()  # clear_session turns it back on
    keras.utils.set_random_seed(seed)
    # ModelSpec(): the network a Scenario gets by default, as the Lightning module's does
    model, layers = build_model(ModelSpec(), arrays.input_shape, arrays.classes)
    model.compile(
        optimizer=make_optimizer(case.train, None, -1, layers),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    # its variables before the train step is traced: traced once, not twice (as the suite)
    model.optimizer.build(model.trainable_variables)
    return model


def training_data(case: Case, arrays: Arrays, seed: int) -> tuple[tf.data.Dataset, int, int]:
    """The batches of ``case`` (its fault in them), steps per epoch and epochs to walk."""
    batch_size = case.train.batch_size
    per_epoch = -(-len(arrays.x) // batch_size)
    epochs = -(-case.train.max_steps // per_epoch)  # the last one cut at max_steps
    data = make_dataset(arrays.x, arrays.y, batch_size, seed, epochs)
    return corrupt_batches(data, case, arrays.classes), per_epoch, epochs


def train(case: Case, seed: int, *, faulty: bool, recover: bool | None) -> Outcome:
    """One fit: ``recover`` None means no stethoscope at all (the twin)."""
    the_case = case if faulty else case.twin()
    arrays = make_data(the_case.data, seed)
    model = fresh_model(the_case, arrays, seed)
    data, per_epoch, epochs = training_data(the_case, arrays, seed)
    # the driver first: in every later callback's hooks its ``step`` is the batch in progress
    driver = _Driver(None, -1, [])
    sink = CapturingSink()
    stethoscope = KerasStethoscope(sinks=[sink], recover=recover) if recover is not None else None
    spike = (
        LearningRateSpike(driver, the_case.train.lr, the_case.factor, the_case.steps)
        if the_case.fault == "lr_spike"
        else None
    )
    poison = PoisonMomentum(driver) if the_case.fault == "poisoned_momentum" else None
    callbacks = [driver, stethoscope, spike, poison, _StopAt(driver, the_case.train.max_steps)]
    with contextlib.redirect_stdout(io.StringIO()):  # the callback's stop line: not the table's
        model.fit(
            data,
            epochs=epochs,
            steps_per_epoch=per_epoch,
            validation_data=(arrays.x_val, arrays.y_val),
            validation_batch_size=VALIDATION_BATCH,
            shuffle=False,  # the pipeline's order: the twin's, batch for batch
            verbose=0,
            callbacks=[c for c in callbacks if c is not None],
        )
    last = driver.val_losses[-1][1] if driver.val_losses else math.nan
    outcome = Outcome(driver.taken, False, last)
    if stethoscope is not None:
        stopped_by = stethoscope.stopped_by
        outcome.stopped = stopped_by is not None
        outcome.stopped_by = stopped_by.detector if stopped_by is not None else None
        outcome.actions = recovery_acts(sink)
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.keras_recovery", description=__doc__
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    args = p.parse_args(argv)
    configure(2)
    quiet()
    names = set(args.only.split(",")) if args.only else None
    results, wall = run_cases(names, args.seeds, train)
    print(f"Keras recovery table ({environment()['versions']}).\n")
    print(markdown(results, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
