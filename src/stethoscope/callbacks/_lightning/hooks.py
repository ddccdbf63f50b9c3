"""Which of the callback's step hooks Lightning calls.

Lightning calls each of the six step hooks of each callback on every step, whether the
callback has work there or not, and each call costs more than a quiet step's work there:
a profiler context opened, the hook's name formatted, the call. Lightning skips a hook
that is not callable
(``_call_callback_hooks`` tests ``callable(fn)`` before it opens the context), so a hook
the step does not need is set to ``None`` on the callback instance, hiding the class's
method, and shown again by deleting that attribute.

Only hooks the callback's class leaves as ``LightningStethoscope`` defines them are
switched: a subclass that overrides one keeps it called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SWITCHED", "HookSwitch"]

#: The step hooks a step may not need: the two LightningStethoscope leaves to the base
#: class never are; ``on_before_backward`` only for the ranks' timing or a recovery
#: ladder; ``on_before_optimizer_step`` only on a sampled step or for a recovery ladder.
SWITCHED = (
    "on_before_zero_grad",
    "on_after_backward",
    "on_before_backward",
    "on_before_optimizer_step",
)


class HookSwitch:
    """Turns step hooks of ``callback`` off and on for Lightning.

    Args:
        callback: The callback instance.
        owner: The class whose definitions of the hooks may be switched (a subclass of
            it that overrides a hook keeps that hook on).
        names: The hooks that may be switched.
    """

    def __init__(self, callback: Any, owner: type, names: tuple[str, ...] = SWITCHED) -> None:
        self._callback = callback
        self.switchable = frozenset(
            n for n in names if getattr(type(callback), n) is getattr(owner, n)
        )
        #: Whether the backward hook is wanted on every step (a recovery ladder, the ranks'
        #: timing, a watch for a game), not only where a step has work there.
        self.backward_always = False
        self._backward_on = False

    def start_fit(self, *, recovering: bool, ranks: int) -> None:
        """A fit starts: the hooks the callback never uses off, the backward hook on only
        where it is used (a recovery ladder; a distributed run of several ``ranks``, which
        time their backward passes), the optimizer hook on until a step's start says."""
        self.set("on_before_zero_grad", False)
        self.set("on_after_backward", False)
        self.backward_always = self._backward_on = recovering or ranks > 1
        self.set("on_before_backward", self._backward_on)
        self.set("on_before_optimizer_step", True)

    def backward(self, wanted: bool) -> None:
        """The backward hook on for a step that has work there (``wanted``), or on every
        step where :attr:`backward_always`; off otherwise."""
        on = wanted or self.backward_always
        if on is not self._backward_on:
            self.set("on_before_backward", on)
            self._backward_on = on

    def set(self, name: str, on: bool) -> None:
        """Have Lightning call hook ``name`` (``on``) or skip it, if it may be switched."""
        if name not in self.switchable:
            return
        own = vars(self._callback)
        if on:
            own.pop(name, None)
        else:
            own[name] = None

    def restore(self) -> None:
        """Every hook on again, as the class defines it (after a fit)."""
        for name in self.switchable:
            self.set(name, True)
