"""The MirroredStrategy tests, run as a script; ``test_keras_mirrored.py`` starts it.

    python _mirrored_worker.py OUTFILE

TensorFlow fixes its logical devices when it initialises, so the two logical CPU
devices (one replica each) are configured here, before anything else touches
TensorFlow, in a process of their own. Every scenario runs in turn in this one process
(importing TensorFlow and Keras once is most of the cost) and leaves plain facts in a
dict; the dict goes to OUTFILE as JSON, and the tests assert on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _keras_facts import clean, finding  # noqa: E402

from stethoscope import KerasStethoscope, TrainingProblem  # noqa: E402
from stethoscope.record import RunRecord  # noqa: E402
from stethoscope.testing import CapturingSink, RecordingDetector  # noqa: E402

N, FEATURES, CLASSES, BATCH, LR = 256, 12, 3, 32, 0.05
STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


Spy = RecordingDetector  # keeps every observation it is shown; finds nothing


class Exploding(keras.optimizers.schedules.LearningRateSchedule):
    """``LR`` until ``onset``, then multiplied by ``factor`` every step."""

    def __init__(self, onset: int, factor: float) -> None:
        self.onset, self.factor = onset, factor

    def __call__(self, step):
        s = keras.ops.cast(step, "float32")
        grown = LR * keras.ops.power(self.factor, keras.ops.maximum(s - self.onset + 1.0, 0.0))
        return keras.ops.where(s >= self.onset, grown, LR)


def data(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


def relu_hiding_nan(h):
    """A ReLU that maps NaN to 0, the same on every CPU (TensorFlow's fused
    MatMul+BiasAdd+Relu kernel does so on some CPUs and passes the NaN on on others): the
    loss stays finite, while the kernel's gradient x^T·delta has NaN·0 = NaN in the NaN
    input's row."""
    return keras.ops.where(keras.ops.isnan(h), 0.0, keras.ops.relu(h))


def mlp(strategy: Any, *, activation: Any = "relu", lr: Any = LR, **opt: Any):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation=activation, name="hidden"),
                keras.layers.Dense(CLASSES, name="head"),
            ],
            name="mlp",
        )
        model.compile(
            keras.optimizers.SGD(lr, **opt),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    return model


def fit(model, callbacks: list, x, y, epochs: int = 1):
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
    )


def healthy() -> dict:
    x, y = data()
    model = mlp(STRATEGY)
    sink = CapturingSink()
    with tempfile.TemporaryDirectory() as tmp:
        cb = KerasStethoscope(sinks=[sink], record=Path(tmp) / "run")
        fit(model, [cb], x, y, epochs=2)
        with RunRecord(cb.record) as record:
            hist = record.layers("weight_hist")
            numel = [p["numel"] for p in record.config["model"]["parameters"]]
            recorded = {
                "losses": len(record.losses().steps),
                "sampled": len(record.layers("grad_norm").steps),
                "every_weight_once": bool(np.all(hist.values[-1].sum(axis=1) == numel)),
                "finished": record.finished,
            }
    out: dict[str, Any] = {
        "alarms": [finding(f) for f in sink.findings if str(f.severity) != "info"],
        "summaries": len(cb.summaries),
        "steps": cb.monitor.last_step,
        "clean": clean(model),
        "record": recorded,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.keras"
        model.save(path)
        with zipfile.ZipFile(path) as z:
            out["archive_mentions"] = [n for n in z.namelist() if b"stethoscope" in z.read(n)]
        loaded = keras.models.load_model(path)
        out["loaded_equal"] = bool(
            np.allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
        )
    return out


def measured() -> dict:
    """What the sampled steps carry, under the strategy and on one device."""
    x, y = data()
    needs = {"loss", "grads", "updates", "units", "inputs", "labels", "outputs", "activations"}
    out: dict[str, Any] = {}
    for name, strategy in (("mirrored", STRATEGY), ("single", None)):
        model = mlp(strategy, activation="tanh")
        if strategy is not None:
            # the global gradient of the first batch, on a copy without any strategy
            twin = mlp(None, activation="tanh")
            twin.set_weights(model.get_weights())
            with tf.GradientTape() as tape:
                loss = twin.compute_loss(y=y[:BATCH], y_pred=twin(x[:BATCH]))
            grads = tape.gradient(loss, twin.trainable_variables)
            out["tape_grad_norm"] = [float(np.linalg.norm(g.numpy())) for g in grads]
        spy = Spy(needs)
        logged: list[float] = []
        keep = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, into=logged: into.append(float(logs["loss"]))
        )
        cb = KerasStethoscope(
            detectors=[spy], sinks=[CapturingSink()], intervals={"recorder": 3}, escalate=False
        )
        fit(model, [cb, keep], x, y)
        out[name] = {
            "steps": [o.step for o in spy.seen],
            "sampled": [
                {
                    "step": o.step,
                    "names": list(o.names),
                    "grad_norm": o.grad_norm.tolist(),
                    "update_norm": o.update_norm.tolist(),
                    "weight_norm": o.weight_norm.tolist(),
                    "input_sq": o.input_sq.tolist(),
                    "input_count": o.input_count,
                    "labels": np.bincount(o.labels, minlength=CLASSES).tolist(),
                    "unit_zero": [u.tolist() for u in o.unit_zero],
                    "act_names": list(o.act_names),
                    "act_saturated": o.act_saturated.tolist(),
                    "act_rms": o.act_rms.tolist(),
                    "act_max": o.act_max.tolist(),
                }
                for o in spy.seen
                if o.grad_norm is not None
            ],
            "losses": [o.loss for o in spy.seen],
            # Keras logs the running mean of the epoch: undo it into per-step losses
            "logged": [
                (k + 1) * m - k * p
                for k, (m, p) in enumerate(zip(logged, [0.0, *logged[:-1]], strict=True))
            ],
            "clean": clean(model),
        }
    return out


