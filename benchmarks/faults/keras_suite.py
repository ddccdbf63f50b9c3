"""The Keras 3 implementation (TensorFlow backend): a ``fit`` per setting, one for baselines.

How a run works. The scenario's data (``data.py``) becomes a ``tf.data`` pipeline
of precomputed batches: the training set is permuted from the seed once per epoch
(the last, smaller batch of an epoch is kept, as in the Lightning loader), the
epochs are laid end to end and ``fit`` walks them with ``steps_per_epoch``, so the
batch of every global step is known before training starts. Images are fed
channels-last (8x8x1), as Keras' CPU convolutions want them. The model spec becomes
a ``keras.Sequential`` with Keras' own initialisers (Glorot for kernels, zero
biases); each hidden layer is a ``Dense`` (or ``Conv2D``) followed by an optional
``BatchNormalization`` and a separate ``Activation``, the layout of the Lightning
modules. The probe reads no Dense output that only an activation layer reads (see
"Why not in the stethoscope's fit" below): of the MLPs' layer outputs it reads the
head's alone, where the Lightning probes read every linear layer's. The loss
(:func:`make_loss`) is ``SparseCategoricalCrossentropy(from_logits=True)``, or the Keras
form of ``TrainSpec.loss``: ``from_logits=False`` for probabilities;
``CategoricalCrossentropy(label_smoothing=0.1)`` of one-hot labels for a smoothed loss
(Keras' sparse loss has no smoothing); ``BinaryCrossentropy`` of the labels one-hot as
float for the multi-label ones; and for a GRU scored at every step, whose ``(N, T, C)``
scores are transposed to ``(N, C, T)`` (and, for ``"steps_softmax"``, put through
``Softmax(axis=1)``), ``CategoricalCrossentropy(axis=1)`` of one-hot ``(N, C, T)``
targets, the classes on axis 1 as in Lightning. A softmax, log-softmax or sigmoid "in the
training step" is a ``train_step`` written by hand (``_StepFaultModel``) that applies it
to the model's output before ``compute_loss``. (On TensorFlow, Keras' cross-entropies
take the logits a softmax or sigmoid caches on its output when handed it straight, and
warn: the softmax-twice scenarios train as their twins do, their mistake is the
configuration, which the stethoscope names as Keras' warning does; on JAX and torch the
softmax is applied twice.) Adam and SGD keep their Keras defaults (Adam's epsilon is
1e-7, not PyTorch's 1e-8).

Precision (``TrainSpec.precision``) is Keras' dtype policy of the same meaning
(:data:`POLICIES`), set while the model is built and compiled and restored after:
``"bf16-true"`` holds the variables in bfloat16, ``"16-true"`` in float16 with no loss
scaling, and ``"16-mixed"`` makes ``compile`` wrap the optimizer in a
``LossScaleOptimizer``. The loss is computed in float32 from the output (a Keras loss
computes in ``floatx``), times ``TrainSpec.loss_weight`` (``compile``'s
``loss_weights``).

Faults are injected the Keras way, each at its exact step:

* ``nan_input``, ``scale_inputs``, ``corrupt_labels``: in the data, the rows of the
  onset batch are changed before the pipeline is built.
* ``lr_scale``, ``lr_growth`` (and the warm-up and cosine schedules): a
  ``LearningRateSchedule`` of the optimizer's iteration counter, read in the graph.
* ``nan_weight``: an optimizer subclass whose ``apply`` writes the NaN into the
  weight right after the update of the onset step, inside the train step (the
  "buggy custom optimizer" of the spec; the probe's weight norms of that step see it,
  as the Lightning hooks do).
* ``zero_lr_group``: Keras has no parameter groups; an optimizer subclass whose
  ``update_step`` multiplies the learning rate of layer ``layer``'s variables by 0,
  a per-variable learning rate of exactly 0: the gradients are real and reach the
  optimizer (and its moments), only the step is zero, as with a PyTorch group at lr 0.
* ``inf_gradient``, ``inf_gradients``, ``exclude_layer``: a ``train_step`` override
  that still calls ``compute_loss``, ``optimizer.scale_loss`` and ``optimizer.apply``;
  it writes +Inf into one element of the layer's kernel gradient when
  ``optimizer.iterations`` equals the onset (the analogue of the tensor hook), or at
  every step from the onset on (counted by the model: a ``LossScaleOptimizer`` skips
  those steps, and its ``iterations`` stand still), or leaves the layer's variables
  out of ``optimizer.apply``
  (they stay trainable and receive gradients; the optimizer never sees them).
  ``trainable=False`` is not that fault: it is the ``healthy_frozen_layer`` control.
* ``kill_units``: a callback's ``on_train_batch_begin`` at the onset sets the biases.

``nan_input``, ``nan_weight`` and ``inf_gradient`` (whose +Inf gradient makes Adam
write a NaN weight) model a NaN that a ReLU hides from the loss, as TensorFlow's fused
MatMul+BiasAdd+Relu kernel does on some CPUs (on others it passes the NaN on, as
torch's ReLU does). Their models' ReLUs are ``where(isnan(h), 0, relu(h))``
(:func:`relu_hiding_nan`), so on every CPU the loss stays finite while the NaN reaches
the gradients or the weights, and the suite's numbers do not depend on the CPU.
* ``init_scale``, ``init_std``, ``zero_init``: the weights are rewritten after the
  model is built, before compiling.

Watchers. A ``KerasStethoscope`` wraps the model's ``compute_loss``, its optimizer's
``apply`` and its layers' ``call`` for one fit, so a model can carry only one at a
time: where the Lightning suite watches one fit with one stethoscope per setting,
this suite trains one fit per setting, each from ``keras.utils.set_random_seed(seed)``
after ``keras.backend.clear_session()`` (so layer names, initial weights, dropout
masks and batches are the same), and checks that the fits were identical: the
per-step training loss and the final weights of every fit must match the first
bit for bit, or the run records an error (and counts as missed). Each fit's
stethoscope is ``KerasStethoscope(sinks=[CapturingSink()], stop_on=None, **kwargs)``
with the setting's arguments (``scenarios.setting_kwargs``, shared with Lightning).

The baselines (``results.KERAS_BASELINES``) watch a fit of their own, with no
stethoscope, each recording the step at which it would have stopped training and then
undoing the stop: Keras' ``EarlyStopping(monitor="loss", patience=3)`` (Keras has no
``check_finite``: a NaN epoch loss is just no improvement), ``TerminateOnNaN()`` and a
hand-written check of ``logs["loss"]``. Keras hands batch callbacks the running mean
of the epoch's losses, which turns non-finite with the first non-finite batch, so the
two are the same check. Lightning's ``SpikeDetection`` has no Keras counterpart.

Why not in the stethoscope's fit, as in Lightning: a stethoscope that read a layer
output could change what a NaN does to this model. On the CPU, TensorFlow's graph
optimiser fuses a MatMul (or convolution), BiasAdd and Relu into one kernel, which on
some CPUs turns a NaN pre-activation into 0 and on others passes it on (an unfused
``relu(NaN)`` is NaN); a second consumer of the Dense output keeps the three ops apart.
KerasStethoscope reads no Dense output that only an activation layer reads, so TensorFlow
fuses as without it; and the scenarios whose NaN meets a ReLU hide it explicitly (see
above), the same fused or not. The baselines here see what a user without the
stethoscope would. Their fit is not always the watched
one to the bit even while every value is finite: fused and unfused tanh and sigmoid
kernels round differently (a relative difference of ~1e-7 in the loss of the tanh MLPs
from step 0 was measured while the probe read the Dense outputs). ``run_scenario``
compares the two fits up to the first non-finite loss and notes any difference in
``RunResult.notes``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is first imported
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from benchmarks.faults.data import Arrays, make_data
from benchmarks.faults.results import RunResult
from benchmarks.faults.scenarios import (
    FaultSpec,
    ModelSpec,
    Scenario,
    TrainSpec,
    resolve_onset,
    setting_kwargs,
)
from stethoscope import KerasStethoscope
from stethoscope.testing import CapturingSink

__all__ = [
    "FRAMEWORK",
    "POLICIES",
    "SPIKE_DETECTION",
    "WatchedKerasStethoscope",
    "baseline_callbacks",
    "build_model",
    "configure",
    "environment",
    "make_dataset",
    "make_loss",
    "quiet",
    "relu_hiding_nan",
    "run_scenario",
    "targets",
]

FRAMEWORK = "keras"
SPIKE_DETECTION = (
    "Lightning's SpikeDetection has no Keras counterpart; TerminateOnNaN is Keras' own "
    "stop-on-non-finite callback. The Keras baselines watch a fit of their own, without "
    "the stethoscope. In nan_input, nan_weight and inf_gradient a ReLU that maps NaN to "
    "0 (built explicitly, as TensorFlow's fused MatMul+BiasAdd+Relu kernel behaves on "
    "some CPUs) keeps the NaN from the loss, which is all these callbacks see."
)

_BATCH_FAULTS = ("nan_input", "scale_inputs", "corrupt_labels")

#: The Keras dtype policy of each of ``TrainSpec.precision``'s settings.
POLICIES = {
    "32": "float32",
    "bf16-true": "bfloat16",
    "16-true": "float16",
    "bf16-mixed": "mixed_bfloat16",
    "16-mixed": "mixed_float16",
}


def quiet() -> None:
    """Silence TensorFlow's C++ and Python logs and the warnings a tiny run triggers."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    tf.get_logger().setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover - absl ships with TensorFlow
        pass
    warnings.filterwarnings("ignore", module="keras.*")
    keras.config.disable_interactive_logging()  # callbacks' messages go to absl: silenced


