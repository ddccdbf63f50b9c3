"""The distributed half of the Keras adapter: the workers of a run under
``tf.distribute.MultiWorkerMirroredStrategy``, as one worker sees them.

Each worker is a process with a callback of its own, so each is a rank of the run (its
place in the cluster: the chief first, then the workers in order), as a Lightning rank
is under DDP, and the ranks meet where those do (see :mod:`stethoscope.distributed`):
on the sampled steps of their shared schedule, every 16 steps at the least, at each
validation and at each epoch end. A meeting is one all-gather that the strategy's own
collectives carry, entered from the host between two train steps, where every worker
is (``on_train_batch_begin`` and ``on_epoch_end`` run on the main thread of every
worker, in the same order). A single worker has none of this.

With ``recover=``, the workers skip the same steps (their verdicts are agreed inside the
train step), and a roll back that one worker's detectors ask for is agreed at the next
meeting, where every worker pays it (as Lightning's ranks do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from stethoscope.distributed import RankMeeting
from stethoscope.engine import Decision, Monitor

if TYPE_CHECKING:
    from stethoscope.callbacks._keras.recovery import KerasRecovery

__all__ = ["KerasWorkers", "place_in_cluster"]

#: The statistic a meeting gathers that a Keras step cannot measure, and why.
_UNMEASURABLE = (
    frozenset({"ranks"}),
    "Keras runs a worker's own work and the gradient all-reduce in one call of the train "
    "function, with no hook between them to time",
)


def place_in_cluster(strategy: Any) -> tuple[int, int]:
    """This worker's rank and the number of workers under ``strategy`` (a single worker:
    ``(0, 1)``). The chief, if the cluster names one, is rank 0 and the workers follow
    in their order: the order of the strategy's replicas (its ``id_in_cluster``)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    chiefs, workers = len(spec.get("chief", ())), len(spec.get("worker", ()))
    if chiefs + workers <= 1:
        return 0, 1
    task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    return (task_id if task_type == "chief" else chiefs + task_id), chiefs + workers