def nan_on_replica(row: int, *, raise_too: bool) -> dict:
    """A NaN in one sample of step 5's batch: ``row`` 3 lands on replica 0, 20 on replica 1."""
    x, y = data()
    x[5 * BATCH + row, 2] = np.nan
    out: dict[str, Any] = {}
    model = mlp(STRATEGY, activation="tanh")
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink])
    history = fit(model, [cb], x, y, epochs=3)
    out["stopped_by"] = finding(cb.stopped_by) if cb.stopped_by else None
    out["epochs"] = len(history.history["loss"])
    out["at5"] = [finding(f) for f in sink.findings if f.step == 5]
    out["clean"] = clean(model)
    if not raise_too:
        return out
    model = mlp(STRATEGY, activation="tanh")
    try:
        fit(
            model, [KerasStethoscope(sinks=[CapturingSink()], stop_on=None, raise_on="error")], x, y
        )
        out["raised"] = None
    except TrainingProblem as exc:
        out["raised"] = str(exc)
    out["raise_clean"] = clean(model)
    return out


def exploding_lr() -> dict:
    """An LR that grows 1.5x a step from step 20: caught alike with and without strategy."""
    x, y = data(n=2 * N)
    out: dict[str, Any] = {}
    for name, strategy in (("mirrored", STRATEGY), ("single", None)):
        model = mlp(strategy, lr=Exploding(onset=20, factor=1.5))
        sink = CapturingSink()
        cb = KerasStethoscope(sinks=[sink])
        fit(model, [cb], x, y, epochs=3)
        alarms = [finding(f) for f in sink.findings if str(f.severity) != "info"]
        out[name] = {
            "first": alarms[0] if alarms else None,
            "stopped_by": finding(cb.stopped_by) if cb.stopped_by else None,
        }
    return out


def refusals() -> dict:
    """An unsupported strategy is refused at the start of fit; clipping is warned about."""
    x, y = data(n=2 * BATCH)
    out: dict[str, Any] = {}
    central = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    model = mlp(central)
    try:
        fit(model, [KerasStethoscope(sinks=[CapturingSink()])], x, y)
        out["central"] = None
    except ValueError as exc:
        out["central"] = str(exc)
    model = mlp(STRATEGY, clipnorm=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [KerasStethoscope(sinks=[CapturingSink()])], x, y)
    out["clip_warnings"] = [str(w.message) for w in caught if "clip" in str(w.message)]
    return out


