"""The distributed half of the Lightning adapter: where the ranks of a run meet (the
sampled steps of their shared schedule, each validation, each epoch end), and what each
rank brings there besides its held decisions (its step times, its replicas' checksums).
A single process has none of this."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from stethoscope.callbacks._lightning.rank_reductions import RankTiming, ReplicaChecksums
from stethoscope.distributed import RankMeeting
from stethoscope.engine import Decision, Monitor
from stethoscope.recovery import Recoverer

__all__ = ["LightningRanks"]


class LightningRanks:
    """The ranks of a Lightning run of several processes, as one rank sees them.

    Args:
        trainer: The run's trainer (its strategy's all-gather carries the meetings).
        monitor: This rank's monitor.
        recoverer: The recovery ladder, if any: every rank rolls back alike.
        drain: Judges every reading still on its way (``wait``: for it), so that its
            verdict goes to the meeting too.
        act: The callback's way of acting on a decision.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        monitor: Monitor,
        recoverer: Recoverer | None,
        drain: Callable[[], None],
        act: Callable[[Decision], None],
    ) -> None:
        self.monitor = monitor
        self.meeting = RankMeeting(monitor, _gather(trainer), recoverer=recoverer)
        self.timing = RankTiming()
        self.replicas: ReplicaChecksums | None = None
        self._drain, self._act = drain, act

    def watch_replicas(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, sharded: bool
    ) -> None:
        """How the ranks judge the gradients and weights, and what replica_divergence
        compares (see ``ReplicaChecksums.of``). Under DDP every rank holds the same, rank
        zero judges them, and the replicas' exact checksums are compared. ``sharded``
        (FSDP2's DTensors): every rank measures its shards, the ranks combine them, rank
        zero judges the whole model's, and what several ranks hold alike (HSDP's
        replicas) is compared; likewise FSDP1's slices. Under another strategy, every rank
        judges what it holds."""
        self.replicas = ReplicaChecksums.of(trainer.strategy.model, pl_module)
        rank, world_size = trainer.global_rank, trainer.world_size
        if sharded:
            self.monitor.distribute(rank=rank, world_size=world_size, sharded=True)
            if self.replicas is None:
                self.monitor.cannot_measure(
                    frozenset({"replicas"}),
                    "each rank holds a shard of every parameter: no replica to compare",
                )
            return
        if self.replicas is not None:
            return
        self.monitor.distribute(rank=rank, world_size=world_size, replicated=False)
        if trainer.is_global_zero:
            warnings.warn(
                f"stethoscope: with {type(trainer.strategy).__name__}, whose parameters "
                "are neither DDP's replicas nor shards it can combine (FSDP2's DTensors, "
                "FSDP1's FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD slices, DeepSpeed's ZeRO "
                "partitions), every rank judges the "
                "gradients and weights it holds, and replica_divergence is off",
                RuntimeWarning,
                stacklevel=2,
            )

    def batch_done(self, trainer: pl.Trainer, step: int) -> None:
        """A batch of ``step`` ended: meet if the optimizer stepped on a step the ranks
        meet at (a sampled step of the shared schedule), gathering what the distributed
        detectors compare."""
        if trainer.global_step != step and self.meeting.due(step):
            gathers = self.meeting.gathers(step)
            shared: dict[str, Any] = {}
            for source in (self.timing, self.replicas):
                if source is not None and not source.statistics.isdisjoint(gathers):
                    shared |= source.shared()
            self.meet(trainer, step, shared)
        self.timing.batch_done()

    def validated(self, trainer: pl.Trainer, step: int, val: float | None) -> None:
        """Every rank validated: meet, and judge the validation of all ranks together."""
        shared = {
            "val_loss": (val if val is not None else 0.0, float(val is not None)),
            **self.monitor.pooled_losses(),
        }
        self.meet(trainer, step, shared)

    def epoch_ended(self, trainer: pl.Trainer, step: int) -> None:
        """Every rank ends the epoch: meet until no rank has a finding left to send, so
        that rank zero's summary and sinks hold every rank's findings of the epoch."""
        self.meet(trainer, step)
        while self.meeting.pending:
            self.meet(trainer, step)

    def meet(self, trainer: pl.Trainer, step: int, shared: dict[str, Any] | None = None) -> None:
        """Meet the other ranks (only where every rank does: a step of the shared schedule,
        a validation end, an epoch end), having judged every pending reading: its verdict
        goes too."""
        self._drain()
        self._act(self.meeting.meet(step, trainer.current_epoch, shared))


def _gather(trainer: pl.Trainer) -> Callable[[np.ndarray], np.ndarray]:
    """The meetings' collective on ``trainer``'s strategy."""
    return functools.partial(_all_gather, trainer)


def _all_gather(trainer: pl.Trainer, packet: np.ndarray) -> np.ndarray:
    """The ranks' packets, stacked, through the strategy's all-gather."""
    mine = torch.from_numpy(packet).to(trainer.strategy.root_device)
    everyone = trainer.strategy.all_gather(mine)
    return everyone.cpu().numpy().reshape(trainer.world_size, -1)
