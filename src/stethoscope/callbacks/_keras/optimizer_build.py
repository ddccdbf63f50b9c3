"""Building a model's optimizer before the fit's first step, exactly as Keras' own train
step would build it in that step.

Keras builds the optimizer (its slots) in the first call of ``apply``, inside the first
traced train step. A ``tf.function`` that creates variables is traced twice: once
creating them, once more without. So whichever of the probe's train functions runs
first would cost two traces of the whole step. Built before, every function is traced
once. A snapshot taken before the first step (``recover=``) needs the slots too.
"""

from __future__ import annotations

from typing import Any

import keras

from stethoscope.callbacks._keras.describe import has_own_train_step

__all__ = ["build_as_keras"]


def build_as_keras(model: Any) -> bool:
    """Build ``model.optimizer`` on the model's trainable variables, in the optimizer's
    name scope, as Keras' ``train_step`` does on its first step; returns whether it did.

    Only where that is what Keras would do: a built model that trains with Keras' own
    ``train_step`` (a ``train_step`` of the user's may apply to other variables, a GAN's
    to each player's), and an optimizer not yet built. Under a distribution strategy
    ``fit`` builds it already, in the strategy's scope."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.trainable_variables) if model.built else []
    if optimizer is None or optimizer.built or not variables or has_own_train_step(model):
        return False
    with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(variables)
    optimizer.built = True
    return True
