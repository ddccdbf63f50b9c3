"""``stethoscope report``: one self-contained HTML file drawing a run's record.

The file opens offline: plotly.js is inlined once, every figure's data is inline, and
nothing is fetched from anywhere. Figures whose data the record lacks are left out with
a sentence saying why. ``png_dir`` also writes each figure as a PNG through kaleido,
which drives a Chrome or Chromium already on the machine.

plotly (and kaleido) are imported here and in ``figures`` only, when a report is drawn:
``pip install "stethoscope[report]"``.
"""

from __future__ import annotations

import errno
import html
import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stethoscope.findings import RECOVERY, Finding
from stethoscope.record.charts import CHARTS
from stethoscope.record.reader import Curve, RunRecord
from stethoscope.record.store import record_file
from stethoscope.recovery.skipped import SkippedBatch
from stethoscope.statistics import DISTRIBUTION_EDGES

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = [
    "CHARTS",
    "cool_downs",
    "distribution_quantiles",
    "escalations",
    "figures",
    "find_browser",
    "write_pngs",
    "write_report",
]

#: Findings listed in the table at most (the first ones, in the order they happened).
MAX_TABLE_ROWS = 5000
#: The width of each PNG, in pixels (its height is the figure's).
PNG_WIDTH = 1200

_PLOTLY_MISSING = (
    'The report needs plotly, which is not installed: pip install "stethoscope[report]".'
)
_NO_BROWSER = (
    "PNG figures need Chrome or Chromium and none was found (the HTML report was "
    "written): install one, e.g. apt-get install chromium, or set BROWSER_PATH to it."
)
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _require_plotly() -> None:
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise RuntimeError(_PLOTLY_MISSING) from None


def _build(record: RunRecord) -> dict[str, go.Figure | str]:
    """Every chart of :data:`CHARTS`: its figure, or why it is left out."""
    from stethoscope.record import figures as f
    from stethoscope.record.precision_figures import fp8_figure, precision_figure

    kinds = set(record.kinds())

    def layers(kind: str):
        return record.layers(kind) if kind in kinds else None

    findings = record.findings()
    losses = record.losses()
    bad_steps = nonfinite_steps(losses, findings)
    return {
        "loss": f.loss_figure(losses, record.validation(), findings),
        "gradient_flow": f.gradient_flow_figure(layers("grad_norm"), bad_steps),
        "update_ratio": f.update_ratio_figure(
            layers("update_ratio"), weight_matrices(record.config), bad_steps
        ),
        "distributions": f.distribution_figure(layers("weight_hist"), layers("grad_hist")),
        "dead_saturated": f.dead_saturated_figure(layers("dead"), layers("saturated")),
        "precision": precision_figure(
            layers("update_lost"),
            layers("grad_subnormal"),
            layers("loss_scale"),
            layers("scale_skipped"),
        ),
        "fp8": fp8_figure(layers("fp8_weight_e4m3"), layers("fp8_grad_e5m2")),
    }


def figures(record: RunRecord | str | os.PathLike[str]) -> dict[str, go.Figure]:
    """The report's plotly figures of ``record`` (name → figure, see :data:`CHARTS`),
    leaving out those whose data it lacks.

    Raises:
        RuntimeError: plotly is not installed.
        RecordError: ``record`` is a path to no readable record.
    """
    _require_plotly()
    if isinstance(record, RunRecord):
        built = _build(record)
    else:
        with RunRecord(record) as run:
            built = _build(run)
    return {name: fig for name, fig in built.items() if not isinstance(fig, str)}


