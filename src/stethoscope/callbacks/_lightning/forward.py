"""Forward hooks, attached for one sampled step and removed at its end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stethoscope.statistics import SATURATION_BOUNDS

__all__ = ["SATURATING", "ForwardProbe"]

#: Activation modules whose inputs are checked for saturation.
SATURATING: dict[type[torch.nn.Module], str] = {torch.nn.Tanh: "tanh", torch.nn.Sigmoid: "sigmoid"}


#: The floating types a norm is taken in directly.
_NORMED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dense_float(x: Any) -> bool:
    """Whether ``x`` is a dense floating tensor: a sparse or nested output is skipped (its
    values need another API, and a nested one has no norm)."""
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and not x.is_nested
        and x.layout == torch.strided
    )


class ForwardProbe:
    """Forward hooks attached for one step only, then removed.

    ``activations`` mode watches the inputs of tanh / sigmoid modules (the fraction
    beyond the saturation bound) and the outputs of layers with units (RMS, max);
    ``trace`` mode records, for every leaf module in the order its forward runs,
    whether its output is entirely finite. Each module is recorded on its first
    call of the step only. Every statistic stays on the device.
    """

    def __init__(self, module: torch.nn.Module, layers: Sequence[tuple[str, int, Any]]) -> None:
        self._bounds = SATURATION_BOUNDS
        named = list(module.named_modules())
        self._act_targets = [
            (name, SATURATING[type(m)], m) for name, m in named if type(m) in SATURATING
        ]
        self._out_targets = [(name, "layer", m) for name, _, m in layers]
        # a leaf has no child; never by a child's truth: a torch.compile'd module (an
        # OptimizedModule) has a __len__ that raises for a module without one
        self._leaves = [
            (n or type(m).__name__, m) for n, m in named if next(m.children(), None) is None
        ]
        self._handles: list[Any] = []
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.dtypes: list[str] = []  # of the activations and outputs, in their order
        self.values: list[torch.Tensor] = []
        self._seen: set[str] = set()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, *, activations: bool, outputs: bool = False, trace: bool = False) -> None:
        self.detach()
        self.names, self.kinds, self.values, self._seen = [], [], [], set()
        self.dtypes = []
        targets = (self._act_targets if activations else []) + (
            self._out_targets if outputs else []
        )
        for name, kind, mod in targets:
            self._handles.append(mod.register_forward_hook(self._act_hook(name, kind)))
        if trace:
            for name, mod in self._leaves:
                self._handles.append(mod.register_forward_hook(self._trace_hook(name)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _act_hook(self, name: str, kind: str):
        def hook(mod: torch.nn.Module, args: tuple, out: Any) -> None:
            key = f"act|{name}"
            x = out if kind == "layer" else (args[0] if args else None)
            if key in self._seen or not _dense_float(x) or not x.numel():  # no peak in none
                return
            self._seen.add(key)
            with torch.no_grad():
                x = x.detach()
                n = max(x.numel(), 1)
                # fused norms: no temporaries the size of the activation, in float32 at
                # least (a norm is never taken in a type narrower than its input's)
                wide = torch.float64 if x.dtype == torch.float64 else torch.float32
                if x.dtype not in _NORMED:  # float8: no norm of its own
                    x = x.to(wide)
                rms = (torch.linalg.vector_norm(x, dtype=wide) / n**0.5).float()
                peak = torch.linalg.vector_norm(x, float("inf"), dtype=wide).float()
                if kind == "layer":
                    sat = torch.full((), float("nan"), device=x.device)
                else:
                    sat = torch.count_nonzero(x.abs() >= self._bounds[kind]) / n
                stats = torch.stack([sat.float(), rms, peak])
            self.names.append(name)
            self.kinds.append(kind)
            self.dtypes.append(str(x.dtype).rsplit(".", 1)[-1])
            self.values.append(stats)

        return hook

    def _trace_hook(self, name: str):
        def hook(mod: torch.nn.Module, args: tuple, out: Any) -> None:
            key = f"trace|{name}"
            if key in self._seen:
                return
            tensors = (
                [out]
                if isinstance(out, torch.Tensor)
                else [
                    t
                    for t in (out if isinstance(out, (tuple, list)) else ())
                    if isinstance(t, torch.Tensor)
                ]
            )
            tensors = [t for t in tensors if _dense_float(t)]
            if not tensors:
                return
            self._seen.add(key)
            with torch.no_grad():
                finite = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()
            self.names.append(name)
            self.kinds.append("trace")
            self.values.append(finite.float().reshape(1))

        return hook

    def collect(self) -> tuple[list[str], list[str], torch.Tensor | None]:
        """What the hooks recorded this step (names, kinds, values), and detach them."""
        self.detach()
        if not self.values:
            return [], [], None
        flat = torch.cat([v.reshape(-1) for v in self.values])
        return self.names, self.kinds, flat
