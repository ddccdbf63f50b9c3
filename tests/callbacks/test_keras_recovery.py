"""KerasStethoscope(recover=...) on real training: a skipped step leaves the weights and
the optimizer (its slots and its step count) exactly as a fit that never saw the batch,
a cool-down scales the learning rate inside the update alone, a roll back restores the
last healthy snapshot, a fault that persists ends in a stop with the ladder's history,
and what cannot be skipped is refused before the first step. With
``Recovery(replay=True)`` a step judged bad is computed again inside the train step: a
transient fault is applied from its replay, bit for bit as a fit that never met it, and
a bad batch is skipped as before, named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from stethoscope import KerasStethoscope, Recovery  # noqa: E402
from stethoscope.findings import RECOVERY  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

BATCH, FEATURES, CLASSES = 16, 12, 3


def data(steps: int, *, poison: dict[int, str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` batches of a learnable task; ``poison`` maps a batch to ``"nan"`` (a NaN
    input) or ``"spike"`` (inputs 100x too large and every label wrong)."""
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(steps * BATCH, FEATURES)).astype("float32")
    y = (x @ teacher).argmax(1)
    for step, kind in (poison or {}).items():
        rows = slice(step * BATCH, (step + 1) * BATCH)
        if kind == "nan":
            x[step * BATCH, 0] = np.nan
        elif kind == "spike":
            x[rows] *= 100.0
            y[rows] = (y[rows] + 1) % CLASSES
    return x, y


def without(x: np.ndarray, y: np.ndarray, steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The same data, never having seen the batches of ``steps``."""
    keep = np.ones(len(x), dtype=bool)
    for step in steps:
        keep[step * BATCH : (step + 1) * BATCH] = False
    return x[keep], y[keep]


def model(optimizer: str = "sgd", lr: float = 0.05) -> Any:
    keras.utils.set_random_seed(1)
    m = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )
    opt = {
        "sgd": lambda: keras.optimizers.SGD(lr, momentum=0.9),
        "plain-sgd": lambda: keras.optimizers.SGD(lr),
        "adamw": lambda: keras.optimizers.AdamW(lr / 20, weight_decay=0.01),
    }[optimizer]()
    m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def fit(m: Any, x: np.ndarray, y: np.ndarray, callbacks: list, **kw: Any) -> Any:
    return m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks, **kw)


def same_state(a: Any, b: Any) -> None:
    for va, vb in zip(a.variables, b.variables, strict=True):
        assert np.array_equal(va.numpy(), vb.numpy()), va.path
    for va, vb in zip(a.optimizer.variables, b.optimizer.variables, strict=True):
        assert np.array_equal(np.asarray(va.numpy()), np.asarray(vb.numpy())), va.path


def acts(sink: CapturingSink) -> list[tuple[int, str]]:
    return [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]


class Weights(keras.callbacks.Callback):
    """The model's weights after each step, and at the start of each step (after the
    callbacks before it in the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.after: dict[int, list[np.ndarray]] = {}
        self.before: dict[int, list[np.ndarray]] = {}
        self.lr: dict[int, float] = {}

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.before[batch] = [v.numpy().copy() for v in self.model.trainable_variables]
        self.lr[batch] = float(np.asarray(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.after[batch] = [v.numpy().copy() for v in self.model.trainable_variables]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_nan_batch_is_skipped_exactly_as_if_never_seen(optimizer):
    x, y = data(30, poison={5: "nan"})
    sink = CapturingSink()
    recovered = model(optimizer)
    shown = fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=True)])
    twin = model(optimizer)
    twin_shown = fit(twin, *without(x, y, [5]), [])
    same_state(recovered, twin)  # weights, slots, and iterations: 29 updates applied
    # the mean loss Keras shows leaves the skipped step out, as the twin never saw it
    assert shown.history["loss"] == twin_shown.history["loss"]
    assert int(recovered.optimizer.iterations.numpy()) == 29
    assert acts(sink) == [(5, "skip")]
    skip = next(f for f in sink.findings if f.detector == RECOVERY)
    assert "the loss was nan" in skip.message
    # nothing is hidden: the non-finite loss is reported on its step, and fit went on
    assert 5 in {f.step for f in sink.by_detector("nonfinite_loss")}
    assert all(np.isfinite(v.numpy()).all() for v in recovered.trainable_variables)


