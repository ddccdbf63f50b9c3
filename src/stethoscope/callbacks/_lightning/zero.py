"""What this rank holds of each parameter under DeepSpeed's ZeRO (Lightning's
``DeepSpeedStrategy``): a slice of its elements, reduced and combined as FSDP1's are
(see ``shards``), but kept where DeepSpeed keeps it.

- **Stages 1 and 2** keep every parameter whole on every rank and split the optimizer
  into one flat partition per rank. After the backward pass ``param.grad`` is empty
  (stage 2): each rank holds the averaged gradient of the elements its partition covers,
  a slice of some parameters (``param._hp_mapping``, None on a rank that holds nothing
  of it). The weights are read from the same slice of the whole parameter, so that each
  element is counted once over the ranks.
- **Stage 3** splits the parameters too: outside the forward and backward passes
  ``param`` is empty, and each rank holds ``param.ds_tensor``, the same number of
  elements for every rank (the last rank's padded), and their gradient.

Read from DeepSpeed's own attributes (``_hp_mapping``, ``ds_tensor``, ``ds_numel``,
``ds_shape``, ``ds_process_group``: DeepSpeed 0.19) and its ``deepspeed.utils``
functions; nothing here imports DeepSpeed unless a model holds its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from stethoscope.callbacks._lightning.shards import FlatSlice

__all__ = [
    "ZeroSlice",
    "ZeroThreeSlice",
    "accumulating",
    "client_optimizer",
    "is_deepspeed_optimizer",
    "trained_by",
    "zero_slices",
    "zero_stage",
]


def zero_stage(model: Any) -> int | None:
    """The ZeRO stage of ``model``, the strategy's wrapped model (a DeepSpeed engine);
    None for any other model."""
    stage = getattr(model, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) and hasattr(model, "zero_optimization") else None


def accumulating(model: Any) -> bool:
    """Whether ``model``, a DeepSpeed engine, is inside a gradient accumulation window,
    before its last micro-batch. Lightning calls the engine's step, and so the
    ``on_before_optimizer_step`` hooks, on every micro-batch; the engine applies it only
    on the window's last, and holds no gradient of the step before. False for any other
    model."""
    boundary = getattr(model, "is_gradient_accumulation_boundary", None)
    return zero_stage(model) is not None and callable(boundary) and not boundary()


def is_deepspeed_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of DeepSpeed's (the ZeRO, bf16 or fp16 optimizers its
    engine steps inside ``engine.step()``)."""
    return type(optimizer).__module__.startswith("deepspeed.")


def client_optimizer(optimizer: Any) -> Any:
    """The optimizer that ``optimizer`` steps: for one of DeepSpeed's, the user's (Adam,
    SGD...) it wraps; any other is itself."""
    if is_deepspeed_optimizer(optimizer):
        return getattr(optimizer, "optimizer", optimizer)
    return optimizer


#: Where each of DeepSpeed's optimizers keeps the model's parameters it updates: its
#: ``param_groups`` hold its own flat fp32 partitions instead.
_MODEL_GROUPS = ("bit16_groups", "fp16_groups", "bf16_groups")  # ZeRO 1-2, ZeRO 3, bf16


def trained_by(optimizer: Any) -> list[torch.Tensor] | None:
    """The model's parameters that ``optimizer``, one of DeepSpeed's, updates; None for
    any other optimizer (its ``param_groups`` say)."""
    if not is_deepspeed_optimizer(optimizer):
        return None
    for attribute in _MODEL_GROUPS:
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return [p for group in groups for p in group]
    return None


@dataclass(frozen=True)
class ZeroSlice(FlatSlice):
    """A parameter under ZeRO stage 1 or 2: whole on every rank, its optimizer partition
    holding elements ``start`` to ``start + count`` of it here (none: ``count`` 0)."""

    gathers_whole: ClassVar[bool] = True

    def data(self, param: torch.Tensor) -> torch.Tensor:
        return param.detach().reshape(-1).narrow(0, self.start, self.count)

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        empty = param.detach().reshape(-1)[:0]
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None or self.count == 0:
            return empty
        try:  # held only between the backward pass and the engine's step
            g = mapping.get_lp_grad_fragment(param._index_in_param_group)
        except ValueError:  # no gradient now (before the backward pass): none is held
            return empty
        g = g.detach().reshape(-1)
        # the bf16 optimizer keeps each parameter's whole gradient: this rank's slice of it
        return g.narrow(0, self.start, self.count) if g.numel() != self.count else g

    def whole_grad(self, param: torch.Tensor) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_grad  # only under DeepSpeed

        return safe_get_full_grad(param)


@dataclass(frozen=True)
class ZeroThreeSlice(ZeroSlice):
    """A parameter under ZeRO stage 3: this rank holds elements ``start`` to
    ``start + count`` of it, in ``param.ds_tensor`` (padded past ``count``); the whole
    gradient is gathered as under stages 1 and 2."""

    def data(self, param: torch.Tensor) -> torch.Tensor:
        return param.ds_tensor.detach().narrow(0, 0, self.count)

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        from deepspeed.utils import safe_get_local_grad  # only under DeepSpeed

        # the gradients' buffers outlive the step, which overwrites them on the next
        # backward pass rather than zeroing them: they are the step's only between its
        # backward pass and the engine's step, while the optimizer lists them
        listed = getattr(param._z3_optimizer, "averaged_gradients", None)
        if listed is not None and all(g is None for g in listed.values()):
            return self.data(param)[:0]
        g = safe_get_local_grad(param)
        if g is None:
            return self.data(param)[:0]
        return g.detach().reshape(-1).narrow(0, 0, self.count)


def zero_slices(module: torch.nn.Module) -> dict[int, FlatSlice]:
    """The slice this rank holds of each parameter of ``module`` that DeepSpeed's ZeRO
    partitions, by the parameter's ``id`` (see the module's docstring). Empty for any
    other model."""
    out: dict[int, FlatSlice] = {}
    for p in module.parameters():
        if hasattr(p, "ds_tensor") and hasattr(p, "ds_numel"):  # stage 3
            held = int(p.ds_tensor.ds_numel)
            rank = torch.distributed.get_rank(group=p.ds_process_group)
            start = rank * held
            count = max(0, min(int(p.ds_numel) - start, held))
            out[id(p)] = ZeroThreeSlice(torch.Size(p.ds_shape), start if count else 0, count)
        elif hasattr(p, "_hp_mapping"):  # stages 1 and 2, and the bf16 optimizer
            mapping = p._hp_mapping
            if mapping is None:
                out[id(p)] = ZeroSlice(p.shape, 0, 0)
            else:
                address = mapping.lp_fragment_address
                out[id(p)] = ZeroSlice(p.shape, int(address.start), int(address.numel))
    return out
