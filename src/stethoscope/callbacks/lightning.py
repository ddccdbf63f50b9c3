"""PyTorch Lightning adapter: hooks in, observations out, decisions back."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, RichProgressBar
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "LightningStethoscope needs torch and lightning: pip install 'stethoscope[lightning]'"
    ) from exc

from stethoscope.callbacks._loggers import lend_logger_destinations
from stethoscope.callbacks._torch import (
    ForwardProbe,
    HostReader,
    ParameterProbe,
    checksums,
    class_labels,
    input_moments,
    split_batch,
    unit_layers,
    zero_rows,
)
from stethoscope.detectors import Detector
from stethoscope.distributed import Gathered, Packet
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
            data detectors (default: ``batch[0]`` of a tuple, or the ``x`` /
            ``input(s)`` / ``features`` / ``image(s)`` key of a dict).
        labels_from: ``batch -> tensor`` giving the class labels (default:
            ``batch[1]``, or the ``labels`` / ``y`` / ``target(s)`` key).
        val_loss_key: The logged metric holding the validation loss, when
            ``validation_step`` does not return it (default: the first of
            ``val_loss``, ``val/loss``, ``validation_loss`` that is logged).

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
    ) -> None:
        super().__init__()
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag={max_lag!r} must be an integer >= 0 (steps)")
        for arg, fn in (("inputs_from", inputs_from), ("labels_from", labels_from)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg}={fn!r} must be a callable taking a batch, or None")
        if val_loss_key is not None and not isinstance(val_loss_key, str):
            raise TypeError(f"val_loss_key={val_loss_key!r} must be a metric name or None")
        self.inputs_from, self.labels_from = inputs_from, labels_from
        self.val_loss_key = val_loss_key
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
        self._snapped: list[int] = []  # the parameters behind self._snapshots
        self._stepped: list[int] = []
        self._units: list[tuple[str, int]] = []  # (layer, units) behind self._unit_parts
        self._unit_samples = 0  # the samples behind them
        self._unit_parts: list[torch.Tensor] = []
        self._early: list[tuple[str, torch.Tensor, Any]] = []  # data and hook results
        self._layers: list[tuple[str, int, Any]] = []
        self._forward: ForwardProbe | None = None
        self._unoptimized: tuple[str, ...] = ()
        self._val_losses: list[torch.Tensor] = []
        self._warned_no_loss = False
        self._printer = None
        self._lr_group: dict[str, Any] | None = None
        # distributed runs only (see _meet)
        self._dist = False
        self._world = 1
        self._replicas: list[torch.Tensor] = []  # the tensors replica_divergence compares
        self._replica_names: tuple[str, ...] = ()
        self._replica_buffer = np.zeros(0, dtype=bool)
        self._packets: dict[tuple, Packet] = {}
        self._mark: float | None = None  # when this rank last finished a batch
        self._busy, self._busy_n = 0.0, 0  # seconds alone, and batches, since last gathered

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
        self._layers = unit_layers(pl_module, self._probe)
        self._forward = ForwardProbe(pl_module, self._layers)
        fan_in = np.full(len(self._probe.names), np.nan)
        for _, i, mod in self._layers:
            fan_in[i] = mod.weight.numel() / max(mod.weight.shape[0], 1)
        self._fan_in = fan_in
        # A second fit with this callback: a new Trainer starts again at step 0 (a checkpoint,
        # if any, restores the baselines right after setup); the same Trainer continues.
        self.monitor.begin(fresh=trainer.global_step == 0)
        self.monitor.distribute(rank=trainer.global_rank, world_size=trainer.world_size)
        self._dist = trainer.world_size > 1
        self._world = trainer.world_size  # DDP averages gradients over every rank's batch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        # the dict object stays the same while schedulers change its "lr": read it per step
        self._lr_group = optimizers[0].param_groups[0] if optimizers else None
        held = {i for opt in optimizers for i in self._probe.indices_of(opt)}
        self._unoptimized = tuple(
            n for i, n in enumerate(self._probe.names) if i not in held and optimizers
        )
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
        if self._dist:
            self._watch_replicas(trainer, pl_module)

    def _watch_replicas(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The tensors replica_divergence compares: under DDP, every parameter, and the
        buffers DDP does not overwrite from rank zero at each forward pass. Strategies that
        shard the parameters (FSDP, DeepSpeed) hold no whole replicas: nothing to compare,
        and every rank judges its own gradients and weights."""
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.monitor.distribute(
                rank=trainer.global_rank, world_size=trainer.world_size, replicated=False
            )
            if trainer.is_global_zero:
                warnings.warn(
                    f"stethoscope: LightningStethoscope is tested under DDP only; with "
                    f"{type(trainer.strategy).__name__} every rank judges the gradients and "
                    "weights it holds (a shard, if they are sharded), and replica_divergence "
                    "is off",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        named = list(pl_module.named_parameters())
        buffers = [] if model.broadcast_buffers else list(pl_module.named_buffers())
        self._replicas = [t for _, t in named + buffers]
        self._replica_names = tuple(n for n, _ in named + buffers)
        self._replica_buffer = np.array([False] * len(named) + [True] * len(buffers))

    # -- per step -----------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._planned_step:
            if "units" in self._plan:  # the gradient rows hold every micro-batch's samples
                self._unit_samples += self._samples_in(batch)
            return  # a later micro-batch of an accumulated step: the plan is made
        self._planned_step = step
        plan = self.monitor.plan(step)
        if self.log_stats and "grads" in plan:
            plan |= {"weights", "updates"}  # the update ratio is a headline stat
        self._plan = plan
        if len(plan) > 1:  # more than the loss: a sampled step
            self._sample_data(plan, batch)
            if "units" in plan:
                self._unit_samples = self._samples_in(batch)
            if self._forward is not None and ({"activations", "outputs", "trace"} & plan):
                self._forward.attach(
                    activations="activations" in plan,
                    outputs="outputs" in plan,
                    trace="trace" in plan,
                )

    def _samples_in(self, batch: Any) -> int:
        """The samples of a batch (0: unknown), on every rank when DDP averages gradients."""
        x = self.inputs_from(batch) if self.inputs_from is not None else split_batch(batch)[0]
        n = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() > 0 else 0
        return n * self._world

    def _sample_data(self, plan: frozenset[str], batch: Any) -> None:
        """Input moments and labels of the step's first batch, kept on the device."""
        if not ({"inputs", "labels"} & plan):
            return
        x, y = split_batch(batch)
        if self.inputs_from is not None:
            x = self.inputs_from(batch)
        if self.labels_from is not None:
            y = self.labels_from(batch)
        if "inputs" in plan and (moments := input_moments(x)) is not None:
            self._early.append(("input_sq", moments[0], moments[1]))
        if "labels" in plan and (labels := class_labels(y)) is not None:
            self._early.append(("labels", labels, None))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        plan = self._plan
        if self._probe is None or not (plan & {"grads", "weights", "updates", "units"}):
            return  # not a sampled step: nothing to do here
        indices = self._probe.with_grad(self._probe.indices_of(optimizer))
        if not indices:
            return
        if "grads" in plan:
            self._grad_parts.append(self._probe.grad_norms(indices))
        if "updates" in plan:
            chosen = self._probe.choose(indices)
            self._snapshots.extend(self._probe.snapshot(chosen))
            self._snapped.extend(chosen)
        if "units" in plan:
            chosen = set(indices)
            layers = [(n, i) for n, i, _ in self._layers if i in chosen]
            if layers:
                grads = [self._probe.params[i].grad for _, i in layers]
                self._units.extend((n, g.shape[0]) for (n, _), g in zip(layers, grads, strict=True))
                self._unit_parts.append(zero_rows(grads))
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
        lr = self._lr_group.get("lr") if self._lr_group is not None else None
        lr = float(lr) if isinstance(lr, (int, float)) else None  # a tensor lr: no sync
        if (
            loss is not None
            and loss.device.type == "cpu"
            and not self._early
            and not self._stepped
            and not len(self._reader)
            and (self._forward is None or not self._forward.attached)
        ):
            # The unsampled CPU step, which nearly every step is: reading a CPU scalar is no
            # device sync, and the loss goes straight to the monitor, with no reader and no
            # layout to build and take apart.
            value = loss.item()
            epoch = trainer.current_epoch
            obs = Observation(
                step=self._planned_step, epoch=epoch, rank=self.monitor.rank, lr=lr, loss=value
            )
            self._act(trainer, self.monitor.observe(obs))
            if not math.isfinite(value):
                self._look_now(trainer, (self._planned_step, epoch, [], [], lr))
        else:
            self._push_step(trainer, loss, lr)
        self._drain(trainer, wait=False)
        if self._dist:
            step = self._planned_step
            if trainer.global_step != step and self.monitor.meets(step):  # the optimizer stepped
                self._meet_at_step(trainer, step)
            self._mark = time.perf_counter()

    def _push_step(self, trainer: pl.Trainer, loss: torch.Tensor | None, lr: float | None) -> None:
        """Hand the reader what a sampled step (or a loss on a device) measured, as one
        tensor read later without a sync, with the layout to take it apart."""
        parts: list[tuple[str, torch.Tensor, Any]] = self._early
        self._early = []
        if self._forward is not None and self._forward.attached:
            names, kinds, values = self._forward.collect()
            if values is not None:
                parts.append(("forward", values, (tuple(names), tuple(kinds))))
        idx = self._stepped
        if idx:  # an optimizer stepped on a sampled step: every array follows ``idx``
            if self._grad_parts:
                parts.append(("grad_norm", torch.cat(self._grad_parts), None))
            if {"weights", "updates"} & self._plan:
                weights, updates, previous = self._probe.weight_and_update_norms(
                    idx, self._snapshots or None, self._snapped
                )
                parts.append(("weight_norm", weights, None))
                if updates is not None:
                    where = {i: k for k, i in enumerate(idx)}
                    positions = tuple(where[i] for i in self._snapped)
                    parts.append(("update_norm", updates, (len(idx), positions)))
                    parts.append(("prev_weight_norm", previous, (len(idx), positions)))
            if self._unit_parts:
                units = (tuple(self._units), self._unit_samples)
                parts.append(("unit_zero", torch.cat(self._unit_parts), units))
            self._grad_parts, self._snapshots, self._stepped = [], [], []
            self._snapped = []
            self._unit_parts, self._units = [], []
        if loss is not None:
            parts.insert(0, ("loss", loss.reshape(1).float(), None))
        if not parts:
            return
        layout = [(key, t.numel(), extra) for key, t, extra in parts]
        meta = (self._planned_step, trainer.current_epoch, idx, layout, lr)
        tensors = [t.reshape(-1).float() for _, t, _ in parts]
        self._reader.push(meta, tensors[0] if len(tensors) == 1 else torch.cat(tensors))

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._dist and self._mark is not None:
            # data loading and forward pass: what this rank did alone since its last batch
            self._busy += time.perf_counter() - self._mark
            self._busy_n += 1

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = None  # the first batch of an epoch also starts the data loader

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = None  # the next training batch comes after a validation: not timed

    # -- validation -----------------------------------------------------------------
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking or dataloader_idx != 0:
            return
        loss = (
            outputs.get("loss", outputs.get("val_loss"))
            if isinstance(outputs, Mapping)
            else outputs
        )
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._val_losses.append(loss.detach().reshape(1).float())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        losses, self._val_losses = self._val_losses, []
        if losses:
            mean = torch.cat(losses).mean()  # once per validation: a sync is fine here
            val: float | None = float(mean)
        else:
            val = self._logged_val_loss(trainer)
        step = max(trainer.global_step - 1, 0)
        if self._dist:
            # every rank validates here: meet, and judge the validation of all ranks
            train_sum, train_n = self.monitor.train_loss_since_validation()
            stats = {
                "val_sum": [val if val is not None else 0.0],
                "val_count": [1.0 if val is not None else 0.0],
                "train_sum": [train_sum],
                "train_count": [float(train_n)],
            }
            gathered = self._meet(trainer, step, stats)
            val = gathered.mean_of("val_sum", "val_count")
            if val is not None:
                decision = self.monitor.observe_validation(
                    step,
                    trainer.current_epoch,
                    val,
                    self.monitor.rank,
                    train_loss=gathered.mean_of("train_sum", "train_count"),
                    shared=True,
                )
                self._act(trainer, decision)
            return
        if val is None:
            return
        self._drain(trainer, wait=True)
        decision = self.monitor.observe_validation(step, trainer.current_epoch, val)
        self._act(trainer, decision)

    def _logged_val_loss(self, trainer: pl.Trainer) -> float | None:
        keys = (
            (self.val_loss_key,)
            if self.val_loss_key
            else ("val_loss", "val/loss", "validation_loss")
        )
        for key in keys:
            value = trainer.callback_metrics.get(key)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return float(value)
            if isinstance(value, (int, float)):
                return float(value)
        return None

    # -- per epoch / end ------------------------------------------------------------
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, wait=True)
        if self._dist:
            # every rank ends the epoch here: meet until no rank has a finding left to send,
            # so rank zero's summary and sinks hold every rank's findings of the epoch
            step = max(trainer.global_step - 1, 0)
            while self._meet(trainer, step, {}).reduced("backlog"):
                pass
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
        if self._forward is not None:
            self._forward.detach()  # never leave a hook on the user's model
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

    def _meet_at_step(self, trainer: pl.Trainer, step: int) -> None:
        """A sampled step of the shared schedule: gather what the distributed detectors
        compare along with the held decisions and findings, in the same collective."""
        probes = self.monitor.shared_probes(step)
        stats: dict[str, Any] = {}
        if "ranks" in probes:
            stats["busy"] = [self._busy / self._busy_n if self._busy_n else math.nan]
            self._busy, self._busy_n = 0.0, 0
        if "replicas" in probes and self._replicas:
            stats["checksums"] = checksums(self._replicas).cpu().numpy()
        gathered = self._meet(trainer, step, stats)
        if not stats:
            return
        obs = Observation(step=step, epoch=trainer.current_epoch, rank=self.monitor.rank)
        if "busy" in stats:
            obs.rank_busy = gathered.per_rank["busy"][:, 0]
        if "checksums" in stats:
            obs.replica_names = self._replica_names
            obs.replica_buffer = self._replica_buffer
            obs.replica_sums = gathered.per_rank["checksums"]
        self._act(trainer, self.monitor.observe_shared(obs))

    def _meet(self, trainer: pl.Trainer, step: int, stats: dict[str, Any]) -> Gathered:
        """The one collective: every rank sends its held decisions, its letter of findings
        and ``stats`` in one fixed-size packet, and acts on what all of them sent.

        Called only where every rank calls it: on the steps of the shared schedule
        (:meth:`Monitor.meets`), at validation ends and at epoch ends.
        """
        self._drain(trainer, wait=True)  # judge every pending reading first: its verdict goes too
        flags, letter = self.monitor.outgoing()
        values = {**flags, **stats}
        layout = tuple((name, len(np.atleast_1d(v))) for name, v in values.items())
        packet = self._packets.get(layout)
        if packet is None:
            packet = self._packets[layout] = Packet(dict(layout))
        mine = torch.from_numpy(packet.pack(values, letter))
        everyone = trainer.strategy.all_gather(mine.to(trainer.strategy.root_device))
        gathered = packet.unpack(everyone.cpu().numpy().reshape(trainer.world_size, -1))
        self._act(trainer, self.monitor.agree(step, trainer.current_epoch, gathered))
        return gathered

    def _drain(self, trainer: pl.Trainer, *, wait: bool) -> None:
        for meta, values in self._reader.pop(wait=wait):
            self._judge(trainer, meta, values)

    def _judge(self, trainer: pl.Trainer, meta: tuple, values: Any) -> None:
        obs = self._observation(meta, values)
        decision = self.monitor.observe(obs)
        if self.log_stats and obs.grad_norm is not None:
            self._log_headline(trainer, obs)
        self._act(trainer, decision)

    def _look_now(self, trainer: pl.Trainer, meta: tuple) -> None:
        """After a non-finite loss on an unsampled CPU step, read this step's gradients and
        weights at once (they are still there), so the detectors that name the parameter
        report on this step rather than at the next sample. Off the healthy path."""
        if self._probe is None or not self.monitor.judges_replicated:
            return  # off rank zero under DDP, the detectors that would read them are idle
        idx = [i for i, p in enumerate(self._probe.params) if p.grad is not None]
        if not idx:
            return
        grads = self._probe.grad_norms(idx)
        weights, _, _ = self._probe.weight_and_update_norms(idx, None)
        layout = [("grad_norm", len(idx), None), ("weight_norm", len(idx), None)]
        step, epoch, _, _, lr = meta
        values = torch.cat([grads, weights]).numpy()
        self._judge(trainer, (step, epoch, idx, layout, lr), values)

    def _act(self, trainer: pl.Trainer, decision: Any) -> None:
        if decision.raise_:
            raise TrainingProblem(decision.reason)
        if decision.stop and not trainer.should_stop:
            trainer.should_stop = True

    def _observation(self, meta: tuple, values: Any) -> Observation:
        step, epoch, idx, layout, lr = meta
        obs = Observation(step=step, epoch=epoch, rank=self.monitor.rank, lr=lr)
        at = 0
        for key, n, extra in layout:
            chunk = np.asarray(values[at : at + n], dtype=np.float64)
            at += n
            if key == "loss":
                obs.loss = float(chunk[0])
            elif key in ("grad_norm", "weight_norm"):
                setattr(obs, key, chunk)
            elif key in ("update_norm", "prev_weight_norm"):
                size, positions = extra  # measured on a subset: NaN for the others
                full = np.full(size, np.nan)
                full[list(positions)] = chunk
                setattr(obs, key, full)
            elif key == "unit_zero":
                layers, obs.unit_samples = extra
                obs.unit_names = tuple(name for name, _ in layers)
                cuts = np.cumsum([units for _, units in layers])[:-1]
                obs.unit_zero = tuple(part.astype(bool) for part in np.split(chunk, cuts))
            elif key == "input_sq":
                obs.input_sq, obs.input_count = chunk, extra
            elif key == "labels":
                if chunk[-1] == 1.0:  # the validity flag: class labels after all
                    obs.labels = chunk[:-1].astype(np.int64)
            elif key == "forward":
                self._forward_stats(obs, chunk, *extra)
        if idx:
            probe = self._probe
            obs.names = tuple(probe.names[i] for i in idx)
            obs.numel = probe.numel[idx]
            obs.is_matrix = probe.is_matrix[idx]
            obs.fan_in = self._fan_in[idx]
            obs.unoptimized = self._unoptimized
        return obs

    @staticmethod
    def _forward_stats(
        obs: Observation, chunk: np.ndarray, names: tuple[str, ...], kinds: tuple[str, ...]
    ) -> None:
        """Split the forward hooks' values into activation stats and the finite trace."""
        acts = [i for i, k in enumerate(kinds) if k != "trace"]
        offsets = np.cumsum([0] + [1 if k == "trace" else 3 for k in kinds])
        if acts:
            rows = np.stack([chunk[offsets[i] : offsets[i] + 3] for i in acts])
            obs.act_names = tuple(names[i] for i in acts)
            obs.act_kinds = tuple(kinds[i] for i in acts)
            obs.act_saturated, obs.act_rms, obs.act_max = rows[:, 0], rows[:, 1], rows[:, 2]
        traced = [i for i, k in enumerate(kinds) if k == "trace"]
        if traced:
            obs.trace_names = tuple(names[i] for i in traced)
            obs.trace_finite = np.array([chunk[offsets[i]] for i in traced]) == 1.0

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
