"""The MultiWorkerMirroredStrategy tests, run as one worker; ``test_keras_multiworker.py``
starts two of them on this machine.

    python _multiworker_worker.py INDEX PORT0,PORT1 OUTDIR

``TF_CONFIG`` names the two workers (``localhost``, one port each) and this one's index,
before TensorFlow starts; each worker is a CPU process of its own, with one replica. Both
run every scenario in the same order (a worker that skipped one would leave the other
waiting in a collective), each leaving plain facts in a dict; the dict goes to
``OUTDIR/worker{INDEX}.json``, and the tests assert on both workers' facts.

Keras 3.15's own ``fit`` fails under this strategy before any callback runs, twice
(see :func:`fix_keras_fit`); the workers patch Keras first, as a user must today.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

INDEX, PORTS = int(sys.argv[1]), sys.argv[2].split(",")
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": [f"localhost:{port}" for port in PORTS]},
        "task": {"type": "worker", "index": INDEX},
    }
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf  # noqa: E402

STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _keras_crash import Crash, CrashAt  # noqa: E402
from _keras_facts import clean, finding  # noqa: E402

from stethoscope import KerasStethoscope, TrainingProblem  # noqa: E402
from stethoscope.callbacks._keras.workers import KerasWorkers  # noqa: E402
from stethoscope.detectors import Detector, default_detectors  # noqa: E402
from stethoscope.record import RunRecord  # noqa: E402
from stethoscope.testing import CapturingSink, RecordingDetector  # noqa: E402

N, FEATURES, CLASSES, BATCH, LR = 256, 12, 3, 32, 0.05  # BATCH: the global batch
#: The global batch whose every row is NaN in worker 1's copy of the data (worker 0's
#: copy is clean): whichever half of it the strategy hands worker 1, its loss is NaN.
NAN_STEP = 5
#: The step that only worker 1's bars judge bad.
BAR_STEP = 3
#: The step whose error only worker 1's detector raises (epoch 2's second step).
DAMAGE_STEP = 9


def fix_keras_fit() -> None:
    """Work around Keras 3.15's ``fit`` under ``MultiWorkerMirroredStrategy`` (upstream
    bugs, keras-team/keras#20585 and tensorflow/tensorflow#72388), without which no fit
    runs, with or without stethoscope:

    - ``_maybe_symbolic_build`` averages the first batch across the workers with one
      ``strategy.reduce`` of the whole ``(x, y)`` tuple, which the strategy refuses
      ("Attempt to convert a value (PerReplica...)"); building only needs the shapes,
      which this worker's first replica has.
    - ``reduce_per_replica`` averages each scalar of the logs with ``axis=0``, which a
      scalar does not have ("Invalid reduction dimension 0"); a scalar is averaged whole.
    """
    from keras.src.backend.tensorflow import trainer

    reduce_per_replica = trainer.reduce_per_replica

    def reduce_scalars_whole(values, strategy, reduction):
        def one(v):
            first = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            if reduction == "auto" and getattr(first, "shape", None) == ():
                return strategy.reduce("MEAN", v, axis=None)
            return reduce_per_replica(v, strategy, reduction)

        return keras.tree.map_structure(one, values)

    def build_from_local_batch(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:
            return
        strategy = self.distribute_strategy
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = next(it)
                break

        def local(v):
            if isinstance(v, tf.distribute.DistributedValues):
                return strategy.experimental_local_results(v)[0]
            return v

        with strategy.scope():
            self._symbolic_build(data_batch=keras.tree.map_structure(local, data_batch))

    trainer.reduce_per_replica = reduce_scalars_whole
    trainer.TensorFlowTrainer._maybe_symbolic_build = build_from_local_batch


def data(n: int = N, *, nan_here: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = np.argmax(x[:, :CLASSES], axis=1).astype("int64")
    if nan_here:
        x[NAN_STEP * BATCH : (NAN_STEP + 1) * BATCH, 2] = np.nan
    return x, y


def mlp(strategy: Any, *, activation: str = "tanh"):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else tf.name_scope("single"):
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation=activation, name="hidden"),
                keras.layers.Dense(CLASSES, name="head"),
            ],
            name="mlp",
        )
        model.compile(
            keras.optimizers.SGD(LR),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    return model


def fit(model, callbacks: list, x, y, epochs: int = 1, **kwargs: Any):
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **kwargs,
    )


def steps_taken(model) -> int:
    return int(model.optimizer.iterations.numpy())


def healthy(out: Path) -> dict:
    """Two epochs with a validation each; replica_divergence compares the workers'
    weights every 4 steps; a record kept by rank zero."""
    x, y = data()
    model = mlp(STRATEGY)
    sink = CapturingSink()
    record = out / f"record{INDEX}"
    cb = KerasStethoscope(sinks=[sink], record=record, intervals={"replica_divergence": 4})
    meetings: list[float] = []
    gather = KerasWorkers.gather

    def timed(self, packet):  # how long each meeting's all-gather takes
        start = time.perf_counter()
        everyone = gather(self, packet)
        meetings.append(time.perf_counter() - start)
        return everyone

    KerasWorkers.gather = timed
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(model, [cb], x, y, epochs=2, validation_data=(x[:64], y[:64]))
    finally:
        KerasWorkers.gather = gather
    result: dict[str, Any] = {
        "meetings": len(meetings),
        "meeting_ms": [round(1e3 * t, 3) for t in meetings],
        "findings": [finding(f) for f in sink.findings],
        "warnings": [str(w.message) for w in caught if "stethoscope" in str(w.message)],
        "summaries": len(sink.summaries),
        "steps": steps_taken(model),
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "clean": clean(model),
        "record_files": sorted(p.name for p in record.iterdir()),
    }
    if INDEX == 0:
        with RunRecord(record) as run:
            result["record"] = {
                "losses": len(run.losses().steps),
                "sampled": len(run.layers("grad_norm").steps),
                "finished": run.finished,
            }
    return result


def measured(out: Path) -> dict:
    """What each worker judges, and, on worker 0, a single process on the same global
    batches: the gradients (rank zero's), every step's loss and the data (each rank's)."""
    x, y = data()
    result: dict[str, Any] = {}
    runs = [("workers", STRATEGY)] + ([("single", None)] if INDEX == 0 else [])
    for name, strategy in runs:
        model = mlp(strategy)
        grads = RecordingDetector({"grads", "updates", "weights"}, name="grad_spy")
        losses = RecordingDetector({"loss"}, name="loss_spy")
        inputs = RecordingDetector({"inputs", "labels"}, name="data_spy")
        cb = KerasStethoscope(
            detectors=[grads, losses, inputs],
            sinks=[CapturingSink()],
            intervals={"grad_spy": 3, "data_spy": 3},
            escalate=False,
        )
        fit(model, [cb], x, y)
        result[name] = {
            "grad_steps": [o.step for o in grads.seen],
            "names": [list(o.names) for o in grads.seen],
            "grad_norm": [o.grad_norm.tolist() for o in grads.seen],
            "update_norm": [o.update_norm.tolist() for o in grads.seen],
            "weight_norm": [o.weight_norm.tolist() for o in grads.seen],
            "loss_steps": [o.step for o in losses.seen],
            "losses": [o.loss for o in losses.seen],
            "ranks": sorted({o.rank for o in losses.seen}),
            "data_steps": [o.step for o in inputs.seen],
            "input_count": [o.input_count for o in inputs.seen],
            "labels": [len(o.labels) for o in inputs.seen],
            "clean": clean(model),
        }
    return result


def nan_on_worker1(out: Path) -> dict:
    """Every row of global batch ``NAN_STEP`` is NaN in worker 1's copy of the data; then
    the same with ``raise_on``; then ``recover=`` with two steps per execution, refused."""
    x, y = data(nan_here=INDEX == 1)
    model = mlp(STRATEGY)
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink])
    history = fit(model, [cb], x, y, epochs=3)
    result: dict[str, Any] = {
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "steps": steps_taken(model),
        "epochs": len(history.history["loss"]),
        "findings": [finding(f) for f in sink.findings if f.step >= NAN_STEP],
        "clean": clean(model),
    }
    model = mlp(STRATEGY)
    try:
        fit(model, [KerasStethoscope(sinks=[], stop_on=None, raise_on="error")], x, y, epochs=3)
        result["raised"] = None
    except TrainingProblem as exc:
        result["raised"] = {**finding(exc.finding), "text": str(exc)}
    result["raised_steps"] = steps_taken(model)
    result["raise_clean"] = clean(model)
    model = mlp(STRATEGY)
    model.compile(model.optimizer, model.loss, steps_per_execution=2)
    try:
        fit(model, [KerasStethoscope(sinks=[], recover=True)], x, y)
        result["recover_several_steps"] = None
    except ValueError as exc:
        result["recover_several_steps"] = str(exc)
    return result


