"""The report's precision figures: what low precision lost, per layer over time (updates
rounded away, gradients subnormal, the loss scale), and how each layer would fit fp8.

This module imports plotly: import it only where plotly is wanted (``report`` does, when
a report is drawn).
"""

from __future__ import annotations

import plotly.graph_objects as go

from stethoscope.record import plotting as pl
from stethoscope.record.reader import LayerSeries

__all__ = ["fp8_figure", "precision_figure"]

#: Layers drawn as lines at most; more make a heat map.
MAX_LINES = 20


def precision_figure(
    update_lost: LayerSeries | None,
    grad_subnormal: LayerSeries | None,
    loss_scale: LayerSeries | None,
    scale_skipped: LayerSeries | None = None,
) -> go.Figure | str:
    """Of each parameter held in 16 bits, the share of its updates that rounded away and
    of its gradient that was subnormal, and the loss scaler's scale and the share of the
    steps it skipped, over time."""
    return pl.share_panels(
        [
            pl.Panel(
                "Updates rounded away: share of each 16-bit weight's pushed elements left "
                "as they were",
                "rounded away",
                update_lost,
            ),
            pl.Panel(
                "Gradient underflow: share of each 16-bit gradient that is subnormal",
                "subnormal",
                grad_subnormal,
            ),
            pl.Panel("Loss scale", "scale", loss_scale, share=False),
            pl.Panel(
                "Steps the loss scaler skipped: share since the last measurement",
                "skipped",
                scale_skipped,
            ),
        ],
        title="Precision",
        empty="The run held nothing in 16 bits, so no precision statistics were recorded.",
        lines=MAX_LINES,
    )


def fp8_figure(weight_e4m3: LayerSeries | None, grad_e5m2: LayerSeries | None) -> go.Figure | str:
    """How each parameter would fit fp8 under per-tensor scaling: the share of its
    weights lost to zero in e4m3 and of its gradient in e5m2, over time."""
    return pl.share_panels(
        [
            pl.Panel(
                "Weights in e4m3: share of each parameter's non-zero weights that would "
                "round to zero",
                "lost in e4m3",
                weight_e4m3,
            ),
            pl.Panel(
                "Gradients in e5m2: share of each gradient's non-zero elements that would "
                "round to zero",
                "lost in e5m2",
                grad_e5m2,
            ),
        ],
        title="fp8 readiness",
        empty="No fp8 readiness was recorded.",
        lines=MAX_LINES,
    )
