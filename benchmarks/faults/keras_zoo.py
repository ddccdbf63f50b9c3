"""The Keras zoo: healthy Keras 3 workloads unlike the fault suite's, and what stethoscope
says on each (the Keras twin of ``zoo.py``, with the same table).

The workloads rebuild what keras.io and ``pytorch/examples`` teach, shrunk to a few CPU
seconds on data that ships or is made here (nothing is downloaded):

* ``vae``: keras.io's "Variational AutoEncoder" (``generative/vae``): a ``keras.Model``
  subclass whose own ``train_step`` computes the reconstruction and KL losses under a
  ``tf.GradientTape`` (``loss.backward()`` on the torch backend), applies the gradients
  and returns its three ``Mean`` trackers' results; compiled with an optimizer alone, no
  loss, and never calling ``compute_loss``. On scikit-learn's 8x8 digits in [0, 1] (the
  example's 28x28 MNIST, its two stride-2 convolutions and transposed convolutions
  kept; the latent space is 2-D, as there).
* ``lstm_lm``: a next-token language model, ``Embedding`` + ``LSTM`` + ``Dense`` over a
  vocabulary of 50 tokens, sparse categorical cross-entropy on logits, Adam, as
  keras.io's text-generation examples train one; on text drawn from a Markov chain over
  the 50 tokens (each token has a few likely successors, so there is something to learn).
* ``regression``: ``pytorch/examples``' ``regression/main.py`` as a Keras user writes it:
  one ``Dense(1)`` on the raw features x, x^2, x^3, x^4 of x ~ N(0, 1), mean squared
  error, SGD (the example's smooth L1 is Keras' ``Huber(delta=1)``, but keras.io's
  regressions use MSE, so MSE it is; its learning rate is smaller to stay stable under
  MSE's unbounded gradient on x^4).

For each workload and seed it trains two fits from ``keras.utils.set_random_seed(seed)``
after ``keras.backend.clear_session()``, one watched by
``KerasStethoscope(sinks=[CapturingSink()])`` with its defaults and one plain, each
served by a ``PyDataset`` that reshuffles every epoch (:class:`Shuffled`), TensorFlow on
one thread with op determinism and oneDNN off (:func:`configure`), and reports, as
``zoo.py`` does:

* trains: the workload's metric (the epoch's mean training loss, as Keras logs it) at
  the start and the end of the plain fit (the median of its first and of its last
  tenth of epochs), and whether it moved the right way;
* findings: every warning and error of the watched fit, the infos counted, any Python
  warning of stethoscope's, and a crash with the stethoscope frame it came from;
* bit-for-bit: whether both fits end with the same weights (the model's and the
  optimizer's), byte for byte, and the same losses;
* time: the watched fit's CPU seconds over the plain one's, the same for wall time, and
  stethoscope's CPU milliseconds per step; medians of ``--repeats`` alternating pairs on
  the first seed. A Keras fit traces its train function first: the watched fit traces a
  light one and a heavy one per set of statistics sampled, so on runs this short the
  traces are a good part of its extra time.

Run::

    python -m benchmarks.faults.keras_zoo                       # 3 seeds, TensorFlow
    python -m benchmarks.faults.keras_zoo --only vae --seeds 1
    KERAS_BACKEND=torch python -m benchmarks.faults.keras_zoo
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is first imported
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# oneDNN's CPU kernels made two plain fits of the VAE on a loaded machine log losses ulps
# apart (op determinism on, one thread; measured in 1 of 2 tries), and never without it
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
from keras import layers, ops

from benchmarks.faults import zoo
from benchmarks.faults.zoo import Fit, Row
from stethoscope import KerasStethoscope
from stethoscope.testing import CapturingSink

__all__ = ["WORKLOADS", "KerasWorkload", "Shuffled", "StepClock", "fit", "main", "run_workload"]

#: How stethoscope words a Python warning that detectors sit a run out, said once on
#: purpose (as ``zoo.py`` reads them: ``engine/schedule.py``).
_SITTING_OUT = re.compile(r"cannot judge this run|are off for this run")


@dataclass(frozen=True)
class KerasWorkload:
    """A healthy Keras training program of one model family.

    Args:
        name: Its name on the command line and in the table.
        example: The program it rebuilds.
        metric: What its trace holds (the epoch's mean of ``logs["loss"]``).
        epochs: Its length in the benchmark.
        test_epochs: Its length in the smoke test.
        build: ``seed -> (model, fit's arguments)``, the model compiled; called after the
            seed is set.
        higher_is_better: Whether training should raise the metric.
    """

    name: str
    example: str
    metric: str
    epochs: int
    test_epochs: int
    build: Callable[[int], tuple[Any, dict[str, Any]]]
    higher_is_better: bool = False


class Shuffled(keras.utils.PyDataset):
    """Batches of ``arrays`` in a new order every epoch, drawn from ``seed``.

    Not ``fit(x, y, shuffle=True)``: on TensorFlow, after ``keras.utils.set_random_seed``
    (which the zoo needs, so that both fits draw alike), Keras' shuffle of arrays serves
    the same order every epoch (its ``tf.random.shuffle`` starts again from its seed each
    epoch), which ``repeated_data`` rightly reports; a fit from an unseeded process, as
    keras.io's, reshuffles."""

    def __init__(self, arrays: tuple[np.ndarray, ...], batch_size: int, seed: int) -> None:
        super().__init__()
        self.arrays, self.batch_size = arrays, batch_size
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(arrays[0]))

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def __getitem__(self, i: int) -> Any:
        rows = self.order[i * self.batch_size : (i + 1) * self.batch_size]
        batch = tuple(a[rows] for a in self.arrays)
        return batch if len(batch) > 1 else batch[0]

    def on_epoch_end(self) -> None:
        self.order = self.rng.permutation(len(self.order))


# -- the VAE (keras.io, generative/vae) --------------------------------------------------

LATENT = 2


class Sampling(layers.Layer):
    """Draws z from N(z_mean, exp(z_log_var)): the reparameterisation trick."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs: Any) -> Any:
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _encoder() -> keras.Model:
    inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(inputs)
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")


def _decoder() -> keras.Model:
    inputs = keras.Input(shape=(LATENT,))
    x = layers.Dense(2 * 2 * 64, activation="relu")(inputs)
    x = layers.Reshape((2, 2, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(inputs, outputs, name="decoder")


class VAE(keras.Model):
    """keras.io's ``VAE``: its own ``train_step``, its losses tracked by three ``Mean``
    metrics and returned as their results; no ``compute_loss``, no compiled loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = _encoder()
        self.decoder = _decoder()
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, data: Any) -> Any:
        # keras.io's has none; Keras on torch cannot build the model before fit without it
        return self.decoder(self.encoder(data)[2])

    def vae_losses(self, data: Any) -> tuple[Any, Any, Any]:
        z_mean, z_log_var, z = self.encoder(data)
        reconstruction = self.decoder(z)
        reconstruction_loss = ops.mean(
            ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
        )
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss

    def train_step(self, data: Any) -> dict[str, Any]:
        data, _, _ = keras.utils.unpack_x_y_sample_weight(data)  # a 1-tuple on torch
        if keras.backend.backend() == "torch":  # keras.io's "custom fit with PyTorch"
            import torch

            self.zero_grad()
            total_loss, reconstruction_loss, kl_loss = self.vae_losses(data)
            total_loss.backward()
            weights = list(self.trainable_weights)
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights], weights)
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                total_loss, reconstruction_loss, kl_loss = self.vae_losses(data)
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def _digits() -> np.ndarray:
    """scikit-learn's 8x8 digits (1797 images) in [0, 1], channels last."""
    from sklearn.datasets import load_digits

    return (load_digits().images / 16.0).astype("float32")[..., None]


