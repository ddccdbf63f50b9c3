"""The loss scaler of a float16 run: the scale a step's gradients still carry when the
callback measures them, and the steps the scaler skipped (the ``loss_scale`` statistic).

Under ``precision="16-mixed"`` Lightning's precision plugin unscales the gradients
(``GradScaler.unscale_``) before ``on_before_optimizer_step``, except for an optimizer
that unscales inside its own step (a fused ``Adam``, ``AdamW`` or ``SGD``: Lightning
leaves it to the optimizer, which the GradScaler hands its scale). Its gradients then
reach the hook multiplied by the scale (2**16 at first), and every gradient statistic
measured there must divide it out.

DeepSpeed's fp16 (``DeepSpeedStrategy``, ``precision="16-mixed"``) scales the loss with a
loss scaler of its own and unscales the gradients inside its step: they too reach the
hook multiplied by its scale. Its engine skips a step whose gradients overflowed and
counts it, on the host.

A GradScaler's skips are counted on the device, with one comparison of two one-element
tensors per step (never read there), since a skip is known only at the step it happens;
DeepSpeed's are read from its engine's counters, host numbers. Both are read with a
sampled step's other numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stethoscope.advice import DEEPSPEED_SCALER
from stethoscope.callbacks._lightning.measures import StepMeasures
from stethoscope.callbacks._lightning.reduction import Reduction
from stethoscope.callbacks._lightning.zero import is_deepspeed_optimizer, zero_stage
from stethoscope.observation import Observation

__all__ = [
    "EngineScaleSkips",
    "LossScale",
    "ScaleSkips",
    "loss_scaler_name",
    "pending_scale",
    "scale_skips",
    "scaler_of",
]


def scaler_of(trainer: Any) -> Any:
    """The GradScaler of ``trainer``'s precision plugin (16-mixed), or None."""
    return getattr(trainer.strategy.precision_plugin, "scaler", None)


