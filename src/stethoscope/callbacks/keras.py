"""Keras 3 adapter: in-graph reductions in, observations out, decisions back."""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    import keras
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "KerasStethoscope needs Keras 3 and a backend: pip install 'stethoscope[keras]' "
        "tensorflow-cpu"
    ) from exc

from stethoscope.callbacks._base import StepClock, StethoscopeBase
from stethoscope.callbacks._keras.describe import describe_run, loss_expects, training_setup
from stethoscope.callbacks._keras.fit_call import data_order
from stethoscope.callbacks._keras.layers import distribution, strategy_name
from stethoscope.callbacks._keras.probe import GraphProbe
from stethoscope.callbacks._keras.recovery import (
    KerasRecovery,
    can_replay,
    refuse_unrecoverable,
)
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.validation import ValidationMeasures, validation_loss
from stethoscope.callbacks._keras.workers import KerasWorkers
from stethoscope.detectors import Detector
from stethoscope.engine import Settings, StopOn
from stethoscope.observation import Observation
from stethoscope.recovery import Recovery
from stethoscope.recovery.skipped import BatchName
from stethoscope.sinks import ConsoleSink, RunContext, Sink

__all__ = ["SUPPORTED_BACKENDS", "KerasStethoscope"]

#: Keras backends whose train step can carry the in-graph probes.
SUPPORTED_BACKENDS = ("tensorflow", "torch")


