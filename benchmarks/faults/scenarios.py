"""The fault scenarios and healthy controls, declared as data, with no framework in them.

A :class:`Scenario` says what to train (:class:`ModelSpec`, :class:`~.data.DataSpec`,
:class:`TrainSpec`), what goes wrong and when (:class:`FaultSpec`, ``onset``), which
detector must name it (``expect``), within how many steps (``window``), and which
other detectors may fire without it counting as a misdiagnosis (``collateral``).
A framework implementation (``lightning_suite.py``, ``keras_suite.py``) turns
the spec into a model and a training run; the scoring in ``metrics.py`` is shared.

Conventions every implementation follows:

* Steps are global optimizer steps, 0-based: "step 150" is the 151st batch. A fault
  with ``onset=150`` is present in the forward pass, backward pass or optimizer
  update of step 150, as its kind says, and a detection at step 150 has latency 0.
* "Layer ``i``" is the ``i``-th layer with weights, counted from the input and
  0-based: an MLP of depth 2 has layers 0 and 1 (hidden) and 2 (output); the CNN
  has 0 and 1 (convolutions) and 2 (the classifier); the GRU has 0 (the GRU) and 1
  (the classifier). Its "weight" is its first weight tensor (``weight_ih`` for a GRU).
* ``expect`` holds the detectors that name the cause; any of them counts. Where
  two detectors are equally right (an LR that grows until training diverges shows
  both as unstable loss and as exploding gradients) both are listed.
* ``collateral`` holds the detectors that report true consequences of the fault
  (a NaN loss makes the next gradients NaN; killed units make the loss jump). A
  warning or error from any detector outside ``expect`` and ``collateral`` is a
  misdiagnosis. Collateral follows from what the fault does to the numbers a
  detector reads, never from what a detector happened to report.

Fault kinds (``FaultSpec.kind``) and their parameters:

``nan_input``        one input value of the batch at ``onset`` is NaN.
``inf_gradient``     one element of layer ``layer``'s weight gradient is +Inf at
                     ``onset`` (a tensor hook on the backward pass).
``inf_gradients``    the same at every step from ``onset`` on (an op that overflows
                     float16 in every backward pass).
``nan_weight``       right after the optimizer update of ``onset``, one element of
                     layer ``layer``'s weight is NaN (a buggy custom optimizer).
``lr_scale``         from ``onset`` on, every learning rate is multiplied by ``factor``.
``lr_growth``        from ``onset`` on, every learning rate is multiplied by
                     ``factor`` at every step (a schedule bug: exponential growth).
``corrupt_labels``   the batch at ``onset`` has every label shifted by one class.
``scale_inputs``     the batch at ``onset`` has its inputs multiplied by ``factor``.
``kill_units``       at ``onset``, before its forward pass, the biases of a
                     ``fraction`` of layer ``layer``'s units are set to ``bias``
                     (-100: those ReLU units never activate again).
``init_scale``       at initialisation, every hidden layer's weight is multiplied
                     by ``factor`` (biases untouched).
``init_std``         at initialisation, every weight is drawn from N(0, ``std``²)
                     with no fan-in scaling, and every bias is 0.
``zero_init``        at initialisation, the weights of ``layers`` are all zero.
``exclude_layer``    layer ``layer``'s parameters are left out of the optimizer
                     (they still require grad and still receive gradients).
``zero_lr_group``    layer ``layer``'s parameters are in their own parameter group
                     with learning rate 0.
``no_zero_grad``     from ``onset`` on, the gradients are never zeroed (each step's
                     gradient is the running sum of all before it); Lightning only:
                     Keras' ``fit`` takes each step's gradients afresh.
``eval_mode``        at ``onset``, before its forward pass, the model is put in eval
                     mode and left there (a side evaluation that never calls
                     ``.train()``); Lightning only: Keras' ``fit`` cannot.
``stuck_batch``      from ``onset`` on, the loader serves the batch of ``onset``
                     again and again (a loader that caches a batch).

Data faults (random labels, label imbalance, unnormalized inputs) live in
:class:`~.data.DataSpec`; configuration faults (an LR far too high or too low) in
:class:`TrainSpec`. Both have ``onset=0``: the fault is there from the first step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.faults.data import DataSpec
from stethoscope.detectors import DETECTORS

__all__ = [
    "DETECTOR_NAMES",
    "FAULT_KINDS",
    "PRECISIONS",
    "SCENARIOS",
    "SETTINGS",
    "FaultSpec",
    "ModelSpec",
    "Scenario",
    "TrainSpec",
    "resolve_onset",
    "select",
    "setting_kwargs",
]

FAULT_KINDS = (
    "nan_input",
    "inf_gradient",
    "inf_gradients",
    "nan_weight",
    "lr_scale",
    "lr_growth",
    "corrupt_labels",
    "scale_inputs",
    "kill_units",
    "init_scale",
    "init_std",
    "zero_init",
    "exclude_layer",
    "zero_lr_group",
    "no_zero_grad",
    "eval_mode",
    "stuck_batch",
)

#: The detector names the library registers (the stable names of docs/detectors.md, which
#: ``tests/test_contract.py`` holds the library to): ``expect`` and ``collateral`` use them.
DETECTOR_NAMES = frozenset(DETECTORS)

#: The three sampling settings of "Adaptive sampling, shown", in words; each
#: implementation maps them to its callback's arguments.
SETTINGS: dict[str, str] = {
    "adaptive": "the default: loss every step, costlier detectors at their base intervals "
    "(stretched to keep within the default overhead budget of 1% of step time), every "
    "step for a while at the start and after any suspicion",
    "every": "every detector every step (intervals of 1, escalation off)",
    "sparse": "every detector at its default base interval, escalation off, no budget",
    "no-budget": "the default with overhead_budget=None: the declared intervals",
    "budget-0.5%": "the default with overhead_budget=0.005: the sampled detectors' intervals "
    "stretch to keep their cost within 0.5% of step time",
    "budget-5%": "the default with overhead_budget=0.05",
}
#: What ``--setting all`` runs: the sampling settings (the budgets have ``--setting budgets``).
SAMPLING = ("adaptive", "every", "sparse")
BUDGETS = ("adaptive", "no-budget", "budget-0.5%", "budget-5%")


def setting_kwargs(setting: str) -> dict[str, Any]:
    """The stethoscope arguments of a sampling setting (both callbacks take the same ones).

    Raises:
        ValueError: ``setting`` is not one of :data:`SETTINGS`.
    """
    if setting == "adaptive":
        return {}
    if setting == "every":
        from stethoscope.detectors import DETECTORS  # framework-free: plain Python and numpy

        every = [name for name, cls in DETECTORS.items() if not cls.opt_in]  # the defaults'
        return {"intervals": dict.fromkeys(every, 1), "escalate": False}
    if setting == "sparse":
        return {"escalate": False, "overhead_budget": None}
    if setting == "no-budget":
        return {"overhead_budget": None}
    if setting.startswith("budget-") and setting in SETTINGS:
        return {"overhead_budget": float(setting[len("budget-") : -1]) / 100}
    raise ValueError(f"setting={setting!r}; use one of {[*SETTINGS]!r}")


#: Families, for the baselines' table and the latency targets of issue 3.
FAMILIES: dict[str, str] = {
    "nonfinite": "a NaN or Inf appears (input, gradient, weight)",
    "spike": "a single bad batch",
    "divergence": "the learning rate drives training to diverge",
    "silent": "training goes on with finite, unspiky losses, but learns badly",
    "pipeline": "the training is wired wrong (data order, a schedule's cadence): the loss "
    "stays finite and quiet, and the model learns less than it should",
    "precision": "low-precision training loses what it cannot hold (updates, gradients, "
    "a loss scale) while the loss stays finite",
}

#: Median latency targets of issue 3, in steps, by family.
TARGET_LATENCY: dict[str, int] = {
    "nonfinite": 1,
    "spike": 1,
    "divergence": 20,
    "silent": 20,
    "pipeline": 50,
    "precision": 20,
}
TARGET_RECALL = 0.95


@dataclass(frozen=True)
class ModelSpec:
    """The network.

    Args:
        arch: ``"mlp"``, ``"cnn"`` (two 3x3 convolutions on 1x8x8 images, a 2x2
            max-pool, a linear classifier), ``"gru"`` (one GRU layer, a linear
            classifier on its last output) or ``"gan"``: a game, not a classifier. A
            generator (8 noise features, one hidden ReLU layer of ``width``, the
            data's features) and a discriminator (one hidden LeakyReLU(0.2) layer of
            ``width``, one logit) learn the training inputs (the labels are unused),
            each with its own Adam (``TrainSpec.lr``, betas 0.5 and 0.999) and binary
            cross-entropy, the discriminator first at every batch. Lightning trains it
            by hand (``automatic_optimization=False``: its step counts both
            optimizers' steps, two a batch); Keras with the model's own
            ``train_step`` (its step counts batches). The loss the callbacks see is
            the generator's, which is not meant to fall.
        depth: Hidden layers of the MLP.
        width: Units per hidden layer (MLP), hidden size (GRU); the CNN has 16 and
            32 channels.
        activation: ``"relu"``, ``"tanh"`` or ``"sigmoid"`` (MLP; the CNN uses ReLU).
        batchnorm: A batch norm after each hidden layer, before its activation.
        bn_momentum: The share of each batch in the batch norms' running statistics
            (torch's ``momentum``; Keras' is 1 minus it), or None for the framework's
            default (torch 0.1, Keras 0.01).
        dropout: Dropout probability before the classifier (0: none).
        hidden_bias: Whether hidden layers have biases.
        frozen: Layers whose parameters do not require grad (a frozen backbone).
        frozen_bn: The batch norms frozen as fine-tuning does: their parameters do not
            require grad and they stay in eval mode, on their running statistics.
        output: ``"logits"`` (the classifier's scores), ``"softmax"`` (a softmax after
            the classifier: probabilities) or ``"sigmoid"`` (a sigmoid after it: one
            probability per class, multi-label; the MLP only). The GRU also
            takes ``"steps"``: its classifier on every step, scores ``(N, C, T)`` against
            the label repeated at each step ``(N, T)``, as ``cross_entropy`` takes a
            sequence's, and ``"steps_softmax"``: their softmax over dim 1 (Keras: the
            ``(N, T, C)`` scores transposed, ``Softmax(axis=1)``).
    """

    arch: str = "mlp"
    depth: int = 2
    width: int = 64
    activation: str = "relu"
    batchnorm: bool = False
    bn_momentum: float | None = None
    dropout: float = 0.0
    hidden_bias: bool = True
    frozen: tuple[int, ...] = ()
    frozen_bn: bool = False
    output: str = "logits"


#: The precisions a scenario can train in (see ``TrainSpec.precision``).
PRECISIONS = (
    "32",
    "bf16-true",
    "16-true",
    "bf16-mixed",
    "16-mixed",
    "16-autocast",
    "bf16-autocast",
)


@dataclass(frozen=True)
class TrainSpec:
    """How it trains: cross-entropy, one optimizer.

    Args:
        optimizer: ``"adam"`` or ``"sgd"`` (SGD with ``momentum``).
        lr: Base learning rate.
        momentum: SGD momentum.
        batch_size: Samples per step (the training set is reshuffled every epoch;
            the last, smaller batch of an epoch is kept).
        max_steps: Steps to train; the run ends at the first of ``max_steps`` and
            ``max_epochs``.
        max_epochs: Epochs to train, or None for no limit.
        schedule: None, ``"warmup"`` (linear from exactly 0 to ``lr`` over
            ``warmup_steps``, then constant), ``"cosine"`` (from ``lr`` down to
            exactly 0 at ``max_steps``) or ``"step_decay"`` (``lr`` times ``decay``
            every ``decay_every`` steps), stepped every step.
        warmup_steps: Length of the warm-up.
        decay_every, decay: The step decay's period in steps and its factor.
        accumulate: Micro-batches whose gradients one optimizer step applies (Lightning's
            ``accumulate_grad_batches``; a step is then that many batches).
        clip: Clip the global gradient norm to this (None: no clipping).
        validate: Run a validation epoch after every training epoch (needs
            ``DataSpec.n_val``); its mean loss is logged as ``val_loss``.
        precision: The precision it trains in, in Lightning's words: ``"32"``,
            ``"bf16-true"`` (weights and compute in bfloat16; Keras: the ``"bfloat16"``
            policy), ``"16-true"`` (float16, no loss scaling; Keras: ``"float16"``),
            ``"bf16-mixed"`` (float32 weights, bfloat16 compute; Keras:
            ``"mixed_bfloat16"``) or ``"16-mixed"`` (float32 weights, float16 compute, a
            dynamic loss scaler; Keras: ``"mixed_float16"``); or, Lightning only,
            ``"16-autocast"`` and ``"bf16-autocast"``: a float32 Trainer whose training
            step writes ``torch.autocast`` of that dtype around its forward pass and loss,
            with no loss scaler. The loss is computed in float32 from the output.
        loss_weight: The loss is multiplied by it (an auxiliary loss weighted down).
        eps: Adam's epsilon (None: the framework's default, torch's 1e-8, Keras' 1e-7).
        loss: ``"logits"``: cross-entropy of the model's output taken as logits
            (Lightning's ``cross_entropy``, Keras' ``from_logits=True``);
            ``"probabilities"``: taken as probabilities (Lightning: ``nll_loss`` of their
            log; Keras: ``from_logits=False``); ``"nll_raw"``: Lightning's ``nll_loss``
            of the output itself (a bug when the output is logits); ``"mse"``: the mean
            squared error of a one-output regression, shapes matched;
            ``"mse_broadcast"``: the same written ``((output - y) ** 2).mean()`` with an
            ``(N, 1)`` output and an ``(N,)`` target (a bug: Lightning only);
            ``"softmax_in_step"``: ``cross_entropy(softmax(output))`` written in the
            training step (a bug), ``"softmax_in_step_sum"``: the same with
            ``reduction="sum"`` (Lightning only), ``"sum"``: ``cross_entropy`` of the
            logits with ``reduction="sum"`` (right; Lightning only),
            ``"log_softmax_in_step"``: ``nll_loss(log_softmax(
            output))`` there (right); ``"smoothed"``: ``cross_entropy`` with
            ``label_smoothing=0.1``; ``"probabilities_smoothed"``: ``nll_loss`` of the
            log of probabilities, label-smoothed by 0.1 (Keras: ``train_step`` applies the
            softmax or log-softmax before a ``from_logits=True`` loss; the smoothed ones
            are ``CategoricalCrossentropy(label_smoothing=0.1)``);
            ``"one_hot"``: the cross-entropy of the logits against one-hot targets (class
            probabilities; Keras: a loss function of the user's own,
            ``categorical_crossentropy(y, p, from_logits=True)``), and
            ``"softmax_in_step_one_hot"``: the same of a softmax written before it, in
            the training step or in that function (a bug);
            ``"bce_with_logits"``: ``binary_cross_entropy_with_logits`` of the output
            against each label one-hot as float (multi-label targets), ``"bce"``:
            ``binary_cross_entropy`` there (of probabilities), ``"sigmoid_in_step"``:
            ``binary_cross_entropy_with_logits(sigmoid(output))`` written in the training
            step (a bug; Keras: ``BinaryCrossentropy``, ``from_logits`` as the name says, the
            sigmoid in ``train_step``).
    """

    optimizer: str = "adam"
    lr: float = 1e-2
    momentum: float = 0.9
    batch_size: int = 32
    max_steps: int = 300
    max_epochs: int | None = None
    schedule: str | None = None
    warmup_steps: int = 0
    decay_every: int = 0
    decay: float = 0.1
    accumulate: int = 1
    clip: float | None = None
    validate: bool = False
    precision: str = "32"
    loss_weight: float = 1.0
    eps: float | None = None
    loss: str = "logits"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; use one of {PRECISIONS!r}")


@dataclass(frozen=True)
class FaultSpec:
    """What is injected; ``params`` as the module docstring lists per kind."""

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind={self.kind!r}; use one of {FAULT_KINDS!r}")

    def __getitem__(self, key: str) -> Any:
        return self.params[key]


@dataclass(frozen=True)
class Scenario:
    """One fault scenario or healthy control.

    Args:
        name: Stable snake_case name (``--only`` uses it).
        family: One of :data:`FAMILIES`, or ``"healthy"`` for a control.
        description: One line: what is wrong (or which trap a control sets).
        model, data, train: What is trained, on what, how.
        fault: What is injected, or None (a pure data/config fault, or a control).
        onset: The step at which the fault begins; ``"best_val"`` for overfitting:
            the first step after the validation epoch with the lowest validation
            loss of the run (known only afterwards). None for a control.
        expect: The detectors that name the cause; the first of them, warning or
            error, at a step in ``[onset, onset + window]`` is a detection.
        window: Steps after the onset within which a detection counts.
        collateral: Detectors whose warnings and errors are true consequences.
        frameworks: Where the fault can be made (a Keras ``fit`` cannot leave its
            model in eval mode, say); the others do not train it.
    """

    name: str
    family: str
    description: str
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    fault: FaultSpec | None = None
    onset: int | str | None = None
    expect: tuple[str, ...] = ()
    window: int = 0
    collateral: tuple[str, ...] = ()
    frameworks: tuple[str, ...] = ("lightning", "keras")

    def __post_init__(self) -> None:
        if self.family not in (*FAMILIES, "healthy"):
            raise ValueError(f"{self.name}: family={self.family!r}; use one of {[*FAMILIES]!r}")
        unknown = sorted((set(self.expect) | set(self.collateral)) - DETECTOR_NAMES)
        if unknown:
            raise ValueError(f"{self.name}: unknown detector name(s) {unknown!r}")
        if self.healthy != (not self.expect):
            raise ValueError(f"{self.name}: a fault scenario needs expect, a control has none")
        if not self.healthy and self.onset is None:
            raise ValueError(f"{self.name}: a fault scenario needs an onset")

    @property
    def healthy(self) -> bool:
        return self.family == "healthy"

    @property
    def expect_label(self) -> str:
        return " | ".join(self.expect) if self.expect else "—"

    @property
    def accepted(self) -> frozenset[str]:
        return frozenset(self.expect) | frozenset(self.collateral)

    @property
    def target_latency(self) -> int | None:
        return TARGET_LATENCY.get(self.family)

    def fault_at(self, kind: str) -> FaultSpec | None:
        """The fault if it is of ``kind``."""
        return self.fault if self.fault is not None and self.fault.kind == kind else None


# -- shared parts ------------------------------------------------------------------

NONFINITE = ("nonfinite_loss", "nonfinite_gradients", "nonfinite_weights")
# A network that a fault has killed (ReLUs dead, gates saturated) shows it everywhere:
# its gradients are exactly zero or vanish, so its weights stop changing and its
# updates shrink to nothing. Measured here: after gru_lr_jump the GRU's weight gradients
# are exactly 0 from about 40 steps after the jump on, while the classifier's are not.
DEAD_NET = (
    "dead_relu",
    "saturated_activation",
    "all_zero",
    "vanishing_gradients",
    "small_updates",
    "frozen_weights",
)
# What a diverging run legitimately shows besides exploding gradients: a high LR
# overflows (NaN), jumps and wanders, makes updates large, and kills the network
# (CS231n: "as much as 40% of your network can be dead" with a learning rate too high).
DIVERGENCE = (
    *NONFINITE,
    "exploding_gradients",
    "unstable_loss",
    "loss_spike",
    "loss_not_decreasing",
    "large_updates",
    *DEAD_NET,
)
ONSET = 150  # past the sampler's 128-step start-up window: the fault meets sparse sampling
MLP = ModelSpec()
GAUSS = DataSpec()
ADAM = TrainSpec(optimizer="adam", lr=1e-2, max_steps=250)
DIGITS = DataSpec(source="digits", n_train=1437)
DIGIT_IMAGES = DataSpec(source="digits", n_train=1437, images=True)
CNN = ModelSpec(arch="cnn")
#: Six epochs of 23 steps on the digit images, validated after each.
BN_DIGITS = DataSpec(source="digits", n_train=1437, n_val=360, images=True)
BN_TRAIN = TrainSpec(optimizer="adam", lr=3e-3, batch_size=64, max_steps=138, validate=True)
GRU = ModelSpec(arch="gru", width=32)
SEQ = DataSpec(source="sequences", n_train=1024)


def _fault(kind: str, **params: Any) -> FaultSpec:
    return FaultSpec(kind, dict(params))


SCENARIOS: tuple[Scenario, ...] = (
    # -- non-finite values -----------------------------------------------------------
    Scenario(
        "nan_input",
        "nonfinite",
        "one NaN in the input batch of step 150 (MLP, Adam)",
        train=ADAM,
        fault=_fault("nan_input"),
        onset=ONSET,
        # torch's ReLU passes the NaN on to the loss. The Keras scenario is a NaN that a
        # ReLU hides from the loss, as TensorFlow's fused MatMul+BiasAdd+Relu kernel does on
        # some CPUs (others pass it on): its ReLUs map NaN to 0 explicitly (keras_suite's
        # relu_hiding_nan; so do nan_weight's and inf_gradient's), so its results are the
        # same on every CPU. The loss stays finite and the first layer's kernel gradient is
        # what goes NaN; from the next step on every unit of that layer outputs 0 (NaN
        # weights through that ReLU): the loss jumps, then swings with each batch's labels
        # around the dead net's one prediction
        expect=("nonfinite_loss", "nonfinite_gradients"),
        window=1,
        collateral=(*NONFINITE, "loss_spike", "unstable_loss", *DEAD_NET),
    ),
    Scenario(
        "inf_gradient",
        "nonfinite",
        "one +Inf in layer 1's weight gradient at step 150, via a tensor hook",
        train=ADAM,
        fault=_fault("inf_gradient", layer=1),
        onset=ONSET,
        expect=("nonfinite_gradients",),
        window=16,
        collateral=NONFINITE,
    ),
    Scenario(
        "nan_weight",
        "nonfinite",
        "a NaN written into layer 0's weight right after the update of step 150",
        train=ADAM,
        fault=_fault("nan_weight", layer=0),
        onset=ONSET,
        expect=("nonfinite_weights",),  # it names the cause; the NaN loss follows
        window=16,
        collateral=NONFINITE,
    ),
    Scenario(
        "gru_nan_input",
        "nonfinite",
        "one NaN in the input sequence batch of step 150 (GRU, Adam)",
        model=GRU,
        data=SEQ,
        train=ADAM,
        fault=_fault("nan_input"),
        onset=ONSET,
        expect=("nonfinite_loss",),
        window=1,
        collateral=NONFINITE,
    ),
    # -- single bad batches ----------------------------------------------------------------
    Scenario(
        "corrupt_labels_batch",
        "spike",
        "every label of the batch at step 150 shifted by one class (MLP, trained)",
        train=ADAM,
        fault=_fault("corrupt_labels"),
        onset=ONSET,
        expect=("loss_spike",),
        window=1,
        collateral=("exploding_gradients", "unstable_loss"),
    ),
    Scenario(
        "scaled_inputs_batch",
        "spike",
        "the inputs of the batch at step 150 multiplied by 30 (MLP, trained)",
        train=ADAM,
        fault=_fault("scale_inputs", factor=30.0),
        onset=ONSET,
        expect=("loss_spike",),
        window=1,
        # a batch x10 is also, truly, unnormalized input
        collateral=("exploding_gradients", "unstable_loss", "unnormalized_input"),
    ),
    # -- divergence ----------------------------------------------------------------------
    Scenario(
        "lr_jump_sgd",
        "divergence",
        "SGD (lr 0.05, momentum 0.9): the learning rate x1000 from step 150",
        train=TrainSpec(optimizer="sgd", lr=0.05, max_steps=250),
        fault=_fault("lr_scale", factor=1000.0),
        onset=ONSET,
        expect=("exploding_gradients",),
        window=20,
        collateral=DIVERGENCE,
    ),
    Scenario(
        "lr_growth",
        "divergence",
        "Adam lr 1e-3 multiplied by 1.1 every step from step 150 (a schedule bug)",
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=300),
        fault=_fault("lr_growth", factor=1.1),
        onset=ONSET,
        expect=("unstable_loss", "exploding_gradients"),
        window=100,
        collateral=DIVERGENCE,
    ),
    Scenario(
        "cnn_lr_too_high",
        "divergence",
        "CNN on digits with SGD lr 1.0 (momentum 0.9) from the first step",
        model=CNN,
        data=DIGIT_IMAGES,
        train=TrainSpec(optimizer="sgd", lr=1.0, max_steps=150),
        onset=0,
        expect=("exploding_gradients",),
        window=20,
        collateral=DIVERGENCE,
    ),
    Scenario(
        "adam_lr_1",
        "divergence",
        "Adam with lr 1.0 (MLP): every update is far too large",
        train=TrainSpec(optimizer="adam", lr=1.0, max_steps=200),
        onset=0,
        expect=("large_updates",),
        window=20,
        collateral=DIVERGENCE,
    ),
    Scenario(
        "gru_lr_jump",
        "divergence",
        "GRU with SGD (lr 0.1, momentum 0.9): the learning rate x1000 from step 150",
        model=GRU,
        data=SEQ,
        train=TrainSpec(optimizer="sgd", lr=0.1, max_steps=250),
        fault=_fault("lr_scale", factor=1000.0),
        onset=ONSET,
        expect=("exploding_gradients",),
        window=20,
        collateral=DIVERGENCE,
    ),
    # -- silent: finite, unspiky, wrong ---------------------------------------------------
    Scenario(
        "deep_sigmoid",
        "silent",
        "a 10-layer sigmoid MLP (default init, SGD lr 0.1): gradients vanish at the input",
        model=ModelSpec(depth=10, width=32, activation="sigmoid"),
        train=TrainSpec(optimizer="sgd", lr=0.1, max_steps=200),
        onset=0,
        expect=("vanishing_gradients",),
        window=50,
        # the input-side layers' updates (lr x ~1e-8) fall below any tolerance: they are
        # frozen in effect, and the updates small
        collateral=(
            "loss_not_decreasing",
            "poor_initialization",
            "small_updates",
            "frozen_weights",
            "saturated_activation",
        ),
    ),
    Scenario(
        "random_labels",
        "silent",
        "labels drawn at random (no signal), 4096 samples, MLP with Adam lr 1e-3",
        data=DataSpec(n_train=4096, random_labels=True),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=400),
        onset=0,
        # no progress from the start, and at chance level: either names it
        expect=("loss_not_decreasing", "loss_at_chance"),
        window=300,
    ),
    Scenario(
        "random_labels_confident",
        "silent",
        "labels drawn at random, hidden weights initialised 4x too large: the loss falls "
        "from a confident start to chance (ln 4) and stays (Adam 1e-2)",
        data=DataSpec(n_train=4096, random_labels=True),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=800),
        fault=_fault("init_scale", factor=4.0),
        onset=0,
        # the fall from the start is progress to loss_not_decreasing: only the level
        # names it. A 4x start is a poor initialisation too, and its first large steps
        # large updates
        expect=("loss_at_chance",),
        window=600,
        collateral=("poor_initialization", "large_updates", "loss_not_decreasing"),
    ),
    Scenario(
        "dead_units",
        "silent",
        "at step 150, the biases of 75% of layer 0's ReLU units set to -100 (they die)",
        train=ADAM,
        fault=_fault("kill_units", layer=0, fraction=0.75, bias=-100.0),
        onset=ONSET,
        expect=("dead_relu",),
        window=32,
        collateral=("loss_spike", "unstable_loss"),
    ),
    Scenario(
        "dead_units_late",
        "silent",
        "at step 1200, long past start-up (where an overhead budget has stretched the "
        "sampled detectors), the biases of 60% of layer 0's ReLU units set to -100",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=1800),
        fault=_fault("kill_units", layer=0, fraction=0.6, bias=-100.0),
        onset=1200,
        expect=("dead_relu",),
        window=600,
        # the loss jumps as the units die, and its gradients with it
        collateral=("loss_spike", "unstable_loss", "exploding_gradients"),
    ),
    Scenario(
        "saturated_tanh",
        "silent",
        "a tanh MLP whose hidden weights are initialised x20: pre-activations saturate",
        model=ModelSpec(activation="tanh"),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=200),
        fault=_fault("init_scale", factor=20.0),
        onset=0,
        expect=("saturated_activation",),
        window=50,
        collateral=(
            "vanishing_gradients",
            "poor_initialization",
            "loss_not_decreasing",
            "unstable_loss",
        ),
    ),
    Scenario(
        "adam_lr_1e-9",
        "silent",
        "Adam with lr 1e-9 (MLP): the weights barely move",
        train=TrainSpec(optimizer="adam", lr=1e-9, max_steps=250),
        onset=0,
        expect=("small_updates",),
        window=100,
        collateral=("loss_not_decreasing", "frozen_weights"),
    ),
    Scenario(
        "layer_not_in_optimizer",
        "silent",
        "layer 1 left out of the optimizer: it requires grad but never changes",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250),
        fault=_fault("exclude_layer", layer=1),
        onset=0,
        expect=("frozen_weights",),
        window=100,
    ),
    Scenario(
        "zero_lr_group",
        "silent",
        "layer 1 in a parameter group with learning rate 0",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250),
        fault=_fault("zero_lr_group", layer=1),
        onset=0,
        expect=("frozen_weights",),
        window=100,
    ),
    Scenario(
        "init_std_1",
        "silent",
        "MLP 20-128-128-128-4, every weight drawn from N(0, 1) with no fan-in scaling",
        model=ModelSpec(depth=3, width=128),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=200),
        fault=_fault("init_std", std=1.0),
        onset=0,
        expect=("poor_initialization",),
        window=10,
        collateral=(
            "exploding_gradients",
            "loss_spike",
            "unstable_loss",
            "large_updates",
            "dead_relu",
        ),
    ),
    Scenario(
        "zero_init",
        "silent",
        "layers 1 (no bias) and 2 zero-initialised: their gradients stay exactly zero",
        model=ModelSpec(hidden_bias=False),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=200),
        fault=_fault("zero_init", layers=(1, 2)),
        onset=0,
        expect=("all_zero",),
        window=10,
        collateral=(
            "frozen_weights",
            "vanishing_gradients",
            "poor_initialization",
            "dead_relu",
            "loss_not_decreasing",
            "small_updates",
        ),
    ),
    Scenario(
        "class_imbalance_95",
        "silent",
        "95% of the training labels are class 0 (MLP)",
        data=DataSpec(majority=0.95),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=200),
        onset=0,
        expect=("class_imbalance",),
        window=50,
        # measured: with 95% of one class, 44-50% of layer 1's units never activate on
        # any training sample after 30-200 steps (about 10% on the balanced data)
        collateral=("dead_relu",),
    ),
    Scenario(
        "raw_digits",
        "silent",
        "digits pixels left raw, 0..16, into an MLP",
        data=DataSpec(source="digits", n_train=1437, raw=True),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=200),
        onset=0,
        expect=("unnormalized_input",),
        window=20,
        collateral=("poor_initialization", "loss_spike", "unstable_loss"),
    ),
    Scenario(
        "features_x100",
        "silent",
        "standardised features multiplied by 100 (MLP)",
        data=DataSpec(scale=100.0),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=200),
        onset=0,
        expect=("unnormalized_input",),
        window=20,
        collateral=(
            "poor_initialization",
            "exploding_gradients",
            "loss_spike",
            "unstable_loss",
        ),
    ),
    Scenario(
        "overfitting",
        "silent",
        "100 digits, 20% of their labels wrong, MLP 64-256-256-10 memorises them; "
        "validated on 360 held-out digits each of 120 epochs",
        model=ModelSpec(width=256),
        data=DataSpec(source="digits", n_train=100, n_val=360, label_noise=0.2),
        train=TrainSpec(
            optimizer="adam", lr=1e-3, batch_size=50, max_steps=240, max_epochs=120, validate=True
        ),
        onset="best_val",
        expect=("overfitting",),
        window=100,
    ),
    # -- pipeline bugs: each has a healthy twin below ----------------------------------------
    Scenario(
        "labels_sorted",
        "pipeline",
        "the training set sorted by label and never shuffled: each batch holds one class",
        data=DataSpec(order="sorted"),
        train=ADAM,
        onset=0,
        expect=("unshuffled_data",),
        window=64,
        # the loss jumps at each class boundary, and the model chases one class at a time:
        # fitted to a batch of one class by its output bias, its ReLUs die and the
        # gradients behind them are all zero (measured); the first labels read are one
        # or two classes, imbalanced as they come; and sorted, it comes in the same order
        # every epoch (Keras cannot tell it was asked for: fit's shuffle never reaches a
        # callback)
        collateral=(
            "repeated_data",
            "loss_spike",
            "unstable_loss",
            "exploding_gradients",
            "dead_relu",
            "all_zero",
            "class_imbalance",
        ),
    ),
    Scenario(
        "left_in_eval",
        "pipeline",
        "at step 150, the model (batch norm and dropout 0.3) is put in eval mode and left "
        "there, as a side evaluation that never calls .train() would",
        model=ModelSpec(batchnorm=True, dropout=0.3),
        train=ADAM,
        fault=_fault("eval_mode"),
        onset=ONSET,
        expect=("eval_mode",),
        window=64,
        frameworks=("lightning",),
    ),
    Scenario(
        "grads_never_zeroed",
        "pipeline",
        "from step 150, the gradients are never zeroed (zero_grad skipped): each step "
        "applies the running sum of every gradient since",
        train=ADAM,
        fault=_fault("no_zero_grad"),
        onset=ONSET,
        expect=("unzeroed_gradients",),
        window=64,
        # the summed gradients grow step by step, and the loss with them (measured)
        collateral=("exploding_gradients", "unstable_loss", "loss_spike", "large_updates"),
        frameworks=("lightning",),
    ),
    Scenario(
        "batch_served_again",
        "pipeline",
        "from step 150, the loader serves the batch of step 150 again and again (a batch "
        "cached by a buggy loader)",
        train=ADAM,
        fault=_fault("stuck_batch"),
        onset=ONSET,
        expect=("repeated_data",),
        window=64,
    ),
    Scenario(
        "same_order_every_epoch",
        "pipeline",
        "the training set shuffled once and served in that order every epoch (a "
        "DistributedSampler without set_epoch): visible from the second epoch (step 32)",
        data=DataSpec(order="fixed"),
        train=ADAM,
        onset=0,
        expect=("repeated_data",),
        window=64,
    ),
    Scenario(
        "validation_leak",
        "pipeline",
        "30% of the 360 validation digits are training digits (a split that leaked): the "
        "validation loss flatters the model",
        data=DataSpec(source="digits", n_train=1437, n_val=360, val_from_train=0.3),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=500, validate=True),
        onset=0,
        expect=("repeated_data",),
        window=100,
    ),
    Scenario(
        "batch_norm_statistics_lag",
        "pipeline",
        "the CNN's batch norms keep 99.9% of their running statistics at each step (Keras' "
        "momentum 0.999, as keras.applications' MobileNetV3 sets it; torch's 0.001), so "
        "after a few epochs they still hold most of their initial values: the model "
        "validates as an untrained one while it trains well",
        model=ModelSpec(arch="cnn", batchnorm=True, bn_momentum=0.001),
        data=BN_DIGITS,
        train=BN_TRAIN,
        onset=0,
        expect=("unlearned_validation",),
        window=100,
    ),
    Scenario(
        "softmax_then_cross_entropy",
        "pipeline",
        "a softmax after the classifier, fed to a loss that takes logits (Lightning's "
        "cross_entropy, Keras' from_logits=True): a softmax applied twice",
        model=ModelSpec(output="softmax"),
        train=ADAM,
        onset=0,
        expect=("logits_mismatch",),
        window=150,
    ),
    Scenario(
        "softmax_in_training_step",
        "pipeline",
        "the classifier's logits through torch.softmax in the training step, then "
        "cross_entropy, which applies its own: a softmax applied twice where no module "
        "shows it",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="softmax_in_step"),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
    ),
    Scenario(
        "summed_softmax_in_training_step",
        "pipeline",
        "softmax_in_training_step with the loss summed over the batch "
        "(cross_entropy(..., reduction='sum')): the loss is the batch's size times the "
        "mean it is set against",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="softmax_in_step_sum"),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
        frameworks=("lightning",),
    ),
    Scenario(
        "softmax_in_own_loss",
        "pipeline",
        "one-hot targets, and a softmax written before a cross-entropy that applies its "
        "own: in Lightning's training step, in a Keras loss function of the user's own "
        "(compile(loss=fn), which says nothing of what it takes)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="softmax_in_step_one_hot"),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
    ),
    Scenario(
        "smoothed_softmax_then_cross_entropy",
        "pipeline",
        "a softmax after the classifier, fed to cross_entropy with label_smoothing=0.1: "
        "a softmax applied twice, under a loss that is no plain cross-entropy",
        model=ModelSpec(output="softmax"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="smoothed"),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
    ),
    Scenario(
        "sigmoid_then_bce_with_logits",
        "pipeline",
        "a sigmoid after the classifier, fed to binary_cross_entropy_with_logits against "
        "multi-label targets: the loss applies its own sigmoid, so a sigmoid is applied twice",
        model=ModelSpec(output="sigmoid"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="bce_with_logits"),
        onset=0,
        expect=("logits_mismatch",),
        window=200,  # a sigmoid's output must stay within [0, 1] for a span of steps
        # the outer sigmoid is flat where the inner one saturates: small gradients, a stall
        collateral=(
            "saturated_activation",
            "vanishing_gradients",
            "small_updates",
            "loss_not_decreasing",
        ),
    ),
    Scenario(
        "sigmoid_in_training_step",
        "pipeline",
        "the classifier's logits through torch.sigmoid in the training step, then "
        "binary_cross_entropy_with_logits against multi-label targets: a sigmoid applied "
        "twice where no module shows it",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="sigmoid_in_step"),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
        collateral=("vanishing_gradients", "small_updates", "loss_not_decreasing"),
    ),
    Scenario(
        "sequence_softmax_then_cross_entropy",
        "pipeline",
        "a GRU scoring every step, a softmax over the classes (dim 1 of its (N, C, T) "
        "output) fed to cross_entropy against (N, T) labels: a softmax applied twice, "
        "classes on the second axis",
        model=ModelSpec(arch="gru", width=32, output="steps_softmax"),
        data=SEQ,
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300),
        onset=0,
        expect=("logits_mismatch",),
        window=150,
    ),
    Scenario(
        "logits_as_probabilities",
        "pipeline",
        "the classifier's logits fed to a loss that takes probabilities (Keras' "
        "from_logits=False, the default)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="probabilities"),
        onset=0,
        expect=("logits_mismatch",),
        window=64,
        # the loss clips the rescaled outputs to [1e-7, 1 - 1e-7]: most of them are
        # clipped, and no gradient passes a clip (measured: all zero from step 50); with
        # no gradient no weight moves (frozen_weights at steps 226-227, 2 of 3 seeds)
        collateral=("vanishing_gradients", "all_zero", "frozen_weights"),
        frameworks=("keras",),
    ),
    Scenario(
        "logits_to_nll",
        "pipeline",
        "the classifier's logits fed to nll_loss, which takes log-probabilities (no "
        "log_softmax): its loss falls without bound",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="nll_raw"),
        onset=0,
        expect=("logits_mismatch",),
        window=64,
        frameworks=("lightning",),
    ),
    Scenario(
        "loss_broadcast",
        "pipeline",
        "a regression's (N, 1) output minus its (N,) target, squared and averaged by "
        "hand: every prediction against every target, N x N",
        data=DataSpec(source="regression"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=250, loss="mse_broadcast"),
        onset=0,
        expect=("broadcast_loss",),
        window=64,
        # the model learns to predict the targets' mean whatever its input: a constant
        # needs no features, and half the hidden ReLUs die (measured: 52% by step 55)
        collateral=("dead_relu",),
        frameworks=("lightning",),
    ),
    Scenario(
        "lr_decay_per_batch",
        "pipeline",
        "a decay meant per epoch (x0.1 every 8 epochs) stepped every batch: the learning "
        "rate is a thousandth of its start by step 24",
        train=TrainSpec(
            optimizer="adam", lr=1e-2, max_steps=250, schedule="step_decay", decay_every=8
        ),
        onset=0,
        expect=("collapsed_lr",),
        window=64,
        # the weights all but stop: that is what the collapse does
        collateral=("small_updates", "frozen_weights", "loss_not_decreasing"),
    ),
    # -- precision: finite, quiet, and learning less ---------------------------------------
    Scenario(
        "bf16_updates_round_away",
        "precision",
        "weights held in bfloat16 (bf16-true) under Adam 3e-4: most updates are under half "
        "a bfloat16 ulp of their weight and round away",
        train=TrainSpec(optimizer="adam", lr=3e-4, max_steps=300, precision="bf16-true"),
        onset=0,
        expect=("rounded_updates",),
        window=64,
        # the weights all but stop, so the loss barely falls: what the rounding does
        collateral=("small_updates", "loss_not_decreasing"),
    ),
    Scenario(
        "fp16_gradients_underflow",
        "precision",
        "float16 weights and gradients with no loss scaling (16-true), the loss weighted "
        "by 1e-3 (SGD 100): the gradients are subnormal or zero in float16",
        train=TrainSpec(
            optimizer="sgd", lr=100.0, max_steps=300, precision="16-true", loss_weight=1e-3
        ),
        onset=0,
        expect=("gradient_underflow",),
        window=64,
        # what flushes to zero is a zero gradient, and what is left learns slowly
        collateral=("all_zero", "vanishing_gradients", "small_updates", "loss_not_decreasing"),
    ),
    Scenario(
        "fp16_gradients_flush_to_zero",
        "precision",
        "float16 weights and gradients with no loss scaling (16-true), the loss weighted "
        "by 1e-6 (SGD 3e4): the whole backward pass falls below float16's smallest "
        "subnormal, every gradient exactly zero and none subnormal",
        train=TrainSpec(
            optimizer="sgd", lr=3e4, max_steps=200, precision="16-true", loss_weight=1e-6
        ),
        onset=0,
        expect=("gradient_underflow",),
        window=64,
        # nothing moves, so the loss stays; the zero gradients themselves are precision's
        # (all_zero, vanishing_gradients, frozen_weights and small_updates leave them)
        collateral=("loss_not_decreasing",),
    ),
    Scenario(
        "fp16_autocast_without_scaler",
        "precision",
        "torch.autocast(float16) written in the training step of a float32 run, no loss "
        "scaler, the loss weighted by 1e-3 (SGD 100): float32 weights whose gradients are "
        "computed in float16, subnormal or zero there",
        train=TrainSpec(
            optimizer="sgd", lr=100.0, max_steps=300, precision="16-autocast", loss_weight=1e-3
        ),
        onset=0,
        expect=("gradient_underflow",),
        window=64,
        # as fp16_gradients_underflow: what flushes is a zero gradient, the rest learns slowly
        collateral=("all_zero", "vanishing_gradients", "small_updates", "loss_not_decreasing"),
        frameworks=("lightning",),
    ),
    Scenario(
        "fp16_autocast_flush_to_zero",
        "precision",
        "torch.autocast(float16) in the training step of a float32 run, no loss scaler, "
        "the loss weighted by 1e-6 (SGD 3e4): the whole float16 backward pass flushes to "
        "zero, though every weight and gradient is held in float32",
        train=TrainSpec(
            optimizer="sgd", lr=3e4, max_steps=200, precision="16-autocast", loss_weight=1e-6
        ),
        onset=0,
        expect=("gradient_underflow",),
        window=64,
        collateral=("loss_not_decreasing",),
        frameworks=("lightning",),
    ),
    Scenario(
        "loss_scale_collapse",
        "precision",
        "float16 mixed precision with a loss scaler (16-mixed), and an Inf in layer 1's "
        "weight gradient at every step from step 150: the scaler skips every step",
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=300, precision="16-mixed"),
        fault=_fault("inf_gradients", layer=1),
        onset=ONSET,
        expect=("loss_scale_collapse", "nonfinite_gradients"),
        window=64,
        # no step applies: the weights stop and the loss stays where it was; and a scale
        # fallen far below 1 flushes the float16 backward pass to zero on its way down
        collateral=(
            "small_updates",
            "frozen_weights",
            "loss_not_decreasing",
            "all_zero",
            "dead_relu",
        ),
    ),
    Scenario(
        "fp16_activations_near_max",
        "precision",
        "float16 mixed precision (16-mixed) on inputs 3000 times their scale: the first "
        "layer's outputs near float16's 65504",
        data=DataSpec(scale=3000.0),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=300, precision="16-mixed"),
        onset=0,
        expect=("overflow_risk",),
        window=64,
        # the cause is the inputs' scale, which unnormalized_input names
        collateral=("unnormalized_input", *DIVERGENCE),
    ),
    Scenario(
        "fp16_adam_epsilon_zero",
        "precision",
        "float16 weights and Adam's moments (16-true) under Adam at eps=1e-8 (torch's "
        "default), which is 0 in float16: where a gradient's second moment underflows, "
        "the step divides by zero",
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=300, precision="16-true", eps=1e-8),
        onset=0,
        expect=("epsilon_underflow", "nonfinite_weights"),
        window=16,
        # the weights turn NaN at once: everything after them follows; float16 gradients
        # with no loss scaling underflow too (gradient_underflow, rightly)
        collateral=(*DIVERGENCE, "gradient_underflow"),
    ),
    # -- healthy controls: each sets a trap ----------------------------------------------
    Scenario(
        "healthy_standardized",
        "healthy",
        "standardised Gaussian inputs: values past ±1 everywhere (Adam 1e-3)",
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=400),
    ),
    Scenario(
        "healthy_converges",
        "healthy",
        "Adam 3e-3 for 1200 steps: the loss falls through 0.005 to ~0.001 and wanders there",
        # not 3e-2: at that rate Adam is unstable on some seeds (seed 2: the loss jumps from
        # 0.003 back to 1.2 at step 532 and 36-41% of layer 1's units die), not a control
        train=TrainSpec(optimizer="adam", lr=3e-3, max_steps=1200),
    ),
    Scenario(
        "healthy_warmup_clip",
        "healthy",
        "SGD lr 0.1 warmed up from exactly 0 over 150 steps, gradients clipped to 0.5",
        train=TrainSpec(
            optimizer="sgd", lr=0.1, max_steps=600, schedule="warmup", warmup_steps=150, clip=0.5
        ),
    ),
    Scenario(
        "healthy_noisy_sgd",
        "healthy",
        "SGD lr 0.05 with batches of 8 and 20% of labels redrawn at random",
        data=DataSpec(label_noise=0.2),
        train=TrainSpec(optimizer="sgd", lr=0.05, batch_size=8, max_steps=1500),
    ),
    Scenario(
        "healthy_frozen_layer",
        "healthy",
        "layer 0 frozen with requires_grad=False (a frozen backbone), Adam 1e-3",
        model=ModelSpec(frozen=(0,)),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=400),
    ),
    Scenario(
        "healthy_cosine",
        "healthy",
        "Adam 1e-2 on a cosine schedule that decays to exactly 0 at the last step",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=600, schedule="cosine"),
    ),
    Scenario(
        "healthy_cnn_bn_dropout",
        "healthy",
        "CNN on digits with batch norm and dropout 0.3 (Adam 1e-3)",
        model=ModelSpec(arch="cnn", batchnorm=True, dropout=0.3),
        data=DIGIT_IMAGES,
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=400),
    ),
    Scenario(
        "healthy_gru",
        "healthy",
        "GRU on noisy sequences (Adam 1e-2)",
        model=GRU,
        data=SEQ,
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=400),
    ),
    Scenario(
        "healthy_tanh",
        "healthy",
        "a tanh MLP with the default initialisation (Adam 1e-3)",
        model=ModelSpec(activation="tanh"),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=400),
    ),
    Scenario(
        "healthy_near_perfect_fit",
        "healthy",
        "well-separated classes fitted to a validation loss of a few thousandths, which "
        "then wobbles up by a fraction of that for 20 epochs (Adam 1e-2)",
        data=DataSpec(source="separable", n_train=512, n_val=256),
        train=TrainSpec(optimizer="adam", lr=1e-2, batch_size=16, max_steps=1536, validate=True),
    ),
    Scenario(
        "healthy_gan",
        "healthy",
        "a GAN learning the Gaussian inputs, two Adams 2e-4: the generator's loss is not "
        "meant to fall",
        model=ModelSpec(arch="gan", width=32),
        data=DataSpec(n_train=4096),
        train=TrainSpec(optimizer="adam", lr=2e-4, batch_size=64, max_steps=1200),
    ),
    Scenario(
        "healthy_skewed_labels",
        "healthy",
        "70% of the labels are class 0, shuffled (the twin of labels_sorted): skew is no "
        "sign of order",
        data=DataSpec(majority=0.7),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300),
    ),
    Scenario(
        "healthy_step_decay",
        "healthy",
        "Adam 1e-2 decayed x0.1 every 60 steps (the twin of lr_decay_per_batch): a "
        "thousandth of its start from step 180, after the loss has fallen",
        train=TrainSpec(
            optimizer="adam", lr=1e-2, max_steps=400, schedule="step_decay", decay_every=60
        ),
    ),
    Scenario(
        "healthy_accumulate",
        "healthy",
        "gradients accumulated over 4 micro-batches per step (the twin of "
        "grads_never_zeroed): zeroed at each step's start",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=200, accumulate=4),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_full_batch",
        "healthy",
        "the whole training set (256 samples) as one batch at every step, in its stored "
        "order (the twin of batch_served_again): the same batch every step, by design",
        data=DataSpec(n_train=256, order="sequential"),
        train=TrainSpec(optimizer="adam", lr=1e-2, batch_size=256, max_steps=300),
    ),
    Scenario(
        "healthy_sequential",
        "healthy",
        "shuffling turned off on purpose, a sequential sampler (the twin of "
        "same_order_every_epoch): the same order every epoch, as asked; Lightning only: "
        "the Keras suite serves a tf.data pipeline, whose order fit's shuffle does not "
        "set",
        data=DataSpec(order="sequential"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_softmax_output",
        "healthy",
        "a softmax after the classifier, fed to a loss that takes probabilities (the twin "
        "of softmax_then_cross_entropy: Lightning's nll_loss of their log, Keras' "
        "from_logits=False)",
        model=ModelSpec(output="softmax"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="probabilities"),
    ),
    Scenario(
        "healthy_log_softmax_in_step",
        "healthy",
        "the classifier's logits through torch.log_softmax in the training step, then "
        "nll_loss (the twin of softmax_in_training_step: the same place, written right)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="log_softmax_in_step"),
    ),
    Scenario(
        "healthy_own_loss",
        "healthy",
        "one-hot targets, the logits to a cross-entropy that applies its softmax (the twin "
        "of softmax_in_own_loss; Keras: a loss function of the user's own)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="one_hot"),
    ),
    Scenario(
        "healthy_summed_cross_entropy",
        "healthy",
        "the classifier's logits to cross_entropy with reduction='sum' (the twin of "
        "summed_softmax_in_training_step)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="sum"),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_label_smoothing",
        "healthy",
        "the classifier's logits to cross_entropy with label_smoothing=0.1 (the twin of "
        "smoothed_softmax_then_cross_entropy)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="smoothed"),
    ),
    Scenario(
        "healthy_smoothed_probabilities",
        "healthy",
        "a softmax after the classifier, and nll_loss of its log label-smoothed by 0.1 "
        "(the twin of smoothed_softmax_then_cross_entropy, probabilities taken as such)",
        model=ModelSpec(output="softmax"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="probabilities_smoothed"),
    ),
    Scenario(
        "healthy_sigmoid_bce",
        "healthy",
        "a sigmoid after the classifier, and binary_cross_entropy of its probabilities "
        "against multi-label targets (the twin of sigmoid_then_bce_with_logits)",
        model=ModelSpec(output="sigmoid"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="bce"),
    ),
    Scenario(
        "healthy_bce_with_logits",
        "healthy",
        "the classifier's logits to binary_cross_entropy_with_logits against multi-label "
        "targets (the twin of sigmoid_in_training_step)",
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="bce_with_logits"),
    ),
    Scenario(
        "healthy_sequence_logits",
        "healthy",
        "a GRU scoring every step, its (N, C, T) logits to cross_entropy against (N, T) "
        "labels (the twin of sequence_softmax_then_cross_entropy)",
        model=ModelSpec(arch="gru", width=32, output="steps"),
        data=SEQ,
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300),
    ),
    Scenario(
        "healthy_regression",
        "healthy",
        "the same regression with the output squeezed to the target's shape (the twin "
        "of loss_broadcast)",
        data=DataSpec(source="regression"),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, loss="mse"),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_frozen_bn",
        "healthy",
        "batch norms frozen on purpose (parameters not trained, eval mode kept from the "
        "start), dropout 0.3 training (the twin of left_in_eval)",
        model=ModelSpec(batchnorm=True, dropout=0.3, frozen_bn=True),
        train=TrainSpec(optimizer="adam", lr=1e-2, max_steps=300),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_bf16_mixed",
        "healthy",
        "float32 weights with bfloat16 compute (bf16-mixed) under Adam 3e-4 (the twin of "
        "bf16_updates_round_away): every update lands",
        train=TrainSpec(optimizer="adam", lr=3e-4, max_steps=300, precision="bf16-mixed"),
    ),
    Scenario(
        "healthy_fp16_loss_scaled",
        "healthy",
        "float16 mixed precision with a loss scaler (16-mixed), the loss weighted by 1e-3 "
        "(SGD 100; the twin of fp16_gradients_underflow): the scale keeps the gradients "
        "normal",
        train=TrainSpec(
            optimizer="sgd", lr=100.0, max_steps=300, precision="16-mixed", loss_weight=1e-3
        ),
    ),
    Scenario(
        "healthy_fp16_flush_scaled",
        "healthy",
        "float16 mixed precision with a loss scaler (16-mixed), the loss weighted by 1e-6 "
        "(SGD 3e4; the twin of fp16_gradients_flush_to_zero): the scale lifts the "
        "gradients out of the flush",
        train=TrainSpec(
            optimizer="sgd", lr=3e4, max_steps=200, precision="16-mixed", loss_weight=1e-6
        ),
    ),
    Scenario(
        "healthy_bf16_autocast",
        "healthy",
        "torch.autocast(bfloat16) in the training step of a float32 run, the loss weighted "
        "by 1e-3 (SGD 100; the twin of fp16_autocast_without_scaler, as "
        "healthy_fp16_loss_scaled is with a scaler): bfloat16 keeps float32's range, "
        "nothing underflows",
        train=TrainSpec(
            optimizer="sgd", lr=100.0, max_steps=300, precision="bf16-autocast", loss_weight=1e-3
        ),
        frameworks=("lightning",),
    ),
    Scenario(
        "healthy_fp16_adam_mixed",
        "healthy",
        "float16 compute with float32 weights and Adam's moments and a loss scaler "
        "(16-mixed) under Adam at eps=1e-8 (the twin of fp16_adam_epsilon_zero): the "
        "epsilon is kept",
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=300, precision="16-mixed", eps=1e-8),
    ),
    Scenario(
        "healthy_digits_validated",
        "healthy",
        "standardised digits (some pixels rare: z-scores past 10), validated every epoch "
        "on held-out digits (the twin of validation_leak)",
        data=DataSpec(source="digits", n_train=1437, n_val=360),
        train=TrainSpec(optimizer="adam", lr=1e-3, max_steps=500, validate=True),
    ),
    Scenario(
        "healthy_cnn_bn_validated",
        "healthy",
        "the CNN with batch norms whose running statistics follow the batches (torch's "
        "momentum 0.1, Keras' 0.9), validated every epoch (the twin of "
        "batch_norm_statistics_lag)",
        model=ModelSpec(arch="cnn", batchnorm=True, bn_momentum=0.1),
        data=BN_DIGITS,
        train=BN_TRAIN,
    ),
)


def resolve_onset(sc: Scenario, val_losses: Sequence[Sequence[float]]) -> int | None:
    """The onset step of a run: ``"best_val"`` becomes the step after the best validation.

    ``val_losses`` holds ``[steps taken, validation loss]`` per validation epoch.
    """
    if sc.onset == "best_val":
        if not val_losses:
            return None
        best = min(range(len(val_losses)), key=lambda i: val_losses[i][1])
        return int(val_losses[best][0])  # the first step after the best validation
    return sc.onset if isinstance(sc.onset, int) else None


def select(names: Sequence[str] | None = None) -> list[Scenario]:
    """The scenarios named (all when None), in declaration order.

    Raises:
        ValueError: A name is unknown; the message lists the valid ones.
    """
    if not names:
        return list(SCENARIOS)
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown!r}; choose among {sorted(known)!r}")
    wanted = set(names)
    return [s for s in SCENARIOS if s.name in wanted]
