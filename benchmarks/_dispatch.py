"""Calling a callback's hook the way Lightning calls each callback's, for the gating
callbacks of the Lightning benchmarks."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

#: The hooks Lightning calls on every step after ``on_train_batch_start`` (which a gate
#: handles itself, choosing who owns the step there).
STEP_HOOKS = (
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)


def call_hook(callback: Callback, name: str, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
    """What Lightning's ``_call_callback_hooks`` does for one callback: skip the hook if it
    is not callable, else call it inside the profiler's context. A gate that called the
    hook directly would leave out what being a callback costs on every step (six hooks
    a step, each called whether the callback works there or not), which a user pays."""
    fn = getattr(callback, name)
    if callable(fn):
        with trainer.profiler.profile(f"[Callback]{callback.state_key}.{name}"):
            fn(trainer, trainer.lightning_module, *args, **kwargs)
