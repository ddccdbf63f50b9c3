"""The recovery ladder in a Lightning run: which step to skip (the gate around each
optimizer's ``step``), the learning rate of a cool-down, and the snapshots a roll back
goes to. What to do when is :mod:`stethoscope.recovery`'s.

How a skip works. Lightning hands ``optimizer.step`` a closure that runs the training
step, the backward pass and ``on_before_optimizer_step`` (where the gate judges the
step: its loss and its gradients, before any clipping). The gate runs that closure
itself, then either does not call the optimizer at all (a skip: the weights, the
optimizer's state and its step count stay exactly as they were) or calls it, with the
learning rate scaled for the optimizer step alone while the ladder cools it down (the
user's scheduler never sees the scaling).

Where it reads the verdict. On the CPU a tensor's value is host memory: the gate reads
the loss and the gradient norm at once. On an accelerator, with a fused optimizer, the
verdict stays on the device and the optimizer skips itself (``skip_on_device``), under a
GradScaler too; with any other optimizer the gate reads it on the host, waiting for the
device (it warns, naming ``fused=True``). No optimizer of torch's but a fused one can
skip a step on the device: the others take no ``found_inf``, and undoing a step after
the fact would mean a copy of the weights and the optimizer's state every step.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stethoscope.callbacks._lightning import device
from stethoscope.callbacks._lightning.buffers import StepBuffers
from stethoscope.callbacks._lightning.loss_scale import pending_scale, scaler_of
from stethoscope.callbacks._lightning.parameters import total_norm
from stethoscope.callbacks._lightning.shards import flat_slices
from stethoscope.callbacks._lightning.skip_on_device import DeviceVerdicts, skips_on_device
from stethoscope.callbacks._lightning.snapshots import Snapshots
from stethoscope.callbacks._lightning.step_batches import StepBatches
from stethoscope.callbacks._lightning.zero import is_deepspeed_optimizer
from stethoscope.engine import Decision
from stethoscope.recovery import Recoverer
from stethoscope.recovery.settings import (
    GRADIENT_PAST_BAR,
    LOSS_PAST_BAR,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
    REASONS,
)
from stethoscope.recovery.skipped import SkippedBatch

__all__ = ["LightningRecovery", "StepGate", "refuse_unrecoverable"]

#: A verdict of the host's own (never agreed across ranks as a reason: the ranks' worst
#: code wins, and every rank's GradScaler finds the same all-reduced gradients): the
#: step's loss or a gradient is not finite, and the GradScaler will skip it itself.
_LEFT_TO_SCALER = -1

#: Optimizers that call their closure more than once per step: the gate runs it once.
_MANY_CLOSURE_CALLS = ("LBFGS",)


def refuse_unrecoverable(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise when a step of these optimizers cannot be skipped by the gate.

    Raises:
        ValueError: An optimizer that evaluates its closure several times per step, or
            one of DeepSpeed's.
    """
    for opt in optimizers:
        if is_deepspeed_optimizer(opt):
            # its steps are applied inside the engine, to fp32 weights and optimizer
            # states it partitions itself: neither the gate nor a snapshot reaches them
            raise ValueError(
                f"recover= cannot yet skip or undo the steps of DeepSpeed's "
                f"{type(opt).__name__}, which keeps the weights it updates in partitions of "
                "its own; use recover=False with DeepSpeedStrategy (every detector "
                "works), or recover= with DDP, FSDPStrategy or ModelParallelStrategy"
            )
        if type(opt).__name__ in _MANY_CLOSURE_CALLS:
            raise ValueError(
                f"recover= cannot skip the steps of {type(opt).__name__}, which evaluates "
                "the loss several times per step; use recover=False with it"
            )


