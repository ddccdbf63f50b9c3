"""The loss of a train step of the user's own that never calls ``compute_loss``: the one
its logs hand ``fit``.

A ``train_step`` of one's own (keras.io's VAE, its "customizing fit" guides, on either
backend) computes its loss itself and returns it in its logs, the dict ``fit`` prints:

- as the step's own tensor, ``{"loss": loss, ...}``;
- as a ``keras.metrics.Mean`` tracker's result, ``{"loss": tracker.result()}`` or
  ``{m.name: m.result() for m in self.metrics}`` after ``tracker.update_state(loss)``:
  the running mean of the epoch, which is not the step's loss; the step's is what the
  tracker took in this step. The tracker need not be named ``loss`` (the VAE's is
  ``total_loss``): the result under the key ``loss`` tells which one it is;
- or under no ``loss`` key at all, with a ``Mean`` named ``loss`` updated in the step.

:class:`OwnLoss` wraps ``update_state`` of each ``Mean`` the model tracks (what it took
in this step, read off its ``total`` and ``count``) and ``result`` of each of its metrics
(which tensor it returned), and after the step reads the logs. A metric that is not a
``Mean`` under ``loss`` (a ``Sum``: a running value with no share per step) gives no
loss, said with the reason.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import keras
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.patches import Patches
from stethoscope.callbacks._keras.switches import Switches

__all__ = ["OwnLoss"]


@dataclass
class _Step:
    """What one step's metrics did, from its start to its logs (one per thread: a
    ``MirroredStrategy`` traces each replica's step in a thread of its own)."""

    outer: Any = None  # the graph of the train step being traced (None: eager)
    results: list[tuple[Any, Any]] = field(default_factory=list)  # (tensor, metric)
    # by metric: what its total and its count gained, one pair per update_state
    shares: dict[int, list[tuple[Any, Any]]] = field(default_factory=dict)
    updated: list[Any] = field(default_factory=list)  # in the order first updated
    nested: set[int] = field(default_factory=set)  # updated in a control-flow body
    computed: bool = False  # the step called compute_loss