def write_report(
    record: str | os.PathLike[str],
    *,
    output: str | os.PathLike[str] | None = None,
    png_dir: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write the HTML report of the record at ``record`` (and each figure as a PNG).

    Args:
        record: The record's directory (``record=`` of the callback) or its file.
        output: The HTML file to write; default ``report.html`` beside the record.
        png_dir: Also write ``<chart>.png`` for each figure there (created).

    Returns:
        The paths written: the HTML first, then the PNGs.

    Raises:
        RecordError: No readable record at ``record`` (one sentence).
        RuntimeError: plotly is not installed, or PNGs were asked for and no Chrome or
            Chromium was found (the HTML is written first).
    """
    _require_plotly()
    database = record_file(record)
    with RunRecord(record) as run:
        built = _build(run)
        page = _page(run, built)
    out = Path(output) if output is not None else database.parent / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, out)
    written = [out]
    if png_dir is not None:
        drawn = {name: fig for name, fig in built.items() if not isinstance(fig, str)}
        written += write_pngs(drawn, png_dir)
    return written


# -- what the charts draw, computed from the record ------------------------------------
_NONFINITE_DETECTORS = frozenset({"nonfinite_loss", "nonfinite_gradients", "nonfinite_weights"})


def nonfinite_steps(losses: Curve, findings: Sequence[Finding]) -> np.ndarray:
    """The steps whose loss was non-finite or that a non-finite finding names: there a
    missing per-layer value is a non-finite one, not one that was not measured."""
    steps = set(losses.steps[~np.isfinite(losses.values)].tolist())
    steps |= {f.step for f in findings if f.detector in _NONFINITE_DETECTORS}
    return np.array(sorted(steps), np.int64)


def weight_matrices(config: dict[str, Any]) -> list[str] | None:
    """The names of the model's parameters of two or more dimensions (what the update
    detectors judge), from the configuration; None when it does not say."""
    model = config.get("model") if isinstance(config, dict) else None
    parameters = model.get("parameters") if isinstance(model, dict) else None
    if not isinstance(parameters, list):
        return None
    return [
        p["name"]
        for p in parameters
        if isinstance(p, dict) and isinstance(p.get("shape"), list) and len(p["shape"]) >= 2
    ]


def escalations(findings: Sequence[Finding], last_step: int) -> list[tuple[int, int, str]]:
    """The sampler's escalations as ``(first step, last step, why)``: from a ``sampler``
    finding whose value is 1 (every interval capped at one step) to the next one whose
    value is None (back to the base intervals), or to ``last_step``."""
    spans: list[tuple[int, int, str]] = []
    start: tuple[int, str] | None = None
    for f in findings:
        if f.detector != "sampler":
            continue
        if f.value == 1 and start is None:
            start = (f.step, f.message)
        elif f.value is None and start is not None:
            spans.append((start[0], f.step, start[1]))
            start = None
    if start is not None:
        spans.append((start[0], max(last_step, start[0]), f"{start[1]} (still escalated)"))
    return spans


def cool_downs(findings: Sequence[Finding], last_step: int) -> list[tuple[int, int, str]]:
    """The recovery ladder's cool-downs as ``(first step, last step, why)``: from a
    ``cool`` act to the ``restore_lr`` (or the next ``cool``) after it, or to
    ``last_step``."""
    spans: list[tuple[int, int, str]] = []
    start: Finding | None = None
    for f in findings:
        if f.detector != RECOVERY or f.where not in ("cool", "restore_lr"):
            continue
        if start is not None:
            spans.append((start.step, f.step, start.message))
        start = f if f.where == "cool" else None
    if start is not None:
        spans.append((start.step, max(last_step, start.step), start.message))
    return spans


#: The quantiles of the distribution chart: its 90% band, its 50% band and the median.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
#: Where an exact zero is drawn on a log10 magnitude axis: below the first bin (0, 1e-12].
ZERO_LOG10 = -13.0


def _bin_bounds() -> tuple[np.ndarray, np.ndarray]:
    """log10 bounds of every bin: zeros at ZERO_LOG10, the magnitude bins by their edges
    (the open ends half a decade wide, like the others), non-finite values nowhere."""
    edges = np.log10(np.array(DISTRIBUTION_EDGES))
    lows = np.concatenate([[ZERO_LOG10, edges[0] - 0.5], edges, [np.nan]])
    highs = np.concatenate([[ZERO_LOG10, edges[0]], edges[1:], [edges[-1] + 0.5, np.nan]])
    return lows, highs


def distribution_quantiles(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantiles (``QUANTILES``) of log10 magnitude of the finite values counted in
    histograms ``counts[..., bins]``, interpolated within a bin; exact zeros at ZERO_LOG10.

    Returns:
        quantiles ``[..., 5]`` (NaN where nothing finite was counted), the fraction of
        exact zeros and the fraction of non-finite values.
    """
    counts = np.nan_to_num(counts, nan=0.0)
    lows, highs = _bin_bounds()
    total = counts.sum(axis=-1)
    finite = counts[..., :-1]
    n = finite.sum(axis=-1)
    cum = np.cumsum(finite, axis=-1)
    out = np.full((*counts.shape[:-1], len(QUANTILES)), np.nan)
    for k, q in enumerate(QUANTILES):
        target = q * n
        idx = np.minimum((cum < target[..., None]).sum(axis=-1), finite.shape[-1] - 1)
        before = np.take_along_axis(cum, idx[..., None], -1)[..., 0]
        inside = np.take_along_axis(finite, idx[..., None], -1)[..., 0]
        before = before - inside
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.clip(np.where(inside > 0, (target - before) / inside, 0.0), 0, 1)
        out[..., k] = np.where(n > 0, lows[idx] + frac * (highs[idx] - lows[idx]), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(total > 0, counts[..., 0] / total, np.nan)
        bad = np.where(total > 0, counts[..., -1] / total, np.nan)
    return out, zeros, bad


# -- PNG --------------------------------------------------------------------------------
def _runnable(path: str | None) -> bool:
    return path is not None and Path(path).is_file() and os.access(path, os.X_OK)


def find_browser() -> str | None:
    """A Chrome or Chromium for kaleido: ``BROWSER_PATH`` if it names one, the first of
    the usual names on ``PATH``, or the one kaleido downloaded (``kaleido_get_chrome``)."""
    env = os.environ.get("BROWSER_PATH")
    if env and _runnable(env):
        return env
    for name in _BROWSERS:
        if path := shutil.which(name):
            return path
    try:
        from choreographer.browsers.chromium import Chromium

        found = Chromium.find_browser(skip_local=False)
    except Exception:  # an older or newer choreographer: no further guess
        return None
    # choreographer reads BROWSER_PATH too and hands it back unchecked: a path that
    # names no program is no browser, whoever found it
    return str(found) if found and _runnable(str(found)) else None


def _check_folder(directory: Path) -> None:
    """Raise the error ``mkdir`` would, before anything is drawn: a folder that is a
    file, or lies under one, is the user's path to mend, not a missing browser."""
    for place in (directory, *directory.parents):
        if place.exists():
            if not place.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(place))
            return


