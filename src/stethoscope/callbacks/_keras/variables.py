"""The Keras probe's variables: where the train step leaves what the host reads.

The variables belong to the probe, never to the model (``model.save()`` holds nothing
of stethoscope). Under ``tf.distribute.MirroredStrategy`` they are per-replica
(``on_read``): every replica writes its own copy, with no collective on any step, and
the host combines the copies as each :class:`Slot` declares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from stethoscope.statistics import AcrossReplicas

__all__ = ["BY_REPLICAS", "COMBINE", "ProbeVariables", "Slot"]


@dataclass(frozen=True)
class Slot:
    """One variable of the probe.

    Args:
        name: Its name (``stethoscope_<name>`` in Keras).
        shape: Its shape.
        init: Its initial value (a number, or an array of that shape).
        dtype: Its dtype.
        combine: How the host combines the replicas' copies: a name in :data:`COMBINE`;
            ``None``: as its statistic's ``across_replicas`` declares (see
            :data:`BY_REPLICAS`).
        returned: Whether a heavy step hands it back with its logs (a small vector the
            host then reads with no op of its own).
    """

    name: str
    shape: tuple[int, ...]
    init: Any
    dtype: str = "float32"
    combine: str | None = None
    returned: bool = True


class ProbeVariables:
    """The probe's variables, made from their slots, and the host's reads and writes.

    Args:
        slots: The variables to make.
        strategy: The model's ``MirroredStrategy`` (variables made per replica), or None.
        also_read: Variables of the model the host reads too (the optimizer's iteration
            count), through the same fast reads.
    """

    def __init__(self, slots: Iterable[Slot], *, strategy: Any, also_read: Iterable[Any]) -> None:
        self.slots = {s.name: s for s in slots}
        where: dict[str, str] = {}
        if strategy is not None:  # each replica writes its own copy, in the graph
            where = {"synchronization": "on_read", "aggregation": "none"}
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self._vars = {
                s.name: keras.Variable(
                    np.full(s.shape, s.init, dtype=s.dtype),
                    trainable=False,
                    # read as stored, also inside a layer's call under a mixed-precision policy
                    autocast=False,
                    name=f"stethoscope_{s.name}",
                    **where,
                )
                for s in self.slots.values()
            }
        own = [*self._vars.values(), *also_read]
        self._handles = _fast_handles(own if strategy is None else [])
        # under a strategy: every replica's copy of each variable, read with the bare ops
        self._parts = _replica_handles(own if strategy is not None else [])
        self._returned: dict[str, Any] = {}  # what the last heavy execution handed back

    def __getitem__(self, name: str) -> Any:
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        return name in self._vars

    def __iter__(self):
        return iter(self._vars.items())

    def hand_back(self, returned: dict[str, Any]) -> None:
        """What a heavy step returned with its logs, by slot name (read instead of the
        variables until the next execution)."""
        self._returned = returned

    def read(self, name: str, replica: int | None = None) -> np.ndarray:
        """Slot ``name``'s value on the host: what the last heavy step handed back, else
        TensorFlow's bare read op where it applies (a fraction of ``keras.ops``' cost; it
        runs once per step). Under a strategy: every replica's copy, combined as the slot
        declares, or the copy of ``replica`` alone."""
        returned = self._returned.get(name)
        if returned is not None and replica is None:
            return np.asarray(returned)
        return self.read_variable(self._vars[name], replica, self.slots[name].combine or "first")

    def read_variable(self, var: Any, replica: int | None = None, combine: str = "first") -> Any:
        """Any variable's value on the host, through the fastest read it has."""
        handle = self._handles.get(id(var))
        if handle is None:
            if id(var) in self._parts:
                parts = self.copies(var)
                if replica is not None:
                    return parts[replica]
                return COMBINE[combine](self, parts)
            return np.asarray(keras.ops.convert_to_numpy(var))
        import tensorflow as tf

        return tf.raw_ops.ReadVariableOp(resource=handle[0], dtype=handle[1]).numpy()

    def write(self, name: str, value: np.ndarray) -> None:
        """Assign from the host (the bare op on TensorFlow, as :meth:`read`); under a
        strategy, into every replica's copy."""
        self._returned.pop(name, None)
        var = self._vars[name]
        handle = self._handles.get(id(var))
        if handle is None:
            parts = self._parts.get(id(var))
            if parts is None:
                var.assign(value)
                return
            import tensorflow as tf

            for resource, _, np_dtype in parts:
                tf.raw_ops.AssignVariableOp(resource=resource, value=value.astype(np_dtype))
            return
        import tensorflow as tf

        tf.raw_ops.AssignVariableOp(resource=handle[0], value=value.astype(handle[2]))

    def copies(self, var_or_name: Any) -> list[np.ndarray]:
        """Each replica's copy of a variable, in replica order (one copy without a strategy)."""
        var = self._vars[var_or_name] if isinstance(var_or_name, str) else var_or_name
        parts = self._parts.get(id(var))
        if parts is None:
            return [self.read_variable(var)]
        import tensorflow as tf

        return [tf.raw_ops.ReadVariableOp(resource=h, dtype=d).numpy() for h, d, _ in parts]

    def bad_replica(self) -> int:
        """The replica that recorded the earliest non-finite step still held (0 if none)."""
        seen = [(int(at), r) for r, at in enumerate(self.copies("bad_at")) if at >= 0]
        return min(seen)[1] if seen else 0


