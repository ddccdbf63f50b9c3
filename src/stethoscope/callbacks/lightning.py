"""PyTorch Lightning adapter: hooks in, observations out, decisions back."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, RichProgressBar
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "LightningStethoscope needs torch and lightning: pip install 'stethoscope[lightning]'"
    ) from exc

from stethoscope.callbacks._loggers import lend_logger_destinations
from stethoscope.callbacks._torch import HostReader, ParameterProbe
from stethoscope.detectors import Detector
from stethoscope.findings import Finding, TrainingProblem
from stethoscope.monitor import Monitor
from stethoscope.observation import Observation, global_norm
from stethoscope.policy import StopOn
from stethoscope.sinks import ConsoleSink, Sink
from stethoscope.summary import EpochSummary

__all__ = ["LightningStethoscope"]


class LightningStethoscope(Callback):
    """Watches a Lightning training run and stops it when something is wrong.

    Every step it reads the loss (kept on the device, read without synchronising
    the GPU); on the steps the adaptive sampler selects it also reduces every
    gradient and weight to a norm in one fused kernel and reads them in one
    transfer. Detectors judge those numbers on the host; findings go to the
    sinks; a finding that matches ``stop_on`` sets ``trainer.should_stop``.

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
    ) -> None:
        super().__init__()
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag={max_lag!r} must be an integer >= 0 (steps)")
        self.monitor = Monitor(
            detectors=detectors,
            sinks=[ConsoleSink()] if sinks is None else list(sinks),
            stop_on=stop_on,
            raise_on=raise_on,
            intervals=intervals,
            escalate=escalate,
            hot_steps=hot_steps,
        )
        self.log_stats = bool(log_stats)
        self.max_lag = max_lag
        self.summaries: list[EpochSummary] = []
        self._reset_run()

    def _reset_run(self) -> None:
        self._probe: ParameterProbe | None = None
        self._reader = HostReader(self.max_lag)
        self._planned_step = -1
        self._plan: frozenset[str] = frozenset()
        # filled on a sampled step by on_before_optimizer_step, consumed at batch end
        self._grad_parts: list[torch.Tensor] = []
        self._snapshots: list[torch.Tensor] = []
        self._stepped: list[int] = []
        self._warned_no_loss = False
        self._printer = None
        self._lr_group: dict[str, Any] | None = None

    @property
    def stopped_by(self) -> Finding | None:
        """The finding that stopped (or raised in) the run, if any."""
        return self.monitor.stopped_by

    # -- set-up -------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        self._probe = ParameterProbe(list(pl_module.named_parameters()))
        # A second fit with this callback: a new Trainer starts again at step 0 (a checkpoint,
        # if any, restores the baselines right after setup); the same Trainer continues.
        self.monitor.begin(fresh=trainer.global_step == 0)
        self.monitor.emit = trainer.is_global_zero

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        # the dict object stays the same while schedulers change its "lr": read it per step
        self._lr_group = optimizers[0].param_groups[0] if optimizers else None
        bar = trainer.progress_bar_callback
        # Print through the progress bar so its line is not torn: tqdm.write for TQDM. A
        # RichProgressBar draws on rich's global console, which ConsoleSink prints to by
        # default and which places output above the live bar itself (its stdout proxy would
        # wrap our already-wrapped lines a second time).
        enabled = bar is not None and bar.is_enabled
        self._printer = bar.print if enabled and not isinstance(bar, RichProgressBar) else None
        for sink in self.monitor.sinks:
            if isinstance(sink, ConsoleSink):
                sink.use_printer(self._printer)
        lend_logger_destinations(self.monitor.sinks, trainer)  # one MLflow run, one TB log dir

    # -- per step -----------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._planned_step:
            self._planned_step = step
            plan = self.monitor.plan(step)
            if self.log_stats and "grads" in plan:
                plan |= {"weights", "updates"}  # the update ratio is a headline stat
            self._plan = plan

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        plan = self._plan
        if self._probe is None or not (plan - {"loss"}):
            return  # not a sampled step: nothing to do here
        indices = self._probe.with_grad(self._probe.indices_of(optimizer))
        if not indices:
            return
        if "grads" in plan:
            self._grad_parts.append(self._probe.grad_norms(indices))
        if "updates" in plan:
            self._snapshots.extend(self._probe.snapshot(indices))
        self._stepped.extend(indices)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = self._loss_of(outputs, trainer, pl_module)
        parts: list[torch.Tensor] = []
        fields: list[str] = []
        idx = self._stepped
        if idx:  # an optimizer stepped on a sampled step: every array follows ``idx``
            if self._grad_parts:
                fields.append("grad_norm")
                parts.extend(self._grad_parts)
            if {"weights", "updates"} & self._plan:
                weights, updates = self._probe.weight_and_update_norms(idx, self._snapshots or None)
                fields.append("weight_norm")
                parts.append(weights)
                if updates is not None:
                    fields.append("update_norm")
                    parts.append(updates)
            self._grad_parts, self._snapshots, self._stepped = [], [], []
        if loss is not None or parts:
            lr = self._lr_group.get("lr") if self._lr_group is not None else None
            lr = float(lr) if isinstance(lr, (int, float)) else None  # a tensor lr: no sync
            meta = (self._planned_step, trainer.current_epoch, loss is not None, idx, fields, lr)
            if not parts and loss.device.type == "cpu" and not len(self._reader):
                # The CPU fast path: reading a CPU scalar is no device sync, and skipping the
                # reader saves several tensor ops on the step that every step is.
                self._judge(trainer, meta, (loss.item(),))
            else:
                if loss is not None:
                    parts.insert(0, loss.reshape(1).float())
                self._reader.push(meta, parts[0] if len(parts) == 1 else torch.cat(parts))
        self._drain(trainer, wait=False)

    # -- per epoch / end ------------------------------------------------------------
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, wait=True)
        summary = self.monitor.end_epoch(trainer.current_epoch)
        self.summaries.append(summary)
        self._log(trainer, {"stethoscope/findings": float(sum(r.count for r in summary.rows))})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, wait=True)
        self.monitor.flush()
        stopped = self.monitor.stopped_by
        if stopped is not None and trainer.is_global_zero:
            self._echo(
                f"stethoscope stopped training at step {stopped.step}: {stopped.detector} "
                f"({stopped.severity}) — {stopped.message}"
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.monitor.close()
            for sink in self.monitor.sinks:
                if isinstance(sink, ConsoleSink):
                    sink.use_printer(None)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.monitor.close()  # keep every finding already emitted, also when training raises

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict.get("monitor", {}))

    # -- internals ----------------------------------------------------------------------
    def _loss_of(
        self, outputs: Any, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> torch.Tensor | None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, (int, float)):
            return torch.tensor(float(loss))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            if not self._warned_no_loss:
                self._warned_no_loss = True
                warnings.warn(
                    "stethoscope: training_step returned no scalar loss, so the loss detectors "
                    "(nonfinite_loss, loss_spike, loss_not_decreasing, unstable_loss) are "
                    "skipped; return the loss or {'loss': loss} to enable them",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
        loss = loss.detach()
        k = trainer.accumulate_grad_batches
        if pl_module.automatic_optimization and k > 1:
            loss = loss * k  # Lightning divides the returned loss by the accumulation factor
        return loss

    def _drain(self, trainer: pl.Trainer, *, wait: bool) -> None:
        for meta, values in self._reader.pop(wait=wait):
            self._judge(trainer, meta, values)

    def _judge(self, trainer: pl.Trainer, meta: tuple, values: Any) -> None:
        obs = self._observation(meta, values)
        decision = self.monitor.observe(obs)
        if self.log_stats and obs.grad_norm is not None:
            self._log_headline(trainer, obs)
        if decision.raise_:
            raise TrainingProblem(decision.reason)
        if decision.stop and not trainer.should_stop:
            trainer.should_stop = True

    def _observation(self, meta: tuple, values: Any) -> Observation:
        step, epoch, has_loss, idx, fields, lr = meta
        obs = Observation(step=step, epoch=epoch, rank=0, lr=lr)
        if has_loss:
            obs.loss = float(values[0])
        if fields:
            probe = self._probe
            obs.names = tuple(probe.names[i] for i in idx)
            obs.numel = probe.numel[idx]
            obs.is_matrix = probe.is_matrix[idx]
            per_param = values[int(has_loss) :].astype("float64").reshape(len(fields), len(idx))
            for field, row in zip(fields, per_param, strict=False):
                setattr(obs, field, row)
        return obs

    def _log_headline(self, trainer: pl.Trainer, obs: Observation) -> None:
        metrics = {
            "stethoscope/grad_norm": global_norm(obs.grad_norm),
            "stethoscope/interval": float(self.monitor.interval("exploding_gradients", obs.step))
            if "exploding_gradients" in self.monitor.sampler.base
            else float("nan"),
        }
        if obs.update_norm is not None and obs.weight_norm is not None:
            w = global_norm(obs.weight_norm)
            metrics["stethoscope/update_ratio"] = global_norm(obs.update_norm) / w if w else 0.0
        self._log(trainer, metrics, step=obs.step)

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
        if not (self.log_stats and trainer.is_global_zero):
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step if step is None else step)

    def _echo(self, text: str) -> None:
        (self._printer or print)(text)