def recover() -> dict:
    """recover=True with a NaN in replica 0's shard at step 3 and in replica 1's at step
    6 (8 steps of 32 samples, 16 per replica): both skipped by both replicas, the weights and
    the optimizer's slots as a fit that never saw those batches, under the strategy and
    on one device; a roll back restores the snapshot; several steps per execution are
    refused."""
    from stethoscope import Recovery
    from stethoscope.findings import RECOVERY

    x, y = data()
    x[3 * BATCH + 2, 0] = np.nan  # replica 0's half of step 3's batch
    x[6 * BATCH + 20, 0] = np.nan  # replica 1's half of step 6's batch
    keep = np.ones(len(x), dtype=bool)
    keep[3 * BATCH : 4 * BATCH] = keep[6 * BATCH : 7 * BATCH] = False

    def state(model) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in (*model.variables, *model.optimizer.variables)]

    sink = CapturingSink()
    # the NaN hidden from the loss, on every CPU: only the gradients show it
    recovered = mlp(STRATEGY, activation=relu_hiding_nan, momentum=0.9)
    fit(recovered, [KerasStethoscope(sinks=[sink], recover=True)], x, y)
    twins = {}
    for name, strategy in (("strategy", STRATEGY), ("one_device", None)):
        twin = mlp(strategy, activation=relu_hiding_nan, momentum=0.9)
        fit(twin, [], x[keep], y[keep])
        twins[name] = state(twin)
    mine = state(recovered)
    out: dict[str, Any] = {
        "acts": [[f.step, f.where] for f in sink.findings if f.detector == RECOVERY],
        "nonfinite": sorted(
            {(f.step, f.detector, f.rank) for f in sink.findings if "nonfinite" in f.detector}
        ),
        "same_as_twin": all(
            np.array_equal(a, b) for a, b in zip(mine, twins["strategy"], strict=True)
        ),
        "close_to_one_device": all(
            np.allclose(a, b, atol=1e-5) for a, b in zip(mine, twins["one_device"], strict=True)
        ),
        "clean": clean(recovered),
    }
    sink = CapturingSink()
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=2)
    x2, y2 = data()
    x2[5 * BATCH, 0] = x2[6 * BATCH, 0] = np.nan
    rolled = mlp(STRATEGY)
    fit(rolled, [KerasStethoscope(sinks=[sink], recover=settings)], x2, y2)
    out["rollback_acts"] = [[f.step, f.where] for f in sink.findings if f.detector == RECOVERY]
    several = mlp(STRATEGY)
    several.compile(several.optimizer, several.loss, steps_per_execution=2)
    try:
        fit(several, [KerasStethoscope(sinks=[], recover=True)], x, y)
        out["several_steps"] = "accepted"
    except ValueError as exc:
        out["several_steps"] = str(exc)
    return out


class OwnStep(keras.Model):
    """A train step of its own, never calling compute_loss: ``style`` ``own`` returns the
    step's loss tensor, ``named`` the result of a ``Mean`` named ``total_loss``."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(CLASSES)
        self.style, self.tracker = style, keras.metrics.Mean(name="total_loss")

    def call(self, x):
        return self.head(self.hidden(x))

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            xent = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = keras.ops.mean(xent)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        if self.style == "own":
            return {"loss": loss}
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def own_loss() -> dict:
    """Each replica's share of the loss its own train step logs, summed: the global
    batch's, as on one device (a learning rate of 0: the replicas' gradients, summed,
    would otherwise move the weights twice as far as one device's)."""
    x, y = data()
    out: dict[str, Any] = {}
    for style in ("own", "named"):
        for name, strategy in (("mirrored", STRATEGY), ("single", None)):
            keras.utils.set_random_seed(0)
            with strategy.scope() if strategy is not None else contextlib.nullcontext():
                model = OwnStep(style)
                model(x[:1])
                model.compile(keras.optimizers.SGD(0.0), jit_compile=False)
            spy = Spy({"loss"})
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fit(model, [KerasStethoscope(detectors=[spy], sinks=[])], x, y)
            out[f"{style}/{name}"] = {
                "losses": [float(o.loss) for o in spy.seen],
                "warnings": [str(w.message) for w in caught if "stethoscope" in str(w.message)],
                "clean": clean(model),
            }
    return out


SCENARIOS = {
    "healthy": healthy,
    "measured": measured,
    "nan_replica1": lambda: nan_on_replica(20, raise_too=True),
    "nan_replica0": lambda: nan_on_replica(3, raise_too=False),
    "exploding_lr": exploding_lr,
    "refusals": refusals,
    "recover": recover,
    "own_loss": own_loss,
}


def main(outfile: str) -> None:
    results: dict[str, Any] = {"replicas": STRATEGY.num_replicas_in_sync, "seconds": {}}
    for name, run in SCENARIOS.items():
        start = time.perf_counter()
        results[name] = run()
        results["seconds"][name] = round(time.perf_counter() - start, 2)
    Path(outfile).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
