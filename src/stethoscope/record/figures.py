"""The report's figures, built with plotly from a :class:`~stethoscope.record.RunRecord`.

Each builder returns a figure, or one sentence saying why there is none (nothing of that
kind was recorded). Long series are thinned so that a record of a million steps still
gives a figure a browser draws at once: the loss keeps the lowest and highest value of
each bucket of steps (a spike survives), the per-layer charts keep evenly spaced sampled
steps; a figure that was thinned says so in its title.

This module imports plotly: import it only where plotly is wanted (``report`` does).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from stethoscope.findings import RECOVERY, Finding
from stethoscope.record import plotting as pl
from stethoscope.record.reader import Curve, LayerSeries
from stethoscope.record.report import (
    ZERO_LOG10,
    cool_downs,
    distribution_quantiles,
    escalations,
)

__all__ = [
    "HEALTHY_UPDATE_RATIO",
    "dead_saturated_figure",
    "distribution_figure",
    "gradient_flow_figure",
    "loss_figure",
    "update_ratio_figure",
]

#: Points of the loss line at most (a bucket's lowest and highest value each).
LOSS_POINTS = 4000
#: Names drawn as one line each; more are drawn as a heat map.
MAX_LINES = 20
#: The update ratio (|update| / |weight| per step) of a healthy parameter: about 1e-3.
HEALTHY_UPDATE_RATIO = (1e-4, 1e-2)
#: Quantile points (steps x parameters) of the distribution chart at most, per kind.
DISTRIBUTION_POINTS = 30_000

SEVERITY_COLOURS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#7f7f7f"}
_MARKERS = {"info": ("circle-open", 9), "warning": ("triangle-up", 11), "error": ("x", 11)}
_ESCALATION = "rgba(255, 160, 0, 0.15)"
_COOLING = "rgba(31, 119, 180, 0.12)"
#: Findings drawn by their own traces, not as markers on the loss curve.
_DRAWN_APART = frozenset({"sampler", RECOVERY})
_JUMP = {
    "mode": "immediate",
    "frame": {"duration": 0, "redraw": True},
    "transition": {"duration": 0},
}


# -- the loss ---------------------------------------------------------------------------
def loss_figure(losses: Curve, validation: Curve, findings: Sequence[Finding]) -> go.Figure | str:
    """The loss of every step, validation losses, the findings where they happened, the
    sampler's escalations shaded and the non-finite losses as red crosses at the top."""
    if not len(losses.steps):
        return "No training loss was recorded yet (the run has not written a step)."
    if few := pl.too_few("The training loss", losses.steps):
        return few
    steps, values = losses.steps, losses.values
    finite = np.isfinite(values)
    shown = pl.envelope(values, LOSS_POINTS)
    fig = go.Figure()
    # stretches shaded on a hidden [0, 1] axis, so that they span the plot's height
    last = int(steps[-1])
    escalated = "sampler escalated (all detectors every step)"
    _shade(fig, escalations(findings, last), _ESCALATION, escalated)
    _shade(fig, cool_downs(findings, last), _COOLING, "learning rate cooled (recovery)")
    fig.add_scatter(
        x=steps[shown],
        y=values[shown],
        mode=pl.line_mode(len(shown)),
        name="training loss",
        line={"color": "#1f77b4", "width": 1.3},
        hovertemplate="step %{x}<br>loss %{y:.4g}<extra></extra>",
    )
    if len(validation.steps):
        fig.add_scatter(
            x=validation.steps,
            y=validation.values,
            mode="markers+lines",
            name="validation loss",
            customdata=validation.epochs,
            marker={"symbol": "diamond", "size": 8, "color": "#2ca02c"},
            line={"dash": "dot", "width": 1, "color": "#2ca02c"},
            hovertemplate="step %{x} (epoch %{customdata})<br>validation loss %{y:.4g}"
            "<extra></extra>",
        )
    bad = np.flatnonzero(~finite)
    if len(bad):
        picked = bad[pl.thin_columns(len(bad), pl.MAX_COLUMNS)]
        fig.add_scatter(
            x=steps[picked],
            y=np.ones(len(picked)),
            yaxis="y2",
            mode="markers",
            name=f"non-finite loss ({len(bad):,} step{'s' if len(bad) > 1 else ''})",
            text=[str(v) for v in values[picked]],
            marker={"symbol": "x", "size": 9, "color": "#d62728"},
            hovertemplate="step %{x}<br>loss %{text}<extra></extra>",
        )
    _add_findings(fig, steps, values, finite, findings)
    _add_recovery(fig, findings)
    fig.update_layout(
        pl.LAYOUT,
        title="Training loss"
        + pl.thinned(len(shown), len(steps), "steps")
        + (" (lowest and highest of each bucket)" if len(shown) < len(steps) else ""),
        xaxis={"title": "step"},
        yaxis={"title": "loss"},
        yaxis2={"overlaying": "y", "range": [0, 1.04], "visible": False, "fixedrange": True},
        height=500,
        margin={**pl.LAYOUT["margin"], "t": 110},  # room for a legend of two rows
        hovermode="closest",
        updatemenus=[
            pl.menu(
                [pl.scale_button("linear"), pl.scale_button("log")],
                type="buttons",
                direction="left",
            )
        ],
    )
    return fig


