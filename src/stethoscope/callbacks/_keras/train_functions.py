"""The train functions a probe had Keras trace, and which of them serves an execution.

Each is a trace of the whole train step: about a second on a small LSTM, seconds on a
large model. So they are kept for the probe's life (a later ``fit`` of the same model
reuses them), and a sampled step runs one traced for more statistics than it plans
rather than have a new one traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TrainFunctions"]

#: The key of the function every step the sampler skips runs.
LIGHT = "light"
#: The key of the one heavy function where a request picks the statistics in ``cond``\\ s.
HEAVY = "heavy"


class TrainFunctions:
    """The traced train functions, by what they carry: ``"light"``, ``"heavy"``, or the
    statistics a whole heavy function (one step per execution, no ``cond``) measures.

    Args:
        make: A new train function of the model, traced on its first call.
    """

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._by_key: dict[Any, Any] = {}

    def ensure(self, *keys: str) -> None:
        """Make the functions of ``keys`` now, where they are not made yet."""
        for key in keys:
            self.get(key)

    def get(self, key: Any) -> Any:
        """The function of ``key``, made on the first ask."""
        fn = self._by_key.get(key)
        if fn is None:
            fn = self._by_key[key] = self._make()
        return fn

    def made(self) -> list[Any]:
        """The keys of the functions made so far."""
        return list(self._by_key)

    def key(self, *, heavy: bool, whole: bool, planned: frozenset[str]) -> Any:
        """The key of the function that serves an execution: the light one where nothing
        is sampled, the heavy one with ``cond``\\ s where the step is not whole, else
        :meth:`whole_key`."""
        if not heavy:
            return LIGHT
        return self.whole_key(planned) if whole else HEAVY

    def whole_key(self, planned: frozenset[str]) -> frozenset[str]:
        """The statistics of the whole heavy function that serves ``planned``: the
        smallest traced one that measures them all, else a new one, for them and every
        statistic traced before.

        A trace per set of statistics a run plans (the calibration's, then fewer, then the
        inputs' alone...) was seconds a run. A superset costs only its extra reductions, on
        the sampled steps alone, which the overhead budget governs; a new trace covers all
        before it, so a run traces as many as the statistics it adds, one where its first
        plan holds them all."""
        traced = [k for k in self._by_key if isinstance(k, frozenset)]
        covering = [k for k in traced if planned <= k]
        if covering:
            return min(covering, key=len)
        return planned.union(*traced)
