"""The in-graph half of the Keras adapter: wrappers that reduce tensors inside the train step.

Keras hands callbacks neither gradients nor batches. :class:`GraphProbe` wraps the
model's public ``compute_loss``, its optimizer's ``apply`` and the ``call`` of its
leaf layers (instance attributes, removed after ``fit``), so that the reductions
run inside the traced train step, written with ``keras.ops``. Results land in
non-trainable ``keras.Variable`` objects that belong to the probe, never to the
model (so ``model.save()`` holds nothing of stethoscope), and the callback reads
them only on the steps the sampler selects. Every step's loss reaches the host: on
TensorFlow with one replica and one step per execution (the *direct* case) as an
output of the step, with each gradient's sum of squares; otherwise through a small ring
buffer, one slot per step of an execution (``steps_per_execution``), and a flag.

The train function is traced more than once. The *light* one, run on every step the
sampler does not select, records the loss and, in the direct case, one ``l2_loss`` per
gradient (the host tests them for a non-finite value and takes the norms from them;
otherwise one ``cond`` that only a non-finite loss or gradient opens records the norms
in the graph); it does not touch the layers' outputs, so TensorFlow fuses and schedules
their kernels exactly as without the probe. The *heavy* one runs on sampled executions
only. With one step per execution it is the sampled step: one heavy function is traced
per set of probes the sampler plans (a handful per run), and it computes exactly those,
with no ``cond`` (cheaper than choosing), handing them back as outputs of the step (no
variable written or read); the update norms are the weights read before the update, then
a difference.
With several steps per execution the reductions sit inside ``cond``s: the callback
writes the step to sample and the probes it wants into two variables, the graph
compares them with the optimizer's iteration counter, and the heavy step hands the
variables back with its logs (TensorFlow, one replica). Every op of a step costs 10-50
us on a busy CPU whatever its size, so each of these choices is one of fewer ops. None
of the functions is ever retraced. A non-finite loss or gradient is measured on its own
step, in either function, so the parameter that went bad is named at once.
Under ``tf.distribute.MirroredStrategy`` each replica runs these wrappers on its own
shard of the batch. The probe's variables are then per-replica (``on_read``): every
replica writes its own copy, with no collective on any step, and the host combines
the copies as :data:`REDUCTIONS` declares. The gradient statistics are taken from the
all-reduced gradients, the ones the optimizer applies (see :meth:`GraphProbe.install`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from typing import Any

import keras
import numpy as np
from keras import ops

from stethoscope.observation import SATURATION_BOUNDS

__all__ = [
    "GROUPS",
    "MAX_CLASSES",
    "MAX_FEATURES",
    "REDUCTIONS",
    "SNAPSHOT_BUDGET",
    "GraphProbe",
    "distribution",
    "leaf_layers",
]

#: Probe groups the host can switch on for a sampled step (indices into the flags).
GROUPS: tuple[str, ...] = (
    "grads",
    "weights",
    "updates",
    "units",
    "inputs",
    "labels",
    "forward",  # activations and layer outputs
    "trace",
)
_G = {name: i for i, name in enumerate(GROUPS)}

#: The planned probes that a whole heavy function (one step per execution, in a graph)
#: is traced for: one function per set of them that the sampler asks for, each computing
#: exactly those (no ``cond``); the others ride back with the light step's ring or are
#: the host's own.
WHOLE_PROBES = frozenset(
    {"grads", "weights", "updates", "units", "inputs", "labels", "activations", "outputs", "trace"}
)
#: Whole heavy functions traced per probe at most: each is a trace of the whole train
#: step (seconds on a large model), so past this many a step whose set of probes is new
#: runs the smallest traced function that measures them all (a superset), or else one
#: that measures every probe.
MAX_WHOLE_FUNCTIONS = 8
#: Which of those each probe group of the graph serves (the forward rows serve three).
_SERVES = {
    "grads": {"grads"},
    "weights": {"weights", "updates"},
    "updates": {"updates"},
    "units": {"units"},
    "inputs": {"inputs"},
    "labels": {"labels"},
    "forward": {"activations", "outputs", "trace"},
    "trace": {"trace"},
}

#: Per-feature input statistics beyond this many features collapse to one number.
MAX_FEATURES = 4096
#: Class labels are counted in a histogram of this many classes (larger: not judged).
MAX_CLASSES = 1024
#: The key under which the train step hands the loss ring to :meth:`GraphProbe.dispatch`,
#: which takes it out of the logs before ``fit`` (or any other callback) sees them.
RING_KEY = "_stethoscope_ring"
#: The key under which the heavy train step hands back what it measured (see
#: :meth:`GraphProbe.read`), taken out of the logs in the same way.
PROBES_KEY = "_stethoscope_probes"
#: The probe variables the heavy step hands back with its logs (small vectors: the host
#: then reads none of them with an op of its own), with the learning rate and step count.
_RETURNED = (
    "sampled_at",
    "grad_norm",
    "weight_norm",
    "update_norm",
    "prev_weight_norm",
    "unit_zero",
    "input_sq",
    "input_shape",
    "label_hist",
    "forward_rows",
)
#: Elements of the weights kept from before a sampled update step (float32: 128 MiB): in
#: variables of the probe for the whole fit, or (one step per execution) as the step's
#: own reads, which the update copies on write; past it, later variables go unmeasured.
SNAPSHOT_BUDGET = 2**25

#: Output magnitudes that correspond to the saturation bounds on the pre-activation.
_SATURATED_OUTPUT = {
    "tanh": math.tanh(SATURATION_BOUNDS["tanh"]),
    "sigmoid": 1.0 / (1.0 + math.exp(-SATURATION_BOUNDS["sigmoid"])),
}

#: A direct heavy step's forward row that a control-flow body wrote to the probe's
#: variable (a tensor made there cannot leave it): read back after the loop.
_IN_VARIABLE = object()

# forward rows: saturated fraction, rms, max |x|, finite, elements (to weigh replicas)
_ROW = 5

#: How the host combines the replicas' copies of each probe variable under a
#: ``tf.distribute`` strategy. Each replica writes its own copy in the graph and nothing
#: is reduced there; the host reads every copy on the steps it reads the variable at all.
REDUCTIONS: dict[str, str] = {
    # host -> graph: the host writes the same value into every copy
    "sample_at": "first",
    "flags": "first",
    # Keras divides each replica's loss by the number of replicas: the sum is the loss
    "losses": "sum",
    "sampled_at": "first",
    # measured on the all-reduced gradients and the mirrored weights: the same everywhere
    "grad_norm": "first",
    "unit_zero": "first",
    "weight_norm": "first",
    "update_norm": "first",
    "prev_weight_norm": "first",
    # a non-finite loss is seen by the replicas whose shard caused it: the earliest one,
    # and the norms that replica recorded for it
    "bad_at": "earliest",
    "bad_grad_norm": "bad_replica",
    "bad_weight_norm": "bad_replica",
    # each replica's shard: a mean weighted by its samples; features, then samples summed
    "input_sq": "sample_mean",
    "input_shape": "features_samples",
    # class counts summed, the validity flag of every replica
    "label_hist": "histogram",
    # saturated fraction: weighted mean, rms: root of the weighted mean square, max: max,
    # finite: all, elements: sum
    "forward_rows": "forward",
    "snapshot": "first",  # never read
}


def _is_symbolic(x: Any) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(x))


def _activation_kind(layer: Any) -> str | None:
    """``"tanh"``/``"sigmoid"`` when the layer ends in that activation."""
    fn = getattr(layer, "activation", None)
    name = getattr(fn, "__name__", None)
    if name in ("tanh", "sigmoid"):
        return name
    return None


def _unit_layer(layer: Any) -> bool:
    """Dense and convolution layers: a kernel whose last axis is the output units."""
    from keras import layers as kl

    convs = (kl.Conv1D, kl.Conv2D, kl.Conv3D)
    return isinstance(layer, (kl.Dense, *convs)) and not isinstance(
        layer, (kl.Conv1DTranspose, kl.Conv2DTranspose, kl.Conv3DTranspose)
    )


def leaf_layers(model: Any) -> list[Any]:
    """The model's layers that contain no other layer, in the order they were added."""
    out: list[Any] = []
    seen: set[int] = set()

    def walk(layer: Any) -> None:
        children = getattr(layer, "layers", None)
        if children is None:
            children = getattr(layer, "_layers", None) or []
        children = [c for c in children if isinstance(c, keras.layers.Layer)]
        if not children and layer is not model:
            if id(layer) not in seen and not isinstance(layer, keras.layers.InputLayer):
                seen.add(id(layer))
                out.append(layer)
            return
        for child in children:
            walk(child)

    walk(model)
    return out


