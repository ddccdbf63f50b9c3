"""Where a tensor's memory is, and how its numbers reach the host without waiting.

A CUDA tensor's memory is the device's. The host cannot read it directly (``.numpy()``
raises), and any plain read (``.item()``, ``float()``, ``.tolist()``, ``.cpu()``) waits
for every kernel queued before it: a host sync, the thing stethoscope must never do on
a healthy step. So every number stethoscope takes from the device crosses one way
(:func:`to_host`): a copy into pinned host memory with ``non_blocking=True``, then an
event recorded on the tensor's stream; the host takes the numbers once the event has
completed (:meth:`Crossing.landed`, a query), and waits only where it chooses to
(:meth:`Crossing.wait`: a validation, an epoch end, a roll back).

An :class:`Accelerator` is that way for one kind of device: pinned buffers and events.
:func:`accelerator_for` picks it by the tensor's device (CUDA here; the CPU needs none;
another device gets a plain copy). The CPU tests drive every branch that an accelerator
takes by substituting one that plays host memory as a device's (:func:`substitute`):
the code cannot tell, as it cannot on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "Accelerator",
    "Crossing",
    "Cuda",
    "DeviceEvent",
    "accelerator_for",
    "is_host",
    "substitute",
    "to_host",
    "to_host_into",
]


class DeviceEvent(Protocol):
    """A point on a device's stream (``torch.cuda.Event`` is one)."""

    def query(self) -> bool:
        """Whether the device has passed it (never waits)."""

    def synchronize(self) -> None:
        """Wait until the device has passed it."""

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds on the device from this event to ``end`` (both passed)."""


class Accelerator:
    """One kind of device, as stethoscope uses it: pinned host buffers, and events on
    the device's current stream."""

    def pinned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that the device copies into without the host waiting."""
        raise NotImplementedError

    def mark(self, device: torch.device, *, timing: bool = False) -> DeviceEvent:
        """An event recorded now on ``device``'s current stream (``timing``: one whose
        :meth:`DeviceEvent.elapsed_time` works)."""
        raise NotImplementedError


class Cuda(Accelerator):
    """CUDA: page-locked buffers from torch's caching host allocator, CUDA events."""

    def pinned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=True)

    def mark(self, device: torch.device, *, timing: bool = False) -> DeviceEvent:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(device))
        return event


_CUDA = Cuda()
#: An accelerator that holds the CPU's tensors, for the CPU tests (see :func:`substitute`).
_substitute: Accelerator | None = None


def accelerator_for(device: torch.device) -> Accelerator | None:
    """The accelerator whose memory ``device`` is; None for host memory, and for a
    device stethoscope has no non-blocking way to read (it copies plainly)."""
    if device.type == "cuda":
        return _CUDA
    if device.type == "cpu":
        return _substitute
    return None


def is_host(device: torch.device) -> bool:
    """Whether the host may read a tensor on ``device`` directly, without a sync."""
    return device.type == "cpu" and _substitute is None


@contextlib.contextmanager
def substitute(accelerator: Accelerator) -> Iterator[Accelerator]:
    """Treat the CPU's tensors as ``accelerator``'s memory while the block runs: every
    branch that a GPU takes runs on the CPU (for tests)."""
    global _substitute
    previous, _substitute = _substitute, accelerator
    try:
        yield accelerator
    finally:
        _substitute = previous


@dataclass
class Crossing:
    """Numbers on their way to the host: ``host`` holds them once ``event`` has passed
    (no event: they are there already)."""

    host: torch.Tensor
    event: DeviceEvent | None

    def landed(self) -> bool:
        """Whether the numbers are on the host (a query: never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The numbers, waiting for the device if they have not landed."""
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        self.event = None
        return self.host


def to_host(tensor: torch.Tensor) -> Crossing:
    """Start ``tensor``'s trip to the host; it is never waited for here."""
    tensor = tensor.detach()
    accelerator = accelerator_for(tensor.device)
    if accelerator is None:
        # host memory: nothing to copy; another device: a plain copy (which may wait)
        return Crossing(tensor if tensor.device.type == "cpu" else tensor.cpu(), None)
    host = accelerator.pinned(tensor.shape, tensor.dtype)
    host.copy_(tensor, non_blocking=True)
    return Crossing(host, accelerator.mark(tensor.device))


def to_host_into(
    tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
) -> list[DeviceEvent]:
    """Copy each of ``tensors`` into its host buffer (pinned, of its shape and dtype:
    see :meth:`Accelerator.pinned`), every copy started before any is waited for; the
    events after the copies, one per device (none: the copies are done already)."""
    marks: dict[torch.device, Accelerator] = {}
    for tensor, buffer in zip(tensors, buffers, strict=True):
        accelerator = accelerator_for(tensor.device)
        buffer.copy_(tensor.detach(), non_blocking=accelerator is not None)
        if accelerator is not None:
            marks.setdefault(tensor.device, accelerator)
    return [accelerator.mark(device) for device, accelerator in marks.items()]
