"""Torch-side probes: fused per-parameter reductions and non-blocking host reads.

Everything here runs on the device the tensors live on. The only way numbers
reach the host is :class:`HostReader`, which on CUDA copies into pinned memory
with ``non_blocking=True`` and polls a CUDA event, so the training stream is
never synchronised; a result is read at most ``max_lag`` steps after it was
produced (then, and only then, the reader waits for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["HostReader", "ParameterProbe", "checksums"]


class HostReader:
    """Moves small 1-D device tensors to the host in order, without blocking.

    Args:
        max_lag: How many pushes a CUDA result may wait before the reader blocks
            on it. This bounds the detection delay, in steps, on a GPU; on the
            CPU results are read at once.
    """

    def __init__(self, max_lag: int = 2) -> None:
        self.max_lag = max_lag
        self._pending: deque[tuple[Any, torch.Tensor, Any]] = deque()

    def push(self, meta: Any, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            self._pending.append((meta, host, event))
        else:
            # CPU: nothing to wait for. Other accelerators: a plain copy (may synchronise).
            self._pending.append((meta, tensor.cpu(), None))

    def pop(self, *, wait: bool = False) -> list[tuple[Any, np.ndarray]]:
        """The results whose copies are done, oldest first (all of them if ``wait``)."""
        out: list[tuple[Any, np.ndarray]] = []
        while self._pending:
            meta, host, event = self._pending[0]
            if event is not None and not event.query():
                if not wait and len(self._pending) <= self.max_lag:
                    break
                event.synchronize()  # the lag bound: never more than max_lag steps behind
            self._pending.popleft()
            out.append((meta, host.numpy()))
        return out

    def __len__(self) -> int:
        return len(self._pending)


class ParameterProbe:
    """Fused reductions over a fixed, ordered set of named parameters.

    Args:
        named_parameters: ``(name, parameter)`` pairs in registration order; only
            those that require grad are watched.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        snapshot_budget: int = 2**25,
    ) -> None:
        pairs = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.snapshot_budget = snapshot_budget
        self._rotation = 0
        self.names: tuple[str, ...] = tuple(n for n, _ in pairs)
        self.params: list[torch.nn.Parameter] = [p for _, p in pairs]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.numel = np.array([p.numel() for p in self.params], dtype=np.float64)
        self.is_matrix = np.array([p.dim() >= 2 for p in self.params], dtype=bool)

    def indices_of(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Indices of the watched parameters this optimizer updates."""
        seen = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self.index.get(id(p))
                if i is not None:
                    seen.append(i)
        return seen

    def with_grad(self, indices: Sequence[int]) -> list[int]:
        """The indices whose parameter has a gradient this step."""
        return [i for i in indices if self.params[i].grad is not None]

    def grad_norms(self, indices: Sequence[int]) -> torch.Tensor:
        """L2 norm of each gradient, as one float32 tensor on the device."""
        return _stack_norms([self.params[i].grad.detach() for i in indices])

    def snapshot(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Copies of these parameters, to measure the optimizer's update against."""
        return torch._foreach_mul([self.params[i].detach() for i in indices], 1.0)

    def choose(self, indices: Sequence[int]) -> list[int]:
        """The parameters to snapshot this sampled step: at most ``snapshot_budget`` elements.

        A snapshot copies the weights, so an unbounded one would double a large model's
        parameter memory on every sampled step. Past the budget, successive sampled steps
        take turns through the parameters, so each is measured every few samples.
        """
        if not indices:
            return []
        n = len(indices)
        start = self._rotation % n
        chosen, used = [], 0
        for k in range(n):
            i = indices[(start + k) % n]
            size = int(self.numel[i])
            if chosen and used + size > self.snapshot_budget:
                self._rotation = start + k
                break
            chosen.append(i)
            used += size
        else:
            self._rotation = start
        return sorted(chosen)

    def weight_and_update_norms(
        self,
        indices: Sequence[int],
        before: list[torch.Tensor] | None,
        snapped: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Norms of the weights now, of their change since ``before``, and of ``before``.

        ``before`` holds snapshots of the parameters ``snapped`` (default: ``indices``).
        """
        now = [self.params[i].detach() for i in indices]
        weights = _stack_norms(now)
        if before is None:
            return weights, None, None
        if snapped is not None and list(snapped) != list(indices):
            now = [self.params[i].detach() for i in snapped]
        previous = _stack_norms(before)
        torch._foreach_sub_(before, now)  # reuse the snapshot's memory for the difference
        return weights, _stack_norms(before), previous


def _stack_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All L2 norms in one fused kernel, accumulated in float32, stacked into one tensor.

    Accumulating in float32 keeps an fp16/bf16 tensor of large but finite values from
    reporting an infinite norm (which would read as a non-finite gradient).
    """
    if all(t.dtype != torch.float64 for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    # float64 cannot be narrowed inside the norm: take those apart, keep the order
    out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    rest = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    for idx, kw in ((wide, {}), (rest, {"dtype": torch.float32})):
        if idx:
            norms = torch._foreach_norm([tensors[i] for i in idx], 2, **kw)
            for i, n in zip(idx, norms, strict=True):
                out[i] = n.float()
    return torch.stack(out)


#: The integer type of each element size, to read a tensor's bit patterns as integers.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An exact checksum of each tensor: the int64 sum of its elements' bit patterns.

    Integer addition does not depend on the order of the sum, so identical tensors give
    identical checksums on any rank and any kernel, and changing any element changes it
    (floats would round, and a norm cannot see a sign flip or a permutation within a
    row either). One int64 tensor on the device; no copy of any tensor is made.
    """
    out = []
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        bits = t.view(_BITS[t.element_size()]) if t.element_size() in _BITS else t
        out.append(bits.sum(dtype=torch.int64))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


#: Layers whose weight has one row per output unit (dim 0): dense and convolution layers.
UNIT_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
)
#: Activation modules whose inputs are checked for saturation.
SATURATING: dict[type[torch.nn.Module], str] = {torch.nn.Tanh: "tanh", torch.nn.Sigmoid: "sigmoid"}


def unit_layers(
    module: torch.nn.Module, probe: ParameterProbe
) -> list[tuple[str, int, torch.nn.Module]]:
    """``(module name, index of its weight in probe, module)`` for each watched layer with units."""
    out = []
    for name, mod in module.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, UNIT_LAYERS) and isinstance(w, torch.Tensor) and id(w) in probe.index:
            out.append((name or type(mod).__name__, probe.index[id(w)], mod))
    return out


def zero_rows(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """For each gradient, 1.0 for every output unit (row) that is zero, else 0.0.

    The row's L2 norm, accumulated in float32, is zero exactly when every entry is
    (or under ~1e-19, where a square underflows): on the CPU it is ~10x faster than
    the max-abs norm, and it leaves no temporary the size of the gradient.
    """
    return torch.cat(
        [
            (
                torch.linalg.vector_norm(g.detach().flatten(1), 2, dim=1, dtype=torch.float32) == 0
            ).float()
            for g in grads
        ]
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
        from stethoscope.observation import SATURATION_BOUNDS

        self._bounds = SATURATION_BOUNDS
        named = list(module.named_modules())
        self._act_targets = [
            (name, SATURATING[type(m)], m) for name, m in named if type(m) in SATURATING
        ]
        self._out_targets = [(name, "layer", m) for name, _, m in layers]
        self._leaves = [(n or type(m).__name__, m) for n, m in named if not any(m.children())]
        self._handles: list[Any] = []
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.values: list[torch.Tensor] = []
        self._seen: set[str] = set()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, *, activations: bool, outputs: bool = False, trace: bool = False) -> None:
        self.detach()
        self.names, self.kinds, self.values, self._seen = [], [], [], set()
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
            if key in self._seen or not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return
            self._seen.add(key)
            with torch.no_grad():
                x = x.detach()
                n = max(x.numel(), 1)
                # fused norms: no temporaries the size of the activation
                rms = torch.linalg.vector_norm(x, dtype=torch.float32) / n**0.5
                peak = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
                if kind == "layer":
                    sat = torch.full((), float("nan"), device=x.device)
                else:
                    sat = torch.count_nonzero(x.abs() >= self._bounds[kind]) / n
                stats = torch.stack([sat.float(), rms, peak])
            self.names.append(name)
            self.kinds.append(kind)
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
            tensors = [t for t in tensors if t.is_floating_point()]
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


#: Keys of a dict batch that hold the inputs, and the labels, in order of preference.
INPUT_KEYS = ("x", "input", "inputs", "features", "image", "images", "pixel_values")
LABEL_KEYS = ("labels", "label", "y", "target", "targets")
#: Above this many features, inputs are judged as one whole.
MAX_FEATURES = 4096


def split_batch(batch: Any) -> tuple[Any, Any]:
    """The (inputs, labels) of a batch: ``(x, y, ...)`` sequences or dicts with usual keys."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0], batch[1] if len(batch) > 1 else None
    if isinstance(batch, dict):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        return x, y
    return None, None


def input_moments(x: Any) -> tuple[torch.Tensor, int] | None:
    """Per-feature mean of x^2 (channels for images, last dim for sequences), and the samples."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or not len(x):
        return None
    with torch.no_grad():
        x = x.detach()
        if x.dim() == 1:
            flat = x.reshape(-1, 1)
        elif x.dim() == 2:
            flat = x
        elif x.dim() == 3:
            flat = x.reshape(-1, x.shape[-1])
        else:
            flat = x.transpose(0, 1).reshape(x.shape[1], -1).T
        if flat.shape[1] > MAX_FEATURES:
            flat = flat.reshape(-1, 1)
        norms = torch.linalg.vector_norm(flat, dim=0, dtype=torch.float32)  # one fused pass
        return norms.square() / max(flat.shape[0], 1), int(x.shape[0])


def class_labels(y: Any) -> torch.Tensor | None:
    """Integer class labels of a batch as float32 (exact below 2**24), then a validity flag.

    One-hot or soft labels (rows of probabilities) become their argmax; the last
    element is 1.0 when the labels are class labels and 0.0 when a float target
    turned out not to be rows of probabilities (decided on the host, no sync).
    """
    if not isinstance(y, torch.Tensor) or y.numel() == 0:
        return None
    with torch.no_grad():
        y = y.detach()
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.dim() == 1 and not y.is_floating_point() and y.dtype != torch.bool:
            return torch.cat([y.float(), y.new_ones(1, dtype=torch.float32)])
        if y.dim() == 2 and y.is_floating_point() and y.shape[1] >= 2:
            rows = ((y.sum(1) - 1).abs() < 1e-3).all() & (y >= 0).all()
            return torch.cat([y.argmax(1).float(), rows.float().reshape(1)])
    return None