def pending_scale(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scale ``optimizer``'s gradients carry at ``on_before_optimizer_step``, a 1-element
    tensor (a GradScaler's, on the device: reading it would wait; DeepSpeed's, on the
    host), or None when they carry none."""
    if is_deepspeed_optimizer(optimizer):
        return _deepspeed_scale(optimizer)
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    return getattr(scaler, "_scale", None)  # the GradScaler's own tensor: no copy


def _deepspeed_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale of DeepSpeed's optimizer, a number its loss scaler keeps on the host
    (``loss_scale``), as a 0-dimensional host tensor: dividing a device tensor by it
    copies nothing to the device. None at 1 (bf16 and float32 keep a static 1)."""
    scale = getattr(optimizer, "loss_scale", None)
    if not isinstance(scale, (int, float)) or scale == 1:
        return None
    return torch.tensor(float(scale))


def _dynamic_deepspeed_scaler(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of DeepSpeed's with a dynamic loss scaler (fp16 with
    ``loss_scale=0``, Lightning's default): one that skips the steps that overflow. Its
    ZeRO optimizers keep the scaler as ``loss_scaler``, its fp16 optimizer below ZeRO
    the setting as ``loss_scale_config``."""
    if not is_deepspeed_optimizer(optimizer):
        return False
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None:
        return bool(getattr(scaler, "dynamic", False))
    config = getattr(optimizer, "loss_scale_config", None)
    return bool(getattr(config, "dynamic_loss_scale", False))


def loss_scaler_name(trainer: Any) -> str | None:
    """The loss scaler that skips ``trainer``'s steps whose gradients overflow, in the
    user's words, or None when none does."""
    if scaler_of(trainer) is not None:
        return "GradScaler"
    if any(_dynamic_deepspeed_scaler(o) for o in trainer.optimizers):
        return DEEPSPEED_SCALER
    return None


class ScaleSkips:
    """The steps a GradScaler skipped, counted on the device.

    A GradScaler lowers its scale exactly when it skips a step (an Inf or NaN in the
    scaled gradients) and raises it only after many clean ones: a step whose scale fell
    was skipped. After each step the scale is compared with the last step's, on the
    device, and the count is read with a sampled step's other numbers.

    Args:
        scaler: The precision plugin's GradScaler.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._last: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._now: torch.Tensor | None = None  # whether the last step was skipped
        self.steps = 0  # steps counted since the last measurement

    @classmethod
    def of(cls, scaler: Any) -> ScaleSkips | None:
        """The counter for ``scaler`` (None: no GradScaler, or one that is not enabled)."""
        if scaler is None or not getattr(scaler, "_enabled", True):
            return None
        return cls(scaler)

    def step_done(self, first: bool) -> None:
        """A step has ended (``first``: the run's first step, whose scale started at the
        scaler's initial one)."""
        scale = getattr(self.scaler, "_scale", None)
        if scale is None:  # the scaler makes its scale at the first backward pass
            return
        self.steps += 1
        if self._last is None:
            self._skipped = torch.zeros((), dtype=torch.float32, device=scale.device)
            self._now = torch.zeros((), dtype=torch.bool, device=scale.device)
            if not first:  # a resumed run: this step's scale is the first known
                self._last = scale.detach().clone()
                return
            self._last = torch.full_like(scale, float(self.scaler._init_scale))
        torch.lt(scale.reshape(()), self._last.reshape(()), out=self._now)
        self._skipped += self._now
        self._last.copy_(scale)

    def measure(self, measures: StepMeasures) -> None:
        """Hand ``measures`` the scale, the steps skipped and the steps counted since the
        last measurement, and start counting again."""
        if self._last is None:
            return
        last = self._last.float().reshape(())
        measures.add("loss_scale", torch.stack([last, self._skipped, self._now.float()]))
        measures.note("loss_scale", self.steps)
        self._skipped.zero_()  # after the stack's copy, in the device's order
        self.steps = 0


class EngineScaleSkips:
    """The steps DeepSpeed's fp16 loss scaler skipped, read from its engine.

    The engine counts its applied steps (``global_steps``) and those it skipped for an
    overflow (``skipped_steps``), and its optimizer keeps the scale (``loss_scale``):
    host numbers, which DeepSpeed updates in its step (reading its overflow flag off the
    device itself). A measurement takes the counters' differences since the last one, so
    a step inside an accumulation window, which the engine does not apply, counts for
    nothing; each step's end notes whether its count of skips rose.

    Args:
        engine: The DeepSpeed engine (the strategy's wrapped model).
        optimizer: Its optimizer, one of DeepSpeed's with a dynamic loss scaler.
    """

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.engine, self.optimizer = engine, optimizer
        self._steps, self._skipped = self._counters()  # at the last measurement
        self._seen = self._skipped  # the engine's skips when the last step ended
        self._now = False  # whether the engine skipped the last step

    @classmethod
    def of(cls, trainer: Any) -> EngineScaleSkips | None:
        """The counter of ``trainer``'s DeepSpeed engine (None: no DeepSpeed, or no
        dynamic loss scaler)."""
        engine = trainer.strategy.model
        dynamic = [o for o in trainer.optimizers if _dynamic_deepspeed_scaler(o)]
        if zero_stage(engine) is None or not dynamic:
            return None
        return cls(engine, dynamic[0])

    def _counters(self) -> tuple[int, int]:
        return int(self.engine.global_steps), int(self.engine.skipped_steps)

    def step_done(self, first: bool) -> None:
        """A step has ended: whether the engine skipped it (its count of skips rose)."""
        skipped = int(self.engine.skipped_steps)
        self._now, self._seen = skipped > self._seen, skipped

    def measure(self, measures: StepMeasures) -> None:
        """Hand ``measures`` the scale, the steps skipped, whether the last one was, and
        the steps applied or skipped since the last measurement (host numbers: no
        tensor)."""
        steps, skipped = self._counters()
        if steps == self._steps:  # no step of the engine's since the last measurement
            return
        scale = float(self.optimizer.loss_scale)
        counted = (scale, skipped - self._skipped, self._now, steps - self._steps)
        measures.note("loss_scale", counted)
        self._steps, self._skipped = steps, skipped


class LossScale(Reduction):
    """The ``loss_scale`` statistic: the loss scaler's scale after the step, and the steps
    it skipped since it was last measured.

    The callback measures it with every step's update under a loss scaler: the update of
    a step the scaler skipped is all zeros, which says nothing of the layers (and would
    read as updates too small to learn), so its update statistics are dropped."""

    statistics = frozenset({"loss_scale"})
    name = "loss_scale"

    def __init__(self, skips: ScaleSkips | EngineScaleSkips | None) -> None:
        self.skips = skips

    def at_end(self, measures: StepMeasures) -> None:
        if self.skips is not None:
            self.skips.measure(measures)

    def decode(self, obs: Observation, values: np.ndarray, contexts: tuple[Any, ...]) -> None:
        counted = contexts[-1]
        if isinstance(counted, tuple):  # DeepSpeed's: read on the host
            scale, skipped, now, steps = counted
        else:  # a GradScaler's: the steps on the host, the rest from the device
            scale, skipped, now, steps = float(values[0]), int(values[1]), values[2], counted
        obs.loss_scale, obs.scale_skipped, obs.scale_steps = float(scale), int(skipped), int(steps)
        if now:  # the scaler skipped this very step: its update was not applied
            obs.drop_update()


def scale_skips(trainer: Any) -> ScaleSkips | EngineScaleSkips | None:
    """The counter of the steps ``trainer``'s loss scaler skips (None: no loss scaler)."""
    return ScaleSkips.of(scaler_of(trainer)) or EngineScaleSkips.of(trainer)