def _shade(fig: go.Figure, spans: list[tuple[int, int, str]], colour: str, name: str) -> None:
    """Shade each ``(first step, last step, why)`` over the plot's height."""
    if not spans:
        return
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b, _ in spans:
        xs += [a, a, b, b, a, None]
        ys += [0, 1, 1, 0, 0, None]
    fig.add_scatter(
        x=xs,
        y=ys,
        yaxis="y2",
        fill="toself",
        fillcolor=colour,
        mode="none",
        name=name,
        hoveron="fills",
        hoverinfo="name",
        hoverlabel={"namelength": -1},
    )


def _add_recovery(fig: go.Figure, findings: Sequence[Finding]) -> None:
    """The recovery ladder's acts: skipped steps as grey crosses near the top, roll backs
    as dashed vertical lines (cool-downs are shaded by the caller)."""
    acts = [f for f in findings if f.detector == RECOVERY]
    skips = [f for f in acts if f.where == "skip"]
    if skips:
        fig.add_scatter(
            x=[f.step for f in skips],
            y=[0.9] * len(skips),
            yaxis="y2",
            mode="markers",
            name=f"skipped step ({len(skips):,})",
            text=[pl.hover_text(f.message) for f in skips],
            marker={"symbol": "x-thin-open", "size": 10, "color": "#555", "line_width": 2},
            hovertemplate="step %{x}<br>%{text}<extra></extra>",
        )
    rollbacks = [f for f in acts if f.where == "rollback"]
    if rollbacks:
        xs: list[float | None] = []
        ys: list[float | None] = []
        for f in rollbacks:
            xs += [f.step, f.step, None]
            ys += [0, 1, None]
        fig.add_scatter(
            x=xs,
            y=ys,
            yaxis="y2",
            mode="lines",
            name="rolled back",
            line={"color": "#9467bd", "dash": "dash", "width": 2},
            text=[pl.hover_text(f.message) for f in rollbacks for _ in range(3)],
            hovertemplate="step %{x}<br>%{text}<extra></extra>",
        )


def _add_findings(fig, steps, values, finite, findings: Sequence[Finding]) -> None:
    """A marker per finding (but the sampler's) at its step: on the loss curve where the
    loss there is finite, else near the top."""
    at = np.clip(np.searchsorted(steps, [f.step for f in findings]), 0, len(steps) - 1)
    for severity, (symbol, size) in _MARKERS.items():
        on_curve: tuple[list, list, list] = ([], [], [])
        on_top: tuple[list, list, list] = ([], [], [])
        for f, i in zip(findings, at, strict=True):
            if f.detector in _DRAWN_APART or f.severity.value != severity:
                continue
            text = f"<b>{f.detector}</b> ({severity}" + (f", {f.where}" if f.where else "")
            text += ")<br>" + pl.hover_text(f.message)
            hit = steps[i] == f.step and finite[i]
            x, y, t = on_curve if hit else on_top
            x.append(f.step)
            y.append(float(values[i]) if hit else 0.96)
            t.append(text)
        colour = SEVERITY_COLOURS[severity]
        marker = {"symbol": symbol, "size": size, "color": colour, "line_color": colour}
        first = True
        for (x, y, t), axis in ((on_curve, "y"), (on_top, "y2")):
            if x:
                fig.add_scatter(
                    x=x,
                    y=y,
                    yaxis=axis,
                    mode="markers",
                    name=f"{severity} finding",
                    legendgroup=severity,
                    showlegend=first,
                    text=t,
                    marker=marker,
                    hovertemplate="step %{x}<br>%{text}<extra></extra>",
                )
                first = False