def _build_vae(seed: int) -> tuple[Any, dict[str, Any]]:
    model = VAE()
    model.compile(optimizer=keras.optimizers.Adam())
    return model, {"x": Shuffled((_digits(),), 128, seed)}


# -- the LSTM language model ------------------------------------------------------------

VOCAB, WINDOW = 50, 20


def _markov_text(seed: int, n: int) -> np.ndarray:
    """``n`` tokens from a Markov chain over :data:`VOCAB` tokens: each token is followed
    by one of 3 successors of its own 90% of the time, by any token the rest."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 3))
    text = np.empty(n, dtype="int32")
    text[0] = rng.integers(VOCAB)
    likely, anyone, pick = rng.random(n) < 0.9, rng.integers(0, VOCAB, n), rng.integers(0, 3, n)
    for i in range(1, n):
        text[i] = successors[text[i - 1], pick[i]] if likely[i] else anyone[i]
    return text


def _build_lstm_lm(seed: int) -> tuple[Any, dict[str, Any]]:
    text = _markov_text(seed, 64 * WINDOW * 16 + 1)
    x = text[:-1].reshape(-1, WINDOW)
    y = text[1:].reshape(-1, WINDOW)
    model = keras.Sequential(
        [
            keras.Input((WINDOW,), dtype="int32"),
            layers.Embedding(VOCAB, 32),
            layers.LSTM(64, return_sequences=True),
            layers.Dense(VOCAB),
        ],
        name="lstm_lm",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, {"x": Shuffled((x, y), 64, seed)}


# -- the polynomial regression (pytorch/examples regression) -------------------------------


def _build_regression(seed: int) -> tuple[Any, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    w, b = rng.normal(size=(4, 1)) * 5, rng.normal() * 5
    r = rng.normal(size=(1024, 1))
    x = np.concatenate([r**i for i in range(1, 5)], axis=1).astype("float32")
    y = (x @ w + b).astype("float32")
    model = keras.Sequential([keras.Input((4,)), layers.Dense(1)], name="poly")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model, {"x": Shuffled((x, y), 32, seed)}


WORKLOADS: dict[str, KerasWorkload] = {
    w.name: w
    for w in (
        KerasWorkload("vae", "keras.io generative/vae", "loss (BCE+KL)", 20, 2, _build_vae),
        KerasWorkload("lstm_lm", "keras.io text generation", "train CE", 10, 2, _build_lstm_lm),
        KerasWorkload("regression", "regression", "MSE", 20, 2, _build_regression),
    )
}


# -- a fit ---------------------------------------------------------------------------------


class _Losses(keras.callbacks.Callback):
    """Each epoch's ``logs["loss"]`` (an epoch-end hook: a batch-end one would make Keras
    wait for the callbacks after every batch, in both fits)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[float] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.trace.append(float((logs or {}).get("loss", float("nan"))))


