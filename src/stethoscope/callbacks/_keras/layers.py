"""What the Keras probe needs to know about a model's layers and its distribution."""

from __future__ import annotations

from typing import Any

import keras

__all__ = [
    "activation_kind",
    "distribution",
    "feeds_activation",
    "fused_activations",
    "input_scaling",
    "leaf_layers",
    "strategy_name",
    "unit_layer",
]


def activation_kind(layer: Any) -> str | None:
    """``"tanh"``/``"sigmoid"`` when the layer ends in that activation."""
    fn = getattr(layer, "activation", None)
    name = getattr(fn, "__name__", None)
    if name in ("tanh", "sigmoid"):
        return name
    return None


def unit_layer(layer: Any) -> bool:
    """Dense and convolution layers: a kernel whose last axis is the output units."""
    from keras import layers as kl

    convs = (kl.Conv1D, kl.Conv2D, kl.Conv3D)
    return isinstance(layer, (kl.Dense, *convs)) and not isinstance(
        layer, (kl.Conv1DTranspose, kl.Conv2DTranspose, kl.Conv3DTranspose)
    )


def input_scaling(model: Any) -> tuple[Any, ...]:
    """The layers a model of one input scales its input with before anything else: its
    leading ``Rescaling`` and ``Normalization`` layers (``keras.applications``' MobileNet
    and EfficientNet models take pixels in 0..255 and rescale them themselves), looked
    for inside a model that is the first layer of another. The inputs are judged as its
    first trained layer sees them."""
    from keras import layers as kl

    if len(getattr(model, "inputs", None) or ()) > 1:
        return ()
    found: list[Any] = []
    layer = model
    while True:
        inner = [la for la in getattr(layer, "layers", ()) if not isinstance(la, kl.InputLayer)]
        if not inner:
            return tuple(found)
        for la in inner:
            if isinstance(la, (kl.Rescaling, kl.Normalization)):
                found.append(la)
                continue
            break
        else:
            return tuple(found)
        if found or not isinstance(la, keras.Model):
            return tuple(found)
        layer = la  # a model as the first layer: its own first layers


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
    """The model's ``tf.distribute.MirroredStrategy`` or ``MultiWorkerMirroredStrategy``,
    or None when it trains on one replica.

    Raises:
        ValueError: For the other strategies, naming the strategy.
    """
    if keras.backend.backend() != "tensorflow":
        return None
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return None
    import tensorflow as tf

    mirrored = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if isinstance(strategy, mirrored):
        return strategy
    name = type(strategy).__name__
    if name in _SINGLE:
        return None
    raise ValueError(
        f"KerasStethoscope supports tf.distribute.MirroredStrategy and "
        f"MultiWorkerMirroredStrategy, not {name}: its probe keeps a copy of its variables "
        "on each replica and reads this process's copies, which hold the replicas' own "
        "measures only where every replica mirrors the weights and runs the whole step "
        "(TPUStrategy, ParameterServerStrategy and CentralStorageStrategy are not "
        "supported). Train under one of those two, or without KerasStethoscope."
    )


def strategy_name(strategy: Any) -> str:
    """The name a user knows ``strategy`` by (``MultiWorkerMirroredStrategy``'s class is
    ``CollectiveAllReduceStrategy``)."""
    name = type(strategy).__name__
    return "MultiWorkerMirroredStrategy" if name == "CollectiveAllReduceStrategy" else name


def feeds_activation(layer: Any) -> bool:
    """Whether ``layer`` is a Dense/Conv without an activation of its own whose output only
    activation layers read (known for Sequential and functional models)."""
    from keras import layers as kl

    own = getattr(getattr(layer, "activation", None), "__name__", "")
    if not unit_layer(layer) or own not in ("linear", ""):
        return False
    consumers = [getattr(n, "operation", None) for n in getattr(layer, "_outbound_nodes", [])]
    acts = (kl.Activation, kl.ReLU, kl.LeakyReLU, kl.ELU, kl.PReLU, kl.Softmax)
    return bool(consumers) and all(isinstance(c, acts) for c in consumers)


def fused_activations(layers: list[Any]) -> set[int]:
    """The ids of the activation layers that read a layer of :func:`feeds_activation`:
    their output is that layer's output after its activation, the one the probe reads in
    its place (as it reads a ``Dense(activation="relu")``'s)."""
    out: set[int] = set()
    for layer in layers:
        if feeds_activation(layer):
            out |= {id(n.operation) for n in getattr(layer, "_outbound_nodes", [])}
    return out
