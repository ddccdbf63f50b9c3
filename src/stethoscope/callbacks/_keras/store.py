"""Where the reductions of a traced train step go, and what one trace of it carries from
wrapper to wrapper.

:class:`StepStore` is the reductions' ``Store``: a direct heavy step (one step per
execution, TensorFlow, one replica) hands its reductions back with its logs as the
step's own tensors (no write and no read of a variable); anything else, and whatever a
control-flow body computes (a tensor made there cannot leave it), goes into the probe's
variables. :class:`StepTrace` is the record of one trace, one per thread: a
``MirroredStrategy`` traces each replica's step in a thread of its own, interleaved with
the others' at its collectives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.reductions import ForwardRows, Layout
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.switches import Switches
from stethoscope.callbacks._keras.variables import ProbeVariables

__all__ = ["StepStore", "StepTrace"]

#: A direct heavy step's forward row that a control-flow body wrote to the probe's
#: variable (a tensor made there cannot leave it): read back after the loop.
_IN_VARIABLE = object()


@dataclass
class StepTrace:
    """What one trace of the train step carries from wrapper to wrapper."""

    loss: Any = None  # the step's loss, from compute_loss to apply
    squares: dict[int, Any] = field(default_factory=dict)  # direct ring: by position
    stored: dict[str, Any] = field(default_factory=dict)  # a direct heavy step's slots
    rows: dict[int, Any] = field(default_factory=dict)  # ... and its forward rows
    written: set[str] = field(default_factory=set)  # slots a control-flow body wrote
    due: tuple | None = None  # (switches, forced), from apply to the all-reduce
    verdict: Any = None  # recover=: the step's verdict, from apply to the logs
    outer: Any = None  # the graph of the train step being traced
    grads: dict[int, Any] = field(default_factory=dict)  # what the gradient hook measured
    carried: Any = None  # the loss scale the gradients carry, from apply to the ring
    scale: Any = None  # a LossScaleOptimizer's ScaleStep, from apply to the update hook
    lr: Any = None  # a heavy step's learning rate, read before its update, to the logs
    slot: Any = None  # the step's slot in the loss ring variable, taken at its start


class StepStore:
    """The reductions' store for one model's train step, and its traces' records.

    Args:
        optimizer: The model's optimizer (its iteration count is the step's index).
        regime: How the train step runs.
        layout: What the probe watches.
        variables: The probe's variables.
        switches: Which reductions the step computes.
        forward: The forward rows' reduction, and ``layers``, the leaf layers it reads.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        regime: Regime,
        layout: Layout,
        variables: ProbeVariables,
        switches: Switches,
        forward: ForwardRows,
        layers: int,
    ) -> None:
        self.optimizer, self.regime, self.layout = optimizer, regime, layout
        self.variables, self.switches = variables, switches
        self.forward, self.layers = forward, layers
        self._traces: dict[int, StepTrace] = {}

    def trace(self) -> StepTrace:
        """The record of the trace being built in this thread."""
        thread = threading.get_ident()
        trace = self._traces.get(thread)
        if trace is None:
            trace = self._traces[thread] = StepTrace()
        return trace

    def forget(self) -> None:
        """Forget what the traces carried."""
        self._traces.clear()

    def step_index(self) -> Any:
        """The index of the step being taken (see ``ops.step_index``)."""
        return kops.step_index(self.optimizer, self.variables)

    # -- the Store protocol -----------------------------------------------------------------
    def variable(self, name: str) -> Any:
        return self.variables[name]

    def put(self, name: str, value: Any) -> None:
        """Record a reduction: a direct heavy step hands it back with its logs (no write and
        no read of a variable: two ops fewer); else it goes into its variable."""
        if self.regime.direct and self.switches.heavy:
            trace = self.trace()
            if not self._nested(trace):
                trace.stored[name] = value
                return
            trace.written.add(name)
        self.variables[name].assign(value)

    def gradients(self) -> dict[int, Any]:
        return self.trace().grads

    def loss_scale(self) -> Any:
        return self.trace().scale

    def put_row(self, name: str, row: int, value: Any) -> None:
        if self.regime.direct:
            trace = self.trace()
            if not self._nested(trace):  # handed back with the logs (see put)
                trace.rows[row] = value
                return
            trace.rows[row] = _IN_VARIABLE  # read back after the loop (see handed_back)
        kops.put(self.variables[name], row, value)

    def _nested(self, trace: StepTrace) -> bool:
        """Whether the op being built sits in a control-flow body (a recurrent cell's while
        loop, a cond) rather than in the train step's own graph: a tensor made there cannot
        leave it, so it goes through its variable, read back after the loop."""
        return trace.outer is not None and kops.graph() is not trace.outer

    # -- the logs ---------------------------------------------------------------------------
    def handed_back(self, trace: StepTrace) -> dict[str, Any]:
        """The heavy step's measurements for its logs: a direct step's own tensors, else
        the variables, read after its writes; with the step count and learning rate."""
        if self.regime.direct:
            out, rows, written = trace.stored, trace.rows, trace.written
            trace.stored, trace.rows, trace.written = {}, {}, set()
            # what a control-flow body (a recurrent cell's loop) wrote to variables instead
            for name in written:
                out[name] = kops.value(self.variables[name])
            if "sampled_at" not in out:  # a step that planned no reduction storing it
                out["sampled_at"] = self.step_index() - 1
            if self.layers and (rows or self.switches.planned & self.forward.statistics):
                table = self.variables["forward_rows"]
                out["forward_rows"] = _forward_rows(rows, table, self.layers)
        else:
            out = {
                name: ops.convert_to_tensor(self.variables[name])
                for name, slot in self.variables.slots.items()
                if slot.returned
            }
        out["iterations"] = self.step_index()  # the steps taken, skipped ones included
        if trace.lr is not None:  # else the optimizer does not expose one number: the host asks
            out["learning_rate"], trace.lr = trace.lr, None
        return out


def _forward_rows(rows: dict[int, Any], variable: Any, count: int) -> Any:
    """A direct heavy step's forward rows, one per watched layer: those it made (``rows``,
    by row), those a control-flow body wrote to ``variable`` instead (marked
    ``_IN_VARIABLE``), and NaN for a layer the step did not call, or whose row no planned
    probe reads."""
    nan = ops.convert_to_tensor(np.full(kops.ROW, np.nan, dtype=np.float32))
    in_variable = any(r is _IN_VARIABLE for r in rows.values())
    table = kops.value(variable) if in_variable else None
    return ops.stack(
        [table[i] if rows.get(i) is _IN_VARIABLE else rows.get(i, nan) for i in range(count)]
    )
