"""The graph side of the Keras probe: wrappers that put the reductions inside the step.

Keras hands callbacks neither gradients nor batches. :class:`StepWrappers` wraps the
model's public ``compute_loss`` and ``train_step`` (where the step hands values back with
its logs, and where a train step of the user's own returns its loss: see
:class:`~stethoscope.callbacks._keras.own_loss.OwnLoss`), its optimizer's ``apply``
(and, under ``MirroredStrategy``, the optimizer's all-reduce of the gradients) and the
``call`` of the watched leaf layers, as instance attributes that
:meth:`StepWrappers.remove` takes off again. The reductions write to its
:class:`~stethoscope.callbacks._keras.store.StepStore`. Inside them:

- every step records its loss (the loss ring) and what catches a non-finite step: in
  the direct regime each gradient's sum of squares, handed back with the loss; else a
  sum of the loss and every gradient that opens one ``cond`` recording the norms;
- a heavy step runs each planned reduction at its hook, inside its switch: a Python
  bool in a whole heavy function (traced for exactly the planned statistics) or when
  eager, else a ``cond`` on the host's request (the step to sample and the groups).

The update itself never runs inside a ``cond``: wrapped in one, it would cost the
light step too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.callbacks._keras import ops as kops
from stethoscope.callbacks._keras.describe import has_own_train_step
from stethoscope.callbacks._keras.gate import UpdateGate
from stethoscope.callbacks._keras.loss_scale import ScaleSkips, carried_scale
from stethoscope.callbacks._keras.nonfinite import NonfiniteRecord
from stethoscope.callbacks._keras.own_loss import OwnLoss
from stethoscope.callbacks._keras.patches import Patches
from stethoscope.callbacks._keras.reductions import ForwardRows, KerasReduction, Layout
from stethoscope.callbacks._keras.regime import Regime
from stethoscope.callbacks._keras.replay import StepReplay
from stethoscope.callbacks._keras.step_start import StepWatch
from stethoscope.callbacks._keras.store import StepStore, StepTrace
from stethoscope.callbacks._keras.switches import Switches, cond
from stethoscope.callbacks._keras.variables import ProbeVariables

__all__ = ["PROBES_KEY", "RING_KEY", "VERDICT_KEY", "StepWrappers"]

#: The key under which the train step hands the loss ring back, taken out of the logs
#: before ``fit`` (or any other callback) sees them.
RING_KEY = "_stethoscope_ring"
#: The key under which a heavy train step hands back what it measured, taken out alike.
PROBES_KEY = "_stethoscope_probes"

#: The key under which a step with ``recover=`` hands back its verdict (see
#: :class:`~stethoscope.callbacks._keras.gate.UpdateGate`), taken out alike.
VERDICT_KEY = "_stethoscope_verdict"


class StepWrappers:
    """The wrappers of one model's train step, and what they share while it is traced.

    Args:
        model: A compiled, built Keras model.
        regime: How its train step runs.
        layout: What the probe watches in it.
        variables: The probe's variables.
        reductions: Every reduction.
        switches: Which of them the step computes (shared with the host).
        position: Each trainable variable's position, by id (and by the id of its
            backing variable under a strategy, which the all-reduce pairs gradients with).
        layers: The leaf layers whose output is read, one forward row each.
        strategy: The model's ``MirroredStrategy``, or None.
        recover: Whether the step judges itself before the optimizer applies it (the
            recovery ladder's skip and cool-down; the probe's ``recovery`` and
            ``skipped`` variables).
        replay: Whether a step judged bad is computed again before it is skipped.
        scale_skips: The count of the steps a ``LossScaleOptimizer`` skipped (None: the
            optimizer is none): the gradient statistics divide its scale out.
    """

    def __init__(
        self,
        model: Any,
        *,
        regime: Regime,
        layout: Layout,
        variables: ProbeVariables,
        reductions: tuple[KerasReduction, ...],
        switches: Switches,
        position: dict[int, int],
        layers: list[Any],
        strategy: Any,
        recover: bool = False,
        replay: bool = False,
        scale_skips: ScaleSkips | None = None,
    ) -> None:
        self.model, self.optimizer = model, model.optimizer
        self.scale_skips = scale_skips
        #: recover=: the verdict and the cond around the optimizer's update.
        self.gate = (
            UpdateGate(
                self.optimizer,
                regime=regime,
                variables=variables,
                position=position,
                strategy=strategy,
                watch=StepWatch(model, switches),
                replay=StepReplay(model, switches) if replay else None,
            )
            if recover
            else None
        )
        self.regime, self.layout, self.variables = regime, layout, variables
        self.position, self.layers, self.strategy = position, layers, strategy
        self.forward = next(r for r in reductions if isinstance(r, ForwardRows))
        self.nonfinite = NonfiniteRecord(
            self.optimizer,
            regime=regime,
            layout=layout,
            variables=variables,
            position=position,
            strategy=strategy,
        )
        self.at = {
            hook: tuple(r for r in reductions if hook in r.hooks)
            for hook in ("batch", "test_batch", "gradients", "before_update", "update")
        }
        self.switches = switches
        #: Whether a train step had a loss: from compute_loss, or (a train step of the
        #: user's own) in the logs it returned (see :class:`OwnLoss`).
        self.saw_loss = False
        # Keras' own train_step always calls compute_loss: only a step of the user's own
        # may return its loss in its logs instead, so only there are its metrics wrapped
        self.own_loss = (
            OwnLoss(model, switches=switches, strategy=strategy)
            if has_own_train_step(model)
            else None
        )
        #: Whether a test step prints its batch (a detector reads a validation's prints).
        self.printing_validation = False
        # positions of the variables the train step hands optimizer.apply, and of those it
        # hands with a gradient: known once apply has been traced (every step when eager)
        self.handed: set[int] = set()
        self.with_grad: set[int] = set()
        #: Where the reductions go, and what each trace carries (see :class:`StepStore`).
        self.store = StepStore(
            self.optimizer,
            regime=regime,
            layout=layout,
            variables=variables,
            switches=switches,
            forward=self.forward,
            layers=len(layers),
        )
        self._patches = Patches()

    # -- installing ------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap compute_loss, optimizer.apply (and the all-reduce under a strategy), the
        train step (its logs may hold its loss, and it hands values back), the model's
        Mean metrics (see :class:`OwnLoss`) and the watched layers' call."""
        model, opt = self.model, self.optimizer
        self._patches.put(model, "compute_loss", self._compute_loss(model.compute_loss))
        if self.regime.outputs or self.own_loss is not None:
            self._patches.put(model, "train_step", self._train_step(model.train_step))
        if self.own_loss is not None:
            self.own_loss.install(self._patches)
        self._patches.put(opt, "apply", self._apply(opt.apply))
        if self.gate is not None:
            self.gate.install(self._patches)
        if self.strategy is not None:
            reduce = opt._all_reduce_sum_gradients
            self._patches.put(opt, "_all_reduce_sum_gradients", self._all_reduce(reduce))
        for row, layer in enumerate(self.layers):
            self._patches.put(layer, "call", self._call(row, layer.call))

    @property
    def why_no_loss(self) -> str:
        """Why a train step of the user's own gave no loss, in a few words."""
        why = self.own_loss.why_not if self.own_loss is not None else ""
        return why or "its train step returned no logs"

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def remove(self) -> None:
        """Take every wrapper off; forget what the traces carried."""
        self._patches.remove()
        self.store.forget()
        self.switches.forget()

    # -- the wrappers --------------------------------------------------------------------------
    def _compute_loss(self, original: Any) -> Any:
        takes_training = "training" in inspect.signature(original).parameters

        @functools.wraps(original)
        def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
            if takes_training:
                loss = original(x, y, y_pred, sample_weight, training=training)
            else:
                loss = original(x, y, y_pred, sample_weight)
            if not training:  # a test step: a validation's, within fit
                if self.printing_validation and not kops.is_symbolic(loss):
                    for r in self.at["test_batch"]:
                        r.on_test_batch(self.store, x)
                return loss
            if self.switches.off or kops.is_symbolic(loss):
                return loss
            self.saw_loss = True
            if self.own_loss is not None:
                self.own_loss.computed()
            if self.gate is not None:  # what a replay computes again
                self.gate.watch.batch = (x, y, sample_weight)
            regime = self.regime
            value = ops.cast(loss if kops.scalar(loss) else ops.reshape(loss, ()), "float32")
            if not regime.direct:  # the direct ring's loss is an output, never differentiated
                value = ops.stop_gradient(value)
                slot = 0 if regime.steps == 1 else ops.mod(self.store.step_index(), regime.steps)
                kops.put(self.variables["losses"], slot, value)
            if not regime.eager:  # apply tests it with the gradients, and the ring carries it
                self.store.trace().loss = value
            any_on, own = self.switches.of(self.at["batch"])

            def batch() -> None:
                for r, on in own.items():
                    cond(on, lambda r=r: r.on_batch(self.store, x, y, y_pred))

            cond(any_on, batch)
            return loss

        return compute_loss

    def _train_step(self, original: Any) -> Any:
        @functools.wraps(original)
        def train_step(*args, **kwargs):
            if self.switches.off:
                return original(*args, **kwargs)
            trace = self.store.trace()
            if self.own_loss is not None:
                self.own_loss.begin()
                if not self.regime.direct and self.regime.steps > 1:  # apply counts the step
                    trace.slot = ops.mod(self.store.step_index(), self.regime.steps)
            if self.regime.outputs:
                trace.outer = kops.graph()
                trace.lr = _learning_rate(self.optimizer) if self.switches.heavy else None
            logs = original(*args, **kwargs)
            own = self._own_loss(logs, trace)
            if not self.regime.outputs:
                return logs
            value, squares = trace.loss if own is None else own, trace.squares
            trace.loss, trace.squares = None, {}
            if not isinstance(logs, dict):
                return logs
            regime_direct = self.regime.direct
            if regime_direct:
                carried, trace.carried = trace.carried, None
                ring = _direct_ring(value, squares, self.layout.count, carried)
            else:  # read after the step's own writes to it (automatic control dependencies)
                ring = ops.convert_to_tensor(self.variables["losses"])
            out = {**logs, RING_KEY: ring}
            if self.gate is not None:  # direct: this step's verdict; else every step's, kept
                verdict = trace.verdict if regime_direct else kops.value(self.variables["verdicts"])
                out[VERDICT_KEY], trace.verdict = verdict, None
            if self.switches.heavy:
                out[PROBES_KEY] = self.store.handed_back(trace)
            elif self.regime.outputs and not regime_direct:
                # how many steps the execution ran (an epoch's last may run fewer): an
                # output of the step, where reading the variable after it costs the host
                # a read op on every execution
                out[PROBES_KEY] = {"iterations": self.store.step_index()}
            return out

        return train_step

    def _own_loss(self, logs: Any, trace: StepTrace) -> Any:
        """A step that never called ``compute_loss``: the loss its logs hold (None: none,
        or compute_loss gave it), into the loss ring variable unless the ring is the
        step's own output. Found after the update, it takes no part in the tests before
        it (a non-finite gradient is still caught; the host tests the loss itself)."""
        if self.own_loss is None:
            return None
        slot, trace.slot = trace.slot, None
        own = self.own_loss.of(logs)
        if own is None:
            return None
        self.saw_loss = True
        if not self.regime.direct:
            kops.put(self.variables["losses"], 0 if slot is None else slot, own)
        return own

    def _apply(self, original: Any) -> Any:
        @functools.wraps(original)
        def apply(grads, trainable_variables=None):
            if trainable_variables is None or self.switches.off or kops.is_symbolic(grads):
                return original(grads, trainable_variables)
            grads, tvars = list(grads), list(trainable_variables)
            for g, v in zip(grads, tvars, strict=True):
                pos = self.position.get(id(v))
                if pos is not None:
                    self.handed.add(pos)
                    if g is not None:
                        self.with_grad.add(pos)
            regime, trace = self.regime, self.store.trace()
            # A non-finite loss or gradient: measure its step. TF's fused ReLU turns a NaN
            # input into 0 on some CPUs, leaving the loss finite and the kernel's gradient NaN,
            # so every gradient is tested. With a direct ring each gradient's sum of squares rides
            # back with the loss (one op per gradient, no cond), and the host tests them,
            # names the parameter and takes the norms. Else one sum of the loss and those
            # sums of squares opens a cond that records the norms, and the record waits for
            # the host, not overwritten. Either way each gradient reaches the optimizer
            # after its own sum (see kops.checked): a sum racing the update for the
            # gradient's buffer made the update copy it, and cost twice as much.
            loss = [trace.loss] if trace.loss is not None else []
            forced: Any = False
            squares: dict[int, Any] = {}
            if regime.direct:
                grads, trace.squares = kops.checked(grads, tvars, self.position)
            elif not regime.eager:
                grads, squares = kops.checked(grads, tvars, self.position)
                forced = self.nonfinite.predicate(loss, list(squares.values()))
            if not regime.direct:
                trace.loss = None
            skips, carried = self.scale_skips, carried_scale(self.optimizer, self.scale_skips)
            trace.carried = carried if regime.direct else None  # the ring divides it out
            heavy = self.switches.heavy
            if self.strategy is not None:
                # the all-reduced gradients exist only inside the optimizer: measured there
                trace.due = (heavy, forced)
            elif heavy:
                self._at_gradients(grads, tvars, scale=carried)
            before = self._before_update(tvars) if heavy else {}
            if self.gate is not None:
                trace.verdict = self.gate.update(original, grads, tvars, loss, trace.squares)
            else:
                original(grads, tvars)
            if skips is not None:  # whether it skipped the step, counted every step
                trace.scale = skips.after_update(carried)
            if heavy:
                self._at_update(tvars, before)
            trace.grads, trace.scale = {}, None  # the update hook has read them
            self.nonfinite.when_first(forced, lambda: self.nonfinite.record(squares, carried))
            if regime.eager:
                self.switches.py_step += 1
            return None

        return apply

    def _all_reduce(self, original: Any) -> Any:
        """Under a strategy: the gradient statistics of the sampled (or non-finite) step,
        taken from the gradients summed across replicas, the ones the optimizer applies.

        A collective inside the sampled step's ``cond`` is refused by ``MirroredStrategy``
        (``merge_call`` inside control flow), so the statistics cannot all-reduce the
        gradients themselves; the optimizer's own all-reduce (Keras' TF optimizer) runs on
        every step and hands each replica the same sum."""

        @functools.wraps(original)
        def all_reduce(grads_and_vars):
            if self.gate is not None and self.gate.summed:  # summed before its cond already
                return list(grads_and_vars)
            reduced = list(original(grads_and_vars))
            trace = self.store.trace()
            due, trace.due = trace.due, None
            if due is not None:
                heavy, forced = due
                grads, tvars = [g for g, _ in reduced], [v for _, v in reduced]
                if heavy:
                    self._at_gradients(grads, tvars, scale=None)
                self.nonfinite.when_first(forced, lambda: self.nonfinite.gradients(grads, tvars))
            return reduced

        return all_reduce

    def _call(self, row: int, original: Any) -> Any:
        @functools.wraps(original)
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            if not self.switches.heavy or out is None or kops.is_symbolic(out):
                return out
            first = next((t for t in keras.tree.flatten(out) if t is not None), None)
            if first is None or not kops.is_float(first):
                return out
            # Cut the tape before the cond: an op that the gradient tape records inside the
            # forward pass makes TensorFlow keep its branch's intermediates for a backward
            # pass that never comes, on every step.
            seen = ops.stop_gradient(first)
            if self.regime.whole:  # only a row that the host reads for a planned statistic
                pred = self.forward.reads(row, self.switches.planned)
            else:
                pred = self.switches.want(self.forward.group)
            cond(pred, lambda: self.forward.on_layer(self.store, row, seen))
            return out

        return call

    # -- inside the heavy step ------------------------------------------------------------------
    def _at_gradients(self, grads: list, tvars: list, *, scale: Any) -> None:
        """The gradient reductions the step planned; ``scale``: the loss scale the
        gradients still carry (None: none)."""
        any_on, own = self.switches.of(self.at["gradients"])
        # by position, for the update hook too (the step's own tensors: a cond may read them)
        by_pos = self.store.trace().grads = kops.by_position(grads, tvars, self.position)

        def gradients() -> None:
            for r, on in own.items():
                cond(on, lambda r=r: r.on_gradients(self.store, by_pos, scale))
            self.store.put("sampled_at", self.store.step_index())

        cond(any_on, gradients)

    def _before_update(self, tvars: list) -> dict[KerasReduction, Any]:
        """What the planned update reductions keep from before the update. In a whole heavy
        function the switches are Python bools and the kept tensors are returned; else each
        reduction copies what it keeps into its variables, inside its switch."""
        kept: dict[KerasReduction, Any] = {}
        for r in self.at["before_update"]:
            on = self.switches.want(r.group)
            if isinstance(on, bool):
                if on:
                    kept[r] = r.before_update(self.store, tvars)
            else:
                cond(on, lambda r=r: r.before_update(self.store, tvars))
        return kept

    def _at_update(self, tvars: list, kept: dict[KerasReduction, Any]) -> None:
        """The reductions of the weights after the update that the step planned."""
        any_on, own = self.switches.of(self.at["update"])

        def update() -> None:
            now = {
                pos: kops.value(v) for v in tvars if (pos := self.position.get(id(v))) is not None
            }
            for r, on in own.items():
                cond(on, lambda r=r: r.on_update(self.store, now, kept.get(r)))
            self.store.put("sampled_at", self.store.step_index() - 1)

        cond(any_on, update)


