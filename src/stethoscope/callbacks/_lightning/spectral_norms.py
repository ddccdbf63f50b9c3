"""What a validation divides its spectrally normalized weights by: the ``val_spectral``
statistic.

Spectral normalization divides a weight ``W`` by an estimate of its largest singular
value, ``u @ W @ v``, from two vectors it keeps as buffers and moves by power iteration.
``torch.nn.utils.spectral_norm`` (a forward pre-hook) draws them at random when it is
applied and iterates only in a training-mode forward: a validation before any (Lightning's
sanity check, ``trainer.validate()`` first) divides by ``u @ W @ v`` of random vectors, a
small number of either sign, and the weight comes out many times too large (pytorch issue
51800). ``torch.nn.utils.parametrizations.spectral_norm`` iterates 15 times when it is
registered, but a weight set after that (an initialization, a weight loaded alone) leaves
its vectors as stale. Either way the eval-mode forward uses what is stored, so what is
stored, beside the weight's true largest singular value, is what is measured: once, over
the modules the first validation batch ran, and nothing at all in a model without
spectral normalization.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm

__all__ = ["FirstSpectralNorms", "normalized_weights", "spectral_estimates"]

#: Above this many elements the largest singular value is found by power iteration
#: (64 iterations are within 1% of it on a 2048x2048 Gaussian matrix) instead of an SVD.
_SVD_ELEMENTS = 2**20
_POWER_STEPS = 64

#: What one spectrally normalized weight is read from: its name, and a function giving
#: the matrix the normalization divides and its stored ``u``, ``v``.
Parts = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def normalized_weights(model: nn.Module) -> list[tuple[str, nn.Module, Parts]]:
    """Every spectrally normalized weight in ``model``, of either implementation, as
    ``(name, module, parts)``: ``"fc.weight"`` under the hook, ``"fc.parametrizations.weight"``
    under the parametrization. A walk over the modules, no tensor read."""
    found = []
    for prefix, module in model.named_modules():
        label = f"{prefix}." if prefix else ""
        # torch's own remove_spectral_norm finds its hook in this dict
        for hook in getattr(module, "_forward_pre_hooks", {}).values():
            if isinstance(hook, SpectralNorm):
                found.append((f"{label}{hook.name}", module, _hooked(module, hook)))
        if parametrize.is_parametrized(module):
            for name, chain in module.parametrizations.items():
                for i, step in enumerate(chain):
                    if _is_spectral(step):
                        where = f"{label}parametrizations.{name}"  # as its state dict names it
                        found.append((where, module, _parametrized(chain, i)))
    return found


def _is_spectral(step: nn.Module) -> bool:
    """Whether a parametrization is ``parametrizations.spectral_norm``'s, on a matrix (a
    vector is normalized exactly: it keeps no estimate): its state holds ``_u`` and
    ``_v``, as its state dict names them."""
    buffers = dict(step.named_buffers(recurse=False))
    return "_u" in buffers and "_v" in buffers and isinstance(getattr(step, "dim", None), int)


def _as_matrix(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """The matrix spectral norm divides: ``dim`` first, the rest flattened (as both
    implementations reshape it)."""
    if dim != 0:
        weight = weight.permute(dim, *(d for d in range(weight.dim()) if d != dim))
    return weight.reshape(weight.shape[0], -1)


def _hooked(module: nn.Module, hook: SpectralNorm) -> Parts:
    def parts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = getattr(module, f"{hook.name}_orig")
        matrix = hook.reshape_weight_to_matrix(weight)
        return matrix, getattr(module, f"{hook.name}_u"), getattr(module, f"{hook.name}_v")

    return parts


def _parametrized(chain: Any, index: int) -> Parts:
    def parts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = chain.original
        for before in list(chain)[:index]:  # what the parametrizations ahead of it made
            weight = before(weight)
        step = chain[index]
        buffers = dict(step.named_buffers(recurse=False))
        return _as_matrix(weight, step.dim), buffers["_u"], buffers["_v"]

    return parts


@torch.no_grad()
def spectral_estimates(
    weights: list[tuple[str, Parts]],
) -> tuple[tuple[str, float, float, float], ...]:
    """For each ``(name, parts)``: the name, the sigma its stored vectors give, the
    matrix's largest singular value and the cosine between ``u`` and ``W @ v``, read in
    one transfer."""
    rows = []
    for _, parts in weights:
        matrix, u, v = parts()
        matrix = matrix.detach()
        if matrix.dtype in (torch.float16, torch.bfloat16) or not (
            matrix.is_floating_point() or matrix.is_complex()
        ):
            matrix = matrix.float()  # what an SVD takes on every device
        u, v = u.to(matrix.dtype), v.to(matrix.dtype)
        wv = torch.mv(matrix, v)
        used = torch.vdot(u, wv).real
        cosine = used / (torch.linalg.vector_norm(u) * torch.linalg.vector_norm(wv)).clamp_min(
            torch.finfo(used.dtype).tiny
        )
        rows.append(torch.stack([used, _largest_singular_value(matrix), cosine]).double())
    if not rows:
        return ()
    values = torch.stack(rows).cpu().tolist()  # once, at one validation
    return tuple((name, *row) for (name, _), row in zip(weights, values, strict=True))


def _largest_singular_value(matrix: torch.Tensor) -> torch.Tensor:
    if matrix.numel() <= _SVD_ELEMENTS:
        return torch.linalg.matrix_norm(matrix, ord=2).real
    generator = torch.Generator(device=matrix.device).manual_seed(0)
    v = torch.randn(matrix.shape[1], generator=generator, device=matrix.device)
    v = F.normalize(v.to(matrix.dtype), dim=0)
    for _ in range(_POWER_STEPS):
        v = F.normalize(torch.mv(matrix.mH, torch.mv(matrix, v)), dim=0)
    return torch.linalg.vector_norm(torch.mv(matrix, v)).real


class FirstSpectralNorms:
    """The ``val_spectral`` statistic of a run: over the first batch of its first
    validation (the sanity check included), what each spectrally normalized weight that
    batch ran was divided by, once, held until taken.

    In a model without spectral normalization it is ``()`` at once, and nothing is hooked.
    """

    def __init__(self) -> None:
        self._done = False
        self._weights: list[tuple[str, nn.Module, Parts]] = []
        self._ran: dict[str, Parts] = {}
        self._handles: list[Any] = []
        self._result: tuple | None = None
        #: Which validation measured them (see the ``val_spectral_when`` field).
        self.when = ""

    def validation_start(self, model: nn.Module, *, wanted: bool, when: str) -> None:
        """A validation begins (``when``: which, see ``val_spectral_when``): find the
        spectrally normalized weights, once."""
        if not wanted or self._done:
            return
        self._done, self.when = True, when
        self._weights = normalized_weights(model)
        if not self._weights:
            self._result = ()

    def batch_start(self, dataloader_idx: int) -> None:
        """Note which of them the first batch runs (a GAN validates its generator alone)."""
        if not self._weights or dataloader_idx != 0:
            return
        weights, self._weights = self._weights, []
        for name, module, parts in weights:
            self._handles.append(module.register_forward_hook(self._ran_hook(name, parts)))

    def _ran_hook(self, name: str, parts: Parts) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._ran.setdefault(name, parts)

        return hook

    def batch_end(self) -> None:
        """The first batch ended: read what it divided by."""
        if not self._handles:
            return
        self._remove()
        ran, self._ran = list(self._ran.items()), {}
        try:
            self._result = spectral_estimates(ran)
        except RuntimeError:  # a layout it cannot read (a meta or sharded weight): skip
            self._result = ()

    def take(self, *, found_only: bool = False) -> tuple | None:
        """What was measured (None: nothing yet), and forget it; ``found_only``: only if
        a spectrally normalized weight was measured (else it waits)."""
        if found_only and not self._result:
            return None
        result, self._result = self._result, None
        return result

    def close(self) -> None:
        """Never leave a hook behind (a validation that raised)."""
        self._remove()
        self._ran = {}

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