class KerasStethoscope(StethoscopeBase, keras.callbacks.Callback):
    """Watches a Keras 3 ``model.fit`` and stops it when something is wrong.

    At the start of ``fit`` it wraps the model's ``compute_loss``, its optimizer's
    ``apply`` and the ``call`` of its leaf layers, so that the train step itself
    reduces the loss, gradients, weights, updates, inputs, labels and layer outputs
    to a few numbers per layer, inside the traced graph, into variables of its own.
    Every step the callback reads the loss; on the steps the adaptive sampler
    selects it reads the rest. After ``fit`` (or when it raises) the wrappers are
    removed and the traced functions dropped: the model is as it was, and
    ``model.save()`` holds nothing of stethoscope.

    Args:
        detectors: Detector instances (default: every detector, default thresholds).
        sinks: Where findings go (default: a :class:`ConsoleSink`).
        stop_on: ``"error"`` (default), ``"warning"``, ``None`` (never), or a set of
            detector names whose warnings and errors stop training
            (``model.stop_training``).
        raise_on: Same choices, default ``None``; a match raises
            :class:`stethoscope.TrainingProblem` carrying the finding.
        intervals: Base sampling interval in steps per detector name.
        escalate: Whether suspicion switches the costlier detectors to every step.
        hot_steps: Length of that every-step window, in steps.
        record: A directory, e.g. ``"runs/NAME"``, where the run's record is kept (the
            loss of every step, the per-layer statistics of sampled steps, weight and
            gradient distributions, every finding, the configuration) for
            ``stethoscope report`` and ``stethoscope watch``; ``None`` (default): no
            record. See :class:`stethoscope.record.RunRecorder`.
        recover: ``False`` (default), ``True`` or a :class:`stethoscope.Recovery`: skip a
            step whose loss or gradients are non-finite or past the detectors' bars, cool
            the learning rate after repeated skips, roll back to a healthy snapshot, and
            only then stop. Each step judges itself inside the train step, so a bad one
            is never applied (with ``Recovery(replay=True)``, a step judged bad is
            computed again inside it first). Refused at the start of ``fit`` where it
            cannot skip (see ``docs/recovery.md``).
        overhead_budget: The share of step time the sampled steps may cost (default
            ``0.01``, 1%): measured as training runs, their detectors' intervals stretch,
            up to every 256 steps, to stay within it; the every-step sentinels and the
            escalations on suspicion are never stretched. ``None``: the declared
            intervals, a schedule that depends on the step alone. Off in a distributed
            run, whose ranks share one schedule.

    The callback judges a step at the start of the next one (or at the epoch's end),
    never in ``on_train_batch_end``: overriding that hook makes Keras wait for every
    callback after every batch instead of running them on a thread. So a stop
    (``model.stop_training``) takes effect after one more step; ``raise_on`` raises
    before it. With ``steps_per_execution=k`` the train function runs k steps before
    any callback sees them: every step's loss is still judged, but at most one step
    per execution is sampled, and a stop takes effect after the next execution.

    Under a ``LossScaleOptimizer`` (a ``mixed_float16`` policy wraps the optimizer in
    one) the gradient statistics are those of the unscaled gradients it applies; the steps
    it skips (an overflow in the scaled gradients) are counted inside the graph, with no
    wait for the device, reported with its scale (``loss_scale_collapse``), and their
    updates, which move nothing, are never judged. ``recover=`` is refused with one.

    Under ``tf.distribute.MirroredStrategy`` every replica runs the reductions on its
    shard into its own copy of the probe's variables, and the callback combines the
    copies: one monitor, one set of findings, one summary. The gradient statistics
    are those of the summed gradients the optimizer applies; a non-finite loss names
    its replica in the finding's ``rank``. Under ``MultiWorkerMirroredStrategy`` each
    worker is a rank, as a DDP process is (see ``docs/distributed.md``).

    Raises:
        ValueError: On bad arguments, naming the value and the valid choices, or
            when the Keras backend is not one of :data:`SUPPORTED_BACKENDS`; at the
            start of ``fit``, under a ``tf.distribute`` strategy other than the two
            mirrored ones (naming it), and with ``recover=`` where it cannot skip (a
            ``LossScaleOptimizer``, which skips steps itself, among them).

    Example:
        >>> model.fit(x, y, callbacks=[KerasStethoscope()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        detectors: Sequence[Detector] | None = None,
        sinks: Sequence[Sink] | None = None,
        stop_on: StopOn = "error",
        raise_on: StopOn = None,
        intervals: Mapping[str, int] | None = None,
        escalate: bool = True,
        hot_steps: int = 32,
        record: str | os.PathLike[str] | None = None,
        recover: bool | Recovery = False,
        overhead_budget: float | None = 0.01,
    ) -> None:
        super().__init__()
        backend = keras.backend.backend()
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"KerasStethoscope supports the Keras backends {list(SUPPORTED_BACKENDS)!r}, "
                f"not KERAS_BACKEND={backend!r}: its train step is a pure function, so the "
                "in-graph probes have no state to write to. Use tensorflow or torch."
            )
        self._build_monitor(
            Settings.of(
                detectors=detectors,
                sinks=[ConsoleSink()] if sinks is None else sinks,
                stop_on=stop_on,
                raise_on=raise_on,
                intervals=intervals,
                escalate=escalate,
                hot_steps=hot_steps,
                overhead_budget=overhead_budget,
            ),
            record=record,
            recover=recover,
        )
        self._clock = StepClock()
        self._probe: GraphProbe | None = None
        self._validation = ValidationMeasures(self.monitor.reads)
        self._recovery: KerasRecovery | None = None
        self._workers: KerasWorkers | None = None  # the other workers (MultiWorkerMirrored)
        self._key: tuple = ()  # what the probe was made for (GraphProbe.key)
        self._epoch = 0
        self._next = 0  # the global step of the next train step
        # the execution launched last and not yet judged: (first step, its batch's index in
        # the epoch, sampled step, plan)
        self._pending: tuple[int, int, int, frozenset[str]] | None = None
        # what on_train_begin found, for the first epoch to begin with (see _begin)
        self._beginning: tuple[Any, bool] | None = None
        self._warned_no_loss = False
        #: The order fit was asked to serve the data in (see ``fit_call.data_order``).
        self._data_order = ""
        #: What the compiled loss takes (see ``describe.loss_expects``).
        self._loss_expects = ""

    # -- set-up / tear-down -----------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        """Refuse, before the first step, what cannot be watched or recovered; the rest
        starts with the first epoch (see :meth:`_begin`)."""
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise ValueError("KerasStethoscope needs a compiled model: call model.compile() first")
        self._data_order = data_order(model)  # fit calls this hook: ask it here
        self._loss_expects = loss_expects(model)
        strategy = distribution(model)
        if strategy is not None:
            _check_optimizer(model.optimizer, strategy)
        recover = self.recoverer is not None
        replay = recover and self.recoverer.ladder.settings.replay
        if recover:
            regime = Regime.of(steps_per_execution=model.steps_per_execution, strategy=strategy)
            refuse_unrecoverable(model, regime)
            replay = replay and can_replay(strategy)
        self._beginning = (strategy, replay)

    def _begin(self, epoch: int) -> None:
        """The first epoch of a fit begins: after every callback's ``on_train_begin``,
        where ``BackupAndRestore`` loads the weights and the optimizer of a fit it resumes,
        and says at which epoch (``epoch``). Make (or reuse) the probe, count the steps
        from there, take the first snapshot, start the run."""
        (strategy, replay), self._beginning = self._beginning, None
        model, recover = self.model, self.recoverer is not None
        forward = bool(self.monitor.sinks_want & {"activations", "outputs"}) or any(
            (d.needs | d.wants | d.requests) & {"activations", "outputs", "trace"}
            for d in self.monitor.detectors
        )
        key = GraphProbe.key(model, forward=forward, strategy=strategy)
        probe = self._probe
        if probe is None or self._key != key:  # else a fit in a row: its functions are traced
            probe = GraphProbe(
                model,
                steps_per_execution=model.steps_per_execution,
                forward=forward,
                strategy=strategy,
                recover=recover,
                replay=replay,
            )
            self._key = key
        # the steps taken: the optimizer's count, and with recover= the steps it skipped
        step0 = probe.ladder.step_index() if recover else probe.steps_taken()
        resumed = recover and self._probe is None and step0 > 0 and epoch > 0
        if resumed and self.recorder is not None:
            # a fit resumed at ``epoch`` by a callback of its own: its optimizer counted
            # only the steps it applied, the record of the run it resumes every step
            recorded = self.recorder.step_after_epoch(epoch - 1)
            if recorded is not None and recorded > step0:
                probe.ladder.continue_from(recorded)
                step0 = recorded
        # A fit that continues a trained model keeps the baselines of the previous fit.
        self.monitor.begin(fresh=step0 == 0 or self._probe is None)
        self._recovery = KerasRecovery(self.recoverer, self._act) if recover else None
        self._workers = KerasWorkers.join(strategy, model, self.monitor, self._act, self._recovery)
        self._next = step0
        self._pending = None
        probe.start(step0)
        self._validation.start(model, probe, step0, single=self._workers is None)
        probe.install()
        self._probe = probe
        if recover:
            self._recovery.start(model, probe, step0)
        verbose = self.params.get("verbose", 1) if isinstance(self.params, dict) else 1
        printer = _after_progress_line if verbose in (1, "auto") else None
        self.monitor.start(
            RunContext(
                framework="keras",
                printer=printer,
                first_step=step0,
                first_epoch=epoch if step0 else 0,
                describe=lambda: self._describe(describe_run(model, self.params)),
                record=self.record,
                report=self._report_writer,
                setup=training_setup(model),
            )
        )
        if resumed and self.recorder is not None and self.recorder.skipped_ahead:
            self._skip_again(self.recorder.skipped_ahead, step0, epoch)

    def _skip_again(self, batches: list, step: int, epoch: int) -> None:
        """A fit resumed into the record of the run it continues, which skipped
        ``batches`` past its checkpoint: skip them again where they come back, when the
        data comes in the same order every time (``shuffle=False`` with arrays or a
        ``PyDataset``); else say that they are not."""
        if self._data_order == "sequential":
            self.recoverer.remember(batches)
            return
        how = (
            "fit shuffles the data every epoch"
            if self._data_order == "shuffle"
            else "the dataset orders itself"
        )
        self.recoverer.cannot_skip_again(step, epoch, batches, how)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._beginning is not None:  # a fit with no epoch to run: nothing began
            self._beginning = None
            return
        self._collect()
        self._detach()
        if self._recovery is not None:
            self._recovery.close()
            self._recovery = None
        self.monitor.flush()
        message = self._stop_message()
        if message is not None and self.monitor.writes:  # rank zero's (the workers')
            _after_progress_line(message)
        self.monitor.close()

    def remove(self) -> None:
        """Take the wrappers off the model now (``fit`` does this itself when it ends;
        call it after a ``fit`` that an exception of your own interrupted)."""
        self._detach()

    def _detach(self) -> None:
        if self._probe is not None:
            self._probe.remove()

    # -- per step ------------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._beginning is not None:
            self._begin(epoch)
        self._clock.drop()  # the last epoch's end and its validation are no step's time

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        # The previous execution has returned: judge it here rather than in a batch-end
        # hook, which would make Keras wait for every callback after every batch.
        self._collect()
        probe = self._probe
        if probe is None:
            return
        chosen, plan = self.monitor.first_sampled(self._next, probe.regime.steps)
        if probe.loss_scaled and "updates" in plan:
            plan |= {"loss_scale"}  # whether the optimizer skipped the step (LossScale)
        probe.schedule(chosen, plan)
        if self._recovery is not None:
            self._recovery.plan(self._next, BatchName(self._epoch, batch))
        self._pending = (self._next, batch, chosen, plan)
        self._clock.start(self.monitor, sampled=chosen >= 0, steps=probe.regime.steps)

    def _collect(self) -> None:
        """Judge the steps of the last execution: every loss, and the sampled step's probes."""
        probe, pending = self._probe, self._pending
        if probe is None or pending is None:
            return
        self._pending = None
        first, index, planned, plan = pending
        k, direct = probe.regime.steps, probe.regime.direct
        # with several steps per execution, the last one of an epoch may run fewer
        count = 1 if k == 1 else probe.steps_run() - first
        self._next = first + count
        if not probe.saw_loss and not self._warned_no_loss:
            self._warned_no_loss = True
            warnings.warn(
                "stethoscope: the train step neither called model.compute_loss nor returned "
                f"its loss in its logs ({probe.wrappers.why_no_loss}), so the loss detectors are "
                "skipped; return the step's loss as logs['loss'] (the loss itself, or the "
                "result of a keras.metrics.Mean that took it with update_state), or compute "
                "it with self.compute_loss(x, y, y_pred, sample_weight)",
                RuntimeWarning,
                stacklevel=3,
            )
        ring = probe.ring()
        if direct and planned != first and self._recovery is None and probe.saw_loss:
            # the step of nearly every call: one step, nothing sampled, no ladder; its loss
            # and each gradient's sum of squares, finite when their sum is
            values = ring.tolist()
            if math.isfinite(sum(values)):
                decision = self.monitor.observe_loss(first, self._epoch, values[0])
                if decision is not None:
                    self._act(decision)
                return
        losses = probe.losses(ring) if probe.saw_loss else None
        last = first + count - 1
        measured = probe.sampled_at() if first <= planned <= last else -1
        bad_at, bad_rank = -1, self.monitor.rank
        replica_losses: list[np.ndarray] = []
        if probe.flagged(ring):  # a step with a non-finite loss or gradient
            bad_at = first if direct else probe.nonfinite_step()
            if probe.regime.replica_ranks:  # which replica's shard made it so
                replica_losses = probe.replica_losses()
                bad_rank = probe.bad_replica()
            if not direct:  # ready for the next one (off the healthy path)
                probe.clear_nonfinite(ring)
        # the weights after a non-finite step are read after the execution: its last step's
        weights_at = last if bad_at >= 0 else -1
        recovery = self._recovery
        verdicts = probe.ladder.verdicts(ring) if recovery is not None else None
        for step in range(first, first + count):
            loss = float(losses[step % k]) if losses is not None else None
            if (
                recovery is None
                and step != planned
                and step != bad_at
                and step != weights_at
                and loss is not None
                and math.isfinite(loss)
            ):  # a quiet step, as nearly every step is: the loss alone
                decision = self.monitor.observe_loss(step, self._epoch, loss)
                if decision is not None:
                    self._act(decision)
                continue
            obs = Observation(step=step, epoch=self._epoch, rank=self.monitor.rank, loss=loss)
            if replica_losses and loss is not None and not math.isfinite(loss):
                obs.rank = _first_nonfinite(replica_losses, step % k)
            if recovery is not None:
                batch = BatchName(self._epoch, index + step - first)
                recovery.settle(step, batch, verdicts[step % k], obs.loss)
            if step == planned:
                probe.decode(obs, plan, fresh=measured == step)
                if obs.sample_prints is not None:
                    obs.data_order = self._data_order
                if obs.output_probs is not None:
                    obs.loss_expects = self._loss_expects
                if recovery is not None:
                    self.recoverer.drop_unapplied_update(obs)
            self._act(self.monitor.observe(obs))
            # a non-finite loss or gradient, the step's norms recorded: where only the
            # gradient was not finite, nothing else raised a suspicion (the workers of a
            # distributed run escalate where they meet, all on the same step)
            finite = obs.loss is None or math.isfinite(obs.loss)
            if step == bad_at and finite and self._workers is None:
                self.monitor.escalate(step, self._epoch, "a non-finite gradient")
            if step in (bad_at, weights_at):
                self._look_at_nonfinite(
                    obs, bad_rank, grads=step == bad_at, weights=step == weights_at
                )
            if recovery is not None:
                recovery.after_step(step, self._epoch, first=first if step == last else None)
        if self._workers is not None:
            self._workers.executed(first, last, self._epoch)

    def _look_at_nonfinite(
        self, judged: Observation, rank: int, *, grads: bool, weights: bool
    ) -> None:
        """Judge what its own observation (``judged``) did not carry, by every detector that
        reads it, due or not: the gradient norms recorded at a non-finite step (``grads``,
        by the replica that saw it first), and the weight norms after the execution that
        took it (``weights``, at its last step), so that the parameter that went bad is
        named, whatever the schedule. ``rank``: the finding's (a replica's, or a worker's)."""
        obs = Observation(step=judged.step, epoch=judged.epoch, rank=rank)
        self._probe.decode_nonfinite(obs, None, grads=grads, weights=weights)
        if judged.grad_norm is not None:
            obs.grad_norm = None  # judged already, as planned
        if judged.weight_norm is not None:
            obs.weight_norm = None
        if obs.grad_norm is not None or obs.weight_norm is not None:
            self._act(self.monitor.observe(obs, forced=True))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._collect()
        val = validation_loss(logs)
        step = max(self._next - 1, 0)
        if self._workers is not None:  # every worker ends the epoch here
            self._workers.epoch_ended(step, epoch, val)
        elif self._probe is not None:
            measured = self._validation.take(self._probe, self._next)
            self._act(self.monitor.observe_validation(step, epoch, val, **measured))
        self._end_epoch(epoch)

    # -- decisions ------------------------------------------------------------------------
    def _stop_training(self) -> None:
        self.model.stop_training = True

    def _before_raise(self) -> None:
        self._detach()  # Keras calls no callback when fit raises: leave the model clean
        self.monitor.close()


