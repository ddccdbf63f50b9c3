"""The recovery ladder in a Keras fit: where a step is skipped, the learning rate of a
cool-down, and the snapshots a roll back goes to. What to do when is
:mod:`stethoscope.recovery`'s.

How a skip works. Inside the traced train step, the wrapper around the optimizer's
``apply`` judges the step from its loss and its gradients' sums of squares (which the
probe computes on every step anyway) against the bars the host last wrote to the
probe's ``recovery`` variable, and runs the update in a ``cond`` on that verdict.
A skipped step leaves the weights, the optimizer's slots and its ``iterations``
exactly as they were, as Keras' own ``LossScaleOptimizer`` does with an overflowing
step; the probe counts it in its ``skipped`` variable, so the host's step numbers go on.
The verdict comes back with the step's logs, where the host reads the loss already: no
wait of its own (with ``steps_per_execution``, each step's verdict and gradient norm in
a variable that the last step's logs hand back whole). The bars are written when they
move by more than 1%, and the cool-down factor when it changes. With several steps per
execution, the steps of one execution are all taken before the host judges any of them:
a roll back comes at the end of the execution, and takes its later steps with it.
Each skip names its batch (its epoch and its index in the epoch). With
``Recovery(replay=True)`` the ``cond`` computes a step judged bad once more before it
skips it (see :mod:`~stethoscope.callbacks._keras.replay`), and the verdict says what
the replay found; under a strategy it warns and skips without a replay.

Under ``MultiWorkerMirroredStrategy`` each worker's host writes bars from its own
losses, so the workers take the worst of their verdicts inside the step (see
``UpdateGate._worst``): every worker skips the same steps. The ladder's other acts follow
from the verdicts, alike on every worker, but for an error that one worker's detectors
find on a step that was applied, held until the workers meet (see ``KerasWorkers``):
there every worker agrees to roll back, and does so at once (:meth:`KerasRecovery.agreed`),
each to its own copy of the same snapshot.

On the torch backend the train step runs eagerly: the same code decides in Python, which
on a GPU waits for the device every step (it warns). Settings it cannot recover in (a
strategy with several steps per execution, a train step of the user's own) are refused
at the start of ``fit``, before the first step, with a sentence that says why.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from stethoscope.callbacks._keras.describe import has_own_train_step
from stethoscope.callbacks._keras.gate import BAD_DATA, ELSEWHERE
from stethoscope.callbacks._keras.ladder_link import LadderLink
from stethoscope.callbacks._keras.loss_scale import loss_scaler
from stethoscope.callbacks._keras.optimizer_build import build_as_keras
from stethoscope.callbacks._keras.probe import GraphProbe
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.replay import REPRODUCES, TRANSIENT
from stethoscope.engine import Decision
from stethoscope.recovery import Recoverer
from stethoscope.recovery.settings import (
    FORCED_SKIP,
    LOSS_PAST_BAR,
    NONFINITE_LOSS,
    REASONS,
    skip_reason,
)
from stethoscope.recovery.skipped import BatchName, SkippedBatch
from stethoscope.recovery.snapshots import SnapshotStore

__all__ = ["KerasRecovery", "can_replay", "refuse_unrecoverable"]

#: Steps between two looks at the bars on a healthy stretch: a bar moves a little every
#: step, and computing it (a median and a spread over the loss window) and writing it to
#: the probe's variable cost more than the step's own verdict. A skip, a roll back or a
#: change of the cool-down factor writes them at once.
BARS_EVERY = 8
#: What a roll back puts back, for its finding.
_RESTORED = "weights, optimizer state and step count, detectors and sampler"


def can_replay(strategy: Any) -> bool:
    """Whether ``Recovery(replay=True)`` can compute a step judged bad once more in this
    fit; where it cannot, it says why (a ``RuntimeWarning``) and such a step is skipped
    without a replay."""
    if strategy is None:
        return True
    warnings.warn(
        f"stethoscope: Recovery(replay=True) cannot replay a step under "
        f"{type(strategy).__name__}: the replicas decide a skip together, across replicas "
        "(a merge_call), where the step's forward and backward passes cannot run again; a "
        "step judged bad is skipped without a replay",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def refuse_unrecoverable(model: Any, regime: Regime) -> None:
    """Raise when the ladder cannot skip a step of this model's fit.

    Raises:
        ValueError: A setting the skip does not reach yet, a train step of the user's
            own (whose update the ladder cannot see), or a ``LossScaleOptimizer`` (which
            skips steps itself), named with what to do instead.
    """
    if (regime.replicas > 1 or regime.workers > 1) and regime.steps > 1:
        # the decision is taken across replicas (a merge_call; the workers', across every
        # worker's replicas), which TensorFlow cannot trace inside the loop that runs an
        # execution's steps
        raise ValueError(
            "KerasStethoscope(recover=...) cannot skip steps under a distribution strategy "
            f"with steps_per_execution={regime.steps} yet; compile with "
            "steps_per_execution=1, or train with recover=False there (the detectors and "
            "stop_on work as usual)"
        )
    if loss_scaler(model.optimizer) is not None:
        # the ladder would skip the overflowing steps before the optimizer saw them, so
        # the optimizer would never lower its scale, and every later step would overflow
        raise ValueError(
            "KerasStethoscope(recover=...) cannot skip steps with a LossScaleOptimizer (a "
            "mixed_float16 policy wraps the optimizer in one): the optimizer skips each step "
            "whose scaled gradients overflow and lowers its scale, and a ladder that skipped "
            "those steps first would keep the scale from ever coming down. Train with "
            "recover=False under a LossScaleOptimizer (the detectors and stop_on work as "
            "usual, loss_scale_collapse among them), or with recover= in mixed_bfloat16, "
            "which needs no loss scale"
        )
    if has_own_train_step(model):
        raise ValueError(
            f"KerasStethoscope(recover=...) cannot skip the steps of {type(model).__name__}, "
            "whose train_step is its own: the ladder judges and skips the update inside "
            "Keras' train step. Use recover=False with a custom train_step"
        )


class KerasRecovery:
    """The ladder in a Keras fit: the bars each step is judged against, the snapshots
    and the ladder, driven from the callback's batch hooks.

    Args:
        recoverer: The monitor's ladder.
        act: The callback's way of acting on a decision (stop or raise).
    """

    def __init__(self, recoverer: Recoverer, act: Callable[[Decision], None]) -> None:
        self.recoverer = recoverer
        self.act = act
        self.monitor = recoverer.monitor
        self.snapshots = SnapshotStore(recoverer.ladder.settings)
        self._skips_ahead = recoverer.ladder.settings.skip_ahead > 0
        #: The detectors that keep the bars a step must not pass (see ``Detector.bars``).
        self.spike = self.monitor.keeper_of("loss")
        self.explode = self.monitor.keeper_of("grad_norm")
        self.model: Any = None
        self.link: LadderLink | None = None  # the probe's ladder variables
        self._bars_due = True  # write the bars after the next step, whatever the cadence
        # the steps the next execution skips whatever they hold: why, by step (a batch
        # skipped before, or one of skip_ahead's)
        self._forced: dict[int, SkippedBatch | str] = {}

    def start(self, model: Any, probe: GraphProbe, step: int) -> None:
        """Take the first snapshot (before step ``step``) and write the bars."""
        self.model, self.link = model, probe.ladder
        if probe.regime.eager and _on_accelerator(model):
            warnings.warn(
                f"stethoscope: recover= on the {keras.backend.backend()} backend decides each "
                "step in Python (the train step runs eagerly), which waits for the device "
                "every step; the TensorFlow backend decides inside the traced step",
                RuntimeWarning,
                stacklevel=3,
            )
        # Keras builds the optimizer (its slots) in the first train step: the first
        # snapshot must hold every variable a roll back to it restores (under a strategy,
        # fit built it already, in the strategy's scope)
        build_as_keras(model)
        self._take(step)
        self._write_bars(step)

    def plan(self, first: int, batch: BatchName) -> None:
        """The next execution begins at step ``first`` on ``batch``: mark the steps it must
        skip whatever they hold (the batches a run this one resumes skipped, where they
        come back; the ``skip_ahead`` batches after a roll back). Nothing is written on a
        run that forces no skip."""
        if not self.recoverer.skips_again and not self._skips_ahead:
            return  # the run never forces a skip: nothing to look up every step
        steps = self.link.regime.steps
        self._forced.clear()
        for step in range(first, first + steps):
            index = batch.index + step - first
            why = self.recoverer.skip_again(batch.epoch, index) or self.recoverer.ahead(step)
            if why is not None:
                self._forced[step] = why
        self.link.force(tuple(sorted(step % steps for step in self._forced)))

    def _loss_elsewhere(self, code: int, loss: float, loss_bar: float) -> bool:
        """Whether the loss that made the verdict ``code`` was not this worker's ``loss``.
        Under several workers the gate judges the global loss (every worker's shard),
        so a NaN or a spike in another worker's shard makes the verdict of every worker
        alike (no :data:`ELSEWHERE` mark), while this worker's own loss is fine."""
        if self.link.regime.workers == 1:
            return False
        if code == NONFINITE_LOSS:
            return math.isfinite(loss)
        return code == LOSS_PAST_BAR and loss <= loss_bar

    def settle(self, step: int, batch: BatchName, verdict: np.ndarray, loss: float | None) -> None:
        """Step ``step`` ran on ``batch`` with ``verdict`` (its code, the gradient norm it
        was judged on and what its replay found) and ``loss``: report a skip, or a replay
        that was fine and applied, then the step settled."""
        code, norm, found = int(verdict[0]), float(verdict[1]), int(verdict[2])
        bad_data, found = found >= BAD_DATA, found % BAD_DATA
        if code == FORCED_SKIP:
            # or another worker's mark: their ladders mark the same steps, so never yet
            why = self._forced.get(step, f"on another worker, {REASONS[code]}")
            if isinstance(why, SkippedBatch):
                self.recoverer.skipped_again(step, batch.epoch, why)
            else:
                self.recoverer.skipped_ahead(step, why, batch)
        elif code:
            loss_bar, grad_bar, *_ = self.link.bars
            value = math.nan if loss is None else loss
            why = skip_reason(code, loss=value, norm=norm, loss_bar=loss_bar, grad_bar=grad_bar)
            if found == ELSEWHERE or self._loss_elsewhere(code, value, loss_bar):
                # this worker's own values would mislead
                why = f"on another worker, {REASONS[code]}"
            if found == TRANSIENT:
                self.recoverer.transient(step, batch.epoch, why, batch)
            else:
                replay = "reproduces" if found == REPRODUCES else None
                if bad_data:
                    why = f"{why}; the batch's inputs hold NaN or Inf"
                decision = self.recoverer.skipped(
                    step, batch.epoch, why, batch, replay, bad_data=bad_data
                )
                self.act(decision)
                self._bars_due = True
        decision = self.recoverer.settle(step)
        if decision.stop or decision.spared:
            self.act(decision)

    def after_step(self, step: int, epoch: int, *, first: int | None = None) -> None:
        """After the detectors judged step ``step``: end a cool-down; at the last step of
        an execution (whose first step was ``first``; the steps of one execution were all
        taken before any is judged), roll back if the ladder owes one, else snapshot when
        a step of the execution was due; then write the bars of the next execution."""
        ladder = self.recoverer.ladder
        self.recoverer.carried_on(step, epoch)
        if first is None:
            return
        if self.recoverer.rollback_due is not None:
            self._roll_back(step, epoch)
        elif any(ladder.snapshot_due(s) for s in range(first, step + 1)) and not self._fresh(step):
            self._take(step)
        cadence = any(s % BARS_EVERY == 0 for s in range(first + 1, step + 2))
        if self._bars_due or cadence or self._lr_bars(step + 1) != self.link.bars[2:]:
            self._write_bars(step + 1)

    def agreed(self, step: int, epoch: int) -> None:
        """The workers met after step ``step`` (see ``KerasWorkers``): pay at once a roll
        back they agreed on there (an error one worker's detectors found on a step that
        was applied), so that every worker restores the same snapshot, before the same
        step, whatever comes next (an epoch end, the end of the fit)."""
        if self.recoverer.rollback_due is not None:
            self._roll_back(step, epoch)
            self._write_bars(step + 1)

    def close(self) -> None:
        self.snapshots.close()

    def _roll_back(self, step: int, epoch: int) -> None:
        """Pay the roll back the ladder owes after step ``step``."""

        def put_back(state: dict[str, Any]) -> list[list[float]]:
            self._put_back(state)
            self.link.continue_from(step + 1)  # the optimizer's count went back
            return [[_learning_rate(self.model.optimizer)]]

        def learning_rates() -> list[list[float]]:  # before the restore: had it risen?
            return [[_learning_rate(self.model.optimizer)]]

        decision = self.recoverer.roll_back(
            step, epoch, self.snapshots, put_back, _RESTORED, learning_rates
        )
        self.act(decision)
        self._bars_due = True

    # -- state ----------------------------------------------------------------------------
    def _take(self, step: int) -> None:
        began = time.perf_counter()
        model = self.model
        state = {
            "model": [_host_value(v) for v in model.variables],
            "optimizer": [_host_value(v) for v in model.optimizer.variables],
            "monitor": copy.deepcopy(self.monitor.state_dict()),
        }
        nbytes = sum(a.nbytes for a in (*state["model"], *state["optimizer"]))
        self.snapshots.keep(step, state, nbytes, began)

    def _fresh(self, step: int) -> bool:
        """Whether the newest snapshot is that of ``step`` already (the one taken at the
        start of the fit, when its first step is due)."""
        kept = self.snapshots.kept
        return bool(kept) and kept[-1].step == step

    def _put_back(self, state: dict[str, Any]) -> None:
        """Restore a snapshot's ``state``."""
        model = self.model
        for v, saved in zip(model.variables, state["model"], strict=True):
            v.assign(saved)
        for v, saved in zip(model.optimizer.variables, state["optimizer"], strict=True):
            v.assign(saved)
        self.monitor.load_state_dict(state["monitor"])

    def _write_bars(self, step: int) -> None:
        self._bars_due = False
        loss_bar = self.spike.threshold() if self.spike is not None else None
        grad_bar = self.explode.threshold() if self.explode is not None else None
        self.link.set_bars(
            math.inf if loss_bar is None else loss_bar,
            math.inf if grad_bar is None else grad_bar,
            *self._lr_bars(step),
        )

    def _lr_bars(self, step: int) -> tuple[float, float]:
        """The learning rate's factor at ``step`` and the learning rate it applies to at
        most (``math.inf``: the schedule's own, whatever it is)."""
        ladder = self.recoverer.ladder
        ceiling = ladder.lr_ceiling(step)
        return ladder.lr_scale(step), ceiling[0][0] if ceiling else math.inf


def _learning_rate(optimizer: Any) -> float:
    """The optimizer's learning rate now (its schedule's, at the step count it has)."""
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _on_accelerator(model: Any) -> bool:
    """Whether the model's weights live on a device other than the CPU (torch backend)."""
    weights = model.trainable_variables
    device = getattr(getattr(weights[0], "value", None), "device", None) if weights else None
    return device is not None and getattr(device, "type", "cpu") != "cpu"


def _host_value(variable: Any) -> np.ndarray:
    """A variable's value in host memory, which training cannot change underneath: the
    array of a read of the variable, a tensor of its own (TensorFlow copies a variable's
    buffer before an update when a read still holds it)."""
    return keras.ops.convert_to_numpy(variable)
