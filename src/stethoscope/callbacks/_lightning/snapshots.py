"""The recovery ladder's snapshots of a Lightning run, taken without waiting for the
device.

A snapshot is the module's weights and buffers, every optimizer's and scheduler's state,
and stethoscope's own. Its tensors are copied into host buffers all at once (on an
accelerator: pinned buffers, ``non_blocking``, one event per device after the last
copy); the host goes on training, and the snapshot is kept once its event has passed,
which :meth:`Snapshots.poll` asks every step (a query, never a wait). The copies are
ordered on the device's stream before every later update, so they hold the state of the
step they were taken at, whenever they land. The host buffers are reused: a set goes
back to the pool when its snapshot is dropped (or written to disk), so a run allocates
pinned memory for ``keep_snapshots + 1`` states at most, once.

A roll back restores copies of a snapshot's tensors, never the tensors themselves: an
optimizer's ``load_state_dict`` keeps the tensors it is given where they are already on
the parameter's device (and a ``step`` count always), and training would then change
the snapshot underneath.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from stethoscope.callbacks._lightning.device import (
    DeviceEvent,
    accelerator_for,
    to_host_into,
)
from stethoscope.callbacks._lightning.shards import DTensor, is_sharded
from stethoscope.recovery import Recovery
from stethoscope.recovery.snapshots import Snapshot, SnapshotStore

__all__ = ["Snapshots"]


class _Tensor:
    """Where a tensor was in a state: its place in the state's list of tensors, and for a
    DTensor, how to make one again of its local shard (see :func:`_hollow`)."""

    __slots__ = ("index", "sharding")

    def __init__(self, index: int, sharding: tuple | None = None) -> None:
        self.index = index
        self.sharding = sharding


def _hollow(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by its place in ``tensors`` (appended there),
    everything else copied. A DTensor (a sharded model's) is taken as this rank's shard
    alone, never gathered: each rank keeps its own."""
    if is_sharded(obj):
        tensors.append(obj.to_local().detach())
        return _Tensor(len(tensors) - 1, (obj.device_mesh, obj.placements, obj.shape, obj.stride()))
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Tensor(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _hollow(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_hollow(v, tensors) for v in obj)
    return copy.deepcopy(obj)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The state ``obj`` was hollowed from (:func:`_hollow`), with ``tensors`` in place."""
    if isinstance(obj, _Tensor):
        if obj.sharding is None:
            return tensors[obj.index]
        mesh, placements, shape, stride = obj.sharding
        return DTensor.from_local(
            tensors[obj.index], mesh, placements, run_check=False, shape=shape, stride=stride
        )
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _signature(tensors: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _buffer_for(tensor: torch.Tensor) -> torch.Tensor:
    """A host buffer for ``tensor``: pinned when an accelerator holds it."""
    accelerator = accelerator_for(tensor.device)
    if accelerator is None:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    return accelerator.pinned(tensor.shape, tensor.dtype)


@dataclass
class _InFlight:
    """A snapshot whose copies have started, not yet known to have landed."""

    step: int
    hollow: dict[str, Any]
    buffers: list[torch.Tensor]
    events: list[DeviceEvent]
    began: float


class Snapshots(SnapshotStore):
    """The last healthy states of the run: the module's weights and buffers, every
    optimizer's and scheduler's state, and stethoscope's own (detectors and sampler).

    Args:
        settings: How many to keep, and where (memory or disk).
    """

    def __init__(self, settings: Recovery) -> None:
        super().__init__(
            settings,
            save=torch.save,
            load=lambda path: torch.load(path, weights_only=False),
            suffix=".pt",
        )
        #: Whether the module's state is its parameters and buffers as this rank holds
        #: them, copied back in place (FSDP1's slices: its ``state_dict`` would gather
        #: every parameter whole on every rank), rather than its ``state_dict``.
        self.in_place = False
        self._flying: _InFlight | None = None
        self._pool: list[list[torch.Tensor]] = []  # buffer sets no snapshot holds
        self._buffers: dict[int, list[torch.Tensor]] = {}  # id(snapshot) -> its buffers

    def take(self, step: int, trainer: Any, module: torch.nn.Module, monitor: Any) -> None:
        """Start copying the state after ``step`` to the host; it is kept once the copies
        have landed (:meth:`poll`)."""
        self.poll()
        if self._flying is not None:
            # one still on its way (the first, of the start, and one after step 0): this one
            # replaces it, in its buffers, its copies ordered after the older ones
            self._pool.append(self._flying.buffers)
            self._flying = None
        began = time.perf_counter()
        tensors: list[torch.Tensor] = []
        state = {
            "module": _held_here(module) if self.in_place else module.state_dict(),
            "in_place": self.in_place,
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        }
        hollow = _hollow(state, tensors)
        hollow["monitor"] = copy.deepcopy(monitor.state_dict())
        buffers = self._buffers_like(tensors)
        events = to_host_into(tensors, buffers)
        self._flying = _InFlight(step, hollow, buffers, events, began)
        self.poll()

    @property
    def on_its_way(self) -> bool:
        """Whether a snapshot has been started and not yet kept."""
        return self._flying is not None

    def poll(self) -> None:
        """Keep the snapshot on its way if its copies have landed (never waits)."""
        if self._flying is not None and all(e.query() for e in self._flying.events):
            self._land(wait=False)

    def newest(self) -> tuple[Snapshot, dict[str, Any]] | None:
        """The newest snapshot and its state, waiting for one still on its way."""
        self._land(wait=True)
        return super().newest()

    def discard_newest(self) -> None:
        self._land(wait=True)
        super().discard_newest()

    def close(self) -> None:
        self._flying = None
        super().close()
        self._pool.clear()
        self._buffers.clear()

    @staticmethod
    def put_back(
        state: dict[str, Any], trainer: Any, module: torch.nn.Module, monitor: Any
    ) -> None:
        """Restore a snapshot's ``state`` (copies of its tensors: the snapshot stays as it
        was, for another roll back)."""
        if state.get("in_place"):
            _copy_into(module, state["module"])
        else:
            module.load_state_dict(state["module"])  # copies into the parameters
        for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(_copied(saved))
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(copy.deepcopy(saved))
        monitor.load_state_dict(state["monitor"])

    def _released(self, snapshot: Snapshot) -> None:
        """A kept snapshot is dropped: its buffers go back to the pool."""
        buffers = self._buffers.pop(id(snapshot), None)
        if buffers is not None:
            self._pool.append(buffers)

    def _land(self, *, wait: bool) -> None:
        flying, self._flying = self._flying, None
        if flying is None:
            return
        if wait:
            for event in flying.events:
                if not event.query():
                    event.synchronize()
        state = _fill(flying.hollow, flying.buffers)
        nbytes = sum(b.numel() * b.element_size() for b in flying.buffers)
        snap = self.keep(flying.step, state, nbytes, flying.began)
        if snap.state is None:  # written to disk: the buffers are free again
            self._pool.append(flying.buffers)
        else:
            self._buffers[id(snap)] = flying.buffers

    def _buffers_like(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host buffers for ``tensors``: a set from the pool when one fits."""
        wanted = _signature(tensors)
        for i, buffers in enumerate(self._pool):
            if _signature(buffers) == wanted:
                return self._pool.pop(i)
        self._pool.clear()  # of another shape (a state before the optimizer had any): freed
        return [_buffer_for(t) for t in tensors]


def _held_here(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers as this rank holds them (a slice, under
    FSDP1), by name: no collective, no copy (a snapshot copies them)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _copy_into(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put ``saved`` (see :func:`_held_here`) back into ``module``'s own tensors, in place:
    FSDP1's parameter slices are views of its flat parameter, which this writes."""
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            tensor.copy_(saved[name])


def _copied(obj: Any) -> Any:
    """``obj`` with every tensor cloned."""
    tensors: list[torch.Tensor] = []
    hollow = _hollow(obj, tensors)
    return _fill(hollow, [t.clone() for t in tensors])
