"""The Keras adapter's in-graph probe: what it reads, and for which variables.

Regression tests for three things the fault suite (benchmarks/faults) showed:

* a train step that hands ``optimizer.apply`` only some of the model's trainable
  variables (a layer left out of the optimizer) made the probe report NaN gradient
  and weight norms for the others, which ``nonfinite_gradients`` and
  ``nonfinite_weights`` read as real NaNs: errors on a finite run;
* those variables were never reported as left out of the optimizer
  (``Observation.unoptimized``), so ``frozen_weights`` could not name them;
* after a non-finite loss on a step the sampler had not chosen, the probe measured
  that step's gradients and weights but they were judged with the loss alone, so the
  detectors that name the parameter reported one step late.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on the environment
    pytest.skip("these tests drive a TensorFlow train step", allow_module_level=True)

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

FEATURES, CLASSES = 20, 4

# Keras' Variable.__array__ takes no copy keyword: numpy 2 warns on every variable read
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def _data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, CLASSES))).argmax(1)
    return x, y


class _LeaveOut(keras.Sequential):
    """Computes every gradient, hands optimizer.apply all but the second Dense's."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        tvars = self.trainable_variables
        grads = tape.gradient(loss, tvars)
        skip = {id(v) for v in self.layers[1].trainable_variables}
        kept = [(g, v) for g, v in zip(grads, tvars, strict=True) if id(v) not in skip]
        self.optimizer.apply([g for g, _ in kept], [v for _, v in kept])
        for m in self.metrics:
            if m.name == "loss":
                m.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


def _mlp(cls=keras.Sequential):
    keras.utils.set_random_seed(0)
    model = cls(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(CLASSES),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _observations(stethoscope: KerasStethoscope) -> list:
    """Record every observation the monitor judges (a spy on the public Monitor.observe)."""
    seen = []
    observe = stethoscope.monitor.observe

    def spy(obs):
        seen.append(obs)
        return observe(obs)

    stethoscope.monitor.observe = spy
    return seen


def test_variables_left_out_of_the_optimizer_are_named_not_read_as_nan():
    x, y = _data()
    model = _mlp(_LeaveOut)
    sink = CapturingSink()
    st = KerasStethoscope(sinks=[sink], stop_on=None)
    seen = _observations(st)
    model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[st])
    left_out = {v.path for v in model.layers[1].trainable_variables}
    sampled = [o for o in seen if o.grad_norm is not None]
    assert sampled, "no step read the gradients"
    for obs in sampled:
        assert left_out.isdisjoint(obs.names)
        assert np.all(np.isfinite(obs.grad_norm)) and np.all(np.isfinite(obs.weight_norm))
        assert set(obs.unoptimized) == left_out
    detectors = {f.detector for f in sink.at_least("warning")}
    assert not detectors & {"nonfinite_gradients", "nonfinite_weights"}, sink.findings
    frozen = sink.by_detector("frozen_weights")
    assert frozen and frozen[0].step == 0 and frozen[0].where in left_out


def test_the_full_model_is_read_when_every_variable_is_optimized():
    x, y = _data()
    model = _mlp()
    st = KerasStethoscope(sinks=[CapturingSink()], stop_on=None)
    seen = _observations(st)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[st])
    first = next(o for o in seen if o.grad_norm is not None)
    assert first.names == tuple(v.path for v in model.trainable_variables)
    assert first.unoptimized == ()


class _NaNAfterStep(keras.callbacks.Callback):
    """Writes a NaN into the classifier's kernel after step ``at``: the next loss is NaN.

    (Not into a kernel before a ReLU: TensorFlow's fused MatMul+BiasAdd+Relu on the
    CPU can turn a NaN pre-activation into 0, so the loss may stay finite.)
    """

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.step = at, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.step == self.at:
            kernel = self.model.layers[-1].kernel
            value = kernel.numpy()
            value.flat[0] = np.nan
            kernel.assign(value)
        self.step += 1


def test_a_nonfinite_loss_names_the_bad_weight_at_its_own_step():
    x, y = _data(n=2048)
    model = _mlp()
    sink = CapturingSink()
    at = 149  # the loss of step 150 is the first NaN; 150 is not a sampled step
    st = KerasStethoscope(sinks=[sink], stop_on=None)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[_NaNAfterStep(at), st])
    assert 150 % 16 != 0
    assert sink.by_detector("nonfinite_loss")[0].step == 150
    weights = sink.by_detector("nonfinite_weights")
    assert weights and weights[0].step == 150, [(f.detector, f.step) for f in sink.findings]
    # the NaN loss made every gradient NaN, so the update of step 150 spoiled every weight
    assert weights[0].where in {v.path for v in model.trainable_variables}


# -- the registry, as the Keras probe derives from it --------------------------------------------
def _probe(spe: int = 1):
    from stethoscope.callbacks._keras.probe import GraphProbe

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=spe)
    return GraphProbe(model, steps_per_execution=spe, forward=True)


def test_every_planned_statistic_has_a_keras_reduction():
    from stethoscope.callbacks._keras.reductions import NOT_IN_FIT
    from stethoscope.statistics import EVERY_STEP, PLANNED

    served = {s for r in _probe().reductions for s in r.statistics}
    # the loss rides in the ring of every step; fit cannot make the others' mistakes
    assert served == PLANNED - EVERY_STEP - NOT_IN_FIT


@pytest.mark.parametrize("spe", [1, 4], ids=["whole", "conditional"])
def test_each_slot_combines_replicas_as_its_statistic_declares(spe):
    from stethoscope.callbacks._keras.reductions import slots_of
    from stethoscope.callbacks._keras.variables import BY_REPLICAS, COMBINE
    from stethoscope.statistics import STATISTICS, AcrossReplicas

    probe = _probe(spe)
    for r in probe.reductions:
        (across,) = {STATISTICS[s].across_replicas for s in r.statistics}
        for slot in slots_of(r, probe.layout, probe.regime):
            assert slot.combine in COMBINE, slot
            if across is AcrossReplicas.POOLED:
                assert slot.combine in {"sample_mean", "features_samples", "forward"}, slot
            else:
                assert slot.combine == BY_REPLICAS[across], slot
    assert all(slot.combine for slot in probe.variables.slots.values())


def test_the_switches_derive_from_the_reductions():
    probe = _probe(4)
    switches = probe.switches
    assert switches.groups == (
        "grads", "weights", "updates", "units", "distributions", "inputs", "labels", "prints",
        "predictions", "forward", "precision", "fp8", "loss_scale",
    )  # fmt: skip
    # the trace is read from the forward rows; the update norms run with the weights, and
    # the rounded-away updates with the snapshots of the update norms
    assert probe._groups_of["trace"] == {"forward"}
    assert probe._groups_of["updates"] == {"updates", "weights"}
    assert probe._groups_of["precision"] == {"precision", "updates"}
