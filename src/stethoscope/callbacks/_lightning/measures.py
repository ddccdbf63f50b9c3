"""One training step's measurements, kept on the device until they are read in one go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stethoscope.callbacks._lightning.shards import COMBINES, ShardCombiner
from stethoscope.statistics import EVERY_STEP

__all__ = ["Reading", "StepMeasures"]


@dataclass(frozen=True)
class Reading:
    """What a step's measures hand the host reader: where its numbers go, and the numbers.

    Args:
        step: The optimizer step measured.
        epoch: Its epoch.
        lr: The learning rate its update was taken at (the first parameter group's), if
            known.
        params: The watched parameters the per-parameter statistics describe, in order.
        layout: ``(statistic, elements, contexts)`` for each statistic measured, in the
            order of the tensor: ``contexts`` holds what decoding needs, one per part.
        values: Every statistic's numbers, flattened into one float32 tensor.
    """

    step: int
    epoch: int
    lr: float | None
    params: tuple[int, ...]
    layout: tuple[tuple[str, int, tuple[Any, ...]], ...]
    values: torch.Tensor


@dataclass
class StepMeasures:
    """What the hooks of one optimizer step measured, by statistic, still on the device.

    The hooks fill it (see :mod:`stethoscope.callbacks._lightning.reductions`); at each
    batch end the callback takes what was measured since the last take as one
    :class:`Reading`, which crosses to the host in one transfer.

    Args:
        step: The optimizer step (``trainer.global_step`` when it began).
        epoch: Its epoch.
        plan: The statistics the monitor asked for.
    """

    step: int
    epoch: int
    plan: frozenset[str]
    #: The learning rate the step's update is taken at (see ``TakenRate``: read when the
    #: step begins, and again just before the update where that hook runs; None:
    #: unknown, or a tensor, which is not read).
    lr: float | None = None
    #: The watched parameters an optimizer stepped this step (with a gradient), in the
    #: order the per-parameter statistics were measured.
    params: list[int] = field(default_factory=list)
    #: The optimizers that reached their step in this step (a closure optimizer reaches
    #: it at its first closure call), in order: each is measured there once.
    optimizers: list[Any] = field(default_factory=list)
    #: What those of them that stepped no parameter with a gradient hold instead, in a
    #: few words each (see ``ParameterProbe.idle_held``).
    idle: list[str] = field(default_factory=list)
    #: Samples behind this step's gradients: every micro-batch, every rank (0: unknown).
    samples: int = 0
    #: Snapshots of the parameters ``snapped`` before the update (the ``updates`` probe).
    snapshots: list[torch.Tensor] = field(default_factory=list)
    snapped: list[int] = field(default_factory=list)
    #: Whether forward hooks are attached for this step.
    forward: bool = False
    #: Whether the step's first backward pass has begun (see ``Reduction.before_backward``).
    backward: bool = False
    #: The loss scale the gradients being measured still carry (see ``loss_scale``), or
    #: None; set per optimizer before its gradients are measured.
    grad_scale: torch.Tensor | None = None
    #: Under sharded parameters: combines what each rank measured of its own shards
    #: (None: every rank holds whole parameters, nothing is combined).
    combiner: ShardCombiner | None = None
    _parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _contexts: dict[str, list[Any]] = field(default_factory=dict)
    _combines: dict[str, list[str | None]] = field(default_factory=dict)

    @property
    def sampled(self) -> bool:
        """Whether the plan asks for more than the every-step statistics (the loss)."""
        return not self.plan <= EVERY_STEP

    @property
    def pending(self) -> bool:
        """Whether anything measured waits to be read (or forward hooks to be collected)."""
        return bool(self._parts) or self.forward

    def add(
        self,
        statistic: str,
        tensor: torch.Tensor,
        context: Any = None,
        *,
        combine: str | None = None,
    ) -> None:
        """Keep ``tensor`` (flattened, float32) as a part of ``statistic``'s reading, with
        what its decoding needs to know.

        Args:
            combine: Under sharded parameters, how the ranks combine it, one of
                :data:`~stethoscope.callbacks._lightning.shards.COMBINES` (None: this
                rank's own, as the loss is).
        """
        if combine is not None and combine not in COMBINES:
            raise ValueError(f"combine={combine!r} must be one of {COMBINES} or None")
        self._parts.setdefault(statistic, []).append(tensor.reshape(-1).float())
        self._contexts.setdefault(statistic, []).append(context)
        self._combines.setdefault(statistic, []).append(combine)

    def note(self, statistic: str, context: Any) -> None:
        """Keep a fact seen on the host (no tensor) as a part of ``statistic``'s reading:
        its decoding finds it among the contexts."""
        self._parts.setdefault(statistic, [])
        self._contexts.setdefault(statistic, []).append(context)
        self._combines.setdefault(statistic, [])

    def take(self) -> Reading | None:
        """What was measured since the last take, as one reading (None: nothing)."""
        if not self._parts:
            return None
        layout = []
        tensors: list[torch.Tensor] = []
        kinds: list[str | None] = []
        for name, parts in self._parts.items():
            tensors.extend(parts)
            kinds.extend(self._combines[name])
            n = sum(t.numel() for t in parts)
            layout.append((name, n, tuple(self._contexts[name])))
        self._parts, self._contexts, self._combines = {}, {}, {}
        if self.combiner is not None and any(kinds):
            tensors = self.combiner.combine(tensors, kinds)
        if not tensors:  # facts seen on the host alone
            tensors = [torch.zeros(0)]
        values = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        return Reading(self.step, self.epoch, self.lr, tuple(self.params), tuple(layout), values)