def configure(threads: int) -> None:
    """Run TensorFlow's ops on ``threads`` threads (before its runtime starts; else a no-op)."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime is already initialised: its settings stay
        pass


def environment() -> dict[str, Any]:
    """Versions of what this implementation runs on."""
    return {
        "versions": f"keras {keras.__version__}, tensorflow {tf.__version__}",
        "threads": tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count(),
    }


def _check_backend() -> None:
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"the Keras fault suite injects faults through TensorFlow (a GradientTape train "
            f"step, tf.data); KERAS_BACKEND={backend!r}: set KERAS_BACKEND=tensorflow"
        )


# -- data ----------------------------------------------------------------------------------


def make_dataset(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int,
    epochs: int,
    *,
    fault: FaultSpec | None = None,
    onset: int = -1,
    classes: int = 0,
    order: str = "shuffled",
) -> tf.data.Dataset:
    """``epochs`` epochs end to end, the batch at global step ``onset`` corrupted (or, for
    a ``stuck_batch`` fault, served again at every step from there on).

    Every epoch is a fresh permutation from ``seed`` (``order="fixed"``: the first
    epoch's, every epoch; ``"sequential"``: the arrays' order, every epoch); its last
    batch may be smaller.
    """
    rng = np.random.default_rng(20_000 + seed)
    if order == "shuffled":
        order_ = np.stack([rng.permutation(len(x)) for _ in range(epochs)])
    elif order == "fixed":
        order_ = np.tile(rng.permutation(len(x)), (epochs, 1))
    else:
        order_ = np.tile(np.arange(len(x)), (epochs, 1))
    xs, ys = x[order_], y[order_]  # (epochs, n, ...): a copy, safe to corrupt
    per_epoch = -(-len(x) // batch_size)
    if fault is not None and fault.kind == "stuck_batch" and 0 <= onset < epochs * per_epoch:
        _serve_again(xs, ys, onset, per_epoch, batch_size)
    if fault is not None and fault.kind in _BATCH_FAULTS and 0 <= onset < epochs * per_epoch:
        e, b = divmod(onset, per_epoch)
        rows = slice(b * batch_size, min((b + 1) * batch_size, len(x)))
        if fault.kind == "nan_input":
            xs[e, rows.start].reshape(-1)[0] = np.nan  # one value of the batch
        elif fault.kind == "scale_inputs":
            xs[e, rows] *= fault["factor"]
        else:  # corrupt_labels
            ys[e, rows] = (ys[e, rows] + 1) % classes

    def batches(xe: tf.Tensor, ye: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((xe, ye)).batch(batch_size)

    return tf.data.Dataset.from_tensor_slices((xs, ys)).flat_map(batches)


def _serve_again(
    xs: np.ndarray, ys: np.ndarray, onset: int, per_epoch: int, batch_size: int
) -> None:
    """Every batch from global step ``onset`` on becomes the one at ``onset`` (as much of
    it as a smaller last batch holds): a loader that caches a batch."""
    n = xs.shape[1]
    e, b = divmod(onset, per_epoch)
    rows = slice(b * batch_size, min((b + 1) * batch_size, n))
    x0, y0 = xs[e, rows].copy(), ys[e, rows].copy()
    for step in range(onset + 1, xs.shape[0] * per_epoch):
        e, b = divmod(step, per_epoch)
        start, stop = b * batch_size, min((b + 1) * batch_size, n)
        xs[e, start:stop], ys[e, start:stop] = x0[: stop - start], y0[: stop - start]


def _channels_last(a: np.ndarray | None) -> np.ndarray | None:
    """(N, C, H, W) images as Keras' CPU convolutions want them: (N, H, W, C)."""
    return None if a is None or a.ndim != 4 else np.ascontiguousarray(a.transpose(0, 2, 3, 1))