class StepGate:
    """Wraps each optimizer's ``step``: a step judged bad is not applied, a cooled one
    is applied at the scaled learning rate.

    Args:
        recoverer: The ladder (its ``lr_scale``) and where skips are reported.
        spike: The detector that keeps the loss's bar (``loss_spike``), or None.
        explode: The one that keeps the gradient norm's (``exploding_gradients``), or None.
        on_skip: Called with ``(step, why, replay)`` when a step was skipped
            (``replay``: ``"reproduces"`` when its replay was judged bad too,
            ``"forced"`` when it was skipped whatever its verdict, see :meth:`new_step`;
            else None).
        on_settle: Called with the step once its optimizer step was applied or skipped.
        on_unapplied: Called with the step when a GradScaler will skip it itself (its
            loss or a gradient is not finite): not the ladder's skip, not applied either.
        on_transient: Called with ``(step, why)`` when a step judged bad was fine on its
            replay (and the replay applied).
        replay: Compute a step judged bad once more before skipping it (its closure,
            from the same state with the same batch).
    """

    def __init__(
        self,
        recoverer: Recoverer,
        spike: Any,
        explode: Any,
        on_skip: Callable[[int, str], None],
        on_settle: Callable[[int], None],
        on_unapplied: Callable[[int], None] = lambda step: None,
        on_transient: Callable[[int, str], None] = lambda step, why: None,
        *,
        replay: bool = False,
        before_replay: Callable[[], None] = lambda: None,
    ) -> None:
        self.recoverer = recoverer
        self.on_transient = on_transient
        self.before_replay = before_replay
        self.replay = replay
        #: A step is being computed again (see :meth:`_replay`): the hooks that watch the
        #: first computation leave it alone.
        self.replaying = False
        #: Which steps skip whatever their verdict (a batch skipped before), and why.
        self.forced: str | None = None
        self.on_unapplied = on_unapplied
        self.spike, self.explode = spike, explode
        self.on_skip = on_skip
        self.on_settle = on_settle
        self.verdicts = DeviceVerdicts()
        self._codes: dict[int, torch.Tensor] = {}  # id(optimizer) -> verdict on the device
        self._sent_step = -1
        self.step = 0  # the global step being taken
        self.scaler_skips_nonfinite = False  # a GradScaler owns non-finite losses and gradients
        #: The ranks hold slices of the parameters (FSDP1, FSDP2): the gradients' norm is
        #: the ranks' combined, on ``device`` where this rank holds no gradient.
        self.across_ranks = False
        self.device: torch.device | None = None
        self._installed: list[tuple[torch.optim.Optimizer, Any]] = []
        self._losses: list[torch.Tensor] = []  # this step's losses (micro-batches), unscaled
        self._verdicts: dict[int, str | None] = {}  # id(optimizer) -> why to skip
        self._skipped_step = -1
        #: The last step judged bad for a non-finite loss: a NaN or Inf in its batch's
        #: inputs would explain it (see ``StepBatches.inputs_nonfinite``).
        self.nonfinite_loss_at = -1

    # -- installing --------------------------------------------------------------------
    def install(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for index, opt in enumerate(optimizers):
            had = opt.__dict__.get("step")
            original = opt.step

            def guarded(
                *args: Any, _opt=opt, _original=original, _index=index, **kwargs: Any
            ) -> Any:
                return self._step(_opt, _index, _original, args, kwargs)

            # keep the marks of who wrapped it before (an LR scheduler checks for its own)
            functools.update_wrapper(guarded, original)
            opt.step = guarded  # type: ignore[method-assign]
            self._installed.append((opt, had))

    def uninstall(self) -> None:
        """Give every optimizer its own ``step`` back."""
        for opt, had in self._installed:
            if had is None:
                opt.__dict__.pop("step", None)
            else:
                opt.step = had  # type: ignore[method-assign]
        self._installed.clear()

    # -- per step ----------------------------------------------------------------------
    def new_step(self, step: int, forced: str | None = None) -> None:
        """Step ``step`` begins; ``forced``: why it is skipped whatever its verdict."""
        self.step = step
        self.forced = forced
        self._losses.clear()
        self._verdicts.clear()
        self._codes.clear()

    def saw_loss(self, loss: torch.Tensor, scale: float) -> None:
        """A micro-batch's loss as it goes into ``backward`` (``scale`` undoes Lightning's
        division by the accumulated batches)."""
        self._losses.append(loss.detach() * scale)

    def judge(
        self,
        optimizer: torch.optim.Optimizer,
        grads: list[torch.Tensor],
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """Judge the step ``optimizer`` is about to take from its loss and ``grads``
        (before clipping; multiplied by ``grad_scale``, when a GradScaler left them
        scaled): keep why it must be skipped, or None. Under DDP every rank takes the
        verdict of the worst of them (a NaN batch on one rank is skipped by all), so the
        replicas stay the same. A forced skip needs no verdict (every rank is forced
        alike)."""
        if self.forced is not None:
            self._verdicts[id(optimizer)] = self.forced
            return
        if self._on_device(optimizer, grads):
            code = self.verdicts.verdict(
                self._losses,
                grads,
                self.spike.threshold() if self.spike is not None else None,
                self.explode.threshold() if self.explode is not None else None,
                scaler_skips_nonfinite=self.scaler_skips_nonfinite,
                grad_scale=grad_scale,
                across_ranks=self.across_ranks,
            )
            if _world_size() > 1:  # a collective on the device's stream: no host wait
                torch.distributed.all_reduce(code, op=torch.distributed.ReduceOp.MAX)
            self._codes[id(optimizer)] = code
            return
        verdict = self._why(grads, grad_scale)
        if _world_size() > 1:
            verdict = _agree(verdict, grads[0].device if grads else torch.device("cpu"))
        if verdict is not None and verdict[0] == _LEFT_TO_SCALER:
            self.on_unapplied(self.step)
            verdict = None
        self._verdicts[id(optimizer)] = verdict[1] if verdict is not None else None

    def _on_device(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> bool:
        """Whether this step's verdict stays on the device (see ``skip_on_device``): a
        fused optimizer's, on an accelerator (in host memory the host reads it at once)."""
        if self.replay:  # a replay is decided on the host, right after the step
            return False
        return skips_on_device(optimizer) and bool(grads) and not device.is_host(grads[0].device)

    def _why(
        self, grads: list[torch.Tensor], grad_scale: torch.Tensor | None
    ) -> tuple[int, str] | None:
        """Why this step must not be applied, as ``(code, sentence)`` (the codes are
        :data:`~stethoscope.recovery.REASONS`), or None; ``grad_scale``: a loss scale the
        gradients still carry, divided out of their norm."""
        losses = [float(v) for v in self._losses]  # on the CPU: no wait
        bad = [v for v in losses if not math.isfinite(v)]
        norm = 0.0
        # taken even after a bad loss, or with no gradient here: under sharding it is a
        # collective every rank makes
        total = None
        if grads or self.across_ranks:
            total = total_norm(grads, across_ranks=self.across_ranks, device=self.device)
        if total is not None and not bad:
            norm = float(total if grad_scale is None else total / grad_scale)  # CPU: no wait
        if self.scaler_skips_nonfinite and (bad or not math.isfinite(norm)):
            # a non-finite loss makes non-finite gradients: the GradScaler skips this step
            # itself, and it is not counted twice
            return _LEFT_TO_SCALER, ""
        if bad:
            self.nonfinite_loss_at = self.step
            return NONFINITE_LOSS, f"the loss is {bad[0]}"
        if not math.isfinite(norm):
            return NONFINITE_GRADIENT, REASONS[NONFINITE_GRADIENT]
        worst = max(losses, default=None)
        loss_bar = self.spike.passed_by(worst) if self.spike and worst is not None else None
        grad_bar = self.explode.threshold() if self.explode is not None else None
        if loss_bar is not None:
            return LOSS_PAST_BAR, f"the loss {worst:.4g} is past the loss_spike bar {loss_bar:.4g}"
        if grad_bar is not None and norm > grad_bar:
            return GRADIENT_PAST_BAR, (
                f"the gradient norm {norm:.3g} is past the exploding_gradients bar {grad_bar:.3g}"
            )
        return None

    def _step(
        self, opt: torch.optim.Optimizer, index: int, original: Any, args: tuple, kwargs: dict
    ) -> Any:
        closure = kwargs.pop("closure", None)
        if closure is None and args:
            closure, args = args[0], args[1:]
        result = closure() if closure is not None else None  # forward, backward, judge
        code = self._codes.pop(id(opt), None)
        if code is not None:  # decided on the device: the optimizer skips itself
            self.verdicts.hand_to(opt, code)
            try:
                self._apply(opt, index, original, args, kwargs, result)
            finally:
                scalers = self.verdicts.taken_back(opt)
            if self._sent_step != self.step:  # several optimizers: one verdict per step
                self._sent_step = self.step
                self.verdicts.send(self.step, code, scalers)
            return result  # settled when the verdict lands (see ``landed``)
        why = self._verdicts.pop(id(opt), None)
        replayed = None
        if why is not None and self.replay and closure is not None and self.forced is None:
            why, result = self._replay(opt, closure, why, result)
            replayed = "reproduces" if why is not None else None
        if why is not None and self.forced is not None:
            self._skip(self.step, why, "forced")
        elif why is not None:
            self._skip(self.step, why, replayed)
        else:
            self._apply(opt, index, original, args, kwargs, result)
        self.on_settle(self.step)
        return result

    def landed(self, *, wait: bool = False) -> None:
        """Report the device's verdicts that have reached the host: a skip, then the
        step settled."""
        for verdict in self.verdicts.landed(wait=wait):
            if verdict.scaler_skipped:  # the GradScaler's skip (it settles the step)
                self.on_unapplied(verdict.step)
                continue
            if verdict.code:
                if verdict.code == NONFINITE_LOSS:
                    self.nonfinite_loss_at = verdict.step
                self._skip(verdict.step, verdict.why)
            self.on_settle(verdict.step)

    def _replay(
        self, opt: torch.optim.Optimizer, closure: Any, first: str, result: Any
    ) -> tuple[str | None, Any]:
        """Compute the step judged bad (``first``) once more: its closure runs the training
        step, the backward pass and the verdict again, from the same weights (nothing was
        applied) with the same batch. Returns the new verdict and the new result. Every
        rank replays: they agreed on the skip, and the backward pass all-reduces."""
        self._losses.clear()
        self.before_replay()
        self.replaying = True
        try:
            result = closure()
        finally:
            self.replaying = False
        again = self._verdicts.pop(id(opt), None)
        if again is None:
            self.on_transient(self.step, first)
        return again, result

    def _skip(self, step: int, why: str, replayed: str | None = None) -> None:
        if self._skipped_step != step:  # several optimizers: one skip per step
            self._skipped_step = step
            self.on_skip(step, why, replayed)

    def _apply(
        self, opt: Any, index: int, original: Any, args: tuple, kwargs: dict, result: Any
    ) -> None:
        """The optimizer's own step, at the cooled learning rate while the ladder cools
        (and, after a roll back, at most the snapshot's learning rate before the factor)."""
        ladder = self.recoverer.ladder
        scale, ceiling = ladder.lr_scale(self.step), ladder.lr_ceiling(self.step)
        if scale == 1.0 and ceiling is None:
            original(*args, closure=lambda: result, **kwargs)
            return
        caps = ceiling[index] if ceiling is not None and index < len(ceiling) else None
        saved = [group["lr"] for group in opt.param_groups]
        for g, group in enumerate(opt.param_groups):
            lr = group["lr"]
            if caps is not None and g < len(caps):
                lr = lr.clamp(max=caps[g]) if isinstance(lr, torch.Tensor) else min(lr, caps[g])
            group["lr"] = lr * scale
        try:
            original(*args, closure=lambda: result, **kwargs)
        finally:
            for group, lr in zip(opt.param_groups, saved, strict=True):
                group["lr"] = lr


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _agree(verdict: tuple[int, str] | None, device: torch.device) -> tuple[int, str] | None:
    """Every rank's verdict, the worst of them: this rank's own reason when it is the
    one that saw it, else what another rank saw."""
    mine = verdict[0] if verdict is not None else 0
    worst = torch.tensor([max(mine, 0)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    code = int(worst.item())
    if code <= 0 or code == mine:  # a step left to the GradScaler stays so on every rank
        return verdict
    return code, f"on another rank, {REASONS[code]}"


#: What a roll back puts back, for its finding.
_RESTORED = "weights and buffers, optimizer and scheduler state, detectors and sampler"


class LightningRecovery:
    """The ladder in a Lightning run: the gate, the snapshots and the ladder, driven
    from the callback's hooks.

    Args:
        recoverer: The monitor's ladder.
        act: The callback's way of acting on a decision (stop or raise).
    """

    def __init__(self, recoverer: Recoverer, act: Callable[[Decision], None]) -> None:
        self.recoverer = recoverer
        self.act = act
        self.monitor = recoverer.monitor
        self.snapshots = Snapshots(recoverer.ladder.settings)
        self.gate = StepGate(
            recoverer,
            self.monitor.keeper_of("loss"),
            self.monitor.keeper_of("grad_norm"),
            self._skipped,
            self._settled,
            self._unapplied,
            self._transient,
            replay=recoverer.ladder.settings.replay,
            before_replay=self._put_back_buffers,
        )
        self.buffers: StepBuffers | None = None  # the module's, as each step found them
        self.epoch = 0
        self.scaler: Any = None  # the precision plugin's GradScaler (AMP with float16)
        self.batches = StepBatches()
        self._before: SkippedBatch | None = None  # the step's batch, skipped before
        self._elsewhere: frozenset[int] = frozenset()  # see start

    def start(self, trainer: Any, module: torch.nn.Module, *, sharded: bool = False) -> None:
        """Wrap the optimizers and take the first snapshot (before the first step);
        ``sharded``: each rank holds slices of the parameters (see ``StepGate``)."""
        refuse_unrecoverable(trainer.optimizers)
        slices = flat_slices(module)
        # FSDP1's slices another rank counts (a hybrid strategy's other replicas): left
        # out of the gate's norm, which adds up every rank's
        self._elsewhere = frozenset(p for p, held in slices.items() if not held.count)
        root = trainer.strategy.root_device
        self.scaler = scaler_of(trainer)
        unfused = [type(o).__name__ for o in trainer.optimizers if not skips_on_device(o)]
        if unfused and not device.is_host(root):
            warnings.warn(
                f"stethoscope: recover= judges the steps of {', '.join(unfused)} on the host, "
                f"which on {root.type} waits for the device twice a step; create the "
                "optimizer with fused=True (torch.optim.Adam, AdamW or SGD) and a bad step "
                "is skipped on the device, without waiting",
                RuntimeWarning,
                stacklevel=2,
            )
        self.gate.scaler_skips_nonfinite = self.scaler is not None
        self.gate.across_ranks, self.gate.device = sharded, root
        # FSDP1's state_dict gathers each parameter whole: its slices are snapshot in place
        self.snapshots.in_place = bool(slices)
        self.batches.ranks = trainer.world_size
        if trainer.world_size > 1:  # each rank's files of its own, in a directory they share
            self.snapshots.rank = trainer.global_rank
        self.batches.fingerprints = trainer.accumulate_grad_batches == 1
        if self.gate.replay:
            self.gate.replay = self._can_replay(trainer, module)
        self.gate.install(trainer.optimizers)
        self.buffers = StepBuffers(module)
        self.snapshots.take(trainer.global_step, trainer, module, self.monitor)

    def new_step(self, step: int, epoch: int, index: int, batch: Any) -> None:
        """Step ``step`` begins on ``batch``, batch ``index`` of epoch ``epoch``: skipped
        again when it was skipped before and comes back where it was."""
        self.epoch = epoch
        self.batches.begin(step, epoch, index, batch)
        self.buffers.keep()
        before = self.recoverer.skip_again(epoch, index)
        if before is not None and not self.batches.is_printed(before.batch.fingerprint):
            self.recoverer.not_the_same(step, epoch, before)
            before = None
        ahead = self.recoverer.ahead(step) if before is None else None
        forced = ahead or (None if before is None else f"batch {index} of epoch {epoch}")
        self.gate.new_step(step, forced)
        self._before = before

    @property
    def replaying(self) -> bool:
        """Whether the step is being computed again: only the gate watches it."""
        return self.gate.replaying

    def saw_loss(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
        automatic = getattr(module, "automatic_optimization", True)
        scale = getattr(self.scaler, "_scale", None)  # the GradScaler's, a tensor: no wait
        if scale is not None:  # the loss going into backward was multiplied by it
            loss = loss.detach() / scale
        self.gate.saw_loss(loss, trainer.accumulate_grad_batches if automatic else 1)

    def judge(self, optimizer: torch.optim.Optimizer) -> None:
        elsewhere = self._elsewhere
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in elsewhere
        ]
        self.gate.judge(optimizer, grads, pending_scale(self.scaler, optimizer))

    def after_step(self, trainer: Any, module: torch.nn.Module, step: int) -> None:
        """After the optimizer step ``step``: hear of the skips decided on the device,
        end a cool-down, roll back if the ladder owes one, else snapshot when due."""
        self.gate.landed()
        self.snapshots.poll()
        self.recoverer.carried_on(step, self.epoch)
        if self.recoverer.rollback_due is not None:

            def learning_rates() -> list[list[float]]:
                return [[float(g["lr"]) for g in o.param_groups] for o in trainer.optimizers]

            def put_back(state: dict[str, Any]) -> list[list[float]]:
                self.snapshots.put_back(state, trainer, module, self.monitor)
                return learning_rates()

            self.act(
                self.recoverer.roll_back(
                    step, self.epoch, self.snapshots, put_back, _RESTORED, learning_rates
                )
            )
        elif self.recoverer.ladder.snapshot_due(step):
            self.snapshots.take(step, trainer, module, self.monitor)

    def close(self) -> None:
        self.gate.landed(wait=True)  # the last verdicts still on their way
        self.gate.uninstall()
        self.snapshots.close()

    def _skipped(self, step: int, why: str, replayed: str | None) -> None:
        if step == self.gate.step:  # a verdict that lands later finds the next step's
            self._put_back_buffers()
        if replayed == "forced" and self._before is not None:  # skipped before
            self.recoverer.skipped_again(step, self.epoch, self._before)
            return
        if replayed == "forced":  # skipped ahead after a roll back
            self.recoverer.skipped_ahead(step, why, self.batches.name(step))
            return
        batch = self.batches.name(step)
        # a NaN or Inf in the inputs explains a non-finite loss whatever the weights
        bad_data = self.gate.nonfinite_loss_at == step and self.batches.inputs_nonfinite(step)
        if bad_data:
            why = f"{why}; the batch's inputs hold NaN or Inf"
        self.act(self.recoverer.skipped(step, self.epoch, why, batch, replayed, bad_data=bad_data))

    def _put_back_buffers(self) -> None:
        if self.buffers is not None:
            self.buffers.put_back()

    def _transient(self, step: int, why: str) -> None:
        self.recoverer.transient(step, self.epoch, why, self.batches.name(step))

    def _can_replay(self, trainer: Any, module: Any) -> bool:
        """Whether a step can be computed again (its closure holds the whole step): not
        with manual optimization, nor with gradients accumulated over micro-batches."""
        why = None
        if not getattr(module, "automatic_optimization", True):
            why = "with manual optimization, the optimizer's step has no closure to run again"
        elif trainer.accumulate_grad_batches != 1:
            why = (
                f"with accumulate_grad_batches={trainer.accumulate_grad_batches}, the step's "
                "closure holds its last micro-batch only"
            )
        if why is not None:
            warnings.warn(
                f"stethoscope: Recovery(replay=True) cannot replay a step here ({why}); "
                "a step judged bad is skipped without a replay",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        root = trainer.strategy.root_device
        if not device.is_host(root):
            warnings.warn(
                f"stethoscope: Recovery(replay=True) judges every step on the host, which on "
                f"{root.type} waits for the device each step; without replay a fused "
                "optimizer skips on the device without waiting",
                RuntimeWarning,
                stacklevel=3,
            )
        return True

    def _settled(self, step: int) -> None:
        self.act(self.recoverer.settle(step))

    def _unapplied(self, step: int) -> None:
        """The GradScaler skips step ``step`` itself: not the ladder's skip, but the
        errors of its non-finite loss or gradients are not those of an applied step."""
        self.recoverer.ladder.not_applied(step)
        self.act(self.recoverer.settle(step))
