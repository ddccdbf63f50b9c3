"""What the model hands its loss: whether its output rows are probabilities or logits,
and what the loss would be for each way of taking them."""

from __future__ import annotations

import math
from typing import Any

import torch

from stethoscope.callbacks._lightning.device import is_host
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
    """Decided on the device, as one float tensor of 13: 1.0 when every row of a model's
    output is probabilities (several columns, the class axis: non-negative and summing to
    1; one column: within [0, 1]), else 0.0; then, with class targets for its rows
    (integer labels, negative ones ignored, or a distribution over the classes per row),
    the seven losses of :func:`_losses` (NaN: no such targets); then, with targets of the
    output's shape, the four of :func:`_binary` (NaN: none); then the number of terms
    those means are taken over (the class targets kept, else the targets' elements; NaN:
    neither), which tells a loss summed over the batch from its mean. Then the columns.
    The class axis is the last, or the second of an output of three or more dimensions
    whose labels lack that one (``cross_entropy``'s ``(N, C, T)`` against ``(N, T)``).
    None: no dense float tensor (a sparse or nested output has no rows to read)."""
    t = output_tensor(output)
    if t is None or not _dense(t) or not t.is_floating_point() or t.dim() < 1 or not t.numel():
        return None
    with torch.no_grad():
        t = t.detach()
        if _classes_second(t, labels):
            t = t.movedim(1, -1)
        width = int(t.shape[-1]) if t.dim() >= 2 else 1
        rows = t.reshape(-1, width).float()
        low, high = torch.aminmax(rows)  # a reduction: far cheaper than a mask of rows
        if width >= 2:  # a 16-bit softmax's rows sum to 1 within its rounding only
            near = (rows.sum(dim=1) - 1).abs() < sum_tolerance(t.dtype)
            probs = (low >= 0) & near.all()
        else:
            probs = (low >= 0) & (high <= 1)
        classes = _losses(rows, labels, probs) if width >= 2 else None
        nan = math.nan
        losses, terms = (torch.full((7,), nan, device=rows.device), None)
        if classes is not None:
            losses, terms = classes
        binary = _binary(t, labels)
        if binary is None:
            binary = torch.full((4,), nan, device=rows.device)
        elif terms is None:  # a binary loss's mean is over the elements
            terms = torch.full((1,), float(t.numel()), device=rows.device)
        if terms is None:
            terms = torch.full((1,), nan, device=rows.device)
        return torch.cat([probs.float().reshape(1), losses, binary, terms.reshape(1)]), width