# -- models ---------------------------------------------------------------------------------


class _StepCount:
    """The train steps taken, in a variable of its own: held in this object, which a
    model does not track (a Variable in a model's attribute would be one of its weights)."""

    def __init__(self) -> None:
        self.variable = keras.Variable(0, dtype="int64", trainable=False, name="steps_taken")


class _StepFaultModel(keras.Sequential):
    """A Sequential whose train step poisons a gradient or skips a layer's variables.

    It computes the loss with ``compute_loss``, scales it with ``optimizer.scale_loss``
    and updates with ``optimizer.apply``, as Keras' own TensorFlow train step does, so the
    stethoscope's wrappers see all three.
    """

    # variable paths, not variables: a Variable in an attribute would be tracked by the
    # model, which moves it to the front of trainable_variables (input side first no more)
    _inf_at = -1
    _inf_path: str | None = None
    _steps: _StepCount | None = None  # inf_gradients: every step from _inf_at on
    _skip: tuple[str, ...] = ()
    _in_step: Any = None  # applied to the model's output before the loss (TrainSpec.loss)

    def in_step(self, fn: Any) -> None:
        """Apply ``fn`` to the model's output in the train step, before ``compute_loss``
        (a softmax or sigmoid written there, where no layer shows it)."""
        self._in_step = fn

    def poison(self, variable: keras.Variable, step: int, *, every: bool = False) -> None:
        """Make element 0 of ``variable``'s gradient +Inf at global step ``step`` (the
        optimizer's ``iterations``); ``every``: at every step from ``step`` on, counted by
        the model itself, since a ``LossScaleOptimizer``'s ``iterations`` stand still on
        the steps it skips."""
        self._inf_path, self._inf_at = variable.path, step
        if every:
            self._steps = _StepCount()

    def leave_out(self, variables: Sequence[keras.Variable]) -> None:
        """Never hand ``variables`` (or their gradients) to the optimizer."""
        self._skip = tuple(v.path for v in variables)

    def applied(self) -> list[keras.Variable]:
        """The variables the train step hands the optimizer."""
        return [v for v in self.trainable_variables if v.path not in self._skip]

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            if self._in_step is not None:
                y_pred = self._in_step(y_pred)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
            scaled = self.optimizer.scale_loss(loss)  # a LossScaleOptimizer's scale
        tvars = list(self.trainable_variables)
        grads = tape.gradient(scaled, tvars)
        if self._inf_path is not None:
            i = next(k for k, v in enumerate(tvars) if v.path == self._inf_path)
            g = grads[i]
            first = ops.reshape(ops.one_hot(0, int(np.prod(g.shape))), g.shape) > 0
            if self._steps is not None:
                now = ops.greater_equal(self._steps.variable, self._inf_at)
                self._steps.variable.assign_add(1)
            else:
                now = ops.equal(self.optimizer.iterations, self._inf_at)
            grads[i] = ops.where(ops.logical_and(now, first), math.inf, g)
        kept = [(g, v) for g, v in zip(grads, tvars, strict=True) if v.path not in self._skip]
        self.optimizer.apply([g for g, _ in kept], [v for _, v in kept])
        batch = ops.cast(ops.shape(x)[0], "float32")
        for metric in self.metrics:  # as Keras' own step: the loss weighted by batch size
            if metric.name == "loss":
                metric.update_state(loss, sample_weight=batch)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def relu_hiding_nan(h: Any) -> Any:
    """A ReLU that maps NaN to 0, the same on every CPU.

    TensorFlow's fused MatMul+BiasAdd+Relu kernel does so on some CPUs and passes the NaN
    on on others. The forward pass is finite; the gradient still reaches the NaN: none
    flows back to a NaN pre-activation, but a kernel's gradient ``x^T @ delta`` has
    ``NaN * 0 = NaN`` in the NaN input's row.
    """
    return ops.where(ops.isnan(h), 0.0, ops.relu(h))


#: The faults whose NaN a hidden ReLU meets: their ReLUs hide it, on every CPU.
_NAN_HIDDEN_BY_RELU = ("nan_input", "nan_weight", "inf_gradient", "inf_gradients")


