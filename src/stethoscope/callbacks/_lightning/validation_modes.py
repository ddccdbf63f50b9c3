"""What ran with training behaviour during a validation: the ``val_modes`` statistic.

Lightning puts the model in eval mode to validate, but a mode is only a flag that each
module reads: a functional dropout called without ``training=self.training``, an
attention's ``dropout_p`` passed whatever the mode, a batch norm that a ``.train()``
inside ``validation_step`` (or an ``eval()`` override that misses it) left training,
each still behaves as in training. Validation is then random, or moves the running
statistics the model is judged with. Every such call passes its behaviour as an
argument, so a function mode that reads those arguments, over one validation batch,
sees each of them wherever it was written: in a module, in ``forward``, in the step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FirstValidation", "TrainingBehaviour", "compiled", "training_behaviour_of"]


def _rule(function: Callable, flag: str, *, needs_stats: str | None = None) -> tuple:
    """How to read one function's call: the argument that turns its training behaviour
    on (its position, name and default) and, for a normalisation, the running-statistics
    argument without which using batch statistics is what it always does."""
    params = list(inspect.signature(function).parameters.values())
    names = [p.name for p in params]
    position = names.index(flag)
    stats = names.index(needs_stats) if needs_stats is not None else None
    return function, (position, flag, params[position].default, stats, needs_stats)


def _rules() -> dict[Callable, tuple]:
    rules = [
        _rule(F.dropout, "training"),
        _rule(F.dropout1d, "training"),
        _rule(F.dropout2d, "training"),
        _rule(F.dropout3d, "training"),
        _rule(F.alpha_dropout, "training"),
        _rule(F.feature_alpha_dropout, "training"),
        _rule(F.rrelu, "training"),
        _rule(F.batch_norm, "training", needs_stats="running_mean"),
        _rule(F.instance_norm, "use_input_stats", needs_stats="running_mean"),
    ]
    # the ATen forms a user can call directly; torch.* builtins take no keywords' names
    # from inspect, so their positions are written out (see torch/_torch_docs.py)
    builtin = {
        torch.dropout: (2, "train", None, None, None),
        torch.feature_dropout: (2, "train", None, None, None),
        torch.alpha_dropout: (2, "train", None, None, None),
        torch.feature_alpha_dropout: (2, "train", None, None, None),
        torch.batch_norm: (5, "training", None, 3, "running_mean"),
    }
    return {**dict(rules), **builtin}


_RULES = _rules()
#: Attention takes its dropout as a probability, not as a flag.
_ATTENTION = F.scaled_dot_product_attention


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def training_behaviour_of(func: Callable, args: tuple, kwargs: dict | None) -> str | None:
    """The name of ``func`` when this call of it behaves as in training (dropping
    elements, or using and updating a batch's statistics where running ones exist),
    else None."""
    kwargs = kwargs or {}
    if func is _ATTENTION:
        p = _argument(args, kwargs, 4, "dropout_p", 0.0)
        return "scaled_dot_product_attention(dropout_p>0)" if _positive(p) else None
    rule = _RULES.get(func)
    if rule is None:
        return None
    position, flag, default, stats_at, stats_name = rule
    on = _argument(args, kwargs, position, flag, default)
    if on is not True:
        return None
    if stats_at is not None and _argument(args, kwargs, stats_at, stats_name, None) is None:
        return None  # no running statistics: batch statistics are all it ever uses
    name = getattr(func, "__name__", str(func))
    prefix = "F." if getattr(func, "__module__", "") == F.__name__ else "torch."
    return f"{prefix}{name}({flag}=True)"


def _positive(p: Any) -> bool:
    try:
        return float(p) > 0
    except (TypeError, ValueError, RuntimeError):
        return False


def compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a part of it runs through ``torch.compile``: a function mode
    there is a guard that compiles the graph again, for one batch, then again without."""
    from torch._dynamo.eval_frame import OptimizedModule

    if getattr(model, "_compiler_ctx", None):
        return True
    return any(isinstance(m, OptimizedModule) for m in model.modules())


class _Watch(TorchFunctionMode):
    """Notes each call with training behaviour, and the module whose forward made it."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self.where = where
        self.seen: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = training_behaviour_of(func, args, kwargs)
        if what is not None:
            self.seen.setdefault(what, self.where())
        return func(*args, **(kwargs or {}))


class TrainingBehaviour:
    """Watches one validation batch of ``model`` for calls with training behaviour.

    ``start()`` before the batch, ``stop()`` after it returns what was seen: a tuple of
    ``"<call> in <module>"`` (empty: none). Nothing is measured between the two but
    Python-level arguments: no tensor is read, nothing waits for the device.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._mode: _Watch | None = None

    def start(self) -> None:
        if self._mode is not None:
            return
        for name, module in self.model.named_modules():
            label = name or "<model>"
            self._handles.append(module.register_forward_pre_hook(self._enter(label)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._mode = _Watch(lambda: self._stack[-1] if self._stack else "the step")
        self._mode.__enter__()

    def stop(self) -> tuple[str, ...]:
        mode, self._mode = self._mode, None
        if mode is None:
            return ()
        mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        return tuple(f"{what} in {where}" for what, where in mode.seen.items())

    def _enter(self, label: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append(label)

        return hook

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()


class FirstValidation:
    """The ``val_modes`` statistic of a run: :class:`TrainingBehaviour` over the first
    batch of its first validation (not the sanity check), once, and what it saw, held
    until that validation ends (:meth:`take`)."""

    def __init__(self) -> None:
        self._watch: TrainingBehaviour | None = None
        self._calls: tuple[str, ...] | None = None
        self._done = False

    def validation_start(self, model: torch.nn.Module, *, wanted: bool) -> None:
        """A validation begins: watch its first batch if ``wanted`` and none was yet
        (nor in a compiled model, where a function mode would make it compile again)."""
        if wanted and not self._done and not compiled(model):
            self._done = True
            self._watch = TrainingBehaviour(model)

    def batch_start(self, dataloader_idx: int) -> None:
        if self._watch is not None and dataloader_idx == 0:
            self._watch.start()

    def batch_end(self) -> None:
        if self._watch is not None:
            self._calls, self._watch = self._watch.stop(), None

    def take(self) -> tuple[str, ...] | None:
        """What the watched batch saw (None: none was watched in this validation)."""
        calls, self._calls = self._calls, None
        return calls

    def close(self) -> None:
        """Never leave the function mode or a hook behind (a validation that raised)."""
        self.batch_end()
        self._calls = None