def _state(model: Any) -> dict[str, bytes]:
    """The model's weights and its optimizer's, as bytes (NaN-safe equality)."""
    out = {}
    for group, variables in (("model", model.weights), ("optimizer", model.optimizer.variables)):
        for i, v in enumerate(variables):
            out[f"{group}/{i}/{v.path}"] = np.asarray(keras.ops.convert_to_numpy(v)).tobytes()
    return out


class StepClock(keras.callbacks.Callback):
    """Appends the process's CPU time to ``times`` at each training batch's start (the
    Keras twin of ``zoo.StepClock``; first among the callbacks, so that a step holds all of
    stethoscope's hooks, the epoch's end included). A batch-start hook takes no logs, so
    it makes Keras wait for nothing."""

    def __init__(self, times: list[float]) -> None:
        super().__init__()
        self.times = times

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.times.append(time.process_time())


def fit(
    workload: KerasWorkload,
    seed: int,
    *,
    watched: bool,
    epochs: int | None = None,
    clock: list[float] | None = None,
) -> Fit:
    """One seeded ``model.fit`` of ``workload``, watched by stethoscope's defaults or not.

    Args:
        workload: What to train.
        seed: ``keras.utils.set_random_seed`` (Python, NumPy and the backend), after
            ``keras.backend.clear_session()``; the data's seed too.
        watched: Whether a ``KerasStethoscope(sinks=[CapturingSink()])`` rides along.
        epochs: Its length (default: the benchmark's, ``workload.epochs``).
        clock: Where to append the process's CPU time at the fit's start, at each
            training batch's start and at the fit's end (see :class:`StepClock`).
    """
    keras.backend.clear_session()  # the same layer names (and seeded draws) in every fit
    keras.config.disable_interactive_logging()  # clear_session turns it back on
    keras.utils.set_random_seed(seed)
    sink, losses = CapturingSink(), _Losses()
    crash, model, steps, seconds, cpu = None, None, 0, 0.0, 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # a crash anywhere, stethoscope's constructor included, is a result
            model, data = workload.build(seed)
            callbacks: list[Any] = [] if clock is None else [StepClock(clock)]
            callbacks += [losses, *([KerasStethoscope(sinks=[sink])] if watched else [])]
            t0, c0 = time.perf_counter(), time.process_time()
            if clock is not None:
                clock.append(c0)
            try:
                model.fit(
                    **data,
                    epochs=workload.epochs if epochs is None else epochs,
                    verbose=0,
                    callbacks=callbacks,
                )
            finally:
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                if clock is not None:
                    clock.append(c0 + cpu)
                steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        except Exception as exc:
            crash = zoo.crash_text(exc)
    ours = {
        str(w.message)
        for w in caught
        if "/stethoscope/" in str(w.filename).replace("\\", "/")
        or str(w.message).startswith("stethoscope:")
    }
    return Fit(
        seconds=seconds,
        cpu=cpu,
        trace=losses.trace,
        state={} if model is None else _state(model),
        steps=steps,
        findings=list(sink.findings),
        crash=crash,
        warnings=sorted(w for w in ours if not _SITTING_OUT.search(w)),
        notices=sorted(w for w in ours if _SITTING_OUT.search(w)),
    )


