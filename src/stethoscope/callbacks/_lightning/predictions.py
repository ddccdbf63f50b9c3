"""What the model hands its loss: whether its output rows are probabilities or logits,
and what the loss would be for each way of taking them."""

from __future__ import annotations

import math
from typing import Any

import torch

from stethoscope.number_formats import sum_tolerance

__all__ = ["output_tensor", "probability_rows"]


def output_tensor(output: Any) -> torch.Tensor | None:
    """The tensor of a model's output the loss is most likely fed: the output itself, the
    ``logits`` of a ``transformers`` output (or of a dict), or a tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def probability_rows(output: Any, labels: Any = None) -> tuple[torch.Tensor, int] | None:
    """Decided on the device, as one float tensor of 4: 1.0 when every row of a model's
    output is probabilities (several columns, the last axis: non-negative and summing to
    1; one column: within [0, 1]), else 0.0; then, with integer class labels for its rows
    (negative ones ignored), the loss with the output taken as logits, as
    log-probabilities and as probabilities (NaN: no labels, or not that many rows). Then
    the columns. None: no dense float tensor (a sparse or nested output has no rows to
    read)."""
    t = output_tensor(output)
    if t is None or not _dense(t) or not t.is_floating_point() or t.dim() < 1 or not t.numel():
        return None
    with torch.no_grad():
        t = t.detach()
        width = int(t.shape[-1]) if t.dim() >= 2 else 1
        rows = t.reshape(-1, width).float()
        if width >= 2:  # a 16-bit softmax's rows sum to 1 within its rounding only
            near = (rows.sum(dim=1) - 1).abs() < sum_tolerance(t.dtype)
            probs = (rows >= 0).all() & near.all()
        else:
            probs = ((rows >= 0) & (rows <= 1)).all()
        losses = _losses(rows, labels) if width >= 2 else None
        if losses is None:
            losses = torch.full((3,), math.nan, device=rows.device)
        return torch.cat([probs.float().reshape(1), losses]), width


def _losses(rows: torch.Tensor, labels: Any) -> torch.Tensor | None:
    """The three losses of :func:`probability_rows` (NaN where no label is kept), or None
    without matching labels. Each reads the labels' entries of the rows, gathered, and a
    log-sum-exp per row: no selection whose size depends on the labels (on a GPU that
    would wait for the device), and no log of every entry."""
    if not isinstance(labels, torch.Tensor) or not _dense(labels) or labels.is_floating_point():
        return None
    y = labels.detach().reshape(-1)
    if y.numel() != rows.shape[0] or y.dtype == torch.bool:
        return None
    y = y.long()
    kept = y >= 0  # ignore_index (-100) and other negative targets are left out
    picked = rows.gather(1, torch.where(kept, y, 0)[:, None]).squeeze(1)
    weight = kept.to(rows.dtype)
    count = weight.sum()
    as_logits = ((torch.logsumexp(rows, dim=1) - picked) * weight).sum() / count
    as_log_probs = -(picked * weight).sum() / count
    as_probs = -(torch.log(picked.clamp_min(1e-30)) * weight).sum() / count
    return torch.stack([as_logits, as_log_probs, as_probs])


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor, whose rows a reshape reads (a sparse or nested
    one's it cannot)."""
    return not t.is_nested and t.layout == torch.strided