class KerasWorkers:
    """The workers of a Keras run under ``MultiWorkerMirroredStrategy``: this worker's
    place, where it meets the others, and what it brings there.

    Every worker judges its own loss and data; rank zero alone judges the gradients and
    weights, which the strategy's all-reduce makes the same on every worker, and writes
    to the sinks (``Monitor.distribute``). A decision (stop, raise, sample faster) waits
    for the next meeting, where every worker takes it on the same step.

    Args:
        strategy: The model's strategy.
        model: The model (its weights are checksummed for ``replica_divergence``).
        monitor: This worker's monitor; told its place here.
        act: The callback's way of acting on a decision.
        recovery: With ``recover=``, the ladder of this worker's fit: a roll back any
            worker asks for is agreed at a meeting, and paid there on every worker.
    """

    def __init__(
        self,
        strategy: Any,
        model: Any,
        monitor: Monitor,
        act: Callable[[Decision], None],
        recovery: KerasRecovery | None = None,
    ) -> None:
        rank, world_size = place_in_cluster(strategy)
        monitor.distribute(rank=rank, world_size=world_size)
        # a worker holds one replica per local device: each sends this worker's packet
        self._local = len(strategy.extended.worker_devices)
        self._gather = _gather_function(strategy)
        self._checksums = _checksum_function(model.trainable_variables)
        self._names = tuple(v.path for v in model.trainable_variables)
        recoverer = recovery.recoverer if recovery is not None else None
        self.meeting = RankMeeting(monitor, self.gather, recoverer=recoverer)
        self.monitor, self._act, self._recovery = monitor, act, recovery
        monitor.cannot_measure(*_UNMEASURABLE)

    @classmethod
    def join(
        cls,
        strategy: Any,
        model: Any,
        monitor: Monitor,
        act: Callable[[Decision], None],
        recovery: KerasRecovery | None = None,
    ) -> KerasWorkers | None:
        """The workers of ``strategy`` when it spans several, else None (a monitor that
        took part in such a run before is told it is a single process now)."""
        if strategy is None or place_in_cluster(strategy)[1] == 1:
            if monitor.world_size != 1:
                monitor.distribute(rank=0, world_size=1)
            return None
        return cls(strategy, model, monitor, act, recovery)

    def executed(self, first: int, last: int, epoch: int) -> None:
        """The steps ``first`` to ``last`` of an execution were judged: meet if the ranks
        meet at one of them (at the last such step: one meeting per execution), with the
        weights' checksums where ``replica_divergence`` is due."""
        due = [s for s in range(first, last + 1) if self.meeting.due(s)]
        if not due:
            return
        step = due[-1]
        shared: dict[str, Any] = {}
        if "replicas" in self.meeting.gathers(step):
            shared = {
                "replica_sums": self._checksums().numpy(),
                "replica_names": self._names,
                "replica_buffer": np.zeros(len(self._names), dtype=bool),
            }
        self._meet(step, epoch, shared)

    def epoch_ended(self, step: int, epoch: int, val: float | None) -> None:
        """Every worker ends the epoch (after its validation, if any, whose loss ``val``
        is this worker's): judge the validation of all of them together, then meet until
        no rank has a finding left to send, so that rank zero's summary and sinks hold
        every rank's findings of the epoch."""
        if val is not None:  # the same on every worker: the same fit arguments
            shared = {"val_loss": (val, 1.0), **self.monitor.pooled_losses()}
            self._meet(step, epoch, shared)
        self._meet(step, epoch)
        while self.meeting.pending:
            self._meet(step, epoch)

    def _meet(self, step: int, epoch: int, shared: dict[str, Any] | None = None) -> None:
        self._act(self.meeting.meet(step, epoch, shared))
        if self._recovery is not None:  # every worker agreed the same: pay it now, alike
            self._recovery.agreed(step, epoch)

    def gather(self, packet: np.ndarray) -> np.ndarray:
        """Every worker's packet (uint8), stacked in rank order: one all-gather of the
        strategy, as int64 words (its collectives carry no bytes)."""
        words = np.zeros(-(-packet.size // 8), dtype=np.int64)
        words.view(np.uint8)[: packet.size] = packet
        every = self._gather(words).numpy().view(np.uint8)
        per_replica = every.reshape(-1, words.size * 8)[:, : packet.size]
        return per_replica[:: self._local]  # each worker's first replica


def _gather_function(strategy: Any) -> Any:
    """The all-gather of a worker's int64 vector over every replica of ``strategy``, in
    replica order (the workers' in rank order), as a function traced once per length.

    Each replica sends a copy of the vector, placed on its device (a host tensor has
    none, which the strategy's collectives refuse)."""
    import tensorflow as tf

    @tf.function
    def gather(words: Any) -> Any:
        def replica() -> Any:
            context = tf.distribute.get_replica_context()
            return context.all_gather(tf.identity(words), axis=0)

        return strategy.experimental_local_results(strategy.run(replica))[0]

    return gather


#: The integer type of each float width, whose bit patterns the checksum adds up.
_BITS = {2: "int16", 4: "int32", 8: "int64"}


def _checksum_function(variables: list[Any]) -> Any:
    """An exact checksum of each of ``variables`` on this worker, computed on its device:
    the int64 sum of its elements' bit patterns (as ``ReplicaChecksums`` sums a torch
    tensor's), independent of the order of the sum, so identical weights give identical
    checksums on every worker and a change to any element changes it."""
    import tensorflow as tf

    @tf.function
    def checksums() -> Any:
        sums = []
        for v in variables:
            x = tf.convert_to_tensor(v.value)  # this worker's copy (the first replica's)
            if x.dtype.is_floating:
                x = tf.bitcast(x, _BITS[x.dtype.size])
            sums.append(tf.reduce_sum(tf.cast(x, tf.int64)))
        return tf.stack(sums) if sums else tf.zeros([0], tf.int64)

    return checksums
