"""A GPU played on the CPU, for tests of the branches an accelerator takes.

:class:`SimulatedAccelerator` is substituted for the CPU's memory (see
``stethoscope.callbacks._lightning.device.substitute``), so stethoscope treats every CPU
tensor as a device's: its numbers reach the host only through pinned buffers and events,
as on CUDA. What a GPU would make of the code is then checked:

- the device runs behind the host: an event passes ``lag`` steps after it was recorded
  (:class:`SimulatedSteps` moves the device on at each batch start), and a wait before
  then is counted (:attr:`SimulatedAccelerator.waits`);
- device memory cannot be read directly: ``.numpy()`` on a tensor that is not one of
  the pinned buffers raises, from stethoscope's code, as it does on CUDA;
- every other direct read by stethoscope's code (``.item()``, ``.tolist()``, ``float()``,
  ``int()``, ``bool()``, ``.cpu()``, ``.to("cpu")``: a copy to the host is written with
  the string), every tensor it builds from host data on the device
  (``torch.tensor(..., device=...)``, or ``.to(device)`` of a tensor made by
  ``torch.from_numpy``, which is pageable host memory, not a pinned buffer) and every
  element it sets to a Python number (``t[0] = 1``, a copy from the host on CUDA) is a
  host sync on a GPU: it is counted
  (:attr:`SimulatedAccelerator.syncs`), with where the fit was and the line of
  stethoscope's that made it;
- the device keeps its own clock: each step takes the milliseconds the test says
  (:class:`SimulatedSteps`' ``device_ms``), which events' ``elapsed_time`` report.

A read is stethoscope's when the first frame above torch's own is in stethoscope's
package: a user's ``.item()`` inside the training step that stethoscope's gate runs is
the user's, and one inside the optimizer's or the GradScaler's step (which the gate
calls) is theirs.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

import stethoscope
from stethoscope.callbacks._lightning import device

_OURS = os.path.dirname(stethoscope.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
#: torch's code that steps the user's optimizer, which stethoscope's gate calls.
_STEPPERS = (_TORCH + "optim" + os.sep, _TORCH + "amp" + os.sep)
#: The reads of a tensor's numbers that wait for the device (``to`` too, to the CPU).
_READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__")


@dataclass(frozen=True)
class Sync:
    """A host sync stethoscope would make on a GPU: what, where in the fit, which line."""

    kind: str
    phase: str
    step: int
    site: str


class SimulatedEvent:
    def __init__(self, accelerator: SimulatedAccelerator, timing: bool) -> None:
        self.accelerator = accelerator
        self.at = accelerator.now
        self.ms = accelerator.device_ms
        self.timing = timing
        self.forced = False

    def query(self) -> bool:
        return self.forced or self.accelerator.now - self.at >= self.accelerator.lag

    def synchronize(self) -> None:
        if not self.query():
            waited = self.accelerator.sync("wait", 1)
            if waited is not None:
                self.accelerator.waits.append(waited)
            self.forced = True

    def elapsed_time(self, end: SimulatedEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")  # what CUDA says
        return end.ms - self.ms


class SimulatedAccelerator(device.Accelerator):
    """Host memory played as a GPU's (a context manager: substituted while it is open).

    Args:
        lag: Steps an event takes to pass.
    """

    def __init__(self, *, lag: int = 1) -> None:
        self.lag = lag
        self.now = 0  # the device's progress, in steps
        self.device_ms = 0.0  # its clock
        self.phase, self.step = "setup", -1
        self.syncs: list[Sync] = []
        self.waits: list[Sync] = []
        self.events = 0
        self._hosts: dict[int, weakref.ref] = {}  # id -> the pinned buffer (ids are reused)
        self._pageable: dict[int, weakref.ref] = {}  # id -> a tensor torch.from_numpy made
        self._saved: dict[str, Any] = {}
        self._substituted: Any = None

    # -- the accelerator ------------------------------------------------------------------
    def pinned(self, shape, dtype) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=dtype)
        self._hosts[id(buffer)] = weakref.ref(buffer)
        return buffer

    def mark(self, where: torch.device, *, timing: bool = False) -> SimulatedEvent:
        self.events += 1
        return SimulatedEvent(self, timing)

    def advance(self, ms: float = 0.0) -> None:
        """The device finishes a step of ``ms`` milliseconds."""
        self.now += 1
        self.device_ms += ms

    # -- what stethoscope's code reads --------------------------------------------------
    def train_syncs(self) -> list[Sync]:
        """The syncs and waits made during training steps."""
        return [s for s in self.syncs + self.waits if s.phase == "train"]

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a pinned buffer: host memory."""
        for t in (tensor, tensor._base):
            held = self._hosts.get(id(t)) if t is not None else None
            if held is not None and held() is t:
                return True
        return False

    def is_pageable(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory that is not pinned (made from a NumPy array)."""
        held = self._pageable.get(id(tensor))
        return held is not None and held() is tensor

    def sync(self, kind: str, depth: int) -> Sync | None:
        """A read of ``kind`` by the code ``depth`` frames above the caller: the sync it
        would be on a GPU, if that code is stethoscope's."""
        frame = sys._getframe(depth + 1)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == _HERE
        ):
            if frame.f_code.co_filename.startswith(_STEPPERS):
                return None  # an optimizer's or a GradScaler's own, in the step it was asked
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(_OURS):
            return None
        site = f"{frame.f_code.co_filename[len(_OURS) :]}:{frame.f_lineno}"
        return Sync(kind, self.phase, self.step, site)

    def _count(self, kind: str) -> None:
        found = self.sync(kind, 2)
        if found is not None:
            self.syncs.append(found)

    def __enter__(self) -> SimulatedAccelerator:
        self._substituted = device.substitute(self)
        self._substituted.__enter__()
        sim = self
        tensor = torch.Tensor

        def reader(name: str) -> Callable:
            original = getattr(torch._C.TensorBase, name)

            def read(t, *args, **kwargs):
                if not sim.is_host(t):
                    if name == "numpy" and sim.sync("numpy", 1) is not None:
                        raise TypeError(
                            "can't convert simulated device tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first."
                        )
                    sim._count(name)
                return original(t, *args, **kwargs)

            return read

        def to(t, *args, **kwargs):
            # a copy to the host names it "cpu"; ``.to(other.device)`` is the device's own
            # (played by the CPU here too), never a trip to the host
            named = [a for a in (*args, kwargs.get("device")) if isinstance(a, str)]
            if "cpu" in named and not sim.is_host(t):
                sim._count("to")

            # a copy to the device from pageable host memory waits, as a pinned one does not
            if sim.is_pageable(t) and any(
                isinstance(a, (torch.device, torch.Tensor)) for a in (*args, kwargs.get("device"))
            ):
                sim._count("to device")
            return torch._C.TensorBase.to(t, *args, **kwargs)

        def build(*args, **kwargs):
            if kwargs.get("device") is not None:
                sim._count("tensor")
            return self._saved["tensor"](*args, **kwargs)

        def from_numpy(array):
            made = self._saved["from_numpy"](array)
            sim._pageable[id(made)] = weakref.ref(made)
            return made

        def setitem(t, index, value):
            if isinstance(value, (bool, int, float)) and not sim.is_host(t):
                sim._count("setitem")
            return torch._C.TensorBase.__setitem__(t, index, value)

        for name in _READS:
            setattr(tensor, name, reader(name))
        tensor.to = to
        tensor.__setitem__ = setitem
        self._saved["tensor"], self._saved["from_numpy"] = torch.tensor, torch.from_numpy
        torch.tensor, torch.from_numpy = build, from_numpy
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in (*_READS, "to", "__setitem__"):
            delattr(torch.Tensor, name)  # torch's own, on its base class, again
        torch.tensor, torch.from_numpy = self._saved["tensor"], self._saved["from_numpy"]
        self._substituted.__exit__(*exc)


class SimulatedSteps(L.Callback):
    """Moves the simulated device on by a step at each batch start (the first callback of
    the list: before stethoscope's), and tells it where the fit is.

    Args:
        accelerator: The simulated device.
        device_ms: ``step -> milliseconds`` the device spends on a step (default 1).
    """

    def __init__(
        self, accelerator: SimulatedAccelerator, device_ms: Callable[[int], float] | None = None
    ) -> None:
        self.accelerator = accelerator
        self.device_ms = device_ms or (lambda step: 1.0)
        self._last: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sim = self.accelerator
        if self._last is not None:
            sim.advance(self.device_ms(self._last))
        self._last = trainer.global_step
        sim.phase, sim.step = "train", trainer.global_step

    def on_validation_start(self, trainer, pl_module) -> None:
        self.accelerator.phase = "validation"
        self._last = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.accelerator.phase = "epoch_end"
        self._last = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.accelerator.phase = "end"
