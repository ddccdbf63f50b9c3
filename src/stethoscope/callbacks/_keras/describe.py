"""The Keras model, its optimizer and the fit's settings as plain data, for the record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stethoscope.advice import (
    RunningStatistics,
    SmallEpsilon,
    TrainingSetup,
    adaptive_optimizers,
    small_epsilon,
)
from stethoscope.number_formats import HALF

__all__ = [
    "LossForm",
    "describe_run",
    "has_own_train_step",
    "loss_expects",
    "loss_form",
    "optimizers_of",
    "own_loss",
    "training_setup",
]

#: Keras' cross-entropies, which take probabilities unless ``from_logits=True``.
_CROSS_ENTROPIES = frozenset(
    {
        "sparse_categorical_crossentropy",
        "categorical_crossentropy",
        "binary_crossentropy",
        "categorical_focal_crossentropy",
        "binary_focal_crossentropy",
    }
)


#: Those of them that take each element of the output as a probability of its own (a
#: sigmoid's: binary or multi-label), not each row along the class axis as a distribution.
_BINARY = frozenset({"binary_crossentropy", "binary_focal_crossentropy"})


def _loss_config(model: Any) -> tuple[str | None, dict[str, Any]]:
    """The compiled loss's name and config (a name or a function: its own defaults)."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        return loss, {}
    if callable(getattr(loss, "get_config", None)):
        config = loss.get_config()
        return config.get("name"), config
    return getattr(loss, "__name__", None), {}


def loss_expects(model: Any) -> str:
    """What the compiled loss takes: ``"logits"`` or ``"probabilities"`` (a Keras
    cross-entropy, by its ``from_logits``: a name, a function or an instance), or ``""``
    (any other loss, several of them, or one the step computes itself)."""
    name, config = _loss_config(model)
    if name not in _CROSS_ENTROPIES:
        return ""
    return "logits" if config.get("from_logits", False) else "probabilities"


@dataclass(frozen=True)
class LossForm:
    """How the compiled loss reads the output it is fed, where it takes probabilities:
    ``binary``, each element (within [0, 1], a sigmoid's), or each slice along the class
    ``axis`` (non-negative and summing to 1, a softmax's): Keras' categorical losses take
    their ``axis`` (1: a channels-first sequence or image, classes before the steps)."""

    binary: bool = False
    axis: int = -1
    #: The loss is the user's own (a function, or a ``Loss`` of their own class): what it
    #: takes is read from its value, set against each way of taking the output.
    own: bool = False


def loss_form(model: Any) -> LossForm:
    """The :class:`LossForm` of ``model``'s compiled loss (any loss but Keras' binary
    cross-entropies: a distribution along its ``axis``, the last by default)."""
    name, config = _loss_config(model)
    axis = config.get("axis", -1)
    return LossForm(
        binary=name in _BINARY, axis=axis if isinstance(axis, int) else -1, own=own_loss(model)
    )


def own_loss(model: Any) -> bool:
    """Whether ``model``'s compiled loss is one the user wrote: a function, or a ``Loss``
    of a class of their own (a Keras loss wrapping their function too). A name, one of
    Keras' losses, or several losses (a dict or a list, one per output) is not."""
    loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (str, dict, list, tuple)) or not callable(loss):
        return False
    wrapped = getattr(loss, "fn", None)  # keras.losses.LossFunctionWrapper(fn)
    if callable(wrapped) and not isinstance(wrapped, str):
        loss = wrapped
    owner = loss if hasattr(loss, "__code__") else type(loss)
    module = getattr(owner, "__module__", "") or ""
    return not (module == "keras" or module.startswith(("keras.", "tensorflow", "tf_keras")))


def describe_run(model: Any, params: dict[str, Any] | None) -> dict[str, Any]:
    """What a run's record says about a Keras ``model`` trained with ``params`` (the
    callback's ``self.params``: epochs, steps, verbose)."""
    weights = [
        {
            "name": w.path,
            "shape": [int(d) for d in w.shape],
            "numel": int(_numel(w.shape)),
            "trainable": bool(w.trainable),
        }
        for w in model.weights
    ]
    optimizer = model.optimizer
    try:
        opt_config = {k: v for k, v in optimizer.get_config().items() if _plain(v)}
    except Exception:  # a custom optimizer without a config: its class is still said
        opt_config = {}
    return {
        "framework": "keras",
        "model": {
            "class": type(model).__name__,
            "name": model.name,
            "parameters": weights,
            "total": sum(w["numel"] for w in weights),
            "layers": [type(layer).__name__ for layer in model.layers],
        },
        "optimizers": [{"class": type(optimizer).__name__, "groups": [opt_config]}],
        "trainer": {
            **{k: v for k, v in (params or {}).items() if _plain(v)},
            "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
            "jit_compile": str(getattr(model, "jit_compile", None)),
        },
    }


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def has_own_train_step(model: Any) -> bool:
    """Whether ``model`` trains with a ``train_step`` of its own, not Keras'."""
    return not getattr(type(model).train_step, "__module__", "").startswith("keras.")


