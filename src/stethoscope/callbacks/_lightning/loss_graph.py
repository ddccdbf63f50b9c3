"""What the loss's last operations did to shapes: a prediction and a target of different
shapes that broadcast into a square, read from the loss's autograd graph on the host."""

from __future__ import annotations

from typing import Any

__all__ = ["broadcast_in_loss"]

#: Elementwise operations that broadcast their two operands.
_ELEMENTWISE = frozenset(
    {"SubBackward0", "RsubBackward0", "AddBackward0", "MulBackward0", "DivBackward0"}
)
#: Losses of two operands that torch broadcasts first (``broadcast_tensors``, which
#: shows in the graph as an ``ExpandBackward0`` of the prediction).
_LOSSES = frozenset(
    {"MseLossBackward0", "L1LossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0"}
)
#: The loss's last operations looked at: the loss itself is computed within them.
_NODES = 24


def broadcast_in_loss(loss: Any) -> str | None:
    """A sentence naming the broadcast, where one of the loss's last operations made an
    ``(M, M)`` square out of a prediction of shape ``(M, 1)`` (or ``(M,)``) and a target
    that takes no gradient, or a 1-D one of ``M`` (a pairwise ``(1, M)`` operand is meant
    as one); ``""`` where none did; None where the graph cannot be read (no graph, or a
    torch without the autograd nodes' shapes)."""
    node = getattr(loss, "grad_fn", None)
    if node is None or not hasattr(node, "_input_metadata"):
        return None
    todo, seen = [node], 0
    while todo and seen < _NODES:
        node = todo.pop(0)
        seen += 1
        found = _broadcast_at(node)
        if found:
            return found
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return ""


def _broadcast_at(node: Any) -> str:
    name = type(node).__name__
    if name in _LOSSES:
        first = node.next_functions[0][0] if node.next_functions else None
        if first is None or type(first).__name__ != "ExpandBackward0":
            return ""
        made = _shape(first, 0)
        given = _producer_shape(first.next_functions[0]) if first.next_functions else None
        if _square(made) and given in ((made[0], 1), (made[0],)):
            return _said(given, "a target", made, name)
        return ""
    if name not in _ELEMENTWISE or len(node.next_functions) != 2:
        return ""
    made = _shape(node, 0)
    if not _square(made):
        return ""
    m = made[0]
    shapes = [_given_shape(edge) for edge in node.next_functions]
    for mine, other in ((0, 1), (1, 0)):
        given, against = shapes[mine], shapes[other]
        if given in ((m, 1), (m,)) and (
            node.next_functions[other][0] is None or (against == (m,) and given == (m, 1))
        ):
            target = "a target" if node.next_functions[other][0] is None else f"a {against}"
            return _said(given, target, made, name)
    return ""


def _shape(node: Any, index: int) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in node._input_metadata[index].shape)
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None


def _producer_shape(edge: tuple[Any, int]) -> tuple[int, ...] | None:
    producer, index = edge
    return _shape(producer, index) if producer is not None else None


def _given_shape(edge: tuple[Any, int]) -> tuple[int, ...] | None:
    """The shape of an operand as the user gave it: through an ``expand`` torch made to
    broadcast it (``l1_loss`` expands its operands, then subtracts)."""
    producer, _ = edge
    expanded = producer is not None and type(producer).__name__ == "ExpandBackward0"
    if expanded and producer.next_functions:
        return _producer_shape(producer.next_functions[0])
    return _producer_shape(edge)


def _square(shape: tuple[int, ...] | None) -> bool:
    return shape is not None and len(shape) == 2 and shape[0] == shape[1] >= 2


def _said(given: tuple[int, ...], target: str, made: tuple[int, ...], where: str) -> str:
    op = where.removesuffix("Backward0").removesuffix("Backward1")
    return f"a {given} prediction against {target} made a {made} tensor in {op}"