def write_pngs(figs: dict[str, go.Figure], directory: str | os.PathLike[str]) -> list[Path]:
    """Write each figure as ``<name>.png`` in ``directory`` with one browser session.

    Raises:
        RuntimeError: No Chrome or Chromium was found, kaleido is missing, or the
            browser failed to draw them.
    """
    target = Path(directory)
    _check_folder(target)
    browser = find_browser()
    if browser is None:
        raise RuntimeError(_NO_BROWSER)
    try:
        import kaleido
    except ImportError:
        raise RuntimeError(
            'PNG figures need kaleido, which is not installed: pip install "stethoscope[report]".'
        ) from None
    target.mkdir(parents=True, exist_ok=True)
    paths = [target / f"{name}.png" for name in figs]
    specs = [
        {
            "fig": fig,
            "path": path,
            "opts": {"format": "png", "width": PNG_WIDTH, "height": fig.layout.height or 500},
        }
        for fig, path in zip(figs.values(), paths, strict=True)
    ]
    try:
        kaleido.write_fig_from_object_sync(
            specs, kopts={"path": browser, "mathjax": False}, cancel_on_error=True
        )
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"Drawing the PNG figures with {browser} failed ({reason}); the HTML report "
            "was written."
        ) from None
    return paths


# -- the page ---------------------------------------------------------------------------
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#222;
margin:0 auto;max-width:1400px;padding:16px 24px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:28px 0 4px}
table{border-collapse:collapse}td,th{padding:3px 10px 3px 0;text-align:left;
vertical-align:top}
.meta th{color:#555;font-weight:600}.what{color:#555;margin:2px 0 6px}
.absent{color:#777;font-style:italic;margin:4px 0 0}
.findings{width:100%;font-size:13px}.findings th{border-bottom:2px solid #ccc}
.findings td{border-bottom:1px solid #eee}.findings td.num{text-align:right}
.error td.sev{color:#d62728;font-weight:600}.warning td.sev{color:#e07000;font-weight:600}
.info td.sev{color:#777}tr.picked{background:#fff3c4}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:480px;font-size:12px}
ul.legend li{margin:3px 0}footer{color:#888;margin:32px 0 8px;font-size:12px}
"""

# Draws a dotted line at a finding's step on every chart (they all have steps across)
# and scrolls to the loss chart; the charts' own shapes are kept.
_JS = """
function stShow(step, link) {
  document.querySelectorAll('tr.picked').forEach(function (r) { r.classList.remove('picked'); });
  if (link) { link.closest('tr').classList.add('picked'); }
  document.querySelectorAll('.st-chart .plotly-graph-div').forEach(function (gd) {
    if (!gd.layout || !window.Plotly) { return; }
    if (!gd._stShapes) { gd._stShapes = (gd.layout.shapes || []).slice(); }
    Plotly.relayout(gd, {shapes: gd._stShapes.concat([{type: 'line', xref: 'x',
      yref: 'paper', x0: step, x1: step, y0: 0, y1: 1,
      line: {color: '#d62728', width: 2, dash: 'dot'}}])});
  });
  var top = document.getElementById('loss');
  if (top) { top.scrollIntoView({behavior: 'smooth'}); }
  return false;
}
"""

_CONFIG = {"displaylogo": False, "responsive": True}


def _page(record: RunRecord, built: dict[str, go.Figure | str]) -> str:
    import plotly
    from plotly.offline import get_plotlyjs

    name = record.path.parent.name or str(record.path)
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>stethoscope report: {html.escape(name)}</title><style>{_CSS}</style>",
    ]
    if any(not isinstance(fig, str) for fig in built.values()):
        parts.append(f'<script type="text/javascript">{get_plotlyjs()}</script>')
    parts.append(f"<script>{_JS}</script></head><body>")
    findings = record.findings()
    parts.append(_header(record, name, findings))
    parts.append('<h2>What the charts show</h2><ul class="legend">')
    for key, heading, what in CHARTS:
        parts.append(f'<li><a href="#{key}">{heading}</a>: {html.escape(what)}</li>')
    parts.append(
        '<li><a href="#findings">Findings</a>: every finding; click a step to mark it on '
        "the charts.</li></ul>"
    )
    for key, heading, _ in CHARTS:
        fig = built[key]
        parts.append(f'<section id="{key}" class="st-chart"><h2>{heading}</h2>')
        if isinstance(fig, str):
            parts.append(f'<p class="absent">Left out: {html.escape(fig)}</p>')
        else:
            parts.append(
                fig.to_html(
                    full_html=False,
                    include_plotlyjs=False,
                    div_id=f"fig-{key}",
                    config={**_CONFIG, "toImageButtonOptions": {"filename": key}},
                    auto_play=False,
                )
            )
        parts.append("</section>")
    parts.append(_findings_table(findings))
    parts.append(_skipped_table(record.skipped_batches()))
    written = datetime.now(timezone.utc).isoformat(timespec="seconds")
    from stethoscope import __version__

    parts.append(
        f"<footer>Written {written} by stethoscope {__version__} with plotly "
        f"{plotly.__version__}; self-contained, opens offline.</footer></body></html>"
    )
    return "\n".join(parts)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def _header(record: RunRecord, name: str, findings: list[Finding]) -> str:
    meta = record.meta
    losses = record.losses()
    if record.finished:
        status = "finished"
    else:
        ago = _ago(record.seconds_since_update())
        status = f"running, or stopped without closing its record (last write {ago} ago)"
    if len(losses.steps):
        steps = f"{len(losses.steps):,} (step {losses.steps[0]} … {losses.steps[-1]})"
    else:
        steps = "none yet"
    counts = Counter(f.severity.value for f in findings)
    rows: list[tuple[str, str]] = [
        ("Record", str(record.path)),
        ("Framework", meta.get("framework") or "unknown"),
        ("Status", status),
        ("Started", meta.get("started", "unknown")),
        ("Last write", meta.get("updated", "unknown")),
        ("Steps", steps),
        ("Epochs finished", str(len(record.epochs()))),
        (
            "Findings",
            f"{len(findings)} ("
            + ", ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info"))
            + ")"
            + _repeats(record.epochs(), len(findings)),
        ),
    ]
    if meta.get("world_size", "1") != "1":
        rows.append(("Processes", meta["world_size"]))
    config = record.config
    for key, value in config.items():
        if key != "framework":
            rows.append((key.replace("_", " ").capitalize(), _summary(value)))
    out = [f"<header><h1>stethoscope report: {html.escape(name)}</h1>", '<table class="meta">']
    out += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows]
    out.append("</table>")
    if config:
        text = json.dumps(config, indent=2, default=str)
        out.append(
            f"<details><summary>The full configuration</summary><pre>{html.escape(text)}"
            "</pre></details>"
        )
    out.append("</header>")
    return "\n".join(out)


def _repeats(epochs: list[dict[str, Any]], reported: int) -> str:
    """How many times the detectors fired in all, when the epoch summaries counted more
    than the findings reported (a finding that repeats unchanged is reported once)."""
    fired = sum(
        int(row.get("count") or 0)
        for epoch in epochs
        for row in epoch.get("rows", ())
        if isinstance(row, dict) and row.get("status") != "ok"
    )
    if fired <= reported:
        return ""
    return (
        f"; the detectors fired {fired:,} times (the epoch summaries' counts): a finding "
        "that repeats unchanged is reported once"
    )


def _summary(value: Any) -> str:
    """One line for a configuration entry: a class and its size, or a count."""
    if isinstance(value, dict):
        if "class" in value:
            total = value.get("total")
            size = f" ({total:,} parameters)" if isinstance(total, int) else ""
            return f"{value['class']}{size}"
        return f"{len(value)} entries (in the full configuration below)"
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return ", ".join(_summary(v) for v in value[:4]) + (" …" if len(value) > 4 else "")
        return json.dumps(value, default=str)[:200]
    return str(value)


def _value(v: float | None) -> str:
    return "" if v is None else f"{v:.4g}"


def _findings_table(findings: list[Finding]) -> str:
    out = [f'<section id="findings"><h2>Findings ({len(findings)})</h2>']
    if not findings:
        out.append('<p class="absent">No findings: nothing was reported.</p></section>')
        return "\n".join(out)
    if len(findings) > MAX_TABLE_ROWS:
        out.append(
            f'<p class="absent">The first {MAX_TABLE_ROWS:,} of {len(findings):,} findings '
            "are listed.</p>"
        )
    out.append(
        '<table class="findings"><thead><tr><th>step</th><th>epoch</th><th>detector</th>'
        "<th>severity</th><th>where</th><th>value</th><th>threshold</th><th>message</th>"
        "</tr></thead><tbody>"
    )
    for f in findings[:MAX_TABLE_ROWS]:
        sev = f.severity.value
        out.append(
            f'<tr class="{sev}"><td class="num"><a href="#loss" '
            f'onclick="return stShow({f.step}, this)">{f.step}</a></td>'
            f'<td class="num">{f.epoch}</td><td>{html.escape(f.detector)}</td>'
            f'<td class="sev">{sev}</td><td>{html.escape(f.where or "")}</td>'
            f'<td class="num">{_value(f.value)}</td><td class="num">{_value(f.threshold)}</td>'
            f"<td>{html.escape(f.message)}</td></tr>"
        )
    out.append("</tbody></table></section>")
    return "\n".join(out)


def _skipped_table(skipped: list[SkippedBatch]) -> str:
    """The batches the recovery ladder skipped (nothing when it skipped none): a run
    resumed from an earlier checkpoint into this record skips them again."""
    if not skipped:
        return ""
    out = [
        f'<section id="skipped"><h2>Skipped batches ({len(skipped)})</h2>',
        '<table class="findings"><thead><tr><th>step</th><th>epoch</th><th>batch</th>'
        "<th>fingerprint</th><th>replay</th><th>why</th></tr></thead><tbody>",
    ]
    for s in skipped[:MAX_TABLE_ROWS]:
        b = s.batch
        out.append(
            f'<tr><td class="num"><a href="#loss" onclick="return stShow({s.step}, this)">'
            f'{s.step}</a></td><td class="num">{b.epoch}</td><td class="num">{b.index}</td>'
            f"<td>{html.escape(b.fingerprint or '')}</td><td>{html.escape(s.replay or '')}"
            f"</td><td>{html.escape(s.why)}</td></tr>"
        )
    out.append("</tbody></table></section>")
    return "\n".join(out)