def optimizers_of(model: Any) -> list[Any]:
    """``model.optimizer`` and every other optimizer the model holds as an attribute (a
    GAN's second player's, set in its ``compile``), each once."""
    import keras

    found = [model.optimizer] if model.optimizer is not None else []
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
    return found


def training_setup(model: Any) -> TrainingSetup:
    """What ``model``'s training already does that the findings' advice depends on: its
    optimizer's clipping, the dtype policy, whether a schedule drives the learning rate,
    whether its own train step plays a game (a GAN: an optimizer per player), whether a
    ``LossScaleOptimizer`` scales its loss, and whether it holds anything in 16 bits (a
    policy other than float32 and float64, or a variable of a layer with a policy of its
    own)."""
    import keras

    optimizer = model.optimizer
    clipping = next(
        (
            f"{name}={value}"
            for name in ("global_clipnorm", "clipnorm", "clipvalue")
            if (value := getattr(optimizer, name, None))
        ),
        None,
    )
    policy = str(
        getattr(getattr(model, "dtype_policy", None), "name", None)
        or keras.config.dtype_policy().name
    )
    schedule = getattr(optimizer, "_learning_rate", None)  # the schedule itself, if any
    # a variable in a 16-bit dtype under a float32 policy: a layer given a policy of its own
    half = any(keras.backend.standardize_dtype(v.dtype) in HALF for v in model.trainable_variables)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    return TrainingSetup(
        framework="keras",
        clipping=clipping,
        precision=None if policy in _FULL_PRECISION else policy,
        scheduler=isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule),
        adversarial=has_own_train_step(model) and len(optimizers_of(model)) > 1,
        adaptive=adaptive_optimizers(optimizers_of(model)),
        loss_scaler="LossScaleOptimizer" if scaled else None,
        low_precision=policy not in _FULL_PRECISION or half,
        small_epsilon=_small_epsilon(model),
        vocabulary=_vocabulary(model),
        running_statistics=_running_statistics(model),
    )


def _running_statistics(model: Any) -> RunningStatistics | None:
    """The trainable batch normalization that follows the batches slowest (its moving
    statistics keep ``momentum`` of themselves each step; a frozen one never moves them,
    and normalises by them in training too)."""
    import keras

    from stethoscope.callbacks._keras.layers import leaf_layers

    norms = [
        la
        for la in leaf_layers(model)
        if isinstance(la, keras.layers.BatchNormalization) and la.trainable
    ]
    if not norms:
        return None
    slowest = max(norms, key=lambda la: float(la.momentum))
    m = float(slowest.momentum)
    return RunningStatistics(slowest.name, f"momentum={m:g}", m)


def _vocabulary(model: Any) -> int:
    """The tokens ``model`` both embeds and predicts: the rows (``input_dim``) of one of
    its ``Embedding`` layers, where its last ``Dense`` layer (or the one a
    ``TimeDistributed`` wraps) has as many units (a language model's encoder and
    decoder); 0: none."""
    from keras import layers as kl

    from stethoscope.callbacks._keras.layers import leaf_layers

    leaves = [getattr(la, "layer", la) for la in leaf_layers(model)]
    tables = {la.input_dim for la in leaves if isinstance(la, kl.Embedding)}
    heads = [la.units for la in leaves if isinstance(la, kl.Dense)]
    return heads[-1] if tables and heads and heads[-1] in tables else 0


def _small_epsilon(model: Any) -> SmallEpsilon | None:
    """The first optimizer's epsilon too small for the 16-bit variables it updates (Keras
    keeps an optimizer's slots in each variable's dtype; a ``LossScaleOptimizer``'s is
    its inner optimizer's)."""
    import keras

    dtypes = {keras.backend.standardize_dtype(v.dtype) for v in model.trainable_variables}
    for optimizer in optimizers_of(model):
        optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer
        risk = small_epsilon(optimizer, "epsilon", getattr(optimizer, "epsilon", None), dtypes)
        if risk is not None:
            return risk
    return None


#: The dtype policies that compute and keep the variables in float32 or float64.
_FULL_PRECISION = frozenset({"float32", "float64"})