def _direct_ring(loss: Any, squares: dict[int, Any], count: int, scale: Any) -> Any:
    """A direct step's ring: its loss (NaN for a step that never called
    ``compute_loss``), then each variable's gradient half sum of squares by position (0 for
    a variable handed no gradient), with ``scale``, the loss scale the gradients carry
    (None: none), divided out: those of the gradients the optimizer applies. The square of
    a scale that has collapsed far below 1 underflows float32: it is taken in float64."""
    if loss is None:
        loss = ops.convert_to_tensor(np.float32(np.nan))
    zero = ops.convert_to_tensor(np.float32(0.0))
    halves = ops.stack([squares.get(i, zero) for i in range(count)])
    if scale is not None:
        wide = ops.cast(halves, "float64") / ops.square(ops.cast(scale, "float64"))
        halves = ops.cast(wide, "float32")
    return ops.concatenate([ops.reshape(loss, (1,)), halves])


def _learning_rate(optimizer: Any) -> Any:
    """The learning rate ``optimizer``'s next update is taken at, a float32 tensor: a
    constant, or its schedule's value at the step count. Read before the update, which
    counts the step (after it, a schedule gives the next step's rate). None when the
    optimizer does not expose one number (the host then asks it)."""
    try:
        return ops.cast(optimizer.learning_rate, "float32")
    except Exception:  # a schedule or wrapper that gives no single number
        return None
