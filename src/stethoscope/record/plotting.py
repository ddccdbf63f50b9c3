"""Building blocks of the report's figures: thinning long series, log colours, heat
maps of names x sampled steps, axes and menus.

This module imports plotly: import it only where plotly is wanted (``figures`` does).
"""

from __future__ import annotations

import html
import itertools
import textwrap
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from stethoscope.record.reader import LayerSeries

#: Columns (sampled steps) of a per-layer chart at most.
MAX_COLUMNS = 2000
#: Cells (names x steps) of a heat map at most: more names leave fewer columns.
MAX_CELLS = 250_000
#: The layout every figure starts from.
LAYOUT = {
    "template": "plotly_white",
    "margin": {"l": 70, "r": 30, "t": 70, "b": 50},
    "hoverlabel": {"align": "left"},
    "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0},
}


def thin_columns(n: int, limit: int) -> np.ndarray:
    """Evenly spaced indices of at most ``limit`` of ``n`` columns, first and last kept."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max(limit, 2)).round().astype(np.int64))


def envelope(values: np.ndarray, limit: int) -> np.ndarray:
    """Indices of the lowest and highest finite value of each of ``limit // 2`` buckets."""
    n = len(values)
    if n <= limit:
        return np.arange(n)
    bounds = np.linspace(0, n, limit // 2 + 1).astype(np.int64)
    low = np.where(np.isfinite(values), values, np.inf)
    high = np.where(np.isfinite(values), values, -np.inf)
    keep = []
    for a, b in itertools.pairwise(bounds):
        if b > a:
            keep += [a + int(np.argmin(low[a:b])), a + int(np.argmax(high[a:b]))]
    return np.unique(np.array(keep, np.int64))


def thinned(shown: int, total: int, what: str = "sampled steps") -> str:
    return "" if shown >= total else f" · {shown:,} of {total:,} {what} shown"


def columns(series: LayerSeries) -> np.ndarray:
    limit = min(MAX_COLUMNS, max(200, MAX_CELLS // max(1, len(series.names))))
    return thin_columns(len(series.steps), limit)


def line_mode(points: int) -> str:
    """A line, with markers while it is too short to draw one."""
    return "lines" if points > 1 else "lines+markers"


def present(series: LayerSeries | None) -> bool:
    return series is not None and bool(series.names) and len(series.steps) > 0


def too_few(what: str, steps: np.ndarray) -> str | None:
    """The sentence that stands in a chart's place when it would show one step (a point
    on an axis of nothing), or None when there are two or more to draw."""
    distinct = np.unique(steps)
    if len(distinct) >= 2:
        return None
    return f"{what} was measured at step {int(distinct[0])} only: too little for a chart yet."


def hover_text(text: str, width: int = 90) -> str:
    """Plain text for a hover label: escaped and wrapped."""
    return "<br>".join(html.escape(line, quote=False) for line in textwrap.wrap(text, width))


def log10_colour(values: np.ndarray) -> np.ndarray:
    """log10 of magnitudes for a colour scale: an exact zero one decade below the least
    positive value, an infinity one decade above the greatest, NaN (not measured) kept."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(np.abs(values))
    finite = np.isfinite(z)
    low = float(z[finite].min()) if finite.any() else -12.0
    high = float(z[finite].max()) if finite.any() else 0.0
    z[np.isneginf(z)] = low - 1.0
    z[np.isposinf(z)] = high + 1.0
    return z


def last_measured(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column's last value that is not NaN, and its row (-1: never measured)."""
    measured = ~np.isnan(values)
    rows = np.where(measured.any(axis=0), len(values) - 1 - np.argmax(measured[::-1], 0), -1)
    last = np.where(rows >= 0, values[np.maximum(rows, 0), np.arange(values.shape[1])], np.nan)
    return last, rows


def heatmap(
    series: LayerSeries, cols: np.ndarray, label: str, *, log: bool = True, **trace
) -> go.Heatmap:
    """Names down, sampled steps across; the colour log10 of the value when ``log``, the
    hover the value itself."""
    raw = series.values[cols].T
    return go.Heatmap(
        x=series.steps[cols],
        y=list(series.names),
        z=(log10_colour(raw) if log else raw).astype(np.float32),
        customdata=raw.astype(np.float32),
        hovertemplate=f"%{{y}}<br>step %{{x}}<br>{label} %{{customdata:.3g}}<extra></extra>",
        hoverongaps=False,
        **trace,
    )


def menu(buttons: list[dict], **where) -> dict:
    """A plotly menu of ``buttons`` at the top right of a figure."""
    return {
        "buttons": buttons,
        "x": 1.0,
        "xanchor": "right",
        "y": 1.02,
        "yanchor": "bottom",
        "showactive": True,
        **where,
    }


def scale_button(kind: str) -> dict:
    return {"label": kind, "method": "relayout", "args": [{"yaxis.type": kind}]}


def height_for(names: int, base: int = 160, per: int = 14) -> int:
    """Tall enough that every name of a heat map gets its own readable row."""
    return int(np.clip(base + per * names, 380, 4200))


def name_axis(names: int) -> dict:
    """A heat map's names axis: every name labelled (plotly would skip some), input side
    at the top, a smaller font when there are many."""
    return {"autorange": "reversed", "dtick": 1, "tickfont": {"size": 11 if names <= 60 else 9}}


def step_ticks(steps: np.ndarray) -> dict:
    """Whole steps on a step axis: a run of a few steps would get ticks at 0.5."""
    span = int(steps[-1] - steps[0]) if len(steps) else 0
    return {"title": "step", "dtick": 1, "tick0": 0} if span < 10 else {"title": "step"}


def nonfinite_cells(series: LayerSeries, cols: np.ndarray, bad_steps: np.ndarray, **trace):
    """Red cells where a value is infinite, or NaN on a step whose loss or gradients were
    non-finite (elsewhere a NaN means "not measured" and stays a gap); None if none."""
    raw = series.values[cols].T
    on_bad_step = np.isin(series.steps[cols], bad_steps)[None, :]
    hit = np.isinf(raw) | (np.isnan(raw) & on_bad_step)
    if not hit.any():
        return None
    return go.Heatmap(
        x=series.steps[cols],
        y=list(series.names),
        z=np.where(hit, 1.0, np.nan).astype(np.float32),
        colorscale=[[0, "#d62728"], [1, "#d62728"]],
        showscale=False,
        hoverongaps=False,
        name="non-finite",
        hovertemplate="%{y}<br>step %{x}<br>non-finite<extra></extra>",
        **trace,
    )


@dataclass(frozen=True)
class Panel:
    """One panel of :func:`share_panels`: its title, the word for its values in a hover
    and a legend, its series (None: not recorded), and whether its values are shares (a
    0..100% axis) or magnitudes (a log axis)."""

    title: str
    label: str
    series: LayerSeries | None
    share: bool = True


def share_panels(panels: list[Panel], *, title: str, empty: str, lines: int) -> go.Figure | str:
    """Panels stacked over a shared step axis, one per recorded series: a line per name,
    or a heat map once there are more than ``lines`` names. ``empty``: the sentence when
    none was recorded."""
    present_ = [p for p in panels if present(p.series)]
    if not present_:
        return empty
    # a panel of one step is a point on an axis of nothing: left out, said if all are
    drawable = [p for p in present_ if too_few(p.label, p.series.steps) is None]
    if not drawable:
        return too_few(title, np.concatenate([p.series.steps for p in present_]))
    present_ = drawable
    heights = [len(p.series.names) if len(p.series.names) > lines else 12 for p in present_]
    fig = make_subplots(
        len(present_),
        1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        row_heights=heights,
        subplot_titles=[p.title for p in present_],
    )
    shown = []
    for row, p in enumerate(present_, start=1):
        s = p.series
        cols = columns(s)
        shown.append(thinned(len(cols), len(s.steps)))
        if len(s.names) > lines:
            trace = heatmap(s, cols, p.label, log=not p.share, coloraxis="coloraxis")
            fig.add_trace(trace, row=row, col=1)
            fig.update_yaxes(autorange="reversed", row=row, col=1)
            continue
        number = "%{y:.1%}" if p.share else "%{y:.3g}"
        for j, name in enumerate(s.names):
            fig.add_scatter(
                x=s.steps[cols],
                y=s.values[cols, j],
                mode=line_mode(len(cols)),
                name=name,
                connectgaps=True,
                legendgroup=p.label,
                legendgrouptitle_text=p.label,
                hovertemplate=f"{html.escape(name)}<br>step %{{x}}<br>{p.label} "
                f"{number}<extra></extra>",
                row=row,
                col=1,
            )
        if p.share:
            fig.update_yaxes(range=[-0.02, 1.02], tickformat=".0%", row=row, col=1)
        else:
            fig.update_yaxes(type="log", row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(present_), col=1)
    fig.update_layout(
        LAYOUT,
        title=title + next((t for t in shown if t), ""),
        legend={"orientation": "v", "y": 1, "yanchor": "top", "x": 1.02},
        height=int(np.clip(200 + 14 * sum(heights), 420, 1400)),
    )
    if any(len(p.series.names) > lines for p in present_):
        colours = {"colorscale": "Reds", "cmin": 0, "cmax": 1, "colorbar_title_text": "fraction"}
        fig.update_layout(coloraxis=colours, legend={**LAYOUT["legend"], "y": 1.04})
    return fig