#: ``tf.distribute`` strategies that train on one replica in this process: nothing to
#: combine (the default one is private: known by its name).
_SINGLE = ("_DefaultDistributionStrategy", "OneDeviceStrategy")


def distribution(model: Any) -> Any | None:
    """The model's ``tf.distribute.MirroredStrategy``, or None when it trains on one replica.

    Raises:
        ValueError: For the other strategies, naming the strategy.
    """
    if keras.backend.backend() != "tensorflow":
        return None
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return None
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return strategy
    name = type(strategy).__name__
    if name in _SINGLE:
        return None
    raise ValueError(
        f"KerasStethoscope supports tf.distribute.MirroredStrategy, not {name}: its probe "
        "keeps a copy of its variables on each replica and reads them from this process, "
        "which holds every replica only under MirroredStrategy (MultiWorkerMirroredStrategy, "
        "TPUStrategy, ParameterServerStrategy and CentralStorageStrategy are not supported). "
        "Train under MirroredStrategy, or without KerasStethoscope."
    )


class GraphProbe:
    """Installs the in-graph reductions on a compiled Keras model, and removes them.

    Args:
        model: A compiled, built Keras model.
        steps_per_execution: Train steps per call of the train function (loss slots).
        forward: Whether to wrap the leaf layers (activation, output and trace probes).
        strategy: The model's ``MirroredStrategy`` (see :func:`distribution`), or None.
    """

    def __init__(
        self, model: Any, *, steps_per_execution: int, forward: bool, strategy: Any = None
    ) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.k = max(int(steps_per_execution), 1)
        self.eager = _eager_backend()
        # One step per execution, in a graph: the heavy function then runs only on the
        # sampled step, and measures there exactly the probes the step planned, with no cond
        # at all: one function is traced per set of planned probes (a handful per run: the
        # calibration's, the steady state's, each with and without the update norms).
        # Conditional groups cost more (an If op per group, and the host's writes of the
        # request: ~2 ms a sampled MLP step) than the reductions themselves, and the
        # reductions a step did not plan cost ~0.3-0.5 ms more again (the forward rows and
        # data statistics, which a steady state no longer asks for).
        self.whole = self.k == 1 and not self.eager
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync) if strategy is not None else 1
        self.variables = list(model.trainable_variables)
        self.names = tuple(v.path for v in self.variables)
        self.p = len(self.variables)
        self._position = {id(v): i for i, v in enumerate(self.variables)}
        if strategy is not None:
            # the optimizer's all-reduce pairs the gradients with the backing tf variables
            self._position.update({id(v.value): i for i, v in enumerate(self.variables)})
        self.numel = np.array([int(np.prod(v.shape)) for v in self.variables], dtype=np.float64)
        self.is_matrix = np.array([len(v.shape) >= 2 for v in self.variables])
        # dense / convolution kernels: their last axis holds the units
        self.unit_layers: list[tuple[str, int, int]] = []  # (layer name, var position, units)
        layers = leaf_layers(model)
        for layer in layers:
            if not _unit_layer(layer):
                continue
            kernel = getattr(layer, "kernel", None)
            pos = self._position.get(id(kernel))
            if pos is not None and len(kernel.shape) >= 2:
                self.unit_layers.append((layer.name, pos, int(kernel.shape[-1])))
        self.fan_in = np.full(len(self.variables), np.nan)
        for _, pos, units in self.unit_layers:
            self.fan_in[pos] = self.numel[pos] / max(units, 1)
        # A linear Dense/Conv whose output only an activation layer reads is left alone:
        # reading it (even on a sampled step) would keep TensorFlow from fusing the two,
        # and the fused ReLU turns a NaN into 0, where the unfused one passes it on.
        self.forward_layers = [la for la in layers if not _feeds_activation(la)] if forward else []
        self.saw_loss = False
        # positions of the variables the train step hands optimizer.apply, and of those it
        # hands with a gradient: known once apply has been traced (every step when eager)
        self.handed: set[int] = set()
        self.with_grad: set[int] = set()

        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self._make_variables()
        iterations = self.optimizer.iterations
        self._handles = self._fast_handles([*self._own, iterations] if strategy is None else [])
        # under a strategy: every replica's copy of each variable, read with the bare ops
        self._parts = self._replica_handles([*self._own, iterations] if strategy else [])
        # host-side mirrors for eager backends, where a Python bool costs nothing
        self._py_flags = np.zeros(len(GROUPS), dtype=bool)
        self._py_sample_at = -1
        self._py_step = 0
        # Per trace, keyed by thread: a MirroredStrategy traces each replica's step in a
        # thread of its own, interleaved with the others' at its collectives.
        self._loss: dict[int, Any] = {}  # the step's loss, from compute_loss to apply
        # each gradient's sum of squares over 2, by variable position, for a direct ring
        self._squares: dict[int, dict[int, Any]] = {}
        # a direct heavy step's reductions, handed back with its logs (see _store)
        self._stored: dict[int, dict[str, Any]] = {}
        self._rows: dict[int, dict[int, Any]] = {}  # ... and its forward rows, by row
        self._outer: dict[int, Any] = {}  # the graph of the train step being traced
        # what a direct heavy step wrote to variables from inside a control-flow body
        self._written: dict[int, set[int]] = {}
        self._wanted: dict[int, tuple] = {}  # (graph, group predicates, combined ones)
        self._due: dict[int, tuple] = {}  # (planned, forced), from apply to the all-reduce
        self._installed: list[tuple[Any, str]] = []
        # what the function being traced (or run, when eager) carries: "off" outside the
        # train function (evaluation, prediction), else "light" or "heavy" (see the module)
        self._mode = "off"
        self.heavy = False  # the host's choice for the next execution
        # ... and, for a whole heavy function, the planned probes it is traced for
        self.probes: frozenset[str] = frozenset()
        self._probes: frozenset[str] = frozenset()  # those of the function being traced
        # "light", "heavy" (conditional probes), or a whole heavy function's probes
        self._functions: dict[Any, Any] = {}
        # On TensorFlow with one replica the train step returns the loss ring with its
        # logs: the host then reads an output the step computed anyway (a few us) instead of
        # running a read op (~100 us on a busy 2-core CPU, every step).
        self._outputs = keras.backend.backend() == "tensorflow" and strategy is None
        # ... and with one step per execution the ring is no variable at all: the step hands
        # back its loss and whether it took a non-finite record (the host reads both before
        # the next step), which spares the light function the ring's read-modify-write
        self.direct = self._outputs and self.k == 1
        self._ring: Any = None  # the ring the last execution returned, not yet read
        self.last_ring = np.zeros(0, dtype=np.float32)  # the one the host read last
        # what the last heavy execution returned, by the id of the variable (see read())
        self._returned: dict[int, Any] = {}
        self._returned_lr: Any = None
        self._returned_name = {
            id(v): n for v in self._own if (n := self._reduction_of[id(v)]) in _RETURNED
        }
        self._returned_name[id(self.optimizer.iterations)] = "iterations"

    def _make_variables(self) -> None:
        """The probe's variables (per replica under a strategy: created in its scope)."""
        p, u = len(self.variables), sum(n for _, _, n in self.unit_layers)
        f32 = "float32"
        where: dict[str, str] = {}
        if self.strategy is not None:  # each replica writes its own copy, in the graph
            where = {"synchronization": "on_read", "aggregation": "none"}
        self._own: list[Any] = []  # every variable of the probe
        self._reduction_of: dict[int, str] = {}  # each one's name in REDUCTIONS, by id

        def var(shape: Any, value: float, dtype: str = f32, name: str = "") -> Any:
            v = keras.Variable(
                np.full(shape, value, dtype=dtype),
                trainable=False,
                # read as stored, also inside a layer's call under a mixed-precision policy
                autocast=False,
                name=f"stethoscope_{name}",
                **where,
            )
            self._own.append(v)
            self._reduction_of[id(v)] = name
            return v

        # host -> graph: which step to sample, and which probe groups
        self.sample_at = var((), -1, "int64", "sample_at")
        self.flags = var((len(GROUPS),), 0, "int32", "flags")
        # graph -> host
        # the loss of each step of an execution, then a flag: 1 when the graph took a
        # non-finite record (``bad_at``) the host has not read yet; one read tells both
        self.losses = var((self.k + 1,), np.array([np.nan] * self.k + [0.0]), name="losses")
        self.sampled_at = var((), -1, "int64", "sampled_at")
        self.grad_norm = var((p,), np.nan, name="grad_norm")
        self.weight_norm = var((p,), np.nan, name="weight_norm")
        self.update_norm = var((p,), np.nan, name="update_norm")
        self.prev_weight_norm = var((p,), np.nan, name="prev_weight_norm")
        # the first step with a non-finite loss since the host last looked, and its norms
        self.bad_at = var((), -1, "int64", "bad_at")
        self.bad_grad_norm = var((p,), np.nan, name="bad_grad_norm")
        self.bad_weight_norm = var((p,), np.nan, name="bad_weight_norm")
        self.unit_zero = var((max(u, 1),), 0, name="unit_zero")
        self.input_sq = var((MAX_FEATURES,), np.nan, name="input_sq")
        self.input_shape = var((2,), 0, "int64", "input_shape")  # features, samples
        self.label_hist = var((MAX_CLASSES + 3,), 0, name="label_hist")
        self.forward_rows = var(
            (max(len(self.forward_layers), 1), _ROW), np.nan, name="forward_rows"
        )
        # update snapshots: float32 copies of the first variables, up to SNAPSHOT_BUDGET
        # elements in all (the others get no update norm: NaN). A whole heavy function
        # needs no variables: it keeps the tensors it read before the update (_snapshot).
        self.snapshots: dict[int, Any] = {}
        self.snapshot_ids: set[int] = set()
        budget = SNAPSHOT_BUDGET
        for v, n in zip(self.variables, self.numel, strict=True):
            if n > budget:
                break
            budget -= int(n)
            self.snapshot_ids.add(id(v))
            if not self.whole:
                self.snapshots[id(v)] = var(v.shape, 0.0, name="snapshot")

    # -- host side -----------------------------------------------------------------
    def schedule(
        self, step: int, groups: set[str], current: tuple, plan: frozenset[str] = frozenset()
    ) -> tuple:
        """Ask for ``groups`` (the probes of ``plan``) at ``step`` (-1: none). Writes the
        variables only on a change, and never to cancel: a past sample step can no longer
        match the iteration count."""
        self.heavy = step >= 0
        if step < 0:
            return current
        if self.whole:  # the whole heavy function traced for these probes runs: no request
            self.probes = plan & WHOLE_PROBES
            return current
        flags = tuple(1 if g in groups else 0 for g in GROUPS)
        want = (step, flags)
        if want != current:
            if step != current[0]:
                self.write(self.sample_at, np.int64(step))
            if flags != current[1]:
                self.write(self.flags, np.array(flags, dtype="int32"))
            self._py_sample_at = step
            self._py_flags = np.array(flags, dtype=bool)
        return want

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The train function ``fit`` calls: the heavy one when the host asked for probes
        in this execution, else the light one. Each is traced on its first call, in its
        mode; outside of them the wrappers do nothing."""
        key: Any = "light"
        if self.heavy:
            key = self._whole_key(self.probes) if self.whole else "heavy"
        fn = self._functions.get(key)
        if fn is None:  # a set of probes this probe has not been asked for yet
            fn = self._functions[key] = self._make_function()
        self._mode = "light" if key == "light" else "heavy"
        self._probes = key if self.whole and self.heavy else frozenset()
        try:
            logs = fn(*args, **kwargs)
        finally:
            self._mode = "off"
        self._returned, self._returned_lr = {}, None
        if isinstance(logs, dict) and RING_KEY in logs:
            logs = dict(logs)
            self._ring = logs.pop(RING_KEY)
            returned = logs.pop(PROBES_KEY, None)
            if returned:
                self._returned = {
                    i: returned[n] for i, n in self._returned_name.items() if n in returned
                }
                self._returned_lr = returned.get("learning_rate")
        return logs

    def _whole_key(self, probes: frozenset[str]) -> frozenset[str]:
        """The probes of the whole heavy function that serves ``probes``: their own one,
        unless :data:`MAX_WHOLE_FUNCTIONS` are traced and none of them is it."""
        traced = [k for k in self._functions if isinstance(k, frozenset)]
        if probes in self._functions or len(traced) < MAX_WHOLE_FUNCTIONS:
            return probes
        supersets = [k for k in traced if probes <= k]
        return min(supersets, key=len) if supersets else WHOLE_PROBES

    def ring(self) -> np.ndarray:
        """The loss ring after the last execution: the losses of its steps, then the flag;
        a direct ring holds the step's loss, then each variable's gradient sum of squares
        over 2 (0 for a variable the step handed no gradient)."""
        ring, self._ring = self._ring, None
        if ring is None:
            ring = self.read(self.losses)
        elif self.direct:  # read-only, and nothing writes to it
            ring = ring.numpy()
        else:
            ring = np.array(ring)  # a writable copy: the host clears the flag in it
        self.last_ring = ring
        return ring

    def flagged(self, ring: np.ndarray) -> bool:
        """Whether the execution of ``ring`` took a step with a non-finite loss or gradient
        (a direct ring: its own step; else the step in ``bad_at``)."""
        if not self.direct:
            return bool(ring[self.k] != 0.0)
        # a sum of squares past float32's range (a norm over 1.8e19) counts as non-finite,
        # as the norms of a sampled step would say; one Python sum of a few floats is
        # finite when each of them is (a fifth of numpy's isfinite().all() on this size)
        values = ring.tolist()
        return not math.isfinite(sum(values if self.saw_loss else values[1:]))

    def grad_norms(self) -> np.ndarray:
        """The per-variable gradient norms of the last sampled step."""
        if self.direct:
            return np.sqrt(2.0 * self.last_ring[1:])
        return self.read(self.grad_norm)

    def forced_norms(self, replica: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The gradient and weight norms of the flagged step. A direct ring holds the
        gradients'; its weights, after the update, are still the model's (no step ran
        since), read here off the healthy path."""
        if not self.direct:
            return self.read(self.bad_grad_norm, replica), self.read(self.bad_weight_norm, replica)
        weights = [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in self.variables]
        return self.grad_norms(), np.array([np.sqrt(np.sum(w * w)) for w in weights])

    def read(self, var: Any, replica: int | None = None) -> np.ndarray:
        """A variable's value on the host: TensorFlow's bare read op where it applies (about
        20 us against 70-140 us through ``keras.ops``; it runs once per step).

        Under a strategy: every replica's copy, combined as :data:`REDUCTIONS` declares
        (one bare read per replica), or the copy of ``replica`` alone.

        After a heavy execution on TensorFlow with one replica, the values it handed back
        with its logs (:data:`PROBES_KEY`): the train step read them after its own writes,
        so they are the same numbers, without a read op per variable (~80 us each)."""
        returned = self._returned.get(id(var))
        if returned is not None and replica is None:
            return np.asarray(returned)
        handle = self._handles.get(id(var))
        if handle is None:
            if id(var) in self._parts:
                return self._combine(var, replica)
            return np.asarray(keras.ops.convert_to_numpy(var))
        import tensorflow as tf

        return tf.raw_ops.ReadVariableOp(resource=handle[0], dtype=handle[1]).numpy()

    def write(self, var: Any, value: np.ndarray) -> None:
        """Assign from the host (the bare op on TensorFlow, as :meth:`read`); under a
        strategy, into every replica's copy."""
        self._returned.pop(id(var), None)
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

    def copies(self, var: Any) -> list[np.ndarray]:
        """Each replica's copy of a variable, in replica order (one copy without a strategy)."""
        parts = self._parts.get(id(var))
        if parts is None:
            return [self.read(var)]
        import tensorflow as tf

        return [tf.raw_ops.ReadVariableOp(resource=h, dtype=d).numpy() for h, d, _ in parts]

    def bad_replica(self) -> int:
        """The replica that recorded the earliest non-finite loss still held (0 if none)."""
        seen = [(int(at), r) for r, at in enumerate(self.copies(self.bad_at)) if at >= 0]
        return min(seen)[1] if seen else 0

    def _combine(self, var: Any, replica: int | None) -> np.ndarray:
        parts = self.copies(var)
        if replica is not None:
            return parts[replica]
        how = REDUCTIONS.get(self._reduction_of.get(id(var), ""), "first")
        if how == "first":
            return parts[0]
        if how == "sum":
            return np.sum(parts, axis=0, dtype=parts[0].dtype)
        if how == "earliest":
            seen = [int(p) for p in parts if p >= 0]
            return np.int64(min(seen) if seen else -1)
        if how == "bad_replica":
            return parts[self.bad_replica()]
        if how == "features_samples":
            return np.array([parts[0][0], sum(int(p[1]) for p in parts)], dtype=np.int64)
        if how == "sample_mean":
            w = np.array([float(p[1]) for p in self.copies(self.input_shape)])
            if w.sum() <= 0:
                return parts[0]
            return (np.tensordot(w, np.stack(parts), axes=1) / w.sum()).astype(parts[0].dtype)
        if how == "histogram":
            out = np.sum(parts, axis=0, dtype=parts[0].dtype)
            out[-1] = min(p[-1] for p in parts)  # the validity flag: of every replica
            return out
        if how == "forward":
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
        raise AssertionError(f"no reduction {how!r}")  # pragma: no cover - REDUCTIONS is fixed

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

    def _fast_handles(self, variables: list) -> dict[int, tuple]:
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

    def _replica_handles(self, variables: list) -> dict[int, list[tuple]]:
        """Per variable, the bare handle of each replica's copy (a distributed variable's
        components are plain resource variables)."""
        handles: dict[int, list[tuple]] = {}
        for v in variables:
            copies = getattr(v.value, "values", None)
            if copies is None:
                continue
            handles[id(v)] = [(c.handle, c.dtype, c.dtype.as_numpy_dtype) for c in copies]
        return handles

    def start(self, step: int) -> None:
        """The optimizer's iteration count at the start of a fit (eager backends count it)."""
        self._py_step = step

    def install(self) -> None:
        """Wrap compute_loss, optimizer.apply and the leaf layers' call; make the light and
        the heavy train functions (traced on their first calls) and hand ``fit`` the
        dispatcher between them."""
        if self._installed:
            return
        model, opt = self.model, self.optimizer
        self._wrap(model, "compute_loss", self._compute_loss_wrapper(model.compute_loss))
        if self._outputs:
            self._wrap(model, "train_step", self._train_step_wrapper(model.train_step))
        self._wrap(opt, "apply", self._apply_wrapper(opt.apply))
        if self.strategy is not None:
            reduce = opt._all_reduce_sum_gradients
            self._wrap(opt, "_all_reduce_sum_gradients", self._all_reduce_wrapper(reduce))
        for i, layer in enumerate(self.forward_layers):
            self._wrap(layer, "call", self._call_wrapper(layer, i, layer.call))
        self._retrace()
        # A later fit of the same model reuses the functions, already traced: tracing them
        # again would cost each fit a second or more. They hold the graph, not the wrappers
        # (which are back on while they run, for a retrace on a new input shape). A whole
        # heavy function is made when a step first plans its set of probes (dispatch).
        for mode in ("light",) if self.whole else ("light", "heavy"):
            if mode not in self._functions:
                self._functions[mode] = self._make_function()
        model.train_function = self.dispatch

    def _make_function(self) -> Any:
        """A new train function of the model (traced on its first call), leaving ``fit``
        the dispatcher."""
        self.model.make_train_function(force=True)
        fn = self.model.train_function
        self.model.train_function = self.dispatch
        return fn

    def remove(self) -> None:
        """Take every wrapper off and drop the traced functions that contain them."""
        if not self._installed:
            return
        for owner, attr in reversed(self._installed):
            if attr in vars(owner):
                delattr(owner, attr)
        self._installed = []
        self._retrace()

    def observed(self) -> np.ndarray:
        """Positions of the variables the train step updates with a gradient (the others'
        norms are NaN placeholders, not measurements); all of them before the first step."""
        if not self.with_grad:
            return np.arange(len(self.variables))
        return np.array(sorted(self.with_grad))

    def unoptimized(self) -> tuple[str, ...]:
        """Trainable variables the train step never hands ``optimizer.apply``."""
        if not self.handed:
            return ()
        return tuple(n for i, n in enumerate(self.names) if i not in self.handed)

    def _wrap(self, owner: Any, attr: str, fn: Any) -> None:
        if attr in vars(owner):  # someone else's instance attribute: keep it, wrap it
            raise RuntimeError(
                f"stethoscope: {type(owner).__name__}.{attr} is already replaced on this "
                "instance (another KerasStethoscope in the same fit?); use one per model"
            )
        setattr(owner, attr, fn)
        self._installed.append((owner, attr))

    def _retrace(self) -> None:
        """Drop the model's traced functions (they may hold the wrappers, or lack them)."""
        model = self.model
        self._loss.clear()
        self._squares.clear()
        self._stored.clear()
        self._rows.clear()
        self._outer.clear()
        self._written.clear()
        self._wanted.clear()
        self._due.clear()
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(model, attr):
                setattr(model, attr, None)

    # -- in the graph --------------------------------------------------------------------
    def _want(self, *groups: str) -> Any:
        """Whether any of ``groups`` is computed at this step (a bool tensor, or a Python
        bool when eager; always ``False`` outside the heavy function). The comparison with
        the host's request is built once per graph and step (and replica), whichever
        wrapper runs first, and shared by the others."""
        if self._mode != "heavy":
            return False
        if self.whole:
            return any(self._probes & _SERVES[g] for g in groups)
        if self.eager:
            due = self._py_step == self._py_sample_at
            return bool(due and any(self._py_flags[_G[g]] for g in groups))
        import tensorflow as tf  # the only graph backend

        # in a traced function, once per graph; run eagerly (run_eagerly=True), every call
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        # each replica compares its own copies (on its own device)
        thread = threading.get_ident()
        cached = self._wanted.get(thread)
        if graph is None or cached is None or cached[0] is not graph:
            due = ops.equal(ops.cast(self.optimizer.iterations, "int64"), self.sample_at)
            on = ops.logical_and(due, ops.greater(self.flags, 0))
            cached = self._wanted[thread] = (graph, ops.unstack(on, len(GROUPS)), {})
        _, on, combined = cached
        if groups not in combined:
            pred = on[_G[groups[0]]]
            for g in groups[1:]:
                pred = ops.logical_or(pred, on[_G[g]])
            combined[groups] = pred
        return combined[groups]

    def _cond(self, pred: Any, fn: Any) -> None:
        if isinstance(pred, bool):
            if pred:
                fn()
            return
        ops.cond(pred, fn, lambda: None)

    def _compute_loss_wrapper(self, original: Any) -> Any:
        takes_training = "training" in inspect.signature(original).parameters

        @functools.wraps(original)
        def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
            if takes_training:
                loss = original(x, y, y_pred, sample_weight, training=training)
            else:
                loss = original(x, y, y_pred, sample_weight)
            if not training or self._mode == "off" or _is_symbolic(loss):
                return loss
            self.saw_loss = True
            value = ops.cast(loss if _scalar(loss) else ops.reshape(loss, ()), "float32")
            if not self.direct:  # the direct ring's loss is an output, never differentiated
                value = ops.stop_gradient(value)
            if not self.direct:
                slot = 0 if self.k == 1 else ops.mod(self.optimizer.iterations, self.k)
                _put(self.losses, slot, value)
            if not self.eager:  # apply tests it with the gradients, and the ring carries it
                self._loss[threading.get_ident()] = value

            def data() -> None:
                self._cond(self._want("inputs"), lambda: self._input_stats(x))
                self._cond(self._want("labels"), lambda: self._label_stats(y))

            self._cond(self._want("inputs", "labels"), data)
            return loss

        return compute_loss

    def _train_step_wrapper(self, original: Any) -> Any:
        @functools.wraps(original)
        def train_step(*args, **kwargs):
            thread = threading.get_ident()
            if self._mode != "off":
                self._outer[thread] = _graph()
            logs = original(*args, **kwargs)
            if self._mode == "off":
                return logs
            value, squares = self._loss.pop(thread, None), self._squares.pop(thread, {})
            if not isinstance(logs, dict):
                return logs
            if self.direct:
                if value is None:  # the step never called compute_loss
                    value = ops.convert_to_tensor(np.float32(np.nan))
                zero = ops.convert_to_tensor(np.float32(0.0))
                ring = ops.stack([value, *(squares.get(i, zero) for i in range(self.p))])
            else:  # read after the step's own writes to it (automatic control dependencies)
                ring = ops.convert_to_tensor(self.losses)
            out = {**logs, RING_KEY: ring}
            if self._mode == "heavy":
                out[PROBES_KEY] = self._handed_back()
            return out

        return train_step

    def _handed_back(self) -> dict[str, Any]:
        """The heavy step's measurements for its logs: a direct step's own tensors, else
        its variables, read after its writes."""
        if self.direct:
            thread = threading.get_ident()
            out = self._stored.pop(thread, {})
            rows = self._rows.pop(thread, {})
            # what a control-flow body (a recurrent cell's loop) wrote to variables instead
            written = self._written.pop(thread, set())
            for v in self._own:
                if id(v) in written:
                    out[self._reduction_of[id(v)]] = _value(v)
            if "sampled_at" not in out:  # a step that planned none of the groups storing it
                out["sampled_at"] = ops.cast(self.optimizer.iterations, "int64") - 1
            if self.forward_layers and (rows or self._probes & _SERVES["forward"]):
                # NaN for a layer the step did not call, or whose row no planned probe reads
                nan = ops.convert_to_tensor(np.full(_ROW, np.nan, dtype=np.float32))
                in_variable = any(r is _IN_VARIABLE for r in rows.values())
                table = _value(self.forward_rows) if in_variable else None
                out["forward_rows"] = ops.stack(
                    [
                        table[i] if rows.get(i) is _IN_VARIABLE else rows.get(i, nan)
                        for i in range(len(self.forward_layers))
                    ]
                )
        else:
            out = {
                self._reduction_of[id(v)]: ops.convert_to_tensor(v)
                for v in self._own
                if id(v) in self._returned_name
            }
        out["iterations"] = ops.convert_to_tensor(self.optimizer.iterations)
        # a constant, or the schedule's value at the step count (as the host would read it);
        # an optimizer that does not expose one number leaves it to the host to ask
        with contextlib.suppress(Exception):
            out["learning_rate"] = ops.cast(self.optimizer.learning_rate, "float32")
        return out

    def learning_rate(self) -> float | None:
        """The optimizer's learning rate after the last execution (None if unknown)."""
        try:
            lr = self._returned_lr
            if lr is None:  # not handed back: ask the optimizer
                lr = keras.ops.convert_to_numpy(self.optimizer.learning_rate)
            value = float(np.asarray(lr))
        except Exception:  # a schedule or wrapper that does not expose one number
            return None
        return value if np.isfinite(value) else None

    def _apply_wrapper(self, original: Any) -> Any:
        @functools.wraps(original)
        def apply(grads, trainable_variables=None):
            if trainable_variables is None or self._mode == "off" or _is_symbolic(grads):
                return original(grads, trainable_variables)
            grads, tvars = list(grads), list(trainable_variables)
            for g, v in zip(grads, tvars, strict=True):
                pos = self._position.get(id(v))
                if pos is not None:
                    self.handed.add(pos)
                    if g is not None:
                        self.with_grad.add(pos)
            want = {g: self._want(g) for g in ("grads", "units", "weights", "updates")}
            # A non-finite loss or gradient: measure its step. TF's fused ReLU turns a NaN
            # input into 0, leaving the loss finite and the kernel's gradient NaN, so every
            # gradient is tested. With a direct ring each gradient's sum of squares rides
            # back with the loss (one op per gradient, no cond: each op of the light step
            # costs 10-50 us on a busy CPU, whatever its size), and the host tests them,
            # names the parameter and takes the norms. Else one sum of the loss and every
            # gradient opens a cond that records the norms, and the record waits for the
            # host, not overwritten.
            thread = threading.get_ident()
            loss = [self._loss[thread]] if thread in self._loss else []
            if not self.direct:
                self._loss.pop(thread, None)
            forced: Any = False
            if self.direct:
                grads, self._squares[thread] = _checked(grads, tvars, self._position)
            elif not self.eager:
                parts = loss + [ops.sum(ops.cast(g, "float32")) for g in grads if g is not None]
                if parts:
                    forced = ops.logical_not(ops.isfinite(ops.sum(ops.stack(parts))))
                    forced = ops.logical_and(forced, ops.less(self.bad_at, 0))
            if self.strategy is not None:
                # the all-reduced gradients exist only inside the optimizer: measured there
                self._due[thread] = (want, forced)
            if self._mode == "light":
                # every step the sampler skips: the update, and (unless the ring is direct)
                # one cond that only a non-finite loss or gradient opens
                original(grads, tvars)
                if forced is not False:
                    self._cond(forced, lambda: self._forced_record(grads, tvars))
                if self.eager:
                    self._py_step += 1
                return None
            if self.strategy is None:
                self._from_grads(grads, tvars, want, forced, scaled=True)

            # The update itself runs outside any cond: wrapped in one, it cost ~10% of an MLP
            # step on every step. A sampled update step copies the weights into the
            # snapshot variables first, and measures against them after.
            before = self._before(tvars) if want["updates"] is True else {}
            if not isinstance(want["updates"], bool):
                self._cond(want["updates"], lambda: self._snapshot(tvars))
            original(grads, tvars)

            def after() -> None:
                self._cond(want["updates"], lambda: self._weight_stats(tvars, before, want, forced))
                self._cond(
                    not want["updates"]
                    if isinstance(want["updates"], bool)
                    else ops.logical_not(want["updates"]),
                    lambda: self._weight_stats(tvars, None, want, forced),
                )

            self._cond(_either(want["weights"], forced), after)
            if self.eager:
                self._py_step += 1

        return apply

    def _all_reduce_wrapper(self, original: Any) -> Any:
        """Under a strategy: the gradient statistics of the sampled (or non-finite) step,
        taken from the gradients summed across replicas, the ones the optimizer applies.

        A collective inside the sampled step's ``cond`` is refused by ``MirroredStrategy``
        (``merge_call`` inside control flow), so the statistics cannot all-reduce the
        gradients themselves; the optimizer's own all-reduce (Keras' TF optimizer) runs on
        every step and hands each replica the same sum."""

        @functools.wraps(original)
        def all_reduce(grads_and_vars):
            reduced = list(original(grads_and_vars))
            due = self._due.pop(threading.get_ident(), None)
            if due is not None:
                want, forced = due
                grads, tvars = [g for g, _ in reduced], [v for _, v in reduced]
                self._from_grads(grads, tvars, want, forced, scaled=False)
            return reduced

        return all_reduce

    def _from_grads(
        self, grads: list, tvars: list, want: dict, forced: Any, *, scaled: bool
    ) -> None:
        """The gradient reductions of a sampled step, and of a non-finite one (``forced``)."""

        def from_grads() -> None:
            into = self.grad_norm
            if not self.direct:  # else the host takes them from the ring
                self._cond(want["grads"], lambda: self._grad_stats(grads, tvars, into, scaled))
            into_bad = self.bad_grad_norm
            self._cond(forced, lambda: self._grad_stats(grads, tvars, into_bad, scaled))
            if self.unit_layers:
                self._cond(want["units"], lambda: self._unit_stats(grads, tvars))

        self._cond(_either(self._want("grads", "units"), forced), from_grads)

    def _call_wrapper(self, layer: Any, row: int, original: Any) -> Any:
        kind = _activation_kind(layer)
        bound = _SATURATED_OUTPUT.get(kind) if kind else None

        @functools.wraps(original)
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            if self._mode != "heavy" or out is None or _is_symbolic(out):
                return out
            first = next((t for t in keras.tree.flatten(out) if t is not None), None)
            if first is None or not _is_float(first):
                return out
            # Cut the tape before the cond: an op that the gradient tape records inside the
            # forward pass makes TensorFlow keep its branch's intermediates for a backward
            # pass that never comes, on every step (measured: +8% on an MLP step).
            seen = ops.stop_gradient(first)
            if self.whole:  # only a row that the host reads for a planned probe
                probes = self._probes
                pred = "trace" in probes or bool(
                    ("activations" in probes and kind is not None)
                    or ("outputs" in probes and _unit_layer(layer))
                )
            else:
                pred = self._want("forward", "trace")
            self._cond(pred, lambda: self._forward_stats(row, seen, kind, bound))
            return out

        return call

    # -- reductions (inside the cond branches) ------------------------------------------
    def _full(self, values: dict[int, Any]) -> Any:
        """A vector over every watched variable: the values given, NaN for the others."""
        nan = ops.convert_to_tensor(np.float32(np.nan))
        return ops.stack([values.get(i, nan) for i in range(len(self.variables))])

    def _norms(self, halves: dict[int, Any]) -> Any:
        """The norms of every watched variable from its :func:`_half_square` (NaN for the
        others): one op per tensor, then two for the vector."""
        return ops.sqrt(ops.multiply(self._full(halves), 2.0))

    def _store(self, var: Any, value: Any) -> None:
        """Record a reduction: a direct heavy step hands it back with its logs (no write and
        no read of a variable: two ops fewer, each 10-50 us on a busy CPU); else it goes
        into its variable."""
        if self.direct and self._mode == "heavy":
            thread = threading.get_ident()
            if not self._nested(thread):
                self._stored.setdefault(thread, {})[self._reduction_of[id(var)]] = value
                return
            self._written.setdefault(thread, set()).add(id(var))
        var.assign(value)

    def _nested(self, thread: int) -> bool:
        """Whether the op being built sits in a control-flow body (a recurrent cell's while
        loop, a cond) rather than in the train step's own graph: a tensor made there cannot
        leave it, so it goes through its variable, read back after the loop."""
        outer = self._outer.get(thread)
        return outer is not None and _graph() is not outer

    def _grad_stats(self, grads: list, tvars: list, into: Any, scaled: bool) -> None:
        """Per-variable norms; ``scaled``: the gradients still carry the loss scale."""
        scale = getattr(self.optimizer, "loss_scale_factor", None) if scaled else None
        halves: dict[int, Any] = {}
        for g, v in zip(grads, tvars, strict=True):
            pos = self._position.get(id(v))
            if pos is not None and g is not None:
                halves[pos] = _half_square(g)
        norms = self._norms(halves)
        into.assign(norms / scale if scale else norms)
        if into is self.grad_norm:
            self.sampled_at.assign(ops.cast(self.optimizer.iterations, "int64"))

    def _forced_record(self, grads: list, tvars: list) -> None:
        """The light function's record of a step whose loss or gradient was not finite: its
        gradient norms (under a strategy the all-reduce wrapper took those), and its weight
        norms after the update."""
        if self.strategy is None:
            self._grad_stats(grads, tvars, self.bad_grad_norm, True)
        weights = {
            self._position[id(v)]: _half_square(ops.convert_to_tensor(v))
            for v in tvars
            if id(v) in self._position
        }
        self.bad_weight_norm.assign(self._norms(weights))
        self._mark_bad(ops.cast(self.optimizer.iterations, "int64") - 1)

    def _mark_bad(self, step: Any) -> None:
        """Say which step the non-finite record is of, and raise the flag the host reads
        with the losses."""
        self.bad_at.assign(step)
        _put(self.losses, self.k, ops.convert_to_tensor(1.0, "float32"))

    def _unit_stats(self, grads: list, tvars: list) -> None:
        by_pos = {self._position.get(id(v)): g for g, v in zip(grads, tvars, strict=True)}
        parts = []
        for _, pos, units in self.unit_layers:
            g = by_pos.get(pos)
            if g is None:
                parts.append(ops.zeros((units,), "float32"))
                continue
            axes = tuple(range(len(g.shape) - 1))
            rows = ops.sum(ops.square(ops.cast(g, "float32")), axis=axes)
            parts.append(ops.cast(ops.equal(rows, 0.0), "float32"))
        self._store(self.unit_zero, ops.concatenate(parts))
        self._store(self.sampled_at, ops.cast(self.optimizer.iterations, "int64"))

    def _before(self, tvars: list) -> dict[int, Any]:
        """The weights before the update, by variable id: in a whole heavy function, the
        tensors it reads (a TensorFlow variable read is an alias that the update copies
        before it writes: one copy of the weights, where a snapshot variable costs a copy
        in and a read out). Else (inside a cond, or eager, where a read is the live
        tensor) they are copied into the snapshot variables, and none is returned."""
        if self.whole:
            return {id(v): _value(v) for v in tvars if id(v) in self.snapshot_ids}
        self._snapshot(tvars)
        return {}

    def _snapshot(self, tvars: list) -> None:
        """Copy the weights that have a snapshot variable, before the update."""
        for v in tvars:
            snap = self.snapshots.get(id(v))
            if snap is not None:
                snap.assign(v)

    def _weight_stats(
        self, tvars: list, before: dict[int, Any] | None, want: dict, forced: Any
    ) -> None:
        """After the update: weight norms (and, with ``before``, update norms against the
        weights before it, or else the snapshot variables) into the planned record when
        planned, into the non-finite record when ``forced``."""
        updates = before is not None
        weights: dict[int, Any] = {}
        changes: dict[int, Any] = {}
        prev: dict[int, Any] = {}
        for v in tvars:
            pos = self._position.get(id(v))
            if pos is None:
                continue
            now = _value(v)
            weights[pos] = _half_square(now)
            old = None
            if before is not None:
                old = before.get(id(v))
                if old is None and id(v) in self.snapshots:
                    old = ops.convert_to_tensor(self.snapshots[id(v)])
            if old is not None:
                old = ops.cast(old, "float32")
                changes[pos] = _half_square(ops.subtract(ops.cast(now, "float32"), old))
                prev[pos] = _half_square(old)
        full = self._norms(weights)
        step = ops.cast(self.optimizer.iterations, "int64") - 1  # apply has counted it

        def record() -> None:
            self._store(self.weight_norm, full)
            if updates:
                self._store(self.update_norm, self._norms(changes))
                self._store(self.prev_weight_norm, self._norms(prev))
            self._store(self.sampled_at, step)

        def record_forced() -> None:
            self.bad_weight_norm.assign(full)
            self._mark_bad(step)

        self._cond(want["weights"], record)
        self._cond(forced, record_forced)

    def _input_stats(self, x: Any) -> None:
        t = next(
            (t for t in keras.tree.flatten(x) if t is not None and _is_float(t)),
            None,
        )
        if t is None or len(t.shape) < 1:
            return
        t = ops.cast(ops.stop_gradient(t), "float32")
        features = t.shape[-1] if len(t.shape) >= 2 else 1
        if features is None or features > MAX_FEATURES:
            flat = ops.reshape(t, (-1, 1))
            features = 1
        else:
            flat = ops.reshape(t, (-1, features))
        mean_sq = ops.mean(ops.square(flat), axis=0)
        padded = ops.pad(mean_sq, [(0, MAX_FEATURES - features)], constant_values=np.nan)
        self._store(self.input_sq, padded)
        samples = ops.cast(ops.shape(t)[0], "int64")
        self._store(
            self.input_shape, ops.stack([ops.convert_to_tensor(features, "int64"), samples])
        )

    def _label_stats(self, y: Any) -> None:
        t = next((t for t in keras.tree.flatten(y) if t is not None), None)
        if t is None:
            return
        if len(t.shape) == 2 and t.shape[-1] == 1:
            t = ops.reshape(t, (-1,))
        dtype = keras.backend.standardize_dtype(t.dtype)
        valid = ops.convert_to_tensor(1.0, "float32")
        if len(t.shape) == 1 and "int" in dtype:
            labels = ops.cast(t, "int32")
        elif len(t.shape) == 2 and _is_float(t) and t.shape[-1] is not None and t.shape[-1] >= 2:
            rows_ok = ops.logical_and(
                ops.all(ops.less(ops.abs(ops.sum(t, axis=1) - 1.0), 1e-3)),
                ops.all(ops.greater_equal(t, 0)),
            )
            valid = ops.cast(rows_ok, "float32")
            labels = ops.cast(ops.argmax(t, axis=1), "int32")
        else:
            return
        c = MAX_CLASSES
        # bins: 0..c-1 the classes, c: negative (ignored targets), c+1: too many classes
        index = ops.where(ops.greater_equal(labels, c), c + 1, labels)
        index = ops.where(ops.less(labels, 0), c, index)
        counts = ops.sum(ops.one_hot(index, c + 2, dtype="float32"), axis=0)
        self._store(self.label_hist, ops.concatenate([counts, ops.reshape(valid, (1,))]))

    def _forward_stats(self, row: int, t: Any, kind: str | None, bound: float | None) -> None:
        t = ops.cast(ops.stop_gradient(t), "float32")
        a = ops.abs(t)
        if bound is None:
            sat = ops.convert_to_tensor(np.float32(np.nan))
        elif kind == "tanh":
            sat = ops.mean(ops.cast(ops.greater_equal(a, bound), "float32"))
        else:  # sigmoid: near 1 or near 0
            near = ops.logical_or(ops.greater_equal(t, bound), ops.less_equal(t, 1.0 - bound))
            sat = ops.mean(ops.cast(near, "float32"))
        finite = ops.cast(ops.all(ops.isfinite(t)), "float32")
        count = ops.cast(ops.size(t), "float32")
        values = ops.stack([sat, ops.sqrt(ops.mean(ops.square(t))), ops.max(a), finite, count])
        thread = threading.get_ident()
        if self.direct and not self._nested(thread):  # handed back with the logs (_store)
            self._rows.setdefault(thread, {})[row] = values
            return
        if self.direct:  # read back after the loop (see _handed_back)
            self._rows.setdefault(thread, {})[row] = _IN_VARIABLE
        _put(self.forward_rows, row, values)

    def forward_kinds(self) -> list[tuple[str, str | None, bool]]:
        """Per forward row: (layer name, tanh/sigmoid or None, whether it has units)."""
        return [
            (layer.name, _activation_kind(layer), _unit_layer(layer))
            for layer in self.forward_layers
        ]


