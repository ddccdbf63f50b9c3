"""What the user's training already does, so that a finding's advice does not repeat it.

A run that clips its gradients should not be told to clip them; a run under float16
mixed precision should hear that float16 overflows past 65504; a run with a schedule
should look at its warm-up rather than add one. Each adapter reads these settings from
the framework when training starts and hands them to the detectors, which word their
advice with the helpers here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from stethoscope.number_formats import format_of

__all__ = [
    "DEEPSPEED_SCALER",
    "EPSILON_BOUND",
    "RunningStatistics",
    "SmallEpsilon",
    "TrainingSetup",
    "adaptive_optimizers",
    "clipping_advice",
    "epsilon_advice",
    "epsilon_cause",
    "float16_note",
    "optimizer_advice",
    "small_epsilon",
    "unoptimized_advice",
    "warmup_advice",
]

#: DeepSpeed's fp16 loss scaler, as :attr:`TrainingSetup.loss_scaler` names it.
DEEPSPEED_SCALER = "DeepSpeed's loss scaler"

#: How far past Adam's usual step (about the learning rate) a step may go where the
#: second moment underflowed before the epsilon counts as small (see :class:`SmallEpsilon`).
EPSILON_BOUND = 10.0

#: Mixed-precision settings whose float16 overflows past 65504 (bfloat16 does not).
_FLOAT16 = frozenset({"16-mixed", "16", "16-true", "mixed_float16", "float16"})


@dataclass(frozen=True)
class RunningStatistics:
    """The normalization layer whose running statistics (what inference normalises by)
    follow the batches slowest: each step they keep ``keep`` of themselves and take the
    rest from the batch (Keras' ``momentum``; ``1 - momentum`` in torch).

    Args:
        layer: The layer's name (its module path in torch).
        setting: Its argument as the user wrote it (``"momentum=0.999"``).
        keep: The share of themselves its statistics keep each step.
    """

    layer: str
    setting: str
    keep: float

    def initial_share(self, steps: int) -> float:
        """How much of their initial values the statistics still hold after ``steps``."""
        return self.keep ** max(steps, 0)


@dataclass(frozen=True)
class SmallEpsilon:
    """An adaptive optimizer's epsilon too small for the 16-bit dtype of the weights it
    updates, in which it keeps their second moment (torch's optimizers and Keras' alike).

    Adam divides each step by ``sqrt(v) + eps``. A gradient element whose square is under
    the dtype's smallest subnormal (float16: 6e-8, so below ~2.4e-4) leaves ``v`` at zero,
    and its step is ``m / eps``: up to ``sqrt(smallest) / eps`` times the usual one (about
    the learning rate), and a division by zero where ``eps`` itself rounds to zero
    (float16: 1e-8). Small when that bound passes :data:`EPSILON_BOUND`.

    Args:
        optimizer: The optimizer's class name (``"AdamW"``).
        name: Its epsilon argument (``"eps"``, Keras' ``"epsilon"``).
        value: The epsilon.
        dtype: The 16-bit dtype (``"float16"``).
    """

    optimizer: str
    name: str
    value: float
    dtype: str

    @property
    def zero(self) -> bool:
        """Whether the epsilon rounds to zero in the dtype (half its smallest subnormal,
        or less)."""
        return self.value <= format_of(self.dtype).smallest / 2

    @property
    def bound(self) -> float:
        """How many times the usual step a step may be where the second moment
        underflowed (inf: the epsilon is zero)."""
        return math.inf if self.zero else math.sqrt(format_of(self.dtype).smallest) / self.value

    def __str__(self) -> str:
        return f"{self.optimizer}'s {self.name}={self.value:g}"


@dataclass(frozen=True)
class TrainingSetup:
    """The settings of the user's training that a finding's advice depends on.

    Args:
        framework: ``"lightning"``, ``"keras"``, or ``""`` when unknown.
        clipping: How the training clips gradients, in the user's own words (e.g.
            ``"gradient_clip_val=1.0"``, ``"clipnorm=1.0"``), or None.
        precision: The precision setting (``"16-mixed"``, ``"bf16-mixed"``,
            ``"mixed_float16"``…), or None for full precision.
        scheduler: Whether a learning-rate schedule drives the learning rate.
        adversarial: Whether the training step steps several optimizers by hand (a game
            such as a GAN): the loss it returns is a player's, not meant to fall.
        adaptive: Whether every optimizer scales each parameter's step by that
            parameter's own gradient history (Adam, RMSprop, Adagrad…), so that one
            large gradient does not make one large update.
        loss_scaler: The loss scaler that skips every step whose gradients overflow, and
            lowers its scale, in the user's words (``"GradScaler"``,
            ``"LossScaleOptimizer"``, ``"DeepSpeed's loss scaler"``), or None: under one,
            an overflow is its business.
        low_precision: Whether the run holds weights, gradients or activations in a 16-bit
            format (a half-precision setting, or a model cast by hand): the precision
            detectors judge only such a run, and cost nothing in any other.
        master_weights: Whether the optimizer updates float32 master copies of the
            16-bit weights (DeepSpeed's optimizers): an update too small for a weight is
            kept in its copy, not lost.
        divided_again: The number a step's loss is divided by a second time, after the
            mean over the batches it accumulates (1: none). Lightning divides each
            batch's loss by ``accumulate_grad_batches``, and under ``DeepSpeedStrategy``
            the engine's backward divides it by its ``gradient_accumulation_steps``,
            which Lightning sets to the same number.
        small_epsilon: An adaptive optimizer's epsilon too small for the 16-bit dtype it
            keeps its second moment in, or None.
        line_search: The optimizer that takes each step as a search over several calls
            of its closure (``"LBFGS"``), by name; empty: none. Its step is as long as the
            search finds, not a learning rate times a gradient.
        vocabulary: The tokens the model both embeds at its input and predicts at its
            output (an embedding table with as many rows as its last layer has outputs),
            as a language model does; 0: not so. Its labels are the next tokens of a
            text, Zipfian and in the text's order by nature, not a classifier's classes.
        loader_workers: The worker processes the training loader loads batches in, each
            with its own copy of the dataset (``DataLoader(num_workers=...)``); 0: the
            main process loads them, or it is not known.
        computes_in: The 16-bit dtype the forward pass was seen computing in where the
            weights are held in float32 and no precision setting says so (``"float16"``:
            ``torch.autocast`` written in the training step), or None. Its gradients are
            float16's, with float16's range, though held in float32.
        running_statistics: The normalization layer whose running statistics follow the
            batches slowest (see :class:`RunningStatistics`), or None: none has any.
        whole_batches: Whether the training loader serves batches that its dataset (or
            iterable) makes whole, rather than collating samples it draws one by one
            (``DataLoader(batch_size=None)``: a dataset of ready batches, the whole
            training set as each item of a full-batch run); False: it collates them, or
            it is not known.
    """

    framework: str = ""
    clipping: str | None = None
    precision: str | None = None
    scheduler: bool = False
    adversarial: bool = False
    adaptive: bool = False
    loss_scaler: str | None = None
    low_precision: bool = False
    master_weights: bool = False
    divided_again: int = 1
    small_epsilon: SmallEpsilon | None = None
    line_search: str = ""
    vocabulary: int = 0
    loader_workers: int = 0
    whole_batches: bool = False
    computes_in: str | None = None
    running_statistics: RunningStatistics | None = None

    @property
    def loss_scaled(self) -> bool:
        """Whether a loss scaler skips the steps whose gradients overflow."""
        return self.loss_scaler is not None

    @property
    def float16(self) -> bool:
        return self.precision in _FLOAT16


#: Optimizer class names (lowercase stems) whose step is normalised per parameter.
_ADAPTIVE = ("adam", "rmsprop", "adagrad", "adadelta", "adafactor", "lion", "lamb")


def adaptive_optimizers(optimizers: list) -> bool:
    """Whether every optimizer of ``optimizers`` (at least one) normalises its steps per
    parameter, judged by its class's name and those of its bases (a wrapper's inner
    optimizer, e.g. Keras' ``LossScaleOptimizer``, counts for it)."""
    if not optimizers:
        return False
    for opt in optimizers:
        opt = getattr(opt, "inner_optimizer", None) or opt
        if not any(stem in _lineage(opt) for stem in _ADAPTIVE):
            return False
    return True


def _lineage(optimizer: object) -> str:
    """The lowercase names of ``optimizer``'s class and its bases, what its kind is judged
    by (a subclass of Adam is an Adam); a name given as a string is its own."""
    if isinstance(optimizer, str):
        return optimizer.lower()
    return " ".join(cls.__name__.lower() for cls in type(optimizer).__mro__)


def clipping_advice(setup: TrainingSetup) -> str:
    """How to clip gradients in this framework, or, when the run clips already, that the
    norm is judged before the clipping (so the clipping bounds the update, not the
    cause)."""
    if setup.clipping:
        return (
            f"gradients are clipped already ({setup.clipping}); the norm here is before the "
            "clipping, so the cause is upstream of it"
        )
    example = {
        "lightning": "Trainer(gradient_clip_val=1.0)",
        "keras": "an optimizer with clipnorm=1.0",
    }.get(setup.framework, "a global norm of 1.0")
    return f"clip gradients (e.g. {example})"


def unoptimized_advice(setup: TrainingSetup) -> str:
    """What to do about trainable parameters that no optimizer updates, in the
    framework's own words."""
    if setup.framework == "keras":
        return (
            "hand them to optimizer.apply in the train step, or set the layer's "
            "trainable = False if they are meant to be frozen"
        )
    return (
        "add them to the optimizer (e.g. self.parameters() in configure_optimizers), or "
        "set requires_grad=False if they are meant to be frozen"
    )


def optimizer_advice(setup: TrainingSetup) -> str:
    """What to do about an optimizer that holds other parameters than those that train,
    in the framework's own words."""
    if setup.framework == "keras":
        return (
            "hand the trainable variables the loss reaches to the optimizer "
            "(model.trainable_variables), and check which layers have trainable = False"
        )
    return (
        "build the optimizer over the parameters meant to train, after any layer is "
        "replaced (self.parameters(), or filter(lambda p: p.requires_grad, "
        "self.parameters()) in configure_optimizers), and check where requires_grad=False "
        "was set"
    )


def warmup_advice(setup: TrainingSetup) -> str:
    """Warm-up advice: add one, or check the schedule's."""
    return "check your schedule's warm-up" if setup.scheduler else "add warm-up"


def float16_note(setup: TrainingSetup) -> str:
    """A clause for non-finite values under float16 mixed precision (empty otherwise)."""
    if not setup.float16:
        return ""
    return (
        f" Under {setup.precision} precision, float16 overflows past 65504: a bfloat16 "
        "setting keeps float32's range."
    )


#: Optimizer class names (lowercase stems) that divide each step by ``sqrt(v) + eps``,
#: ``v`` the mean of the squared gradients (Adamax keeps no square; Adadelta takes the
#: root of ``v + eps``).
_EPSILON_DIVIDES = ("adam", "rmsprop", "adagrad", "lamb")


def small_epsilon(
    optimizer: object, name: str, eps: object, dtypes: Iterable[object]
) -> SmallEpsilon | None:
    """``optimizer``'s epsilon (its argument ``name``) if it is small for one of
    ``dtypes``, those of the weights it updates (see :class:`SmallEpsilon`); None when
    it is not, is no number, or ``optimizer`` (judged by its class and bases, as
    :func:`adaptive_optimizers` judges it, or a class name) divides by no such root.
    bfloat16 has float32's range: 1e-8 is not small there."""
    lineage = _lineage(optimizer)
    if "adamax" in lineage or not any(s in lineage for s in _EPSILON_DIVIDES):
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        return None
    formats = {f.name: f for f in map(format_of, dtypes) if f is not None and f.bits < 24}
    shown = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    for fmt in sorted(formats.values(), key=lambda f: -f.smallest):  # the narrowest first
        risk = SmallEpsilon(shown, name, float(eps), fmt.name)
        if risk.bound > EPSILON_BOUND:
            return risk
    return None


def epsilon_advice(setup: TrainingSetup) -> str:
    """How to give the optimizer an epsilon its weights' dtype can bound the step with,
    in the framework's own words (1e-4 bounds it at 2.4x in float16)."""
    if setup.framework == "keras":
        return (
            "set epsilon=1e-4, or keep float32 variables and optimizer state (the "
            '"mixed_float16" dtype policy)'
        )
    if setup.framework == "lightning":
        return 'set eps=1e-4, or keep float32 weights and optimizer state (precision="16-mixed")'
    return "set an epsilon of 1e-4, or keep float32 weights and optimizer state"


def epsilon_cause(risk: SmallEpsilon) -> str:
    """Why a step went far where the epsilon is small: a clause naming it."""
    bound = (
        f"is 0 in {risk.dtype}"
        if risk.zero
        else f"lets such a step be up to {risk.bound:.0f}x the usual one"
    )
    return (
        f"where a gradient's second moment underflows to zero in {risk.dtype}, the step "
        f"divides by the epsilon alone, and {risk} {bound}"
    )