@pytest.mark.parametrize("recover", [True, Recovery(replay=True)], ids=["skip", "replay"])
def test_two_nan_batches_in_a_row_are_the_data_not_a_harmful_update(recover):
    # two steps judged bad right after an applied one would roll back (the weights that
    # update left are suspect), but a NaN in each batch's inputs explains both
    x, y = data(30, poison={7: "nan", 8: "nan"})
    sink = CapturingSink()
    recovered = model("adamw")
    fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=recover)])
    assert acts(sink) == [(7, "skip"), (8, "skip")]
    for skip in (f for f in sink.findings if f.detector == RECOVERY):
        assert "the loss was nan; the batch's inputs hold NaN or Inf" in skip.message
    twin = model("adamw")
    fit(twin, *without(x, y, [7, 8]), [])
    same_state(recovered, twin)


def test_a_spike_past_the_bars_is_skipped_exactly_as_if_never_seen():
    x, y = data(80, poison={60: "spike"})
    sink = CapturingSink()
    recovered = model("sgd")
    fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=True)])
    twin = model("sgd")
    fit(twin, *without(x, y, [60]), [])
    same_state(recovered, twin)
    assert acts(sink) == [(60, "skip")]
    skip = next(f for f in sink.findings if f.detector == RECOVERY)
    assert "was past the exploding_gradients bar" in skip.message
    # the detectors report the spike on its step all the same
    assert 60 in {f.step for f in sink.by_detector("loss_spike")}


def test_a_healthy_run_takes_no_action_and_trains_bit_for_bit_as_without():
    x, y = data(40)
    sink = CapturingSink()
    recovered = model("adamw")
    fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=True)])
    plain = model("adamw")
    fit(plain, x, y, [KerasStethoscope(sinks=[])])
    same_state(recovered, plain)
    assert acts(sink) == []