# -- gradients and updates --------------------------------------------------------------
def gradient_flow_figure(
    series: LayerSeries | None, bad_steps: Sequence[int] = ()
) -> go.Figure | str:
    """A heat map of log10 gradient norm per parameter (input side at the top) over the
    sampled steps, beside the last finite sample's norms as bars on a log axis. Norms are
    as the backward pass left them, before any clipping; non-finite ones are red cells
    (``bad_steps``: the steps whose loss or gradients were non-finite)."""
    if not pl.present(series):
        return "No per-parameter gradient norms were recorded."
    cols = pl.columns(series)
    finite_values = np.where(np.isfinite(series.values), series.values, np.nan)
    last, rows = pl.last_measured(finite_values)
    names = list(series.names)
    latest = int(series.steps[rows.max()]) if (rows >= 0).any() else int(series.steps[-1])
    bars_title = f"latest finite sample (step {latest})"
    titles = ("log10 gradient norm over the sampled steps", bars_title)
    fig = make_subplots(
        1,
        2,
        shared_yaxes=True,
        column_widths=[0.74, 0.26],
        horizontal_spacing=0.02,
        subplot_titles=titles,
    )
    heat = pl.heatmap(series, cols, "gradient norm", coloraxis="coloraxis")
    fig.add_trace(heat, row=1, col=1)
    bad = pl.nonfinite_cells(series, cols, np.asarray(bad_steps, np.int64))
    if bad is not None:
        fig.add_trace(bad, row=1, col=1)
    # the colour range of the finite norms: an infinite one is a red cell, not the top
    z = np.where(np.isfinite(np.asarray(heat.customdata)), np.asarray(heat.z), np.nan)
    low, high = (float(np.nanmin(z)), float(np.nanmax(z))) if np.isfinite(z).any() else (-12, 0)
    high = max(high, low + 1e-6)
    z_last = pl.log10_colour(last)
    floor = np.nanmin(z_last) if np.isfinite(z_last).any() else -12.0
    # explicit colours: plotly.js does not map a bar's numbers through a shared colour axis
    shade = np.clip((np.nan_to_num(z_last, nan=low) - low) / (high - low), 0, 1)
    fig.add_bar(
        x=np.where(last > 0, last, 10.0**floor),
        y=names,
        orientation="h",
        marker={"color": sample_colorscale("Viridis", list(shade))},
        name="latest gradient norm",
        customdata=np.stack([last, series.steps[np.maximum(rows, 0)]], axis=1),
        hovertemplate="%{y}<br>gradient norm %{customdata[0]:.3g}"
        "<br>at step %{customdata[1]}<extra></extra>",
        row=1,
        col=2,
    )
    fig.update_layout(
        pl.LAYOUT,
        title="Gradient flow: gradient norm per parameter, before clipping"
        + (" · red: non-finite" if bad is not None else "")
        + pl.thinned(len(cols), len(series.steps)),
        coloraxis={
            "colorscale": "Viridis",
            "cmin": low,
            "cmax": high,
            "colorbar": {"title": {"text": "log10 ‖g‖"}},
        },
        height=pl.height_for(len(names)),
        showlegend=False,
    )
    fig.update_yaxes(pl.name_axis(len(names)), row=1, col=1)
    fig.update_xaxes(pl.step_ticks(series.steps), row=1, col=1)
    fig.update_xaxes(type="log", title_text="gradient norm", row=1, col=2)
    return fig


def _only(series: LayerSeries, names: Sequence[str] | None) -> LayerSeries:
    """``series`` restricted to ``names`` (all of it when None, or when none match)."""
    if names is None:
        return series
    keep = [j for j, n in enumerate(series.names) if n in set(names)]
    if not keep or len(keep) == len(series.names):
        return series
    picked = tuple(series.names[j] for j in keep)
    return LayerSeries(series.kind, picked, series.steps, series.values[:, keep])