def _first_nonfinite(replica_losses: list[np.ndarray], slot: int) -> int:
    """The first replica whose own share of the loss in ``slot`` is not finite."""
    for r, losses in enumerate(replica_losses):
        if not np.isfinite(losses[slot]):
            return r
    return 0


def _check_optimizer(optimizer: Any, strategy: Any) -> None:
    """Refuse what the probe cannot measure under a strategy; warn where its gradient
    statistics differ from those of one device."""
    name = strategy_name(strategy)
    if hasattr(optimizer, "inner_optimizer") or not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise ValueError(
            f"KerasStethoscope under {name} measures the gradients where Keras' TensorFlow "
            "optimizer sums them across replicas, and this optimizer "
            f"({type(optimizer).__name__}) does not sum them there (a LossScaleOptimizer "
            "or a custom one): not supported. Use a plain Keras optimizer, or train "
            "without KerasStethoscope."
        )
    if optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue:
        warnings.warn(
            f"stethoscope: under {name}, Keras clips each replica's gradient before it "
            "sums them, so the gradient statistics describe the clipped sum the optimizer "
            "applies, not the gradient of the loss: exploding_gradients sees norms bounded "
            "by the clipping",
            RuntimeWarning,
            stacklevel=3,
        )


def _after_progress_line(text: str) -> None:
    """Print below Keras' progress bar, which holds its line open with a carriage return."""
    sys.stdout.write("\n" + text + "\n")
    sys.stdout.flush()
