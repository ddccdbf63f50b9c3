"""Instance attributes the probe puts on the user's objects (a model's ``compute_loss``,
an optimizer's ``apply``, a layer's ``call``), each taken off again."""

from __future__ import annotations

from typing import Any

__all__ = ["Patches"]


class Patches:
    """The instance attributes put on objects, in order, to be taken off in reverse."""

    def __init__(self) -> None:
        self._put: list[tuple[Any, str]] = []

    def __bool__(self) -> bool:
        return bool(self._put)

    def put(self, owner: Any, attr: str, fn: Any) -> None:
        """Set ``owner.attr = fn`` on the instance, where nothing else has set one (``fn``
        may wrap one of these patches: the train step's, on torch with ``recover=``)."""
        ours = any(o is owner and a == attr for o, a in self._put)
        if attr in vars(owner) and not ours:  # someone else's instance attribute
            raise RuntimeError(
                f"stethoscope: {type(owner).__name__}.{attr} is already replaced on this "
                "instance (another KerasStethoscope in the same fit?); use one per model"
            )
        setattr(owner, attr, fn)
        self._put.append((owner, attr))

    def remove(self) -> None:
        """Take every attribute off, last first; the class's own shows through again."""
        for owner, attr in reversed(self._put):
            if attr in vars(owner):
                delattr(owner, attr)
        self._put = []