def _bn_kwargs(spec: ModelSpec) -> dict[str, float]:
    """A batch norm's arguments: Keras' momentum is the share of the statistics kept."""
    return {} if spec.bn_momentum is None else {"momentum": 1.0 - spec.bn_momentum}


def _activation(name: str, fault: FaultSpec | None) -> Any:
    """The hidden activation ``name``; a ReLU that hides a NaN under the faults that
    make one before it."""
    if name == "relu" and fault is not None and fault.kind in _NAN_HIDDEN_BY_RELU:
        return relu_hiding_nan
    return name


#: The head's activation of each ``ModelSpec.output`` (the sequences' softmax, over the
#: classes on axis 1, is a layer of its own after the transpose).
_OUTPUTS = {
    "logits": None,
    "softmax": "softmax",
    "sigmoid": "sigmoid",
    "steps": None,
    "steps_softmax": None,
}

#: What a train step written by hand applies to the output before the compiled loss
#: (``TrainSpec.loss``): a softmax or sigmoid before a loss that applies its own (a bug),
#: or a log-softmax, whose softmax is the logits' own (right).
_IN_STEP = {
    "softmax_in_step": ops.softmax,
    "log_softmax_in_step": ops.log_softmax,
    "sigmoid_in_step": ops.sigmoid,
}

#: The losses whose targets are the labels one-hot as float: multi-label targets for the
#: binary cross-entropies, Keras' label smoothing, which its sparse loss lacks, and the
#: loss functions of the user's own.
_ONE_HOT = (
    "bce_with_logits",
    "bce",
    "sigmoid_in_step",
    "smoothed",
    "probabilities_smoothed",
    "one_hot",
    "softmax_in_step_one_hot",
)


def _softmax(p: Any) -> Any:
    """A softmax written out by hand (on TensorFlow, a cross-entropy with
    ``from_logits=True`` takes the logits back from Keras' own softmax, and warns)."""
    e = ops.exp(p - ops.max(p, axis=-1, keepdims=True))
    return e / ops.sum(e, axis=-1, keepdims=True)


def own_cross_entropy(y: Any, p: Any) -> Any:
    """A loss function of the user's own, ``compile(loss=own_cross_entropy)``: the
    cross-entropy of one-hot targets with the logits (right)."""
    return keras.losses.categorical_crossentropy(y, p, from_logits=True)


def own_softmax_cross_entropy(y: Any, p: Any) -> Any:
    """The same, with a softmax written in it before a cross-entropy that applies its own
    (a bug)."""
    return keras.losses.categorical_crossentropy(y, _softmax(p), from_logits=True)


def make_loss(spec: ModelSpec, train: TrainSpec) -> keras.losses.Loss:
    """The compiled loss of ``train.loss``, as a Keras user writes each: a cross-entropy
    that takes logits (``from_logits=True``) or probabilities, sparse labels or one-hot
    targets (label-smoothed by 0.1, or multi-label for a binary cross-entropy); a
    sequence scored at every step takes its one-hot targets with the classes on axis 1."""
    loss, kl = train.loss, keras.losses
    if loss == "one_hot":
        return own_cross_entropy
    if loss == "softmax_in_step_one_hot":
        return own_softmax_cross_entropy
    logits = loss not in ("probabilities", "probabilities_smoothed", "bce")
    if loss in ("bce_with_logits", "bce", "sigmoid_in_step"):
        return kl.BinaryCrossentropy(from_logits=logits)
    if loss in ("smoothed", "probabilities_smoothed"):
        return kl.CategoricalCrossentropy(from_logits=logits, label_smoothing=0.1)
    if loss not in ("logits", "probabilities", "softmax_in_step", "log_softmax_in_step"):
        raise ValueError(f"loss={loss!r} has no Keras form here")
    if spec.output.startswith("steps"):
        return kl.CategoricalCrossentropy(from_logits=logits, axis=1)
    return kl.SparseCategoricalCrossentropy(from_logits=logits)


def targets(spec: ModelSpec, train: TrainSpec, y: np.ndarray, classes: int, steps: int) -> Any:
    """What the loss of :func:`make_loss` is fed for the labels ``y``: themselves, one-hot
    as float, or one-hot at each of a sequence's ``steps``, classes on axis 1 ``(N, C, T)``."""
    if spec.output.startswith("steps"):
        return np.eye(classes, dtype=np.float32)[np.repeat(y[:, None], steps, 1)].transpose(0, 2, 1)
    return np.eye(classes, dtype=np.float32)[y] if train.loss in _ONE_HOT else y