def test_a_cool_down_scales_the_learning_rate_inside_the_update_alone():
    x, y = data(24, poison={5: "nan", 7: "nan"})
    settings = Recovery(cool_after=2, cool_steps=4)
    sink, seen = CapturingSink(), Weights()
    cooled = model("plain-sgd")
    fit(cooled, x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    twin, twin_seen = model("plain-sgd"), Weights()
    fit(twin, *without(x, y, [5, 7]), [twin_seen])
    assert acts(sink)[:3] == [(5, "skip"), (7, "skip"), (7, "cool")]
    # step 8 starts from the same weights as the twin's 7th step (both skipped 5 and 7),
    # so its plain SGD update is the twin's times the factor
    for before, after, t_before, t_after in zip(
        seen.before[8], seen.after[8], twin_seen.before[6], twin_seen.after[6], strict=True
    ):
        np.testing.assert_array_equal(before, t_before)
        # up to the float32 rounding of a weight near 0.3 (3e-8), on updates near 1e-5
        np.testing.assert_allclose(after - before, 0.1 * (t_after - t_before), atol=1e-7)
    # what reads the learning rate outside the update (a callback, the host) sees the
    # schedule's own, so a ReduceLROnPlateau cannot bake the factor in
    assert all(lr == pytest.approx(0.05) for lr in seen.lr.values())
    # the cool-down ends after its 4 steps, and the learning rate is the user's again
    assert (12, "restore_lr") in acts(sink)
    for before, after, t_before, t_after in zip(
        seen.before[14], seen.after[14], twin_seen.before[12], twin_seen.after[12], strict=True
    ):
        ratio = np.linalg.norm(after - before) / np.linalg.norm(t_after - t_before)
        assert 0.5 < ratio < 2.0  # unscaled (the weights differ a little by now)


def test_a_skip_during_the_cool_down_rolls_back_to_the_last_healthy_snapshot():
    x, y = data(30, poison={10: "nan", 12: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=4)
    sink, seen = CapturingSink(), Weights()
    m = model("sgd")
    fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    assert acts(sink)[:4] == [(10, "skip"), (10, "cool"), (12, "skip"), (12, "rollback")]
    rollback = next(f for f in sink.findings if f.where == "rollback")
    assert "snapshot of step 8" in rollback.message
    # judged at the start of step 13: the weights it starts from are those after step 8
    for now, snapshot in zip(seen.before[13], seen.after[8], strict=True):
        np.testing.assert_array_equal(now, snapshot)
    # the run goes on, numbering its steps on, cooled again after the roll back
    assert (12, "cool") in acts(sink)
    assert len(seen.after) == 30 and not m.stop_training


def test_with_several_steps_per_execution_a_roll_back_waits_for_the_execution_to_end():
    x, y = data(30, poison={10: "nan", 12: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=4)
    sink, seen = CapturingSink(), Weights()
    m = model("sgd")
    m.compile(m.optimizer, m.loss, steps_per_execution=4)
    fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    # executions take steps 8-11 and 12-15: a snapshot after 8-11 (its step 8 was due),
    # the roll back once 12-15 have all run. It passes over the snapshot of step 11,
    # taken after the trouble began (the skip at 10), for the one of step 7 (after 4-7)
    assert acts(sink)[:4] == [(10, "skip"), (10, "cool"), (12, "skip"), (15, "rollback")]
    rollback = next(f for f in sink.findings if f.where == "rollback")
    assert "snapshot of step 7" in rollback.message
    for now, snapshot in zip(seen.before[16], seen.after[7], strict=True):
        np.testing.assert_array_equal(now, snapshot)
    assert not m.stop_training


@pytest.mark.parametrize(("steps_per_execution", "back", "ahead"), [(1, 12, 13), (4, 15, 16)])
def test_skip_ahead_skips_the_batches_after_a_roll_back_whatever_they_hold(
    steps_per_execution, back, ahead
):
    # PaLM's rewind-and-skip: the batches after the roll back are not trained on. With 4
    # steps per execution the roll back comes after step 15, and the execution of steps
    # 16-19 skips its first three
    x, y = data(30, poison={10: "nan", 12: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=4, skip_ahead=3)
    sink, seen = CapturingSink(), Weights()
    m = model("sgd")
    m.compile(m.optimizer, m.loss, steps_per_execution=steps_per_execution)
    callback = KerasStethoscope(sinks=[sink], recover=settings)
    fit(m, x, y, [callback, seen])
    assert (back, "rollback") in acts(sink)
    skipped = callback.recoverer.skipped_data.batches
    assert [(b.step, b.batch.index) for b in skipped] == [
        (10, 10),
        (12, 12),
        *((s, s) for s in range(ahead, ahead + 3)),
    ]
    assert all("skip_ahead" in b.why for b in skipped[2:])
    # the first applied step after them starts from the roll back's snapshot (with 4
    # steps per execution, the callback sees the executions' first steps only)
    snapshot, first_seen = (8, 16) if steps_per_execution == 1 else (7, 16)
    for now, kept in zip(seen.before[first_seen], seen.after[snapshot], strict=True):
        np.testing.assert_array_equal(now, kept)
    # every update after the snapshot's counted once: those after the skipped batches
    applied = snapshot + 1 + (30 - (ahead + 3))
    assert int(m.optimizer.iterations.numpy()) == applied and not m.stop_training


class SpikedLearningRate(keras.callbacks.Callback):
    """Sets the learning rate x1000 for steps 30..45 before each batch (a schedule gone
    wrong); after the stethoscope in the list, so it overrides what a roll back restored."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.model.optimizer.learning_rate = 100.0 if 30 <= batch <= 45 else 0.1


def test_a_spike_the_gate_cannot_see_is_rolled_back_and_its_rest_cooled_from_before_it():
    import tensorflow as tf

    x, y = data(80)
    settings = Recovery(snapshot_every=10, cool_steps=30, trust_after=5)
    sink, seen = CapturingSink(), Weights()
    m = model("plain-sgd", lr=0.1)
    fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=settings), SpikedLearningRate(), seen])
    rollbacks = [f for f in sink.findings if f.where == "rollback"]
    assert len(rollbacks) == 1 and not m.stop_training
    # back to a snapshot from before the spike (20; 30 is the spike's first step)
    assert "snapshot of step 20" in rollbacks[0].message
    # the rest of the spike goes no higher than the snapshot's learning rate: an update of
    # plain SGD is the learning rate times the gradient, 0.1 here, not 100
    step = 40
    assert seen.lr[step] == 100.0  # what the schedule asks for
    for v, before in zip(m.trainable_variables, seen.before[step], strict=True):
        v.assign(before)
    rows = slice(step * BATCH, (step + 1) * BATCH)
    with tf.GradientTape() as tape:
        loss = m.loss(y[rows], m(x[rows]))
    grads = tape.gradient(loss, m.trainable_variables)
    for g, before, after in zip(grads, seen.before[step], seen.after[step], strict=True):
        np.testing.assert_allclose(after - before, -0.1 * g.numpy(), rtol=1e-4, atol=1e-7)


def test_a_roll_back_to_the_snapshot_taken_at_the_start_restores_the_unbuilt_optimizer():
    # Adam's slots do not exist before the first step: the first snapshot, taken before
    # it, must hold them all the same (a roll back to it crashed the fit)
    x, y = data(30, poison={3: "nan", 4: "nan", 5: "nan", 6: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1)
    sink, seen = CapturingSink(), Weights()
    m = model("adamw")
    assert not m.optimizer.built
    fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    [rollback] = [f for f in sink.findings if f.where == "rollback"]
    assert "the snapshot taken before step 0" in rollback.message
    assert "the updates of steps 0…" in rollback.message
    for now, start in zip(seen.before[rollback.step + 1], seen.before[0], strict=True):
        np.testing.assert_array_equal(now, start)
    assert not m.stop_training


def test_trouble_soon_after_a_roll_back_goes_back_to_the_snapshot_before():
    x, y = data(30, poison={10: "nan", 12: "nan", 14: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=4, keep_snapshots=3)
    sink, seen = CapturingSink(), Weights()
    fit(model("sgd"), x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    rollbacks = [f for f in sink.findings if f.where == "rollback"]
    # the snapshot of step 8 was restored at 12; the trouble at 14 passes over it
    assert [(f.step, f.message.split("snapshot of ")[1][:7]) for f in rollbacks] == [
        (12, "step 8 "),
        (14, "step 4 "),
    ]
    for now, snapshot in zip(seen.before[15], seen.after[4], strict=True):
        np.testing.assert_array_equal(now, snapshot)


def test_a_fault_that_persists_climbs_the_ladder_and_stops_with_its_history():
    x, y = data(40, poison={s: "nan" for s in range(10, 40, 2)})
    settings = Recovery(cool_after=1, rollback_after=1, max_rollbacks=1, snapshot_every=4)
    sink, seen = CapturingSink(), Weights()
    fit(model("sgd"), x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    steps = [a for a in acts(sink) if a[1] in ("rollback", "stop")]
    assert steps == [(12, "rollback"), (14, "stop")]
    stop = next(f for f in sink.findings if f.where == "stop")
    assert stop.severity.value == "error"
    assert "gave up" in stop.message and "skipped 3 steps" in stop.message
    assert len(seen.after) < 40  # stopped early (after the next step, as a Keras stop)


@pytest.mark.parametrize("steps_per_execution", [3, 4])
def test_with_several_steps_per_execution_each_bad_step_is_skipped_as_if_never_seen(
    steps_per_execution,
):
    # steps 5 and 18 fall at different places in executions of 3 and of 4 steps
    x, y = data(30, poison={5: "nan", 18: "nan"})
    sink = CapturingSink()
    recovered = model("adamw")
    recovered.compile(recovered.optimizer, recovered.loss, steps_per_execution=steps_per_execution)
    fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=True)])
    twin = model("adamw")
    twin.compile(twin.optimizer, twin.loss, steps_per_execution=steps_per_execution)
    fit(twin, *without(x, y, [5, 18]), [])
    same_state(recovered, twin)
    assert acts(sink) == [(5, "skip"), (18, "skip")]
    # every step's loss is judged on its own step number, the skipped ones counted in
    assert 5 in {f.step for f in sink.by_detector("nonfinite_loss")}


def test_recover_is_refused_before_the_first_step_where_it_cannot_skip():
    x, y = data(4)

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(1)
    own = OwnStep([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    own.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="whose train_step is its own"):
        fit(own, x, y, [KerasStethoscope(sinks=[], recover=True)])
    assert int(own.optimizer.iterations.numpy()) == 0  # refused before any step


def test_the_epoch_summary_counts_what_the_ladder_did():
    x, y = data(20, poison={5: "nan"})
    callback = KerasStethoscope(sinks=[], recover=True)
    fit(model(), x, y, [callback])
    assert callback.recoverer.ladder.counts == {"skip": 1, "cool": 0, "rollback": 0, "stop": 0}
    [row] = [r for r in callback.summaries[-1].rows if r.detector == RECOVERY]
    assert row.verdict == "skipped 1 step" and row.status == "info"


TORCH_SCRIPT = textwrap.dedent(
    """
    import keras, numpy as np
    assert keras.backend.backend() == "torch"
    from test_keras_recovery import (
        CapturingSink, KerasStethoscope, Recovery, Weights, acts, data, fit, model,
        same_state, without,
    )
    x, y = data(30, poison={5: "nan", 18: "nan"})
    sink = CapturingSink()
    recovered = model("adamw")
    fit(recovered, x, y, [KerasStethoscope(sinks=[sink], recover=True)])
    twin = model("adamw")
    fit(twin, *without(x, y, [5, 18]), [])
    same_state(recovered, twin)
    assert acts(sink) == [(5, "skip"), (18, "skip")], acts(sink)
    x, y = data(30, poison={10: "nan", 12: "nan"})
    sink, seen = CapturingSink(), Weights()
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=4, skip_ahead=2)
    fit(model("sgd"), x, y, [KerasStethoscope(sinks=[sink], recover=settings), seen])
    assert acts(sink)[:4] == [(10, "skip"), (10, "cool"), (12, "skip"), (12, "rollback")]
    for step in (13, 15):  # steps 13 and 14 skipped ahead
        for now, snapshot in zip(seen.before[step], seen.after[8], strict=True):
            np.testing.assert_array_equal(now, snapshot)
    print("OK")
    """
)


def run_on_torch(script: str) -> None:
    """Run ``script`` in a process of its own on Keras' torch backend; it prints OK."""
    pytest.importorskip("torch")
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_on_the_torch_backend_the_same_ladder_runs_in_python():
    run_on_torch(TORCH_SCRIPT)


# -- Recovery(replay=True) ---------------------------------------------------------------


class TransientFault(keras.layers.Layer):
    """Passes its input on, but turns it to NaN on one forward pass once armed: a fault
    of the machine, which a second computation of the same step does not meet (what
    triggers it is no variable of the model's, so no state the step started from)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import tensorflow as tf

        #: Forward passes until the fault, counting this one (0: disarmed).
        self.countdown = tf.Variable(0, trainable=False)

    def call(self, x: Any) -> Any:
        import tensorflow as tf

        hit = tf.equal(self.countdown, 1)
        self.countdown.assign(tf.maximum(self.countdown - 1, 0))
        return tf.where(hit, x + np.float32(np.nan), x)


class ArmFault(keras.callbacks.Callback):
    """Arms ``fault`` at the start of batch ``at`` to strike on the ``passes``-th
    forward pass from there (with several steps per execution, the callback sees the
    first batch of each execution only)."""

    def __init__(self, fault: TransientFault, at: int, passes: int = 1) -> None:
        super().__init__()
        self.fault, self.at, self.passes = fault, at, passes

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch == self.at:
            self.fault.countdown.assign(self.passes)


def faulty_model(steps_per_execution: int = 1, *, state: bool = False) -> tuple[Any, Any]:
    """The model of :func:`model` (``state``: with a BatchNormalization and a Dropout,
    whose moving statistics and seed a training step moves), a transient fault on its
    logits."""
    keras.utils.set_random_seed(1)
    fault = TransientFault()
    middle = [keras.layers.BatchNormalization(), keras.layers.Dropout(0.3)] if state else []
    m = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="tanh"),
            *middle,
            keras.layers.Dense(CLASSES),
            fault,
        ]
    )
    m.compile(
        keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return m, fault


def test_recovery_replay_is_a_setting_of_its_own():
    assert Recovery(replay=True).replay and not Recovery().replay
    with pytest.raises(ValueError, match="replay"):
        Recovery(replay="yes")


@pytest.mark.parametrize(("steps_per_execution", "arm_at", "passes"), [(1, 10, 1), (3, 9, 2)])
def test_a_transient_fault_is_computed_again_and_the_replay_applied_bit_for_bit(
    steps_per_execution, arm_at, passes
):
    # the fault strikes step 10's first forward pass only (with 3 steps per execution,
    # armed at the execution of steps 9-11, on the second forward pass: step 10's)
    x, y = data(30)
    sink = CapturingSink()
    m, fault = faulty_model(steps_per_execution)
    replay = KerasStethoscope(sinks=[sink], recover=Recovery(replay=True))
    fit(m, x, y, [replay, ArmFault(fault, arm_at, passes)])
    twin, _ = faulty_model(steps_per_execution)
    fit(twin, x, y, [])  # never struck
    same_state(m, twin)  # step 10 applied its replay, which is the twin's step 10
    assert int(m.optimizer.iterations.numpy()) == 30
    assert acts(sink) == [(10, "replay")]
    [found] = [f for f in sink.findings if f.detector == RECOVERY]
    assert found.where == "replay" and found.severity.value == "warning"
    assert "Step 10 (batch 10 of epoch 0) was judged bad (the loss was nan)" in found.message
    assert "computed again from the same state with the same batch it was fine" in found.message
    assert "transient fault" in found.message
    # the step's own loss, the first computation's, is reported as it was
    assert 10 in {f.step for f in sink.by_detector("nonfinite_loss")}
    assert replay.recoverer.skipped_data.batches == []


def test_without_replay_the_same_transient_fault_is_skipped():
    x, y = data(30)
    sink = CapturingSink()
    m, fault = faulty_model()
    fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=True), ArmFault(fault, 10)])
    assert acts(sink) == [(10, "skip")]
    assert int(m.optimizer.iterations.numpy()) == 29


def test_a_nan_batch_replayed_is_judged_bad_again_and_skipped_as_if_never_seen():
    x, y = data(30, poison={5: "nan"})
    sink = CapturingSink()
    recovered = model("adamw")
    callback = KerasStethoscope(sinks=[sink], recover=Recovery(replay=True))
    fit(recovered, x, y, [callback], epochs=2)
    twin = model("adamw")
    fit(twin, *without(x, y, [5]), [], epochs=2)
    same_state(recovered, twin)
    assert acts(sink) == [(5, "skip"), (35, "skip")]
    first, second = (f for f in sink.findings if f.detector == RECOVERY)
    assert "Skipped step 5 (batch 5 of epoch 0): the loss was nan" in first.message
    assert "judged bad again" in first.message
    assert "(batch 5 of epoch 1)" in second.message  # named by its index in its epoch
    batches = callback.recoverer.skipped_data.batches
    assert [(b.step, b.batch.epoch, b.batch.index, b.replay) for b in batches] == [
        (5, 0, 5, "reproduces"),
        (35, 1, 5, "reproduces"),
    ]


def test_a_replay_starts_from_the_state_the_step_started_from():
    # A BatchNormalization's moving statistics and a Dropout's seed move with every
    # training forward pass: the replay reads them as they were before the step (the
    # same dropout mask), a replay applied keeps its own, and a skipped step puts them
    # back. Twins run with the same callback (the probe's reads change how TensorFlow
    # fuses a BatchNormalization, in the last bit).
    settings = Recovery(replay=True)
    x, y = data(30)
    struck, fault = faulty_model(state=True)
    fit(struck, x, y, [KerasStethoscope(sinks=[], recover=settings), ArmFault(fault, 10)])
    twin, _ = faulty_model(state=True)
    fit(twin, x, y, [KerasStethoscope(sinks=[], recover=settings)])
    same_state(struck, twin)
    x, y = data(30, poison={5: "nan"})
    skipped, _ = faulty_model(state=True)
    fit(skipped, x, y, [KerasStethoscope(sinks=[], recover=settings)])
    twin, _ = faulty_model(state=True)
    fit(twin, *without(x, y, [5]), [KerasStethoscope(sinks=[], recover=settings)])
    same_state(skipped, twin)  # the moving statistics too: no NaN from the batch
    assert all(np.isfinite(v.numpy()).all() for v in skipped.non_trainable_variables)


def test_a_skipped_step_puts_back_the_state_its_forward_pass_moved():
    # without a replay too: a NaN batch leaves no NaN in a BatchNormalization's moving
    # statistics (every later evaluation would be NaN), nor moves the Dropout's seed
    x, y = data(30, poison={5: "nan"})
    skipped, _ = faulty_model(state=True)
    fit(skipped, x, y, [KerasStethoscope(sinks=[], recover=True)])
    twin, _ = faulty_model(state=True)
    fit(twin, *without(x, y, [5]), [KerasStethoscope(sinks=[], recover=True)])
    same_state(skipped, twin)
    assert all(np.isfinite(v.numpy()).all() for v in skipped.non_trainable_variables)
    assert np.isfinite(skipped.evaluate(x[:64], y[:64], verbose=0))


def test_under_a_strategy_a_step_is_skipped_without_replay_and_it_says_why():
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        m = model()
    x, y = data(10, poison={5: "nan"})
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="cannot replay a step under MirroredStrategy"):
        fit(m, x, y, [KerasStethoscope(sinks=[sink], recover=Recovery(replay=True))])
    assert acts(sink) == [(5, "skip")]
    skip = next(f for f in sink.findings if f.detector == RECOVERY)
    assert "judged bad again" not in skip.message


TORCH_REPLAY_SCRIPT = textwrap.dedent(
    """
    import keras, numpy as np
    assert keras.backend.backend() == "torch"
    from test_keras_recovery import (
        CLASSES, FEATURES, RECOVERY, CapturingSink, KerasStethoscope, Recovery, acts, data,
        fit, same_state, without,
    )

    class TransientFault(keras.layers.Layer):  # eager: a Python counter
        countdown = 0

        def call(self, x):
            hit, self.countdown = self.countdown == 1, max(self.countdown - 1, 0)
            return x + float("nan") if hit else x

    class Arm(keras.callbacks.Callback):
        def __init__(self, fault):
            super().__init__()
            self.fault = fault

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 10:
                self.fault.countdown = 1

    def faulty():  # a Dropout without a seed draws from torch's own generator
        keras.utils.set_random_seed(1)
        fault = TransientFault()
        m = keras.Sequential([
            keras.Input((FEATURES,)), keras.layers.Dense(32, activation="tanh"),
            keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
            keras.layers.Dense(CLASSES), fault,
        ])
        m.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m, fault

    settings = Recovery(replay=True)
    x, y = data(30)
    sink = CapturingSink()
    struck, fault = faulty()
    fit(struck, x, y, [KerasStethoscope(sinks=[sink], recover=settings), Arm(fault)])
    twin, _ = faulty()
    fit(twin, x, y, [KerasStethoscope(sinks=[], recover=settings)])
    same_state(struck, twin)
    assert acts(sink) == [(10, "replay")], acts(sink)
    x, y = data(30, poison={5: "nan"})
    sink = CapturingSink()
    skipped, _ = faulty()
    fit(skipped, x, y, [KerasStethoscope(sinks=[sink], recover=settings)])
    twin, _ = faulty()
    fit(twin, *without(x, y, [5]), [KerasStethoscope(sinks=[], recover=settings)])
    same_state(skipped, twin)
    assert acts(sink) == [(5, "skip")], acts(sink)
    skip = next(f for f in sink.findings if f.detector == RECOVERY)
    assert "judged bad again" in skip.message, skip.message
    skipped, _ = faulty()  # without a replay, the skip puts the state back all the same
    fit(skipped, x, y, [KerasStethoscope(sinks=[], recover=True)])
    twin, _ = faulty()
    fit(twin, *without(x, y, [5]), [KerasStethoscope(sinks=[], recover=True)])
    same_state(skipped, twin)
    print("OK")
    """
)


def test_on_the_torch_backend_a_replay_runs_in_python_from_the_same_state():
    run_on_torch(TORCH_REPLAY_SCRIPT)