def _put(var: Any, index: Any, value: Any) -> None:
    """``var[index] = value`` along the first axis, with a mask: ``ops.slice_update`` is an
    XLA op on TensorFlow, which the CPU runs through an on-demand compilation (~20 us more
    per call, on every step for the loss ring)."""
    n = var.shape[0]
    hit = ops.equal(ops.arange(n, dtype="int32"), ops.cast(index, "int32"))
    if len(var.shape) > 1:
        hit = ops.reshape(hit, (n,) + (1,) * (len(var.shape) - 1))
    var.assign(ops.where(hit, value, var))


def _scalar(t: Any) -> bool:
    """Whether ``t`` is known to be a scalar (a reshape to one is then an op for nothing)."""
    try:
        return len(t.shape) == 0
    except (TypeError, ValueError):  # an unknown rank
        return False


def _graph() -> Any:
    """The TensorFlow graph ops are being built in (None when eager, or on another
    backend)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _value(v: Any) -> Any:
    """A variable's value now, as a tensor. ``keras.ops.convert_to_tensor`` hands back the
    TensorFlow variable itself, which every op that uses it reads anew (after an update
    in between, too)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(v.value)
    return ops.convert_to_tensor(v)


def _half_square(t: Any) -> Any:
    """``sum(t**2) / 2`` in float32, in one op on TensorFlow (``tf.nn.l2_loss``)."""
    t = ops.cast(t, "float32")
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.l2_loss(t)
    return ops.sum(ops.square(t)) / 2.0