def build_model(
    spec: ModelSpec,
    input_shape: tuple[int, ...],
    classes: int,
    *,
    fault: FaultSpec | None = None,
    onset: int = -1,
    loss: str = "logits",
) -> tuple[keras.Sequential, list[keras.layers.Layer]]:
    """The network of ``spec`` (built) and its layers with weights, from the input; a
    ``loss`` of :data:`_IN_STEP` applies its function to the output in the train step."""
    mods: list[keras.layers.Layer] = [keras.Input(input_shape)]
    layers: list[keras.layers.Layer] = []
    if spec.arch == "mlp":
        if len(input_shape) > 1:
            mods.append(keras.layers.Flatten())
        for _ in range(spec.depth):
            dense = keras.layers.Dense(spec.width, use_bias=spec.hidden_bias)
            layers.append(dense)
            mods.append(dense)
            if spec.batchnorm:
                mods.append(keras.layers.BatchNormalization(**_bn_kwargs(spec)))
            mods.append(keras.layers.Activation(_activation(spec.activation, fault)))
        if spec.dropout:
            mods.append(keras.layers.Dropout(spec.dropout))
    elif spec.arch == "cnn":
        for channels in (16, 32):
            conv = keras.layers.Conv2D(channels, 3, padding="same")
            layers.append(conv)
            mods.append(conv)
            if spec.batchnorm:
                mods.append(keras.layers.BatchNormalization(**_bn_kwargs(spec)))
            mods.append(keras.layers.Activation(_activation("relu", fault)))
        mods += [keras.layers.MaxPooling2D(2), keras.layers.Flatten()]
        if spec.dropout:
            mods.append(keras.layers.Dropout(spec.dropout))
    elif spec.arch == "gru":
        steps = spec.output.startswith("steps")
        gru = keras.layers.GRU(spec.width, return_sequences=steps)  # its last output, or all
        layers.append(gru)
        mods.append(gru)
    else:
        raise ValueError(f"arch={spec.arch!r}; use 'mlp', 'cnn' or 'gru'")
    if spec.output not in _OUTPUTS:
        raise ValueError(f"output={spec.output!r}; use one of {[*_OUTPUTS]!r}")
    head = keras.layers.Dense(classes, activation=_OUTPUTS[spec.output])
    layers.append(head)
    mods.append(head)
    if spec.output.startswith("steps"):  # (N, T, C) -> (N, C, T): classes on axis 1
        mods.append(keras.layers.Permute((2, 1)))
        if spec.output == "steps_softmax":
            mods.append(keras.layers.Softmax(axis=1))
    kind = fault.kind if fault is not None else None
    if kind in ("inf_gradient", "inf_gradients", "exclude_layer") or loss in _IN_STEP:
        model: keras.Sequential = _StepFaultModel(mods, name="sequential")
        if loss in _IN_STEP:
            model.in_step(_IN_STEP[loss])
        if kind == "exclude_layer":
            model.leave_out(layers[fault["layer"]].trainable_variables)
        elif kind in ("inf_gradient", "inf_gradients"):
            model.poison(_weight(layers[fault["layer"]]), onset, every=kind == "inf_gradients")
    else:
        model = keras.Sequential(mods)
    _init_faults(fault, layers)
    for i in spec.frozen:
        layers[i].trainable = False
    return model, layers


#: The generator's noise features (``ModelSpec.arch == "gan"``).
GAN_NOISE = 8


class _GanModel(keras.Model):
    """A GAN on a scenario's inputs (``ModelSpec.arch == "gan"``) with its own train step,
    as Keras' GAN examples write it: the discriminator's optimizer is its own, the
    generator's is ``model.optimizer``, and the logs' ``loss`` is the generator's."""

    def __init__(self, features: int, width: int, seed: int) -> None:
        super().__init__()
        dense = keras.layers.Dense
        self.generator = keras.Sequential(
            [keras.Input((GAN_NOISE,)), dense(width, activation="relu"), dense(features)]
        )
        self.discriminator = keras.Sequential(
            [keras.Input((features,)), dense(width), keras.layers.LeakyReLU(0.2), dense(1)]
        )
        self.noise = keras.random.SeedGenerator(seed)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.g_loss = keras.metrics.Mean(name="loss")
        self.d_loss = keras.metrics.Mean(name="d_loss")

    def compile(self, *, lr: float) -> None:  # type: ignore[override]
        super().compile(optimizer=keras.optimizers.Adam(lr, beta_1=0.5))
        self.d_optimizer = keras.optimizers.Adam(lr, beta_1=0.5)

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return [self.g_loss, self.d_loss]

    def call(self, x: Any) -> Any:
        return self.discriminator(x)

    def train_step(self, data: Any) -> dict[str, Any]:
        x, _ = data
        n = ops.shape(x)[0]
        real, fake = ops.ones((n, 1)), ops.zeros((n, 1))
        noise = keras.random.normal((n, GAN_NOISE), seed=self.noise)
        d_vars = self.discriminator.trainable_variables
        with tf.GradientTape() as tape:
            made = self.generator(noise, training=True)
            d_loss = self.bce(real, self.discriminator(x, training=True)) + self.bce(
                fake, self.discriminator(made, training=True)
            )
        self.d_optimizer.apply(tape.gradient(d_loss, d_vars), d_vars)
        g_vars = self.generator.trainable_variables
        with tf.GradientTape() as tape:
            made = self.generator(noise, training=True)
            g_loss = self.bce(real, self.discriminator(made, training=True))
        self.optimizer.apply(tape.gradient(g_loss, g_vars), g_vars)
        self.g_loss.update_state(g_loss)
        self.d_loss.update_state(d_loss)
        return {"loss": self.g_loss.result(), "d_loss": self.d_loss.result()}


def _weight(layer: keras.layers.Layer) -> keras.Variable:
    """A layer's first weight tensor: a kernel (the input kernel of a GRU)."""
    return layer.weights[0]


def _is_bias(v: keras.Variable) -> bool:
    return v.path.endswith("bias")


def _init_faults(fault: FaultSpec | None, layers: list[keras.layers.Layer]) -> None:
    if fault is None:
        return
    if fault.kind == "init_scale":
        for layer in layers[:-1]:
            w = _weight(layer)
            w.assign(w.numpy() * fault["factor"])
    elif fault.kind == "init_std":  # drawn from Keras' seeded generator: the same every fit
        for layer in layers:
            for v in layer.weights:
                if _is_bias(v):
                    v.assign(ops.zeros(v.shape, v.dtype))
                else:
                    v.assign(keras.random.normal(v.shape, stddev=fault["std"], dtype=v.dtype))
    elif fault.kind == "zero_init":
        for i in fault["layers"]:
            w = _weight(layers[i])
            w.assign(np.zeros(w.shape, w.dtype))


# -- optimizers ----------------------------------------------------------------------------


