"""What a statistic's declaration says: when it is measured, how ranks and replicas
combine it, and the observation fields it fills (see :mod:`stethoscope.statistics`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["ARRAY", "AcrossRanks", "AcrossReplicas", "Cadence", "Field", "Statistic"]

#: The annotation of a per-parameter (or per-layer) array field.
ARRAY = "np.ndarray | None"


class Cadence(str, Enum):
    """When a statistic is measured."""

    #: On every step (the cheap sentinel: the loss).
    STEP = "step"
    #: On the steps the sampler selects for a detector that needs it.
    SAMPLED = "sampled"
    #: With an event (a validation), never planned per step.
    EVENT = "event"
    #: Gathered from every rank where the ranks of a distributed run meet; a single
    #: process never has it.
    MEETING = "meeting"


class AcrossRanks(str, Enum):
    """How the ranks of a distributed run combine a statistic."""

    #: Each rank measures and judges its own (its batch, its loss).
    OWN = "own"
    #: The same on every rank of a data-parallel run (DDP all-reduces the gradients
    #: before the optimizer step, so every replica holds the global gradient and takes
    #: the same step): rank zero judges it for everyone, the other ranks skip it.
    REPLICATED = "replicated"
    #: Pooled over every rank's batches (each field travels as a sum and a count), so
    #: every rank judges the same global value.
    POOLED = "pooled"
    #: Every rank's value side by side, for the detectors that compare ranks.
    GATHERED = "gathered"


class AcrossReplicas(str, Enum):
    """How the replicas of one process (Keras' ``MirroredStrategy``) combine a statistic,
    each replica having measured its own shard of the batch."""

    #: The replicas' shares add up (Keras divides each replica's loss by their number).
    SUM = "sum"
    #: Measured on what every replica holds alike (the all-reduced gradients, the
    #: mirrored weights): any replica's copy.
    SAME = "same"
    #: Pooled over the replicas' samples: a mean weighted by the samples behind each.
    POOLED = "pooled"
    #: Counts (a histogram): summed.
    COUNTS = "counts"
    #: Not measured by replicas (an event, or a fact of distributed processes).
    NONE = "none"


@dataclass(frozen=True)
class Field:
    """One field of :class:`~stethoscope.Observation`.

    Args:
        name: The attribute name.
        annotation: Its type, as written in an annotation.
        doc: One or two sentences for the observation's docstring.
        default: Its value when the statistic was not measured; ``None`` marks a field
            whose presence says the statistic was measured (see ``Observation.has``);
            ``dataclasses.MISSING``: a required argument.
        dtype: The element type a distributed run sends it as (``"int64"`` for values
            compared bit for bit, never rounded as floats).
    """

    name: str
    annotation: str
    doc: str
    default: Any = None
    dtype: str = "float64"


@dataclass(frozen=True)
class Statistic:
    """The declaration of one statistic (see the module docstring).

    Args:
        name: The stable name detectors ask for in ``needs`` and ``wants``.
        doc: What it measures, in one sentence.
        fields: The observation fields it fills. The first whose default is ``None``
            is present exactly when the statistic was measured.
        cadence: When it is measured.
        across_ranks: How the ranks of a distributed run combine it.
        across_replicas: How the replicas of one process combine it.
        requires: Statistics measured whenever it is (what its fields mean only beside).
    """

    name: str
    doc: str
    fields: tuple[Field, ...]
    cadence: Cadence = Cadence.SAMPLED
    across_ranks: AcrossRanks = AcrossRanks.OWN
    across_replicas: AcrossReplicas = AcrossReplicas.SAME
    requires: frozenset[str] = frozenset()

    @property
    def marker(self) -> str:
        """The field that is present exactly when the statistic was measured."""
        return next(f.name for f in self.fields if f.default is None)