def _first(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    return parts[0]


def _sum(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    return np.sum(parts, axis=0, dtype=parts[0].dtype)


def _earliest(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    seen = [int(p) for p in parts if p >= 0]
    return np.int64(min(seen) if seen else -1)


def _bad_replica(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    return parts[vs.bad_replica()]


def _features_samples(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    return np.array([parts[0][0], sum(int(p[1]) for p in parts)], dtype=np.int64)


def _sample_mean(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    w = np.array([float(p[1]) for p in vs.copies("input_shape")])
    if w.sum() <= 0:
        return parts[0]
    return (np.tensordot(w, np.stack(parts), axes=1) / w.sum()).astype(parts[0].dtype)


def _histogram(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    out = np.sum(parts, axis=0, dtype=parts[0].dtype)
    out[-1] = min(p[-1] for p in parts)  # the validity flag: of every replica
    return out


def _forward_rows(vs: ProbeVariables, parts: list[np.ndarray]) -> np.ndarray:
    """Saturated fraction: weighted mean; rms: root of the weighted mean square; max: max;
    finite: all; elements: sum (the weights)."""
    rows = np.stack(parts)  # replicas, layers, columns
    w = rows[..., 4]
    total = w.sum(axis=0)
    out = np.empty_like(parts[0])
    out[:, 0] = (w * rows[..., 0]).sum(axis=0) / total
    out[:, 1] = np.sqrt((w * rows[..., 1] ** 2).sum(axis=0) / total)
    out[:, 2] = rows[..., 2].max(axis=0)
    out[:, 3] = rows[..., 3].min(axis=0)
    out[:, 4] = total
    return out


#: The combination of a slot whose statistic declares how its replicas combine, when the
#: slot names none: what the replicas hold alike is any one's copy, shares add up, counts
#: are a histogram. A pooled statistic's slots name theirs: how to pool depends on what
#: they hold (a mean, a shape, a row of moments).
BY_REPLICAS: dict[AcrossReplicas, str] = {
    AcrossReplicas.SAME: "first",
    AcrossReplicas.SUM: "sum",
    AcrossReplicas.COUNTS: "histogram",
}

#: How the replicas' copies of a slot combine, by name: ``first`` (what every replica
#: holds alike: measured on the all-reduced gradients and the mirrored weights, or written
#: by the host), ``sum`` (shares that add up), ``earliest`` (a step index: the earliest
#: set one), ``bad_replica`` (the copy of the replica that saw the earliest non-finite
#: step), ``features_samples`` (features, then samples summed), ``sample_mean`` (a mean
#: weighted by each replica's samples), ``histogram`` (counts summed, the validity flag
#: of every replica), ``forward`` (forward rows pooled over the replicas' elements).
COMBINE = {
    "first": _first,
    "sum": _sum,
    "earliest": _earliest,
    "bad_replica": _bad_replica,
    "features_samples": _features_samples,
    "sample_mean": _sample_mean,
    "histogram": _histogram,
    "forward": _forward_rows,
}


def _fast_handles(variables: list) -> dict[int, tuple]:
    if keras.backend.backend() != "tensorflow":
        return {}
    handles: dict[int, tuple] = {}
    for v in variables:
        try:
            tv = v.value
            handles[id(v)] = (tv.handle, tv.dtype, tv.dtype.as_numpy_dtype)
        except (AttributeError, ValueError, RuntimeError):  # e.g. a distributed variable
            continue
    return handles


def _replica_handles(variables: list) -> dict[int, list[tuple]]:
    """Per variable, the bare handle of each replica's copy (a distributed variable's
    components are plain resource variables)."""
    handles: dict[int, list[tuple]] = {}
    for v in variables:
        copies = getattr(v.value, "values", None)
        if copies is None:
            continue
        handles[id(v)] = [(c.handle, c.dtype, c.dtype.as_numpy_dtype) for c in copies]
    return handles