class _Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate of a step: warm-up or cosine, times an LR fault from its onset."""

    def __init__(self, train: TrainSpec, fault: FaultSpec | None, onset: int) -> None:
        self.lr, self.train = train.lr, train
        self.kind = fault.kind if fault is not None else None
        self.factor = float(fault["factor"]) if self.kind in ("lr_scale", "lr_growth") else 1.0
        self.onset = onset

    def __call__(self, step: Any) -> Any:
        s = ops.cast(step, "float32")
        lr = ops.convert_to_tensor(self.lr, "float32")
        t = self.train
        if t.schedule == "warmup":
            lr = lr * ops.minimum(1.0, s / t.warmup_steps)  # exactly 0 at the first step
        elif t.schedule == "cosine":
            last = float(t.max_steps - 1)
            lr = lr * 0.5 * (1.0 + ops.cos(math.pi * ops.minimum(s, last) / last))
        elif t.schedule == "step_decay":
            lr = lr * ops.power(t.decay, ops.floor(s / t.decay_every))
        if self.kind == "lr_scale":
            lr = ops.where(s >= self.onset, lr * self.factor, lr)
        elif self.kind == "lr_growth":  # x factor at every step from the onset on
            grown = lr * ops.power(self.factor, s - self.onset + 1.0)
            lr = ops.where(s >= self.onset, grown, lr)
        return lr

    def get_config(self) -> dict[str, Any]:
        return {"lr": self.lr, "kind": self.kind, "factor": self.factor, "onset": self.onset}


class _NaNAfterUpdate:
    """Mixin: right after the update of step ``at``, writes a NaN into one weight element."""

    def __init__(self, *, nan_at: int, nan_variable: keras.Variable, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._nan_at, self._nan_variable = nan_at, nan_variable

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        super().apply(grads, trainable_variables)
        v = self._nan_variable
        first = ops.reshape(ops.one_hot(0, int(np.prod(v.shape))), v.shape) > 0
        now = ops.equal(self.iterations, self._nan_at + 1)  # apply has counted the step
        v.assign(ops.where(ops.logical_and(now, first), math.nan, v))


class _ZeroLearningRate:
    """Mixin: a learning rate of exactly 0 for the variables of one layer (a 'param group')."""

    def __init__(self, *, zero_lr: Sequence[keras.Variable], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # TensorFlow's update step hands update_step the backend variable (Variable.value)
        self._zero_lr = {id(v) for v in zero_lr} | {id(v.value) for v in zero_lr}

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        if id(variable) in self._zero_lr:
            learning_rate = ops.multiply(learning_rate, 0.0)
        super().update_step(gradient, variable, learning_rate)


class _NaNAdam(_NaNAfterUpdate, keras.optimizers.Adam):
    pass


class _NaNSGD(_NaNAfterUpdate, keras.optimizers.SGD):
    pass


class _ZeroLRAdam(_ZeroLearningRate, keras.optimizers.Adam):
    pass


class _ZeroLRSGD(_ZeroLearningRate, keras.optimizers.SGD):
    pass


_OPTIMIZERS = {
    (None, "adam"): keras.optimizers.Adam,
    (None, "sgd"): keras.optimizers.SGD,
    ("nan_weight", "adam"): _NaNAdam,
    ("nan_weight", "sgd"): _NaNSGD,
    ("zero_lr_group", "adam"): _ZeroLRAdam,
    ("zero_lr_group", "sgd"): _ZeroLRSGD,
}


def make_optimizer(
    train: TrainSpec, fault: FaultSpec | None, onset: int, layers: list[keras.layers.Layer]
) -> keras.optimizers.Optimizer:
    """The optimizer of ``train``, with the fault of ``fault`` where an optimizer carries it."""
    kind = fault.kind if fault is not None else None
    lr: Any = train.lr
    if train.schedule is not None or kind in ("lr_scale", "lr_growth"):
        if train.schedule not in (None, "warmup", "cosine", "step_decay"):
            raise ValueError(
                f"schedule={train.schedule!r}; use None, 'warmup', 'cosine' or 'step_decay'"
            )
        lr = _Schedule(train, fault, onset)
    # named as Keras names its own: a subclass's default name (_NaNAdam -> "__na_n_adam")
    # is not a valid name scope
    kwargs: dict[str, Any] = {"learning_rate": lr, "name": train.optimizer}
    if train.optimizer == "sgd":
        kwargs["momentum"] = train.momentum
    elif train.optimizer == "adam" and train.eps is not None:
        kwargs["epsilon"] = train.eps
    elif train.optimizer != "adam":
        raise ValueError(f"optimizer={train.optimizer!r}; use 'adam' or 'sgd'")
    if train.clip is not None:
        kwargs["global_clipnorm"] = train.clip  # clip_grad_norm_ over every parameter
    if kind == "nan_weight":
        kwargs.update(nan_at=onset, nan_variable=_weight(layers[fault["layer"]]))
    elif kind == "zero_lr_group":
        kwargs["zero_lr"] = layers[fault["layer"]].trainable_variables
    else:
        kind = None
    return _OPTIMIZERS[kind, train.optimizer](**kwargs)


# -- watchers -------------------------------------------------------------------------------


class WatchedKerasStethoscope(KerasStethoscope):
    """``KerasStethoscope(sinks=[CapturingSink()], stop_on=None, **kwargs)`` for one setting.

    It differs from the public class only in counting, per probe, the steps on which
    its sampler asked for it (through the public ``Monitor.plan``).
    """

    def __init__(self, setting: str, **kwargs: Any) -> None:
        self.sink = CapturingSink()
        super().__init__(sinks=[self.sink], stop_on=None, **kwargs)
        self.setting = setting
        self.probe_counts: dict[str, int] = {}
        self._count_step = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self._count_step = int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_begin(batch, logs)
        counts = self.probe_counts
        for probe in self.monitor.plan(self._count_step):
            counts[probe] = counts.get(probe, 0) + 1
        self._count_step += 1


class _Stops:
    """Records the first step at which a baseline stops (or would stop) training."""

    key = ""

    def _init_stops(self, driver: _Driver) -> None:
        self.first: dict[str, Any] | None = None
        self._driver = driver

    def _stopped(self, reason: str) -> None:
        if self.first is None:
            self.first = {"step": self._driver.step, "reason": reason}

    def _watch(self, check: Any, reason: Any) -> None:
        """Run ``check``; if it stopped training, record why and let the run go on.

        Only the first stop counts, so a baseline that has stopped is not asked again.
        """
        if self.first is not None:
            return
        before = self.model.stop_training
        check()
        if self.model.stop_training and not before:
            self._stopped(reason())
            self.model.stop_training = False  # observe only


class EarlyStoppingWatch(_Stops, keras.callbacks.EarlyStopping):
    """``EarlyStopping(monitor="loss", patience=3)``, its stop recorded and undone."""

    key = "early_stopping"

    def __init__(self, driver: _Driver) -> None:
        super().__init__(monitor="loss", patience=3)
        self._init_stops(driver)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        value = (logs or {}).get("loss")

        def reason() -> str:
            finite = value is None or math.isfinite(float(value))
            return "no improvement" if finite else "non-finite"

        self._watch(lambda: super(EarlyStoppingWatch, self).on_epoch_end(epoch, logs), reason)


class TerminateOnNaNWatch(_Stops, keras.callbacks.TerminateOnNaN):
    """Keras' ``TerminateOnNaN()``, its stop recorded and undone."""

    key = "terminate_on_nan"

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._init_stops(driver)

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._watch(
            lambda: super(TerminateOnNaNWatch, self).on_batch_end(batch, logs),
            lambda: "non-finite",
        )