def state(model) -> list[np.ndarray]:
    """The weights and the optimizer's variables (its slots and step count)."""
    return [np.asarray(v.numpy()) for v in (*model.variables, *model.optimizer.variables)]


def digest(arrays: list[np.ndarray]) -> str:
    """A hash of ``arrays``' bytes: equal on two workers when every bit is."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def recover_nan(out: Path) -> dict:
    """``recover=True`` with global batch ``NAN_STEP`` NaN in worker 1's copy of the data:
    skipped by both workers; then a fit with no callback on the same global batches but
    that one (``twin``)."""
    from stethoscope.findings import RECOVERY

    x, y = data(nan_here=INDEX == 1)
    sink = CapturingSink()
    model = mlp(STRATEGY)
    cb = KerasStethoscope(sinks=[sink], recover=True)
    fit(model, [cb], x, y)
    keep = np.ones(N, dtype=bool)
    keep[NAN_STEP * BATCH : (NAN_STEP + 1) * BATCH] = False
    clean_x, clean_y = data()
    twin = mlp(STRATEGY)
    fit(twin, [], clean_x[keep], clean_y[keep])
    mine, theirs = state(model), state(twin)
    return {
        "acts": [[f.step, f.where, f.rank] for f in sink.findings if f.detector == RECOVERY],
        "messages": [f.message for f in sink.findings if f.detector == RECOVERY],
        "skipped": [
            [b.step, b.batch.epoch, b.batch.index] for b in cb.recoverer.skipped_data.batches
        ],
        "applied": steps_taken(model),
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "digest": digest(mine),
        "twin_digest": digest(theirs),
        "same_as_twin": all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)),
        "finite": all(np.isfinite(a).all() for a in mine),
        "clean": clean(model),
    }


class LowBar(keras.callbacks.Callback):
    """Before step ``step``, writes a loss bar of 0 into this worker's probe, as though
    its own losses had set it there: only this worker judges the step bad."""

    def __init__(self, cb: KerasStethoscope, step: int) -> None:
        super().__init__()
        self.cb, self.step, self.seen = cb, step, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.step:
            link = self.cb._recovery.link
            link.set_bars(0.0, *link.bars[1:])
        self.seen += 1


def recover_bars(out: Path) -> dict:
    """``recover=True`` where worker 1's bars alone say that step ``BAR_STEP`` is bad:
    both workers skip it (the worst verdict of the two)."""
    from stethoscope.findings import RECOVERY

    x, y = data()
    sink = CapturingSink()
    model = mlp(STRATEGY)
    cb = KerasStethoscope(sinks=[sink], recover=True)
    fit(model, [cb, *([LowBar(cb, BAR_STEP)] if INDEX == 1 else [])], x, y)
    return {
        "acts": [[f.step, f.where, f.message] for f in sink.findings if f.detector == RECOVERY],
        "skipped": [
            [b.step, b.batch.epoch, b.batch.index] for b in cb.recoverer.skipped_data.batches
        ],
        "applied": steps_taken(model),
        "digest": digest(state(model)),
    }


class WorkerOneDamage(Detector):
    """Stands in for ``large_updates`` (a detector the recovery ladder answers with a roll
    back): an error at step ``at`` from worker 1's observation only, which only worker 1's
    monitor sees until the workers meet."""

    name = "large_updates"
    needs = frozenset({"loss"})

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def _update(self, obs):
        if obs.step != self.at or obs.rank != 1:
            return []
        return [self.finding(obs, "error", "worker 1's updates went wrong", value=1.0)]


def recover_rollback(out: Path) -> dict:
    """``recover=`` with snapshots every 4 steps, and worker 1's error at step
    ``DAMAGE_STEP``: both workers roll back to the same snapshot at the next meeting."""
    from stethoscope import Recovery
    from stethoscope.findings import RECOVERY

    x, y = data()
    sink = CapturingSink()
    model = mlp(STRATEGY)
    detectors = [d for d in default_detectors() if d.name != "large_updates"]
    cb = KerasStethoscope(
        detectors=[*detectors, WorkerOneDamage(DAMAGE_STEP)],
        sinks=[sink],
        recover=Recovery(snapshot_every=4),
    )
    rolled: list[dict] = []
    rolled_back = cb.recoverer.rolled_back

    def spy(step, epoch, to_step, *args, **kwargs):  # after the snapshot's restore
        rolled.append({"step": step, "to_step": to_step, "digest": digest(state(model))})
        return rolled_back(step, epoch, to_step, *args, **kwargs)

    cb.recoverer.rolled_back = spy
    fit(model, [cb], x, y, epochs=3)
    return {
        "rolled": rolled,
        "acts": [[f.step, f.where, f.rank] for f in sink.findings if f.detector == RECOVERY],
        "applied": steps_taken(model),
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "digest": digest(state(model)),
        "clean": clean(model),
    }


def recover_resumed(out: Path) -> dict:
    """A run with ``recover=True`` and a record per worker, as on two nodes (rank zero's
    record holds the run, worker 1's stays empty), backed up by ``BackupAndRestore`` at
    the end of epoch 0 on each worker: global batch ``NAN_STEP`` is NaN in worker 1's
    data, skipped in epoch 0 and in epoch 1, and the job dies in epoch 1 at its batch 7.
    Resumed on clean data, both workers number their steps on from rank zero's record
    and skip epoch 1's batch ``NAN_STEP`` again; then a fit with no callback on the same
    global batches but those two (``twin``)."""
    from stethoscope.findings import RECOVERY

    record, backup = out / f"record{INDEX}", out / f"backup{INDEX}"
    x, y = data(nan_here=INDEX == 1)
    model = mlp(STRATEGY)
    callbacks = [
        KerasStethoscope(sinks=[], record=record, recover=True),
        keras.callbacks.BackupAndRestore(backup),
        CrashAt(1, 7),
    ]
    crashed = False
    try:
        fit(model, callbacks, x, y, epochs=2)
    except Crash:
        crashed = True
    x, y = data()
    resumed = mlp(STRATEGY)
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink], record=record, recover=True)
    fit(resumed, [cb, keras.callbacks.BackupAndRestore(backup)], x, y, epochs=2)
    keep = np.ones(N, dtype=bool)
    keep[NAN_STEP * BATCH : (NAN_STEP + 1) * BATCH] = False
    twin = mlp(STRATEGY)
    fit(twin, [], x[keep], y[keep], epochs=2)
    mine, theirs = state(resumed), state(twin)
    result: dict[str, Any] = {
        "crashed": crashed,
        "acts": [[f.step, f.where, f.message] for f in sink.findings if f.detector == RECOVERY],
        "applied": steps_taken(resumed),
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "digest": digest(mine),
        "same_as_twin": all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)),
        "clean": clean(resumed),
    }
    if INDEX == 0:
        with RunRecord(record) as run:
            result["record"] = {
                "steps": sorted(int(s) for s in run.losses().steps),
                "skipped": [b.step for b in run.skipped_batches()],
            }
    return result


class Nudge(keras.callbacks.Callback):
    """At the start of ``step``, adds 1e-3 to this worker's own copy of the hidden
    kernel: the workers' weights differ from there on (the same summed update moves
    both)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.step:
            kernel = self.model.get_layer("hidden").kernel.value.values[0]  # a plain variable
            kernel.assign_add(tf.fill(kernel.shape, 1e-3))
        self.seen += 1


def diverged(out: Path) -> dict:
    """Worker 1 alone nudges a weight at step 10: replica_divergence names it."""
    x, y = data()
    model = mlp(STRATEGY)
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink], intervals={"replica_divergence": 4})
    nudges = [Nudge(10)] if INDEX == 1 else []
    fit(model, [*nudges, cb], x, y, epochs=3)
    return {
        "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        "steps": steps_taken(model),
        "findings": [finding(f) for f in sink.findings if str(f.severity) != "info"],
    }


SCENARIOS = {
    "healthy": healthy,
    "measured": measured,
    "nan_on_worker1": nan_on_worker1,
    "diverged": diverged,
    "recover_nan": recover_nan,
    "recover_bars": recover_bars,
    "recover_rollback": recover_rollback,
    "recover_resumed": recover_resumed,
}


def main(out: Path) -> None:
    fix_keras_fit()
    results: dict[str, Any] = {
        "index": INDEX,
        "replicas": STRATEGY.num_replicas_in_sync,
        "seconds": {},
    }
    for name, run in SCENARIOS.items():
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            results[name] = run(Path(tmp))
        results["seconds"][name] = round(time.perf_counter() - start, 2)
    (out / f"worker{INDEX}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[3]))
