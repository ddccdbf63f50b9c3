"""What a framework adapter hands the monitor for one step: host-side numbers only.

:class:`Observation` is built from the declarations of :mod:`stethoscope.statistics`:
its fields are the core fields, then every statistic's, in their order there. A new
statistic's fields appear here without an edit to this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from stethoscope.statistics import CORE_FIELDS, STATISTICS, Field

__all__ = ["Observation", "computes_in", "global_norm"]


def _fields() -> list[Field]:
    """The core fields, then each statistic's, each field once (``activations`` and
    ``outputs`` share theirs)."""
    out: dict[str, Field] = {f.name: f for f in CORE_FIELDS}
    for statistic in STATISTICS.values():
        for f in statistic.fields:
            known = out.setdefault(f.name, f)
            if known != f:  # a programming error in the registry, caught at import
                raise TypeError(f"field {f.name!r} is declared twice, differently")
    return list(out.values())


def _spec(f: Field) -> tuple[str, str, Any]:
    if f.default is dataclasses.MISSING:
        return (f.name, f.annotation, dataclasses.field())
    # tuples and None are immutable: shared defaults are safe
    return (f.name, f.annotation, dataclasses.field(default=f.default))


def _docstring(fields: list[Field]) -> str:
    lines = [
        "The statistics of one optimizer step, reduced on the device, read once.",
        "",
        "Per-parameter arrays are aligned with ``names``; a statistic's fields keep their",
        "defaults (mostly ``None``) when it was not measured this step.",
        "",
        "Args:",
    ]
    for f in fields:
        lines.append(f"    {f.name}: {f.doc}")
    return "\n".join(lines)


_FIELDS = _fields()
_MARKERS = {name: s.marker for name, s in STATISTICS.items()}
_NAMES = frozenset(f.name for f in _FIELDS)
#: The statistic whose presence each field marks (see ``Statistic.marker``).
_MARKED = {s.marker: name for name, s in STATISTICS.items()}
#: What :meth:`Observation.carried_by` has worked out, by the fields set.
_CARRIED: dict[tuple[str, ...], frozenset[str]] = {}

# The generated base holds the fields; the class below adds its methods and is what
# pickling, ``isinstance`` and type annotations name.
_ObservationFields = dataclasses.make_dataclass(
    "Observation", [_spec(f) for f in _FIELDS], namespace={"__module__": __name__}
)


class Observation(_ObservationFields):  # type: ignore[misc, valid-type]
    __doc__ = _docstring(_FIELDS)

    @classmethod
    def of_loss(
        cls, step: int, epoch: int, rank: int, lr: float | None, loss: float | None
    ) -> Observation:
        """A quiet step's observation, the loss alone: equal to ``Observation(step=step,
        epoch=epoch, rank=rank, lr=lr, loss=loss)``, made with five attribute writes
        instead of the generated ``__init__``'s one per field (every other field reads
        its default, which the dataclass keeps as a class attribute). Quiet steps are
        nearly every step, judged 16 at a time."""
        obs = cls.__new__(cls)
        obs.step, obs.epoch, obs.rank, obs.lr, obs.loss = step, epoch, rank, lr, loss
        return obs

    @classmethod
    def of_event(cls, step: int, epoch: int, rank: int, **fields: Any) -> Observation:
        """An event's observation (a validation's): equal to ``Observation(step=step,
        epoch=epoch, rank=rank, **fields)``, made as :meth:`of_loss` is, with a write for
        each field given. A full-batch run validates on every step."""
        obs = cls.__new__(cls)
        obs.step, obs.epoch, obs.rank = step, epoch, rank
        for name, value in fields.items():
            if name not in _NAMES:
                raise TypeError(f"Observation has no field {name!r}")
            setattr(obs, name, value)
        return obs

    @staticmethod
    def carried_by(fields: Iterable[str]) -> frozenset[str]:
        """The statistics an observation carries where ``fields`` (names of its fields)
        are set and no other is: those whose marker field is among them. (Asked at every
        validation, with a handful of distinct answers: kept.)"""
        key = tuple(fields)
        carried = _CARRIED.get(key)
        if carried is None:
            carried = _CARRIED[key] = frozenset(_MARKED[f] for f in key if f in _MARKED)
        return carried

    def has(self, statistic: str) -> bool:
        """Whether the data of ``statistic`` (a name in ``STATISTICS``) is present."""
        return getattr(self, _MARKERS[statistic]) is not None

    def drop(self, statistics: Iterable[str]) -> None:
        """Forget what ``statistics`` (names in ``STATISTICS``) carry: their fields go
        back to their defaults, as if never measured."""
        for name in statistics:
            for field in STATISTICS[name].fields:
                setattr(self, field.name, field.default)

    def read_ways(self, values: np.ndarray) -> None:
        """The losses of the ways of taking the output that both adapters measure (12
        values, NaN where a way does not apply): with class targets, the cross-entropy
        at them of the output taken as logits, as log-probabilities, as probabilities and
        as a softmax taken as logits again, then the uniform terms of the first, third and
        fourth; with targets of the output's shape, whether it lies within [0, 1] and its
        binary cross-entropy as logits, as probabilities and as a sigmoid taken as logits
        again; then the terms those means are over."""
        if not np.isnan(values[0]):
            self.loss_as_logits, self.loss_as_log_probs, self.loss_as_probs = values[0:3].tolist()
            self.loss_as_softmax, self.uniform_as_logits = values[3:5].tolist()
            self.uniform_as_probs, self.uniform_as_softmax = values[5:7].tolist()
        if not np.isnan(values[7]):
            self.output_in_unit = float(values[7])
            self.bce_as_logits, self.bce_as_probs, self.bce_as_sigmoid = values[8:11].tolist()
        if not np.isnan(values[11]):
            self.loss_terms = float(values[11])

    def drop_update(self) -> None:
        """This step's update was not applied (the recovery ladder or a loss scaler skipped
        it): its update statistics, all zero, say nothing of the layers and would read as
        updates too small to learn, or rounded away. They are dropped before it is
        judged."""
        self.update_norm = self.prev_weight_norm = self.update_lost = None


def computes_in(obs: Observation) -> str | None:
    """``"float16"`` where ``obs`` saw a layer's output in float16 and every watched
    parameter held in float32: the forward pass runs under float16 autocast (written in
    the training step, which no precision setting shows). None: not seen, or not so. Only
    float16 is told: bfloat16 keeps float32's range, and nothing of it underflows."""
    if not obs.act_dtypes or obs.act_kinds is None:
        return None
    layers = [d for d, k in zip(obs.act_dtypes, obs.act_kinds, strict=False) if k == "layer"]
    if "float16" not in layers or not obs.dtypes or set(obs.dtypes) != {"float32"}:
        return None
    return "float16"


def global_norm(norms: np.ndarray) -> float:
    """The L2 norm of all tensors together, from their individual L2 norms."""
    return float(np.sqrt(np.sum(np.square(norms, dtype=np.float64))))
