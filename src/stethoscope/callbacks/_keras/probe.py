"""The host side of the Keras probe: the train functions ``fit`` calls, the request for
each execution, and what a step measured, read back into an observation.

The train function is traced more than once. The *light* one, run on every step the
sampler does not select, records the loss and what catches a non-finite step; it does
not touch the layers' outputs, so TensorFlow fuses and schedules their kernels exactly
as without the probe. The *heavy* ones run on sampled executions only: in a whole
regime (one step per execution, in a graph) one is traced for the statistics the first
sampled step plans, with no ``cond``, and serves every later step whose statistics it
measures (a step planning one more traces one more, for all of them); otherwise one
heavy function measures whatever the host's request asks for, inside ``cond``\\ s. None
of them is ever retraced.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from stethoscope.callbacks._keras.describe import LossForm, loss_form, optimizers_of
from stethoscope.callbacks._keras.ladder_link import LadderLink
from stethoscope.callbacks._keras.layers import (
    activation_kind,
    feeds_activation,
    fused_activations,
    input_scaling,
    leaf_layers,
    unit_layer,
)
from stethoscope.callbacks._keras.loss_scale import LossScale, ScaleSkips, loss_scaler
from stethoscope.callbacks._keras.optimizer_build import build_as_keras
from stethoscope.callbacks._keras.precision import Fp8Fit, GradientPrecision
from stethoscope.callbacks._keras.predictions import Predictions
from stethoscope.callbacks._keras.reductions import (
    ClassLabels,
    Distributions,
    ForwardRows,
    GradNorms,
    InputScale,
    KerasReduction,
    Layout,
    SamplePrints,
    UnitRows,
    UpdateNorms,
    WeightNorms,
    slots_of,
)
from stethoscope.callbacks._keras.regime import Mode, Regime
from stethoscope.callbacks._keras.switches import Switches
from stethoscope.callbacks._keras.train_functions import HEAVY, LIGHT, TrainFunctions
from stethoscope.callbacks._keras.variables import ProbeVariables, Slot
from stethoscope.callbacks._keras.wrappers import PROBES_KEY, RING_KEY, VERDICT_KEY, StepWrappers
from stethoscope.observation import Observation
from stethoscope.prints import join_prints

__all__ = ["SNAPSHOT_BUDGET", "GraphProbe", "make_reductions"]

#: Elements of the weights kept from before a sampled update step (float32: 128 MiB): in
#: variables of the probe for the whole fit, or (a whole heavy function) as the step's
#: own reads, which the update copies on write; past it, later variables go unmeasured.
SNAPSHOT_BUDGET = 2**25


class GraphProbe:
    """Installs the in-graph reductions on a compiled Keras model, runs its train
    functions, and reads back what they measured.

    Args:
        model: A compiled, built Keras model.
        steps_per_execution: Train steps per call of the train function.
        forward: Whether to wrap the leaf layers (activation, output and trace rows).
        strategy: The model's mirrored strategy (see ``layers.distribution``), or None.
        recover: Whether each step judges itself before its update (``recover=``): the
            update runs in a ``cond`` on the verdict, against the bars the host writes.
        replay: Whether a step judged bad is computed again before it is skipped.
    """

    def __init__(
        self,
        model: Any,
        *,
        steps_per_execution: int,
        forward: bool,
        strategy: Any = None,
        recover: bool = False,
        replay: bool = False,
    ) -> None:
        self.model, self.optimizer = model, model.optimizer
        self.regime = regime = Regime.of(steps_per_execution=steps_per_execution, strategy=strategy)
        watched = list(model.trainable_variables)
        self._watched = watched
        position = {id(v): i for i, v in enumerate(watched)}
        if strategy is not None:
            # the optimizer's all-reduce pairs the gradients with the backing tf variables
            position.update({id(v.value): i for i, v in enumerate(watched)})
        layers = leaf_layers(model)
        # A linear Dense/Conv whose output only an activation layer reads is left alone:
        # reading it (even on a sampled step) would keep TensorFlow from fusing the two,
        # and on some CPUs the fused ReLU turns a NaN into 0, where the unfused one passes
        # it on. The activation layer's output stands for it: a layer with units, as a
        # Dense(activation="relu") is.
        self._layers = [la for la in layers if not feeds_activation(la)] if forward else []
        standing = fused_activations(layers)
        self.layout = _layout(
            watched, layers, self._layers, position, input_scaling(model), standing
        )
        scaler = loss_scaler(self.optimizer)
        if scaler is not None and not scaler.built:
            # its scale is read before the first step's update, where Keras would build it
            scaler.build(watched)
        if not regime.eager and strategy is None:
            build_as_keras(model)  # or the first train function traced is traced twice
        self.reductions = make_reductions(
            self.layout, regime, position, scaled=bool(scaler), loss=loss_form(model)
        )
        slots = _plumbing(self.layout, regime, len({r.group for r in self.reductions}))
        for r in self.reductions:
            slots += slots_of(r, self.layout, regime)
        if recover:
            slots += LadderLink.slots(regime)
        if scaler is not None:
            slots += ScaleSkips.slots()
        self.variables = ProbeVariables(
            slots, strategy=strategy, also_read=[self.optimizer.iterations]
        )
        #: The count of the steps a LossScaleOptimizer skipped (None: no such optimizer).
        self.scale_skips = ScaleSkips(scaler, self.variables) if scaler is not None else None
        #: recover=: the ladder's variables, as the host writes and reads them.
        self.ladder = LadderLink(regime, self.variables, self.optimizer) if recover else None
        self.switches = Switches(
            regime=regime,
            reductions=self.reductions,
            variables=self.variables,
            optimizer=self.optimizer,
        )
        self.wrappers = StepWrappers(
            model,
            regime=regime,
            layout=self.layout,
            variables=self.variables,
            reductions=self.reductions,
            switches=self.switches,
            position=position,
            layers=self._layers,
            strategy=strategy,
            recover=recover,
            replay=replay,
            scale_skips=self.scale_skips,
        )
        # the switches each statistic needs, and what a whole heavy function can measure
        self._groups_of: dict[str, frozenset[str]] = {}
        for r in self.reductions:
            for s in r.statistics:
                self._groups_of[s] = self._groups_of.get(s, frozenset()) | {r.group, *r.requires}
        self._measurable = frozenset(self._groups_of)
        #: What every step's ring carries: a step planning no more runs the light function.
        self._in_ring = frozenset(
            s for r in self.reductions if r.in_ring(regime) for s in r.statistics
        )
        self._ring_served = -1  # the step the next execution measures from its ring alone
        self.functions = TrainFunctions(self._make_function)
        self._request = (-1, (0,) * len(self.switches.groups))  # what the variables ask for
        self.heavy = False  # the host's choice for the next execution
        self.planned: frozenset[str] = frozenset()  # ... and a whole function's statistics
        self._ring: Any = None  # the ring the last execution returned, not yet read
        self.last_ring = np.zeros(0, dtype=np.float32)  # the one the host read last
        self._returned_lr: Any = None
        self._returned_step: Any = None
        #: Samples per batch, once the inputs were measured (0: unknown).
        self.batch_samples = 0

    @staticmethod
    def key(model: Any, *, forward: bool, strategy: Any = None) -> tuple:
        """What a probe and its traced functions depend on: a later fit whose key is the
        same reuses them (same model, optimizer, variables, execution settings)."""
        return (
            id(model),
            id(model.optimizer),
            tuple(id(v) for v in model.trainable_variables),
            int(model.steps_per_execution),
            bool(model.run_eagerly),
            repr(getattr(model, "jit_compile", None)),
            forward,
            id(strategy),
        )

    @property
    def saw_loss(self) -> bool:
        """Whether the train step had a loss: from compute_loss, or in its logs (OwnLoss)."""
        return self.wrappers.saw_loss

    # -- installing ------------------------------------------------------------------------
    @property
    def loss_scaled(self) -> bool:
        """Whether the optimizer is a ``LossScaleOptimizer``."""
        return self.scale_skips is not None

    def start(self, step: int) -> None:
        """A fit starts at ``step`` (eager backends count the steps on the host, and the
        loss scale's measurements count the steps since the last)."""
        self.switches.py_step = step
        for r in self.reductions:
            if isinstance(r, LossScale):
                r.start(step, self.scale_skips.total() if self.scale_skips is not None else 0)

    def steps_taken(self) -> int:
        """The steps taken so far: the optimizer's count, plus the steps a
        ``LossScaleOptimizer`` skipped (not counted by it); with ``recover=``, see
        ``ladder.step_index``."""
        applied = int(self.variables.read_variable(self.optimizer.iterations))
        return applied + (self.scale_skips.total() if self.scale_skips is not None else 0)

    def install(self) -> None:
        """Wrap the train step, make the light (and, unless whole, the heavy) train
        function, traced on its first call, and hand ``fit`` the dispatcher."""
        if self.wrappers.installed:
            return
        self.wrappers.install()
        self._retrace()
        # A later fit of the same model reuses the functions, already traced: tracing them
        # again would cost each fit a trace of the whole step. They hold the graph, not the wrappers
        # (which are back on while they run, for a retrace on a new input shape). A whole
        # heavy function is made when a step plans statistics no traced one measures
        # (dispatch).
        self.functions.ensure(*((LIGHT,) if self.regime.whole else (LIGHT, HEAVY)))
        self.model.train_function = self.dispatch

    def remove(self) -> None:
        """Take every wrapper off and drop the model's traced functions that contain them."""
        if not self.wrappers.installed:
            return
        self.wrappers.remove()
        self._retrace()

    def _retrace(self) -> None:
        """Drop the model's traced functions (they may hold the wrappers, or lack them)."""
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)

    def _make_function(self) -> Any:
        """A new train function of the model (traced on its first call), leaving ``fit``
        the dispatcher."""
        self.model.make_train_function(force=True)
        fn = self.model.train_function
        self.model.train_function = self.dispatch
        return fn

    # -- each execution ----------------------------------------------------------------------
    def schedule(self, step: int, plan: frozenset[str]) -> None:
        """Measure ``plan`` at ``step`` in the next execution (``step`` -1: nothing). A whole
        heavy function is chosen by its statistics; else the request variables are written,
        only on a change, and never to cancel (a past step can no longer match the
        iteration count)."""
        graph = plan - self._in_ring
        groups = frozenset(g for s in graph for g in self._groups_of.get(s, ()))
        self.heavy = step >= 0 and bool(groups)
        # the gradient norms of a direct ring, planned alone (a suspicion of a gradient
        # norm's raises its readers only): the light step measures them
        self._ring_served = step if step >= 0 and not self.heavy and plan & self._in_ring else -1
        if not self.heavy:
            return
        if self.regime.whole:
            self.planned = plan & self._measurable
            return
        flags = self.switches.request(step, groups)
        if (step, flags) == self._request:
            return
        if step != self._request[0]:
            self.variables.write("sample_at", np.int64(step))
        if flags != self._request[1]:
            self.variables.write("flags", np.array(flags, dtype="int32"))
        self._request = (step, flags)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The train function ``fit`` calls: a heavy one when the host asked for statistics
        in this execution, else the light one. Each is traced on its first call, in its
        mode; outside of them the wrappers do nothing."""
        key = self.functions.key(heavy=self.heavy, whole=self.regime.whole, planned=self.planned)
        fn = self.functions.get(key)  # traced on its first call
        switches = self.switches
        switches.mode = Mode.LIGHT if key == LIGHT else Mode.HEAVY
        switches.planned = key if self.regime.whole and self.heavy else frozenset()
        try:
            logs = fn(*args, **kwargs)
        finally:
            switches.mode = Mode.OFF
        self.variables.hand_back({})
        self._returned_lr = self._returned_step = None
        if isinstance(logs, dict) and RING_KEY in logs:
            logs = dict(logs)
            self._ring = logs.pop(RING_KEY)
            if self.ladder is not None:
                self.ladder.hand(logs.pop(VERDICT_KEY, None))
            returned = logs.pop(PROBES_KEY, None)
            if returned:
                self.variables.hand_back({n: v for n, v in returned.items() if n in self.variables})
                self._returned_lr = returned.get("learning_rate")
                self._returned_step = returned.get("iterations")
        return logs

    # -- reading an execution back ------------------------------------------------------------
    def ring(self) -> np.ndarray:
        """The loss ring after the last execution: the losses of its steps, then the flag;
        a direct ring holds the step's loss, then each variable's gradient sum of squares
        over 2 (0 for a variable the step handed no gradient)."""
        ring, self._ring = self._ring, None
        if ring is None:
            ring = self.variables.read("losses")
        elif self.regime.direct:  # read-only, and nothing writes to it
            ring = ring.numpy()
        else:
            ring = np.array(ring)  # a writable copy: the host clears the flag in it
        self.last_ring = ring
        return ring

    def flagged(self, ring: np.ndarray) -> bool:
        """Whether the execution of ``ring`` took a step with a non-finite loss or gradient
        (a direct ring: its own step; else the step in ``bad_at``)."""
        if not self.regime.direct:
            return bool(ring[self.regime.steps] != 0.0)
        # a sum of squares past float32's range (a norm over 1.8e19) counts as non-finite,
        # as the norms of a sampled step would say; one Python sum of a few floats is
        # finite when each of them is, and cheaper than numpy's test on this size
        values = ring.tolist()
        return not math.isfinite(sum(values if self.saw_loss else values[1:]))

    def nonfinite_step(self) -> int:
        """The step of the non-finite record the graph took (not a direct ring)."""
        return int(self.variables.read("bad_at"))

    def clear_nonfinite(self, ring: np.ndarray) -> None:
        """Ready the record for the next non-finite step (not a direct ring, whose records
        are the step's own output and never wait for the host)."""
        self.variables.write("bad_at", np.int64(-1))
        ring[self.regime.steps] = 0.0
        self.variables.write("losses", ring)

    def losses(self, ring: np.ndarray) -> np.ndarray:
        """The losses of ``ring``'s steps, this worker's own: Keras divides each replica's
        loss by every replica in sync, so the sum of this worker's is multiplied back by
        the workers (``MultiWorkerMirroredStrategy``), as a DDP rank judges its own."""
        return ring if self.regime.workers == 1 else ring * self.regime.workers

    def replica_losses(self) -> list[np.ndarray]:
        """Each replica's own share of the losses of the last execution."""
        return self.variables.copies("losses")

    def bad_replica(self) -> int:
        return self.variables.bad_replica()

    def steps_run(self) -> int:
        """The steps taken after the last execution (the optimizer's iteration count,
        and with ``recover=`` the steps it skipped)."""
        if self._returned_step is not None:
            return int(np.asarray(self._returned_step))
        if "skipped" in self.variables.slots:
            return self.ladder.step_index()
        return self.steps_taken()

    def sampled_at(self) -> int:
        """The step the last sampled execution measured (-1: none): a heavy one's, or the
        light one's whose ring carried all it planned."""
        if self._ring_served >= 0:
            return self._ring_served
        return int(self.variables.read("sampled_at"))

    def read(self, name: str) -> np.ndarray:
        """Slot ``name`` on the host (see :class:`ProbeVariables`)."""
        return self.variables.read(name)

    def print_validation(self, on: bool) -> None:
        """Whether the test steps of the validations print their batches (a test function
        traced from now on)."""
        self.wrappers.printing_validation = on

    def validation_prints(self) -> np.ndarray | None:
        """The prints of the last validation's first batches (None: none printed), and
        their rows cleared for the next one."""
        printed = int(self.variables.read("val_printed")[0])
        if not printed:
            return None
        pairs = self.variables.read("val_prints")[:printed].reshape(-1)
        self.variables.write("val_printed", np.zeros(1, np.float32))
        return join_prints(pairs[~np.isnan(pairs)])

    def decode(self, obs: Observation, plan: frozenset[str], *, fresh: bool) -> None:
        """Fill ``obs`` with the statistics of ``plan`` that the step measured; ``fresh``:
        the per-parameter ones were measured at this very step."""
        run = [r for r in self.reductions if not r.statistics.isdisjoint(plan)]
        per_parameter = fresh and any(r.per_parameter for r in run)
        idx = self.describe(obs) if per_parameter else np.zeros(0, dtype=np.int64)
        for r in run:
            if per_parameter or not r.per_parameter:
                r.decode(obs, self, idx, plan)

    def decode_nonfinite(
        self, obs: Observation, replica: int | None, *, grads: bool = True, weights: bool = True
    ) -> None:
        """The gradient norms the graph took at a step whose loss or gradient was not
        finite (under a strategy: those of the replica that saw it, taken from the summed
        gradients), and the weight norms now, after the execution, read off the healthy
        path: a direct step's own (no step ran since); with several steps an execution,
        those of its last step (the graph records no weight: see
        :meth:`NonfiniteRecord.record`)."""
        idx = self.describe(obs)
        if grads:
            norms = (
                np.sqrt(2.0 * self.last_ring[1:])
                if self.regime.direct
                else self.variables.read("bad_grad_norm", replica)
            )
            obs.grad_norm = norms[idx].astype(np.float64)
        if weights:
            values = [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in self._watched]
            obs.weight_norm = np.array([np.sqrt(np.sum(w * w)) for w in values])[idx]

    def describe(self, obs: Observation) -> np.ndarray:
        """Name the parameters of a measured step; returns their positions in the probe.

        Only the variables the step updated with a gradient: a variable the train step
        keeps from optimizer.apply has a NaN placeholder, not a non-finite value (it is
        named in ``unoptimized`` instead, as the Lightning adapter does)."""
        layout = self.layout
        with_grad = self.wrappers.with_grad
        idx = np.array(sorted(with_grad)) if with_grad else np.arange(layout.count)
        obs.names = tuple(layout.names[i] for i in idx)
        obs.numel = layout.numel[idx]
        obs.dtypes = tuple(layout.dtypes[i] for i in idx)
        obs.is_matrix = layout.is_matrix[idx]
        obs.fan_in = layout.fan_in[idx]
        handed = self.wrappers.handed
        obs.unoptimized = (
            tuple(n for i, n in enumerate(layout.names) if i not in handed) if handed else ()
        )
        if obs.unoptimized:  # rare: then ask whether another optimizer holds them (a GAN's)
            held = self._held_elsewhere()
            obs.unoptimized = tuple(n for n in obs.unoptimized if n not in held)
        obs.lr = self.learning_rate()
        return idx

    def _held_elsewhere(self) -> set[str]:
        """The watched variables that an optimizer of the model other than the watched one
        updates (a GAN's discriminator, with an optimizer of its own), by name."""
        others = [o for o in optimizers_of(self.model) if o is not self.optimizer]
        ids = set()
        for opt in others:
            for o in (opt, getattr(opt, "inner_optimizer", None)):  # a loss-scale wrapper's
                ids.update(id(v) for v in getattr(o, "_trainable_variables", None) or ())
        return {self.layout.names[i] for i, v in enumerate(self._watched) if id(v) in ids}

    def learning_rate(self) -> float | None:
        """The learning rate of the sampled step's update, as its step handed it back; else
        (an optimizer whose rate the step cannot read) the optimizer's own after the last
        execution; None if unknown."""
        try:
            lr = self._returned_lr
            if lr is None:  # not handed back: ask the optimizer
                lr = keras.ops.convert_to_numpy(self.optimizer.learning_rate)
            value = float(np.asarray(lr))
        except Exception:  # a schedule or wrapper that does not expose one number
            return None
        return value if np.isfinite(value) else None


def _layout(
    watched: list[Any],
    layers: list[Any],
    forward: list[Any],
    position: dict[int, int],
    scaling: tuple[Any, ...] = (),
    standing: set[int] | frozenset[int] = frozenset(),
) -> Layout:
    """What the probe watches: the trainable variables, the layers with units (their
    kernel's last axis holds the units), the layers whose output it reads (``standing``:
    the ids of the activation layers read in place of the layer with units they follow),
    and those that scale its input first."""
    numel = np.array([int(np.prod(v.shape)) for v in watched], dtype=np.float64)
    units = []
    for layer in layers:
        kernel = getattr(layer, "kernel", None) if unit_layer(layer) else None
        pos = position.get(id(kernel)) if kernel is not None else None
        if pos is not None and len(kernel.shape) >= 2:
            units.append((layer.name, pos, int(kernel.shape[-1])))
    fan_in = np.full(len(watched), np.nan)
    for _, pos, n in units:
        fan_in[pos] = numel[pos] / max(n, 1)
    snapshot, budget = set(), SNAPSHOT_BUDGET
    for pos, n in enumerate(numel):
        if n > budget:
            break
        budget -= int(n)
        snapshot.add(pos)
    return Layout(
        names=tuple(v.path for v in watched),
        shapes=tuple(tuple(int(d) for d in v.shape) for v in watched),
        numel=numel,
        is_matrix=np.array([len(v.shape) >= 2 for v in watched]),
        fan_in=fan_in,
        unit_layers=tuple(units),
        forward_layers=tuple(
            (la.name, activation_kind(la), unit_layer(la) or id(la) in standing) for la in forward
        ),
        snapshot=frozenset(snapshot),
        input_scaling=scaling,
        dtypes=tuple(keras.backend.standardize_dtype(v.dtype) for v in watched),
    )


def make_reductions(
    layout: Layout,
    regime: Regime,
    position: dict[int, int],
    *,
    scaled: bool = False,
    loss: LossForm | None = None,
) -> tuple[KerasReduction, ...]:
    """Every reduction, for a model of ``layout`` run in ``regime`` (``position``: each
    trainable variable's position, by id; ``scaled``: its optimizer is a
    ``LossScaleOptimizer``; ``loss``: how its compiled loss reads the output), in the
    order the host decodes them: the unit rows before the inputs, since a step's unit rows
    go with the batch size known before it; the loss scale last, since it drops the update
    statistics of a step the optimizer skipped."""
    return (
        GradNorms(regime),
        WeightNorms(),
        UpdateNorms(layout, regime, position),
        UnitRows(layout),
        Distributions(),
        InputScale(),
        ClassLabels(),
        SamplePrints(),
        Predictions(loss),
        ForwardRows(layout),
        GradientPrecision(layout, regime, position),
        Fp8Fit(),
        LossScale(scaled),
    )


def _plumbing(layout: Layout, regime: Regime, groups: int) -> list[Slot]:
    """The probe's own variables, beside the reductions'."""
    k, p = regime.steps, layout.count
    return [
        # host -> graph: which step to sample, and which switches
        Slot("sample_at", (), -1, "int64", combine="first", returned=False),
        Slot("flags", (groups,), 0, "int32", combine="first", returned=False),
        # the loss of each step of an execution, then a flag: 1 when the graph took a
        # non-finite record (``bad_at``) the host has not read yet; one read tells both
        Slot("losses", (k + 1,), np.array([np.nan] * k + [0.0]), combine="sum", returned=False),
        Slot("sampled_at", (), -1, "int64", combine="first"),
        # the first step with a non-finite loss since the host last looked, and its norms
        Slot("bad_at", (), -1, "int64", combine="earliest", returned=False),
        Slot("bad_grad_norm", (p,), np.nan, combine="bad_replica", returned=False),
    ]
