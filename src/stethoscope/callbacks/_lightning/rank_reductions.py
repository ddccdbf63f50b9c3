"""What this rank hands a meeting of the ranks (``shared``) instead of a per-step
reading: an exact checksum of what the replicas hold alike, and how long it spent alone
per batch. The meeting gathers them from every rank (:mod:`stethoscope.distributed`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stethoscope.callbacks._lightning.parameters import checksums
from stethoscope.callbacks._lightning.shards import (
    flat_replicas,
    replicated,
    summed_over_groups,
    unwrapped_name,
    whole_checksums,
)
from stethoscope.callbacks._lightning.zero import zero_stage

__all__ = ["RankTiming", "ReplicaChecksums"]


class ReplicaChecksums:
    """An exact checksum of every tensor the ranks hold alike, for the meeting to compare
    across ranks: under DDP, every replica's parameters (and the buffers DDP does not
    re-broadcast); with sharded parameters, those placed ``Replicate`` along some mesh
    dimension (HSDP's replicas), each summed over its shards first."""

    statistics = frozenset({"replicas"})

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        buffers: int,
        *,
        sharded: bool = False,
        groups: Sequence[Any] | None = None,
        grads: bool = False,
    ) -> None:
        self.tensors = [t for _, t in named]
        #: Whether each rank holds every parameter's whole gradient, as DDP's all-reduce
        #: leaves it: then the gradients the step used are compared too.
        self.grads = grads
        self.names = tuple(n for n, _ in named)
        self.buffer = np.array([False] * (len(named) - buffers) + [True] * buffers)
        self.sharded = sharded
        self.groups = groups  # FSDP1's hybrid strategies: each tensor's shard group

    @classmethod
    def of(cls, model: Any, module: torch.nn.Module) -> ReplicaChecksums | None:
        """What ``module``'s replicas compare under ``model`` (the strategy's wrapped model):
        under DDP, every parameter, and the buffers DDP does not overwrite from rank zero at
        each forward pass; with DTensor parameters, those held alike by several ranks.
        Under DeepSpeed's ZeRO below stage 3, every parameter: each rank holds it whole.
        Under FSDP1's hybrid strategies, every parameter, each rank's slices summed over
        its replica first. None where the ranks hold nothing alike to compare (FSDP2
        sharding every parameter, FSDP1's FULL_SHARD, ZeRO stage 3)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            buffers = [] if model.broadcast_buffers else list(module.named_buffers())
            return cls(list(module.named_parameters()) + buffers, len(buffers), grads=True)
        if zero_stage(model) in (0, 1, 2):  # the updated slices are gathered to every rank
            return cls(list(module.named_parameters()), 0)
        hybrid = flat_replicas(model)  # FSDP1's replicas, each sharded over a group
        if hybrid:
            held = [(unwrapped_name(n), p) for n, p in module.named_parameters() if id(p) in hybrid]
            return cls(held, 0, groups=[hybrid[id(p)] for _, p in held])
        alike = [(n, p) for n, p in module.named_parameters() if replicated(p)]
        return cls(alike, 0, sharded=True) if alike else None

    def shared(self) -> dict[str, Any]:
        if self.sharded:
            sums = whole_checksums(self.tensors, checksums([t.to_local() for t in self.tensors]))
        elif self.groups is not None:
            sums = summed_over_groups(self.groups, checksums(self.tensors))
        else:
            sums = checksums(self.tensors)
        shared = {
            "replica_sums": sums.cpu().numpy(),
            "replica_names": self.names,
            "replica_buffer": self.buffer,
        }
        if self.grads:  # after the step: the gradients it used, until the next zero_grad
            params = self.tensors[: len(self.tensors) - int(self.buffer.sum())]
            grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in params]
            sums = checksums(grads)
            shared["replica_grad_sums"] = sums.cpu().numpy()
        return shared


class RankTiming:
    """Under DDP: how long this rank spent alone per batch (data loading and the forward
    pass, which no collective waits in) since the ranks last compared."""

    statistics = frozenset({"ranks"})

    def __init__(self) -> None:
        self.mark: float | None = None  # when this rank last finished a batch
        self.busy, self.batches = 0.0, 0

    def batch_done(self) -> None:
        self.mark = time.perf_counter()

    def before_backward(self) -> None:
        if self.mark is not None:
            self.busy += time.perf_counter() - self.mark
            self.batches += 1

    def pause(self) -> None:
        """The next batch comes after an epoch start or a validation: not timed."""
        self.mark = None

    def shared(self) -> dict[str, Any]:
        busy = self.busy / self.batches if self.batches else math.nan
        self.busy, self.batches = 0.0, 0
        return {"rank_busy": busy}