class NanCheck(_Stops, keras.callbacks.Callback):
    """The check people write: ``if not math.isfinite(logs["loss"]): stop``."""

    key = "nan_check"

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._init_stops(driver)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self._stopped("non-finite")  # a real one would set self.model.stop_training = True


def baseline_callbacks(driver: _Driver) -> list[Any]:
    """Fresh baseline watchers; they read the global step from ``driver``."""
    return [EarlyStoppingWatch(driver), TerminateOnNaNWatch(driver), NanCheck(driver)]


class _Driver(keras.callbacks.Callback):
    """Counts steps, kills units at the onset and records the losses of a run.

    It goes first in the callback list, so that in every other callback's hooks
    ``step`` is the global step of the batch in progress (at an epoch's end, its last).
    """

    def __init__(self, fault: FaultSpec | None, onset: int, layers: list[Any]) -> None:
        super().__init__()
        self.step = -1
        self.taken = 0  # steps taken
        self.losses: list[float] = []
        self.val_losses: list[list[float]] = []
        self._kill = None
        if fault is not None and fault.kind == "kill_units":
            bias = layers[fault["layer"]].bias
            self._kill = (onset, bias, round(fault["fraction"] * bias.shape[0]), fault["bias"])

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.taken = int(ops.convert_to_numpy(self.model.optimizer.iterations))
        self.step = self.taken - 1

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.step = self.taken
        self.taken += 1
        if self._kill is not None and self.step == self._kill[0]:
            _, bias, n, value = self._kill
            b = ops.convert_to_numpy(bias).copy()
            b[:n] = value
            bias.assign(b)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.losses.append(float((logs or {}).get("loss", math.nan)))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        val = (logs or {}).get("val_loss")
        if val is not None:
            self.val_losses.append([self.taken, float(val)])


class _StopAt(keras.callbacks.Callback):
    """Last in the callback list: ends the fit after ``max_steps`` steps."""

    def __init__(self, driver: _Driver, max_steps: int) -> None:
        super().__init__()
        self._driver, self.max_steps = driver, max_steps

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._driver.taken >= self.max_steps:
            self.model.stop_training = True


# -- one run --------------------------------------------------------------------------------


@dataclass
class _Fit:
    """What one fit of a scenario left behind."""

    steps: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    probe_counts: dict[str, int] = field(default_factory=dict)
    baselines: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    val_losses: list[list[float]] = field(default_factory=list)
    wall_s: float = 0.0
    error: str | None = None
    losses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    weights: str = ""  # a digest of the final weights