def _checked(grads: list, tvars: list, position: dict[int, int]) -> tuple[list, dict]:
    """Each gradient's :func:`_half_square`, by variable position, and the gradients to
    hand the optimizer: each one after its own sum (a control dependency on an identity,
    no copy). The optimizer's element-wise ops then find the gradient's buffer with no
    other reader left and update in place; measured on the benchmark MLP, the check costs
    half as much as when it races them."""
    import tensorflow as tf

    squares: dict[int, Any] = {}
    out = list(grads)
    for i, (g, v) in enumerate(zip(grads, tvars, strict=True)):
        if g is None or id(v) not in position:
            continue
        sq = squares[position[id(v)]] = _half_square(g)
        with tf.control_dependencies([sq]):
            out[i] = tf.identity(g)
    return out, squares


def _either(a: Any, b: Any) -> Any:
    """``a or b`` for Python bools and bool tensors alike, folding the constants away."""
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return ops.logical_or(a, b)


def _feeds_activation(layer: Any) -> bool:
    """Whether ``layer`` is a Dense/Conv without an activation of its own whose output only
    activation layers read (known for Sequential and functional models)."""
    from keras import layers as kl

    own = getattr(getattr(layer, "activation", None), "__name__", "")
    if not _unit_layer(layer) or own not in ("linear", ""):
        return False
    consumers = [getattr(n, "operation", None) for n in getattr(layer, "_outbound_nodes", [])]
    acts = (kl.Activation, kl.ReLU, kl.LeakyReLU, kl.ELU, kl.PReLU, kl.Softmax)
    return bool(consumers) and all(isinstance(c, acts) for c in consumers)


def _is_float(t: Any) -> bool:
    return "float" in keras.backend.standardize_dtype(t.dtype)


def _eager_backend() -> bool:
    """Whether the train step runs eagerly in Python (torch): then the host's own booleans
    choose the branches, since a tensor predicate would cost a device sync each step.
    TensorFlow's ``run_eagerly=True`` needs no special case: its conds resolve eagerly."""
    return keras.backend.backend() == "torch"