def _losses(
    rows: torch.Tensor, labels: Any, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The losses of :func:`probability_rows` (NaN where no label is kept), or None
    without matching targets: the cross-entropy at the targets with the output taken as
    logits, as log-probabilities, as probabilities, and as logits whose softmax is taken
    as logits again (a softmax written before a loss that applies its own); then, for
    the first, third and fourth, the cross-entropy against the uniform distribution,
    which label smoothing mixes in (``(1 - e) * loss + e * uniform``); and how many
    targets were kept, the terms of those means.

    The targets are integer class labels, one per row, or a distribution over the
    classes per row (one-hot or soft targets, ``cross_entropy``'s class probabilities:
    NaN unless every row is one). Each reads the targets' entries of the rows, gathered
    or weighted, and a log-sum-exp per row: no selection whose size depends on the
    targets (on a GPU that would wait for the device).

    Where the host reads the rows directly (the CPU), ``probs`` (whether they are
    probabilities) is known at no cost, and only the ways the rule reads for that kind of
    output are computed: probabilities are read as logits or as probabilities (their
    log), logits as logits, log-probabilities or softmax; the others are NaN. For a
    language model's 10,000 classes those passes are most of a sampled step's cost."""
    at = _targets(rows, labels)
    if at is None:
        return None
    at_labels, weight, valid = at
    count = weight.sum()

    def mean(per_row: torch.Tensor) -> torch.Tensor:
        return (per_row * weight).sum() / count

    # the log-sum-exp from the softmax, which takes the exponentials in one fused pass
    # (torch's logsumexp and exp are each about twice its cost on the CPU): at each row's
    # largest entry, whose probability is at least 1 / columns and never underflows,
    # lse = x - log(softmax(x))
    soft = torch.softmax(rows, dim=1)
    lse = _lse_from(rows, soft)
    known = bool(probs) if is_host(rows.device) else None  # None: both kinds, on the device
    nan = torch.full((), math.nan, device=rows.device)
    as_probs = uniform_as_probs = as_softmax = uniform_as_softmax = nan
    if known is not False:
        logs = torch.log(rows.clamp_min(1e-30))
        as_probs, uniform_as_probs = mean(-at_labels(logs)), mean(-logs.mean(dim=1))
    if known is not True:  # the softmax's own log-sum-exp, the same way
        soft_lse = _lse_from(soft, torch.softmax(soft, dim=1))
        as_softmax = mean(soft_lse - at_labels(soft))
        uniform_as_softmax = mean(soft_lse - soft.mean(dim=1))
    means = torch.stack(
        [
            mean(lse - at_labels(rows)),
            mean(-at_labels(rows)),
            as_probs,
            as_softmax,
            mean(lse - rows.mean(dim=1)),
            uniform_as_probs,
            uniform_as_softmax,
        ]
    )
    if valid is not None:  # not distributions: a binary loss's targets, its elements' terms
        means = torch.where(valid, means, torch.full_like(means, math.nan))
        count = torch.where(valid, count, torch.full_like(count, float(labels.numel())))
    return means, count.float()


def _lse_from(rows: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp, from the rows and their softmax: at the row's largest
    entry, ``x - log(softmax(x))`` (the softmax is largest there too)."""
    return rows.amax(dim=1) - soft.amax(dim=1).log()


def _targets(rows: torch.Tensor, labels: Any) -> tuple[Any, torch.Tensor, Any] | None:
    """How the rows' entries at their targets are read: a function of a per-row tensor
    of the rows' shape giving each row's entry at its target (gathered at an integer
    label, or weighted by a distribution), each row's weight (0 for an ignored label),
    and whether the targets are distributions (a bool tensor; None for labels). None:
    the targets are neither one label per row nor one distribution per row."""
    if not isinstance(labels, torch.Tensor) or not _dense(labels) or labels.is_complex():
        return None
    if labels.dtype == torch.bool:
        return None
    if labels.is_floating_point():  # class probabilities, one row each
        if labels.numel() != rows.numel() or labels.shape[-1] != rows.shape[1]:
            return None
        q = labels.detach().reshape(rows.shape).to(rows.dtype)
        near = (q.sum(dim=1) - 1).abs() < sum_tolerance(labels.dtype)
        valid = (q >= 0).all() & near.all()
        weight = torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device)
        return (lambda v: (q * v).sum(dim=1)), weight, valid
    y = labels.detach().reshape(-1)
    if y.numel() != rows.shape[0]:
        return None
    y = y.long()
    kept = y >= 0  # ignore_index (-100) and other negative targets are left out
    at = torch.where(kept, y, 0)[:, None]
    return (lambda v: v.gather(1, at).squeeze(1)), kept.to(rows.dtype), None


def _binary(t: torch.Tensor, labels: Any) -> torch.Tensor | None:
    """With targets of ``t``'s shape (``(N,)`` against a one-column ``(N, 1)`` too),
    within [0, 1]: 1.0 when every element of ``t`` is within [0, 1] (a sigmoid's output),
    else 0.0; then the binary cross-entropy with ``t`` taken as logits
    (``binary_cross_entropy_with_logits``), as probabilities (``binary_cross_entropy``,
    whose logs torch clamps at -100), and as logits whose sigmoid is taken as logits again
    (a sigmoid written before a loss that applies its own). NaN where a target is outside
    [0, 1] (decided on the device). None without such targets: a binary or multi-label
    output's targets, one per element."""
    if not isinstance(labels, torch.Tensor) or not _dense(labels) or labels.is_complex():
        return None
    if labels.numel() != t.numel() or t.dim() < 1:
        return None
    squeezed = tuple(s for s in t.shape if s != 1) == tuple(s for s in labels.shape if s != 1)
    if tuple(labels.shape) != tuple(t.shape) and not squeezed:
        return None
    x, y = t.reshape(-1).float(), labels.detach().reshape(-1).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    log_p, log_q = torch.log(x).clamp_min(-100), torch.log1p(-x).clamp_min(-100)
    losses = torch.stack(
        [
            bce(x, y),
            -(y * log_p + (1 - y) * log_q).mean(),
            bce(torch.sigmoid(x), y),
        ]
    )
    targets = ((y >= 0) & (y <= 1)).all()
    losses = torch.where(targets, losses, torch.full_like(losses, math.nan))
    unit = ((x >= 0) & (x <= 1)).all().float().reshape(1)
    return torch.cat([unit, losses])


def _classes_second(t: torch.Tensor, labels: Any) -> bool:
    """Whether ``t``'s classes lie on its second axis: an output of three or more
    dimensions whose integer labels have its shape without that axis, and not without
    its last (``cross_entropy`` of ``(N, C, T)`` scores against ``(N, T)`` labels)."""
    if t.dim() < 3 or not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return False
    shape = tuple(labels.shape)
    return shape == (t.shape[0], *t.shape[2:]) and shape != tuple(t.shape[:-1])


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor, whose rows a reshape reads (a sparse or nested
    one's it cannot)."""
    return not t.is_nested and t.layout == torch.strided
