"""What ``fit`` was asked that Keras tells no callback: the order of the data."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["data_order"]

#: How far up the stack ``fit`` may be from the callback's ``on_train_begin`` (Keras
#: calls it through its callback list and a traceback filter).
_DEPTH = 12


def data_order(model: Any) -> str:
    """The order ``model.fit`` was asked to serve its training data in: ``"shuffle"``
    (``shuffle=True`` or ``"batch"`` with arrays, tensors or a ``PyDataset``),
    ``"sequential"`` (``shuffle=False`` with those), or ``""`` when unknown: a
    ``tf.data.Dataset``, a generator or a torch loader orders itself (``fit`` ignores
    ``shuffle`` for them), or ``fit`` is not on the stack.

    Keras hands a callback ``epochs``, ``steps`` and ``verbose`` only, so this reads the
    two arguments from ``fit``'s own frame, which calls ``on_train_begin`` (found as a
    function named ``fit`` whose ``self`` is ``model``): call it from there.
    """
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return ""
        names = frame.f_locals
        if frame.f_code.co_name == "fit" and names.get("self") is model and "shuffle" in names:
            return _order(names.get("x"), names["shuffle"])
        frame = frame.f_back
    return ""


def _order(x: Any, shuffle: Any) -> str:
    kind = type(x).__module__ + "." + type(x).__name__
    orders_itself = (
        ("tensorflow" in kind and "Dataset" in kind)
        or "DataLoader" in kind
        or hasattr(x, "__next__")  # a generator or an iterator
    )
    if orders_itself:
        return ""
    return "sequential" if shuffle is False else "shuffle"