def _fit(sc: Scenario, seed: int, arrays: Arrays, setting: str | None, *, baselines: bool) -> _Fit:
    """One ``model.fit`` of ``sc``, watched by the stethoscope of ``setting`` (None: none)."""
    interactive = keras.config.is_interactive_logging_enabled()
    keras.backend.clear_session()  # the same layer names in every fit
    if not interactive:  # clear_session resets it: keep quiet() quiet
        keras.config.disable_interactive_logging()
    keras.utils.set_random_seed(seed)
    t, f = sc.train, sc.fault
    onset = sc.onset if isinstance(sc.onset, int) else -1
    x, x_val = _channels_last(arrays.x), _channels_last(arrays.x_val)
    x = arrays.x if x is None else x
    x_val = arrays.x_val if x_val is None else x_val
    if sc.model.arch == "gan":
        if f is not None or t.validate:
            raise ValueError(f"{sc.name}: a GAN takes no fault and no validation")
        model, layers = _GanModel(int(np.prod(x.shape[1:])), sc.model.width, seed), []
        model.compile(lr=t.lr)
        model(x[:1])  # built, for the callbacks' first look at its weights
    else:
        policy = keras.config.dtype_policy()
        keras.config.set_dtype_policy(POLICIES[t.precision])
        try:  # the layers take the policy when made; compile wraps a LossScaleOptimizer
            model, layers = build_model(
                sc.model, x.shape[1:], arrays.classes, fault=f, onset=onset, loss=t.loss
            )
            model.compile(
                optimizer=make_optimizer(t, f, onset, layers),
                loss=make_loss(sc.model, t),
                loss_weights=t.loss_weight if t.loss_weight != 1.0 else None,
            )
        finally:
            keras.config.set_dtype_policy(policy)
        # Built here, the optimizer's variables exist before the train step is traced, so
        # it is traced once instead of twice (a first trace that creates variables is
        # traced again): the same numbers, a second less per fit.
        applied = getattr(model, "applied", lambda: model.trainable_variables)
        model.optimizer.build(applied())
    per_epoch = -(-len(x) // t.batch_size)
    epochs = -(-t.max_steps // per_epoch)
    if t.max_epochs is not None:
        epochs = min(epochs, t.max_epochs)
    y, y_val = arrays.y, arrays.y_val
    if sc.model.arch != "gan":
        if f is not None and f.kind == "corrupt_labels" and t.loss != "logits":
            raise ValueError(f"{sc.name}: corrupt_labels shifts sparse labels only")
        y = targets(sc.model, t, y, arrays.classes, x.shape[1])
        if y_val is not None:
            y_val = targets(sc.model, t, y_val, arrays.classes, x.shape[1])
    data = make_dataset(
        x,
        y,
        t.batch_size,
        seed,
        epochs,
        fault=f,
        onset=onset,
        classes=arrays.classes,
        order=sc.data.loader_order,
    )
    val = None
    if t.validate:
        if x_val is None:
            raise ValueError(f"{sc.name}: validate=True needs DataSpec.n_val > 0")
        val = (x_val, y_val)
    driver = _Driver(f, onset, layers)
    watcher = WatchedKerasStethoscope(setting, **setting_kwargs(setting)) if setting else None
    others = baseline_callbacks(driver) if baselines else []
    out = _Fit()
    t0 = time.perf_counter()
    try:
        model.fit(
            data,
            epochs=epochs,
            steps_per_epoch=per_epoch,
            validation_data=val,
            validation_batch_size=256,
            shuffle=False,
            verbose=0,
            callbacks=[
                driver,
                *([watcher] if watcher else []),
                *others,
                _StopAt(driver, t.max_steps),
            ],
        )
    except Exception as exc:  # a crash is a result too: it counts as a miss, with its cause
        out.error = traceback.format_exception_only(type(exc), exc)[-1].strip()
    finally:
        if watcher is not None:
            watcher.remove()  # fit removes it itself, unless it raised
    out.wall_s = time.perf_counter() - t0
    # every batch trained on: a LossScaleOptimizer does not count the steps it skipped
    out.steps = driver.taken
    out.val_losses = driver.val_losses
    out.losses = np.array(driver.losses)
    digest = hashlib.sha256()
    for w in model.weights:
        digest.update(np.ascontiguousarray(ops.convert_to_numpy(w)).tobytes())
    out.weights = digest.hexdigest()
    if watcher is not None:
        out.findings = [x.to_dict(json_safe=True) for x in watcher.sink.findings]
        out.probe_counts = dict(sorted(watcher.probe_counts.items()))
    out.baselines = {cb.key: cb.first for cb in others}
    return out


def _same_fit(a: _Fit, b: _Fit) -> str | None:
    """Why fits ``a`` and ``b`` were not the same training run, or None if they were."""
    if a.steps != b.steps:
        return f"{a.steps} vs {b.steps} steps"
    if a.losses.tobytes() != b.losses.tobytes():
        differ = np.flatnonzero(a.losses.view(np.int64) != b.losses.view(np.int64))
        return f"losses differ from step {int(differ[0])}"
    if a.weights != b.weights:
        return "final weights differ"
    return None


def _same_until_nonfinite(watched: _Fit, plain: _Fit) -> str | None:
    """How an unwatched fit parted from the watched one while every loss was finite, or None.

    Past a non-finite value they may part for good, and before it by float rounding:
    see the module docstring (TensorFlow's op fusion).
    """
    if watched.steps != plain.steps:
        return f"{watched.steps} vs {plain.steps} steps"
    bad = ~np.isfinite(watched.losses) | ~np.isfinite(plain.losses)
    n = int(np.argmax(bad)) if bad.any() else len(bad)
    a, b = watched.losses[:n], plain.losses[:n]
    if a.tobytes() != b.tobytes():
        first = int(np.flatnonzero(a != b)[0])
        rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))
        return f"its running loss differs from step {first}, by at most {rel:.1e} (relative)"
    if not bad.any() and watched.weights != plain.weights:
        return "its final weights differ"
    return None


def run_scenario(
    sc: Scenario,
    seed: int,
    *,
    settings: Sequence[str] = ("adaptive",),
    baselines: bool = True,
) -> RunResult:
    """Train ``sc`` with ``seed`` once per setting, and once more for the baselines.

    The watched fits must be identical (a difference is the run's error); where the
    baselines' unwatched fit parts from them while the losses are finite, a note says so.
    """
    _check_backend()
    arrays = make_data(sc.data, seed)
    watched = [(s, _fit(sc, seed, arrays, s, baselines=False)) for s in settings]
    plain = _fit(sc, seed, arrays, None, baselines=True) if baselines or not watched else None
    first = watched[0][1] if watched else plain
    assert first is not None
    fits = [f for _, f in watched] + ([plain] if plain is not None else [])
    result = RunResult(
        scenario=sc.name,
        seed=seed,
        framework=FRAMEWORK,
        steps=first.steps,
        steps_per_epoch=-(-len(arrays.x) // sc.train.batch_size),
        val_losses=first.val_losses,
        onset=resolve_onset(sc, first.val_losses),
        baselines=plain.baselines if plain is not None else {},
        wall_s=sum(f.wall_s for f in fits),
        error=next((f.error for f in fits if f.error), None),
    )
    for setting, f in watched:
        result.findings[setting] = f.findings
        result.probe_counts[setting] = f.probe_counts
        why = _same_fit(first, f)
        if why is not None and result.error is None:
            result.error = f"the {setting} fit differs from the {watched[0][0]} fit: {why}"
    if plain is not None and watched:
        why = _same_until_nonfinite(first, plain)
        if why is not None:  # the stethoscope's findings stand; the baselines' fit is a twin
            result.notes.append(
                f"the baselines' fit, without the stethoscope, is not the {watched[0][0]} fit "
                f"while its losses are finite: {why}"
            )
    return result
