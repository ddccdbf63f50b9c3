"""PyTorch Lightning adapter: hooks in, observations out, decisions back."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "LightningStethoscope needs torch and lightning: pip install 'stethoscope[lightning]'"
    ) from exc

from stethoscope.callbacks._base import StepClock, StethoscopeBase
from stethoscope.callbacks._lightning.batch import BatchParts
from stethoscope.callbacks._lightning.context import describe_run, run_context
from stethoscope.callbacks._lightning.device_clock import DeviceStepClock, step_clock_for
from stethoscope.callbacks._lightning.forward import ForwardProbe
from stethoscope.callbacks._lightning.game import GameWatch
from stethoscope.callbacks._lightning.hooks import HookSwitch
from stethoscope.callbacks._lightning.learning_rate import TakenRate
from stethoscope.callbacks._lightning.logged import headline, log_metrics
from stethoscope.callbacks._lightning.loss_scale import (
    EngineScaleSkips,
    ScaleSkips,
    pending_scale,
    scaler_of,
)
from stethoscope.callbacks._lightning.losses import TrainingLosses, ValidationLosses
from stethoscope.callbacks._lightning.measures import Reading, StepMeasures
from stethoscope.callbacks._lightning.nonfinite import look_if_nonfinite
from stethoscope.callbacks._lightning.parameters import ParameterProbe
from stethoscope.callbacks._lightning.ranks import LightningRanks
from stethoscope.callbacks._lightning.reader import HostReader
from stethoscope.callbacks._lightning.recovery import LightningRecovery
from stethoscope.callbacks._lightning.reductions import (
    ReductionSet,
    watch_parameters,
)
from stethoscope.callbacks._lightning.shards import ShardCombiner
from stethoscope.callbacks._lightning.validation import ValidationMeasures
from stethoscope.callbacks._lightning.zero import accumulating
from stethoscope.detectors import Detector
from stethoscope.engine import Monitor, Settings, StopOn
from stethoscope.observation import Observation, computes_in
from stethoscope.recovery import Recovery
from stethoscope.sinks import ConsoleSink, Sink

__all__ = ["LightningStethoscope"]


class LightningStethoscope(StethoscopeBase, Callback):
    """Watches a Lightning training run and stops it when something is wrong.

    Every step it reads the loss (kept on the device, read without synchronising
    the GPU); on the steps the adaptive sampler selects it also reduces every
    gradient and weight to a norm in one fused kernel and reads them in one
    transfer. Detectors judge those numbers on the host; findings go to the
    sinks; a finding that matches ``stop_on`` sets ``trainer.should_stop``.

    Under DDP every rank runs the callback; rank zero writes to the sinks. The ranks
    meet in one all-gather on the sampled steps of their shared schedule, at each
    validation and at each epoch end: the findings of the other ranks reach rank zero
    there, a decision to stop (or to sample faster) taken on any rank is taken by all of
    them on that step, and the distributed detectors compare the replicas' weights and
    the ranks' step times. In a single process none of this runs.

    Args:
        detectors: Detector instances (default: every detector, default thresholds).
        sinks: Where findings go (default: a :class:`ConsoleSink`). Sinks are
            written from rank zero only.
        stop_on: ``"error"`` (default), ``"warning"``, ``None`` (never), or a set of
            detector names whose warnings and errors stop training.
        raise_on: Same choices, default ``None``; a match raises
            :class:`stethoscope.TrainingProblem` carrying the finding.
        intervals: Base sampling interval in steps per detector name, e.g.
            ``{"exploding_gradients": 4}``.
        escalate: Whether suspicion switches the costlier detectors to every step
            for a while (``False``: fixed intervals).
        hot_steps: Length of that every-step window, in steps.
        log_stats: Also send the global gradient norm, update ratio and sampling
            interval to the Trainer's loggers on sampled steps.
        max_lag: On CUDA, how many steps a reading may trail the step it measures
            before the callback waits for it; this bounds detection latency. On
            the CPU readings are never late.
        inputs_from: ``batch -> tensor`` giving the model inputs of a batch, for the
            data detectors (default: the batch itself when it is a tensor, ``batch[0]``
            of a tuple, or the ``x`` / ``input(s)`` / ``features`` / ``image(s)`` /
            ``pixel_values`` key of a dict).
        labels_from: ``batch -> tensor`` giving the class labels (default: ``batch[1]`` of
            a pair, or the ``labels`` / ``y`` / ``target(s)`` key; a longer tuple: none).
        val_loss_key: The logged metric holding the validation loss, when
            ``validation_step`` does not return it (default: the first of
            ``val_loss``, ``val/loss``, ``validation_loss`` that is logged).
        record: A directory, e.g. ``"runs/NAME"``, where the run's record is kept (the
            loss of every step, the per-layer statistics of sampled steps, weight and
            gradient distributions, every finding, the configuration) for
            ``stethoscope report`` and ``stethoscope watch``; ``None`` (default): no
            record. Rank zero writes it. See :class:`stethoscope.record.RunRecorder`.
        recover: ``False`` (default), ``True`` or a :class:`stethoscope.Recovery`: skip a
            bad step, cool the learning rate, roll back to a snapshot, then stop.
        overhead_budget: The share of step time the sampled steps may cost (default
            ``0.01``, 1%): measured as training runs, their detectors' intervals stretch,
            up to every 256 steps, to stay within it; the every-step sentinels and the
            escalations on suspicion are never stretched. ``None``: the declared
            intervals, a schedule that depends on the step alone. Off in a distributed
            run, whose ranks share one schedule.

    Raises:
        ValueError: On bad arguments, naming the value and the valid choices.

    Example:
        >>> trainer = L.Trainer(callbacks=[LightningStethoscope()])  # doctest: +SKIP
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
        log_stats: bool = False,
        max_lag: int = 2,
        inputs_from: Callable[[Any], Any] | None = None,
        labels_from: Callable[[Any], Any] | None = None,
        val_loss_key: str | None = None,
        record: str | os.PathLike[str] | None = None,
        recover: bool | Recovery = False,
        overhead_budget: float | None = 0.01,
    ) -> None:
        super().__init__()
        _check_arguments(max_lag, inputs_from, labels_from, val_loss_key)
        self.inputs_from, self.labels_from = inputs_from, labels_from
        self.val_loss_key = val_loss_key
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
        self.log_stats = bool(log_stats)
        self.max_lag = max_lag
        self._hooks = HookSwitch(self, LightningStethoscope)
        self._reset_run()
        self._validation = ValidationMeasures(self.monitor.reads)  # kept for the next fit

    def _reset_run(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._probe: ParameterProbe | None = None
        self._forward: ForwardProbe | None = None
        self._reader = HostReader(self.max_lag)
        self._reductions: ReductionSet | None = None
        self._measures = StepMeasures(step=-1, epoch=0, plan=frozenset())
        self._val_losses = ValidationLosses(self.val_loss_key)
        self._train_losses = TrainingLosses()
        self._clock: StepClock | DeviceStepClock = StepClock()
        self._printer: Callable[[str], None] | None = None
        self._rate = TakenRate()
        #: The other ranks (a distributed run only).
        self._ranks: LightningRanks | None = None
        self._recovery: LightningRecovery | None = None
        self._scale_skips: ScaleSkips | EngineScaleSkips | None = None
        self._batch: BatchParts | None = None
        #: Under sharded parameters: combines the ranks' measures of their shards.
        self._combiner: ShardCombiner | None = None
        #: With several optimizers: whether they play a game, until it is found.
        self._game: GameWatch | None = None

    # -- set-up -------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        self._trainer = trainer
        self._clock = step_clock_for(trainer.strategy.root_device)
        # DDP averages the gradients over every rank's batch
        self._batch = batch = BatchParts(self.inputs_from, self.labels_from, trainer.world_size)
        self._validation = self._validation.for_fit(batch.inputs)
        # A second fit with this callback: a new Trainer starts again at step 0 (a checkpoint,
        # if any, restores the baselines right after setup); the same Trainer continues.
        self.monitor.begin(fresh=trainer.global_step == 0)
        self.monitor.distribute(rank=trainer.global_rank, world_size=trainer.world_size)
        if trainer.world_size > 1:
            drain = functools.partial(self._drain, trainer, wait=True)
            self._ranks = LightningRanks(trainer, self.monitor, self.recoverer, drain, self._act)
        self._hooks.start_fit(recovering=self.recoverer is not None, ranks=trainer.world_size)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # at train start: a strategy that shards the model (FSDP2's configure_model,
        # DeepSpeed's engine) replaces its parameters and optimizers after setup
        watched = watch_parameters(pl_module, self._batch)
        self._probe, self._forward, self._scale_skips, self._reductions = watched
        self._rate = TakenRate(trainer.optimizers, self.recoverer)
        self._probe.optimized_by(trainer.optimizers)
        if self._ranks is not None:  # before the monitor starts: how the ranks judge
            self._ranks.watch_replicas(trainer, pl_module, sharded=self._probe.sharded)
        context = run_context(
            trainer,
            record=self.record,
            report=self._report_writer,
            describe=lambda: self._describe(describe_run(trainer, pl_module, self._probe)),
        )
        self._printer = context.printer
        self.monitor.start(context)
        self._act(self._validation.training_starts(trainer, pl_module, self.monitor))
        if len(trainer.optimizers) > 1:  # manual optimization: a game, or layer by layer
            self._game = GameWatch(trainer.optimizers)
            self._hooks.backward_always = True  # it hears each backward pass
        if self.recoverer is not None:
            self._remember_skipped(trainer.strategy.broadcast if trainer.world_size > 1 else None)
            self._recovery = LightningRecovery(self.recoverer, self._act)
            self._recovery.start(trainer, pl_module, sharded=self._probe.sharded)
        if self._probe.sharded and self._ranks is not None:
            self._combiner = ShardCombiner.of_process_group()

    # -- per step -----------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        measures = self._measures
        step = trainer.global_step
        if self._recovery is not None and step != measures.step:
            self._recovery.new_step(step, trainer.current_epoch, batch_idx, batch)
        if step == measures.step:  # a later micro-batch of an accumulated step
            if measures.sampled:
                for r in self._reductions.run(measures.plan):
                    r.micro_batch(measures, batch)
            return
        plan = self.monitor.plan(step)
        if self.log_stats and "grads" in plan:
            plan |= {"weights", "updates"}  # the update ratio is a headline stat
        if self._scale_skips is not None and "updates" in plan:
            plan |= {"loss_scale"}  # whether the scaler skipped the step (LossScale)
        self._measures = measures = StepMeasures(
            step, trainer.current_epoch, plan, combiner=self._combiner, lr=self._rate.at(step)
        )
        self._clock.start(self.monitor, sampled=measures.sampled)
        self._hooks.set("on_before_optimizer_step", measures.sampled or self.recoverer is not None)
        wanted = not plan.isdisjoint(self._reductions.before_backward)
        self._hooks.backward(wanted or self._train_losses.hearing)  # only where it has work
        if measures.sampled:
            for r in self._reductions.run(plan):
                r.at_start(measures, batch)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        measures = self._measures
        measures.lr = self._rate.at(measures.step)  # a warm-up may set it after batch start
        if self._recovery is not None:
            self._recovery.judge(optimizer)
            if self._recovery.replaying:  # the step again: its statistics were taken
                return
        if measures.sampled and not accumulating(trainer.strategy.model):  # else nothing to read
            scale = pending_scale(scaler_of(trainer), optimizer)
            self._reductions.before_step(measures, optimizer, scale)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        measures = self._measures
        if self._game is not None and self._game.batch_done():  # before the loss is judged
            self.monitor.plays_a_game()
            self._game = None
        elif self._game is not None and self._game.new_stage:
            self.monitor.new_stage(measures.step)
        if self._scale_skips is not None and trainer.global_step != measures.step:
            self._scale_skips.step_done(first=measures.step == 0)
        lr = measures.lr
        quiet = not measures.sampled and not len(self._reader)
        value = self._train_losses.on_cpu(outputs, trainer, pl_module) if quiet else None
        if value is not None:
            # the unsampled CPU step, as nearly every step is: reading a CPU scalar is no
            # device sync, and the loss goes straight to the monitor
            decision = self.monitor.observe_loss(measures.step, measures.epoch, value, lr)
            if decision is not None:  # judged now, not left to wait
                self._act(decision)
                if not math.isfinite(value):
                    step, epoch, rank = measures.step, measures.epoch, self.monitor.rank
                    obs = Observation(step=step, epoch=epoch, rank=rank, lr=lr, loss=value)
                    self._look_if_nonfinite(trainer, obs)
        else:
            loss = self._train_losses(outputs, trainer, pl_module)
            for r in self._reductions.run(measures.plan):
                r.at_end(measures)
            if loss is not None:
                measures.add("loss", loss.reshape(1))
            reading = measures.take()
            if reading is not None:
                self._reader.push(reading, reading.values)
            self._drain(trainer, wait=False)
        if self._recovery is not None and trainer.global_step != measures.step:
            self._recovery.after_step(trainer, pl_module, measures.step)
        if self._ranks is not None:
            self._ranks.batch_done(trainer, measures.step)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._recovery is not None and self._recovery.replaying:
            self._recovery.saw_loss(trainer, pl_module, loss)  # the step again: the gate's
            return
        measures = self._measures
        self._train_losses.backward(loss)
        if self._game is not None:
            self._game.backward()
        if measures.sampled:
            self._reductions.backward_begins(measures, loss)
        if self._ranks is not None:
            self._ranks.timing.before_backward()
        if self._recovery is not None:
            self._recovery.saw_loss(trainer, pl_module, loss)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()
        if self._ranks is not None:
            self._ranks.timing.pause()  # the first batch of an epoch also starts the loader

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()
        self._validation.start(trainer, pl_module, single=self._ranks is None)
        if self._ranks is not None:
            self._ranks.timing.pause()

    # -- validation -----------------------------------------------------------------
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._validation.batch_start(trainer, batch, dataloader_idx)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking and dataloader_idx == 0:
            self._val_losses.add(outputs)
        self._validation.batch_end()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        val = self._val_losses.take(trainer)
        step = max(trainer.global_step - 1, 0)
        if self._ranks is not None:  # every rank validates here
            self._ranks.validated(trainer, step, val)
            return
        measured = self._validation.take()
        if val is None and all(v is None for v in measured.values()):
            return
        self._drain(trainer, wait=True)
        self._act(self.monitor.observe_validation(step, trainer.current_epoch, val, **measured))

    # -- per epoch / end ------------------------------------------------------------
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, wait=True)
        if self._ranks is not None:  # every rank ends the epoch here
            self._ranks.epoch_ended(trainer, max(trainer.global_step - 1, 0))
        summary = self._end_epoch(trainer.current_epoch)
        if self.log_stats:
            findings = float(sum(r.count for r in summary.rows))
            log_metrics(trainer, {"stethoscope/findings": findings})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, wait=True)
        self.monitor.flush()
        message = self._stop_message()
        if message is not None and trainer.is_global_zero:
            (self._printer or print)(message)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._hooks.restore()
        self._validation.close()  # a validation batch that raised
        if self._forward is not None:
            self._forward.detach()  # never leave a hook on the user's model
        if self._reductions is not None:
            self._reductions.close()
        if self._game is not None:
            self._game.close()  # nor a hook on the user's optimizers
            self._game = None
        if self._recovery is not None:
            self._recovery.close()  # nor a wrapper on the user's optimizers
            self._recovery = None
        if stage == "fit":
            self.monitor.close()
            self._trainer = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.monitor.close()  # keep every finding already emitted, also when training raises

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._checkpoint_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_checkpoint_state(state_dict)

    # -- internals ----------------------------------------------------------------------
    def _stop_training(self) -> None:
        if self._trainer is not None:
            self._trainer.should_stop = True

    def _drain(self, trainer: pl.Trainer, *, wait: bool) -> None:
        for reading, values in self._reader.pop(wait=wait):
            self._judge(trainer, reading, values)

    def _judge(self, trainer: pl.Trainer, reading: Reading, values: np.ndarray) -> None:
        obs = self._reductions.observation(reading, values, self.monitor.rank)
        if (dtype := computes_in(obs)) and self.monitor.computes_in(dtype):  # an autocast
            self._reductions.computes_in(dtype)
        if self.recoverer is not None:
            self.recoverer.drop_unapplied_update(obs)
        decision = self.monitor.observe(obs)
        if self.log_stats and obs.grad_norm is not None:
            every = functools.partial(_gradient_interval, self.monitor)
            log_metrics(trainer, headline(obs, every), step=obs.step)
        self._act(decision)
        self._look_if_nonfinite(trainer, obs)

    def _look_if_nonfinite(self, trainer: pl.Trainer, judged: Observation) -> None:
        decision = look_if_nonfinite(judged, self._measures.step, self.monitor, self._reductions)
        if decision is not None:
            self._act(decision)


def _gradient_interval(monitor: Monitor) -> float:
    """How often the gradients are measured now (NaN: for no detector)."""
    every = monitor.every("grads")
    return float("nan") if every is None else float(every)


def _check_arguments(
    max_lag: int,
    inputs_from: Callable[[Any], Any] | None,
    labels_from: Callable[[Any], Any] | None,
    val_loss_key: str | None,
) -> None:
    """Refuse LightningStethoscope's own arguments when bad, naming them."""
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag={max_lag!r} must be an integer >= 0 (steps)")
    for arg, fn in (("inputs_from", inputs_from), ("labels_from", labels_from)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{arg}={fn!r} must be a callable taking a batch, or None")
    if val_loss_key is not None and not isinstance(val_loss_key, str):
        raise TypeError(f"val_loss_key={val_loss_key!r} must be a metric name or None")