class OwnLoss:
    """Finds the loss a train step of the user's own returns in its logs.

    Args:
        model: A compiled Keras model.
        switches: The probe's switches: nothing is recorded outside the train function.
        strategy: The model's mirrored strategy, or None: the loss found is divided by
            the replicas in sync, as Keras' ``compute_loss`` scales it, so that the
            replicas' shares sum to the loss ``fit`` logs.
    """

    def __init__(self, model: Any, *, switches: Switches, strategy: Any = None) -> None:
        self.model, self.switches, self.strategy = model, switches, strategy
        #: Why the last step that returned logs gave no loss ("": it gave one).
        self.why_not = ""
        self._steps: dict[int, _Step] = {}

    def install(self, patches: Patches) -> None:
        """Wrap ``update_state`` and ``result`` of every ``Mean`` the model tracks, and
        ``result`` of its other metrics (to tell a running value under ``loss``)."""
        seen: set[int] = set()
        for metric in _metrics(self.model):
            if id(metric) in seen:
                continue
            seen.add(id(metric))
            if isinstance(metric, keras.metrics.Mean):
                patches.put(metric, "update_state", self._update_state(metric))
            patches.put(metric, "result", self._result(metric))

    def begin(self) -> None:
        """A train step starts (is traced, or runs eagerly): forget the last one's."""
        self._steps[threading.get_ident()] = _Step(outer=kops.graph())

    def computed(self) -> None:
        """The step being taken called ``compute_loss``: its loss is that one."""
        step = self._recording()
        if step is not None:
            step.computed = True

    def _end(self) -> _Step:
        """The step ends: its record, taken off."""
        return self._steps.pop(threading.get_ident(), None) or _Step()

    def of(self, logs: Any) -> Any | None:
        """The loss of the step that returned ``logs``: a float32 scalar tensor, cut from
        the tape, or None: it called ``compute_loss``, or (then :attr:`why_not` says why)
        its logs hold none."""
        step = self._end()
        if step.computed:
            return None
        value = self._find(logs, step)
        if value is None:
            return None
        self.why_not = ""
        value = ops.cast(ops.stop_gradient(ops.convert_to_tensor(value)), "float32")
        if not kops.scalar(value):
            value = ops.mean(value)
        if self.strategy is not None:
            value = value / float(self.strategy.num_replicas_in_sync)
        return value

    def _find(self, logs: Any, step: _Step) -> Any | None:
        if not isinstance(logs, Mapping):
            self.why_not = "its train step returned no dict of logs"
            return None
        if "loss" not in logs:
            tracker = next((m for m in step.updated if m.name == "loss"), None)
            if tracker is None:
                self.why_not = (
                    "its train step returned no 'loss' in its logs and updated no Mean "
                    "metric named 'loss'"
                )
                return None
            return self._share(tracker, step)
        value = logs["loss"]
        metric = next((m for t, m in step.results if t is value), None)
        if metric is None:  # the step's own tensor (or a number)
            if isinstance(value, (float, int)) or hasattr(value, "dtype"):
                return value
            self.why_not = f"the 'loss' in its logs is not a number ({type(value).__name__})"
            return None
        if not isinstance(metric, keras.metrics.Mean):
            self.why_not = (
                f"the 'loss' in its logs is the result of the metric {metric.name!r} "
                f"({type(metric).__name__}), a value over the epoch with no share per step; "
                "track the loss with a keras.metrics.Mean"
            )
            return None
        return self._share(metric, step)

    def _share(self, metric: Any, step: _Step) -> Any | None:
        """What ``metric`` took in this step: its total's share over its count's."""
        if id(metric) in step.nested:
            self.why_not = (
                f"the Mean metric {metric.name!r} under 'loss' was updated inside a "
                "control-flow body (a cond or a loop), where its step's value cannot be read"
            )
            return None
        shares = step.shares.get(id(metric))
        if not shares:
            self.why_not = (
                f"the Mean metric {metric.name!r} under 'loss' was not updated in the step"
            )
            return None
        if len(shares) == 1:
            total, count = shares[0]
        else:
            total = ops.sum(ops.stack([t for t, _ in shares]))
            count = ops.sum(ops.stack([c for _, c in shares]))
        return ops.divide_no_nan(total, count)

    # -- the wrappers ----------------------------------------------------------------------
    def _recording(self) -> _Step | None:
        """The record of the step being taken, or None outside a train step."""
        if self.switches.off:
            return None
        return self._steps.get(threading.get_ident())

    def _update_state(self, metric: Any) -> Any:
        original = metric.update_state

        @functools.wraps(original)
        def update_state(*args: Any, **kwargs: Any) -> Any:
            step = self._recording()
            if step is None or step.computed:  # compute_loss gave the step's loss
                return original(*args, **kwargs)
            if step.outer is not None and kops.graph() is not step.outer:
                step.nested.add(id(metric))  # a tensor made here cannot leave the body
                return original(*args, **kwargs)
            if all(m is not metric for m in step.updated):
                step.updated.append(metric)
            # What its total and its count gained in the call, read off its variables
            # rather than taken from the values it was handed: a second reader of the
            # user's loss tensor keeps TensorFlow from folding the sums that make it into
            # the tracker's (one that rounds otherwise), and the metric logged would drift
            # from the unwatched fit's by an ulp. The gain of a float32 total is the
            # value rounded to its total's precision (exact while the total is 0).
            total, count = _read(metric.total), _read(metric.count)
            out = original(*args, **kwargs)
            step.shares.setdefault(id(metric), []).append(
                (
                    ops.cast(_read(metric.total) - total, "float32"),
                    ops.cast(_read(metric.count) - count, "float32"),
                )
            )
            return out

        return update_state

    def _result(self, metric: Any) -> Any:
        original = metric.result

        @functools.wraps(original)
        def result(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            step = self._recording()
            if step is not None:
                step.results.append((out, metric))
            return out

        return result


def _read(v: Any) -> Any:
    """The value of variable ``v`` now, kept when it is written later (on torch, the
    variable's own tensor is updated in place)."""
    value = kops.value(v)
    return ops.copy(value) if keras.backend.backend() == "torch" else value


def _metrics(model: Any) -> list[Any]:
    """The metrics the model tracks (its ``metrics``, which a subclass may override)."""
    try:
        metrics = list(model.metrics)
    except Exception:  # a metrics property of the user's own that fails before fit
        return []
    return [m for m in metrics if isinstance(m, keras.metrics.Metric)]
