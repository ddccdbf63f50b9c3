"""The host's request, as the train step sees it: which reductions run at this step.

Each reduction runs under a switch (its ``group``). What decides a switch depends on
the regime: in a whole heavy function, the statistics it was traced for (a Python
bool, so no op at all); when eager, the host's own booleans (a tensor predicate would
cost a device sync); otherwise a comparison, in the graph, of the optimizer's step
with the step the host asked to sample and of the host's flags, built once per graph
and shared by the wrappers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.reductions import KerasReduction
from stethoscope.callbacks._keras.regime import Mode, Regime
from stethoscope.callbacks._keras.variables import ProbeVariables

__all__ = ["Switches", "cond"]


def cond(pred: Any, fn: Any) -> None:
    """Run ``fn`` when ``pred`` holds: at once for a Python bool, else in a ``cond``."""
    if isinstance(pred, bool):
        if pred:
            fn()
        return
    ops.cond(pred, fn, lambda: None)


class Switches:
    """Which groups of reductions the step being traced (or run, when eager) computes.

    The host sets :attr:`mode` and :attr:`planned` around each call of a train function,
    and the eager mirrors of its request; the wrappers ask :meth:`want`.

    Args:
        regime: How the train step runs.
        reductions: Every reduction (their groups are the switches, in order).
        variables: The probe's variables (the request: ``sample_at`` and ``flags``).
        optimizer: The model's optimizer (its step count).
    """

    def __init__(
        self,
        *,
        regime: Regime,
        reductions: Iterable[KerasReduction],
        variables: ProbeVariables,
        optimizer: Any,
    ) -> None:
        reductions = tuple(reductions)
        self.regime, self.variables, self.optimizer = regime, variables, optimizer
        #: The switches, in the order of the request's flags.
        self.groups: tuple[str, ...] = tuple(dict.fromkeys(r.group for r in reductions))
        self._flag = {g: i for i, g in enumerate(self.groups)}
        # the statistics whose reductions run under each switch
        self._serving = {
            g: frozenset(s for r in reductions if g in (r.group, *r.requires) for s in r.statistics)
            for g in self.groups
        }
        #: What the function being traced (or run, when eager) carries.
        self.mode = Mode.OFF
        #: In a whole heavy function: the statistics it is traced for.
        self.planned: frozenset[str] = frozenset()
        # host-side mirrors of the request, for eager backends (a Python bool is free)
        self.py_flags = np.zeros(len(self.groups), dtype=bool)
        self.py_sample_at = -1
        self.py_step = 0
        # per thread (a MirroredStrategy traces each replica in its own): the graph, each
        # group's predicate in it, and the combinations of them built so far
        self._wanted: dict[int, tuple] = {}

    @property
    def heavy(self) -> bool:
        return self.mode is Mode.HEAVY

    @property
    def off(self) -> bool:
        """Outside the train function (evaluation, prediction): the wrappers do nothing."""
        return self.mode is Mode.OFF

    def request(self, step: int, groups: frozenset[str]) -> tuple[int, ...]:
        """The flags of a request for ``groups`` at ``step``; mirrored for eager steps."""
        flags = tuple(1 if g in groups else 0 for g in self.groups)
        self.py_sample_at = step
        self.py_flags = np.array(flags, dtype=bool)
        return flags

    def want(self, *groups: str) -> Any:
        """Whether any of ``groups`` is computed at this step: a Python bool in a whole
        heavy function, when eager, or outside the heavy function (``False``); else a bool
        tensor comparing the host's request with the optimizer's step."""
        if self.mode is not Mode.HEAVY:
            return False
        if self.regime.whole:
            return any(self.planned & self._serving[g] for g in groups)
        if self.regime.eager:
            due = self.py_step == self.py_sample_at
            return bool(due and any(self.py_flags[self._flag[g]] for g in groups))
        import tensorflow as tf  # the only graph backend

        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        thread = threading.get_ident()  # each replica compares its own copies
        wanted = self._wanted.get(thread)
        if graph is None or wanted is None or wanted[0] is not graph:
            step = kops.step_index(self.optimizer, self.variables)
            due = ops.equal(step, self.variables["sample_at"])
            on = ops.logical_and(due, ops.greater(self.variables["flags"], 0))
            wanted = self._wanted[thread] = (graph, ops.unstack(on, len(self.groups)), {})
        _, on, combined = wanted
        if groups not in combined:
            pred = on[self._flag[groups[0]]]
            for g in groups[1:]:
                pred = ops.logical_or(pred, on[self._flag[g]])
            combined[groups] = pred
        return combined[groups]

    def of(self, reductions: tuple[KerasReduction, ...]) -> tuple[Any, dict]:
        """Whether any of ``reductions`` runs at this step, and each one's switch."""
        own = {r: self.want(r.group) for r in reductions}
        groups = tuple(dict.fromkeys(g for r in reductions for g in (r.group, *r.requires)))
        return (self.want(*groups) if groups else False), own

    def forget(self) -> None:
        """Forget the predicates built in traced graphs (their functions are dropped)."""
        self._wanted.clear()