def update_ratio_figure(
    series: LayerSeries | None,
    matrices: Sequence[str] | None = None,
    bad_steps: Sequence[int] = (),
) -> go.Figure | str:
    """The update ratio (‖update‖ / ‖weight‖ of a step) of each weight matrix over time
    (``matrices``: their names; biases and norm scales, which start at or near zero and
    so move by large ratios while healthy, are left out, as the detectors leave them
    out), the healthy band shaded: a line each on a log axis, or a heat map for many."""
    if not pl.present(series):
        return "No update ratios were recorded (they need two consecutive weight reads)."
    if few := pl.too_few("The update ratio", series.steps):
        return few
    everything = len(series.names)
    series = _only(series, matrices)
    low, high = HEALTHY_UPDATE_RATIO
    band = f"healthy band {low:.0e} … {high:.0e} (about 1e-3)"
    cols = pl.columns(series)
    which = "per parameter"
    if len(series.names) < everything:
        which = f"per weight matrix ({len(series.names)} of {everything} parameters)"
    title = f"Update ratio ‖Δw‖ / ‖w‖ {which} · {band}"
    title += pl.thinned(len(cols), len(series.steps))
    fig = go.Figure()
    if len(series.names) <= MAX_LINES:
        values = series.values[cols]
        positive = values[values > 0]
        floor = min(low / 100, float(positive.min()) / 10) if positive.size else low / 100
        for j, name in enumerate(series.names):
            raw = values[:, j]
            fig.add_scatter(
                x=series.steps[cols],
                y=np.where(raw > 0, raw, floor),
                customdata=raw,
                mode=pl.line_mode(len(cols)),
                name=name,
                connectgaps=True,
                hovertemplate=f"{html.escape(name)}<br>step %{{x}}<br>update ratio "
                "%{customdata:.3g}<extra></extra>",
            )
        fig.add_hrect(
            y0=low, y1=high, fillcolor="#2ca02c", opacity=0.12, line_width=0, layer="below"
        )
        shown = values[np.isfinite(values) & (values > 0)]
        top = max(high * 10, float(shown.max()) * 2) if shown.size else high * 10
        axis = {"type": "log", "range": [np.log10(floor / 2), np.log10(top)], "dtick": 1}
        fig.update_layout(yaxis=axis, yaxis_title="update ratio (0 at the bottom)", height=480)
    else:
        centre, spread = np.log10(low * high) / 2, np.log10(high / low) / 2 + 2
        colours = {"colorscale": "RdBu_r", "zmin": centre - spread, "zmax": centre + spread}
        fig.add_trace(
            pl.heatmap(series, cols, "update ratio", colorbar_title_text="log10", **colours)
        )
        title += " · white: healthy, blue: too small, red: too large"
        bad = pl.nonfinite_cells(series, cols, np.asarray(bad_steps, np.int64))
        if bad is not None:
            fig.add_trace(bad.update(colorscale=[[0, "#000000"], [1, "#000000"]]))
            title += ", black: non-finite"
        fig.update_yaxes(pl.name_axis(len(series.names)))
        fig.update_layout(height=pl.height_for(len(series.names)))
    fig.update_layout(pl.LAYOUT, title=title, xaxis=pl.step_ticks(series.steps))
    return fig


