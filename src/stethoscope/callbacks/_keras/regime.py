"""How the Keras train step runs, decided once per probe: the execution regime."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import keras

__all__ = ["Mode", "Regime"]


class Mode(enum.Enum):
    """What the train function being traced (or run, when eager) carries."""

    #: Outside the train function (evaluation, prediction): the wrappers do nothing.
    OFF = "off"
    #: Every step the sampler skips: the loss, and what catches a non-finite step.
    LIGHT = "light"
    #: A sampled execution: the reductions the host asked for, too.
    HEAVY = "heavy"


@dataclass(frozen=True)
class Regime:
    """The execution regime of one model's train step: what the probe can do in it, and
    how. Every branch of the probe that depends on how Keras runs the step reads it here.

    Args:
        steps: Train steps per call of the train function (``steps_per_execution``).
        replicas: Replicas in sync in this process (``MirroredStrategy``: every one; a
            worker's own under ``MultiWorkerMirroredStrategy``), 1 without a strategy.
        workers: Processes that train together (``MultiWorkerMirroredStrategy``), else 1.
        eager: The train step runs in Python (the torch backend): the host's own booleans
            choose the branches, since a tensor predicate would cost a device sync. (A
            TensorFlow ``run_eagerly=True`` step needs no such case: its conds resolve
            eagerly.)
        whole: One step per execution, in a graph: a heavy function runs only on the
            sampled step, so it is traced for exactly the statistics that step plans (one
            function per set of them), with no cond at all.
        outputs: TensorFlow with one replica: the train step hands its loss ring back with
            its logs, an output the step computed anyway, instead of the host running a
            read op every step.
        direct: ``outputs`` with one step per execution: the ring is no variable at all,
            but the step's own loss and each gradient's sum of squares (the host tests
            them for a non-finite value and takes the gradient norms from them), and a
            heavy step hands its reductions back as outputs, writing no variable.
    """

    steps: int
    replicas: int
    workers: int
    eager: bool
    whole: bool
    outputs: bool
    direct: bool

    @classmethod
    def of(cls, *, steps_per_execution: int, strategy: Any) -> Regime:
        """The regime of a model compiled with ``steps_per_execution`` under ``strategy``
        (a mirrored strategy, or None), on the current Keras backend."""
        steps = max(int(steps_per_execution), 1)
        backend = keras.backend.backend()
        eager = backend == "torch"
        outputs = backend == "tensorflow" and strategy is None
        replicas = len(strategy.extended.worker_devices) if strategy is not None else 1
        return cls(
            steps=steps,
            replicas=replicas,
            workers=int(strategy.num_replicas_in_sync) // replicas if strategy is not None else 1,
            eager=eager,
            whole=steps == 1 and not eager,
            outputs=outputs,
            direct=outputs and steps == 1,
        )

    @property
    def replica_ranks(self) -> bool:
        """Whether a finding's ``rank`` names the replica whose shard made it: one process
        holds every replica (``MirroredStrategy``). Under ``MultiWorkerMirroredStrategy`` it
        names the worker, a rank of its own."""
        return self.replicas > 1 and self.workers == 1