def run_workload(
    workload: KerasWorkload, seeds: Sequence[int], *, repeats: int = 3, log: Any = None
) -> Row:
    """Every seed's watched and plain fit, then ``repeats`` timing pairs on the first seed
    (see ``zoo.run_workload``), each made by :func:`fit`."""
    return zoo.run_workload(workload, seeds, repeats=repeats, log=log, fit=fit)


def quiet() -> None:
    """Silence TensorFlow's logs and Keras' warnings (stethoscope's are still caught)."""
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl ships with TensorFlow; the torch backend may lack it
        pass
    warnings.filterwarnings("ignore", module="keras.*")
    keras.config.disable_interactive_logging()


def configure(threads: int) -> None:
    """Run the backend's ops on ``threads`` threads, deterministically (TensorFlow: before
    its runtime starts; else its settings stay).

    TensorFlow's CPU kernels are not deterministic by default: two plain fits of the VAE
    in one process log losses an ulp apart from the second fit on (with two threads,
    even under ``enable_op_determinism``), so the zoo runs on one thread with op
    determinism, keras.io's recipe for reproducible fits, and only then can a difference
    be stethoscope's."""
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
        return
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime is already initialised
        pass
    tf.config.experimental.enable_op_determinism()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.keras_zoo",
        description="Healthy Keras workloads (a VAE with its own train_step, an LSTM language "
        "model, a polynomial regression): does stethoscope stay quiet, change nothing, and "
        "cost little?",
    )
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per workload (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timing pairs (default 3; 1: no extra)")
    p.add_argument("--threads", type=int, default=1, help="backend threads (default 1)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = zoo.chosen(args.only, WORKLOADS)
    if names is None:
        return 2
    configure(args.threads)
    quiet()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}", file=sys.stderr)
    workloads = [WORKLOADS[n] for n in names]
    print(zoo.run_all(workloads, seeds=args.seeds, repeats=args.repeats, run=run_workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