# -- distributions ----------------------------------------------------------------------
def _distribution_traces(series: LayerSeries | None, name: str, cols, axis: int) -> list:
    """The 5-95% band, the 25-75% band, the median and the non-finite markers of one
    parameter in one subplot (empty traces when it was not recorded)."""
    xaxis, yaxis = f"x{axis if axis > 1 else ''}", f"y{axis if axis > 1 else ''}"
    j = series.names.index(name) if series is not None and name in series.names else -1
    if j < 0:
        empty = {"x": [], "y": [], "xaxis": xaxis, "yaxis": yaxis}
        return [go.Scatter(empty), go.Scatter(empty), go.Scatter(empty), go.Scatter(empty)]
    counts = series.values[cols, j]
    keep = ~np.isnan(counts).all(axis=1)
    steps = series.steps[cols][keep].astype(np.int32)
    quant, zeros, bad = distribution_quantiles(counts[keep])
    mag = (10.0**quant).astype(np.float32)
    common = {"xaxis": xaxis, "yaxis": yaxis, "showlegend": axis == 1, "hoverinfo": "skip"}
    bands = [
        go.Scatter(
            x=np.concatenate([steps, steps[::-1]]),
            y=np.concatenate([mag[:, hi], mag[::-1, lo]]),
            fill="toself",
            fillcolor=f"rgba(31, 119, 180, {alpha})",
            mode="none",
            name=label,
            legendgroup=label,
            **common,
        )
        for lo, hi, alpha, label in ((0, 4, 0.15, "5–95% of |values|"), (1, 3, 0.35, "25–75%"))
    ]
    common["hoverinfo"] = None
    median = go.Scatter(
        x=steps,
        y=mag[:, 2],
        mode=pl.line_mode(len(steps)),
        line={"color": "#1f77b4", "width": 1.5},
        name="median",
        legendgroup="median",
        customdata=np.stack([zeros, bad], axis=1).astype(np.float32),
        hovertemplate=f"{html.escape(name)}<br>step %{{x}}<br>median |x| %{{y:.3g}}"
        "<br>exact zeros %{customdata[0]:.1%} · non-finite %{customdata[1]:.1%}"
        "<extra></extra>",
        **common,
    )
    hit = bad > 0
    nonfinite = go.Scatter(
        x=steps[hit],
        y=np.full(int(hit.sum()), 10.0**5, np.float32),
        mode="markers",
        marker={"symbol": "x", "color": "#d62728", "size": 8},
        name="non-finite values",
        legendgroup="bad",
        customdata=bad[hit].astype(np.float32),
        hovertemplate="step %{x}<br>non-finite %{customdata:.1%}<extra></extra>",
        **common,
    )
    return [*bands, median, nonfinite]


def distribution_figure(weights: LayerSeries | None, grads: LayerSeries | None) -> go.Figure | str:
    """Quantile bands of |weight| and |gradient| over the sampled steps, for the
    parameter chosen in a dropdown (one frame per parameter, so hundreds stay cheap)."""
    present = [
        (label, s) for label, s in (("weights", weights), ("gradients", grads)) if pl.present(s)
    ]
    if not present:
        return "No weight or gradient distributions were recorded."
    names = list(dict.fromkeys(n for _, s in present for n in s.names))
    limit = int(np.clip(DISTRIBUTION_POINTS // len(names), 50, 500))
    cols = {label: pl.thin_columns(len(s.steps), limit) for label, s in present}
    total = max(len(s.steps) for _, s in present)
    shown = max(len(c) for c in cols.values())
    titles = [f"|{label}|" for label, _ in present]
    fig = make_subplots(
        len(present), 1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=titles
    )
    frames = []
    for name in names:
        data = []
        for axis, (label, s) in enumerate(present, start=1):
            data += _distribution_traces(s, name, cols[label], axis)
        frames.append(go.Frame(name=name, data=data))
    fig.add_traces(list(frames[0].data))
    fig.frames = frames
    ticks = list(range(-12, 6, 2))
    values, text = [10.0**ZERO_LOG10] + [10.0**t for t in ticks], ["0"] + [f"1e{t}" for t in ticks]
    fig.update_yaxes(
        type="log",
        range=[ZERO_LOG10 - 0.3, 5.3],
        title_text="magnitude",
        tickvals=values,
        ticktext=text,
    )
    fig.update_xaxes(title_text="step", row=len(present), col=1)
    buttons = [{"label": name, "method": "animate", "args": [[name], _JUMP]} for name in names]
    title = "Weight and gradient magnitudes of the chosen parameter (bands: quantiles)"
    fig.update_layout(
        pl.LAYOUT,
        title=title + pl.thinned(shown, total),
        updatemenus=[pl.menu(buttons, direction="down", y=1.13)],
        height=300 + 260 * len(present),
        hovermode="closest",
    )
    return fig


# -- units ------------------------------------------------------------------------------
def dead_saturated_figure(dead: LayerSeries | None, saturated: LayerSeries | None):
    """The fraction of dead units per layer and of saturated inputs per tanh/sigmoid
    activation over time: lines, or a heat map for many layers."""
    return pl.share_panels(
        [
            pl.Panel(
                "Dead units: fraction of each layer's units that got no gradient", "dead", dead
            ),
            pl.Panel(
                "Saturated: fraction of each tanh/sigmoid's inputs in its flat tails",
                "saturated",
                saturated,
            ),
        ],
        title="Dead and saturated units",
        empty="No dead-unit or saturation fractions were recorded.",
        lines=MAX_LINES,
    )
