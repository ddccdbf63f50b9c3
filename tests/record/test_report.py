"""``stethoscope report``: one self-contained HTML file of a run's record (and PNGs),
checked for its numbers, opened in a real Chromium, and refused in one sentence when
the record cannot be read."""

from __future__ import annotations

import base64
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("plotly")

from _browser import assert_not_blank, open_in_chromium
from stethoscope.cli import main
from stethoscope.findings import Finding
from stethoscope.record import RunRecord, report
from stethoscope.record.figures import (
    dead_saturated_figure,
    distribution_figure,
    gradient_flow_figure,
    loss_figure,
    update_ratio_figure,
)
from stethoscope.record.reader import Curve, LayerSeries
from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES

from ._records import NAMES, make_record

CHARTS = [key for key, _, _ in report.CHARTS]
EXTERNAL = re.compile(
    r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", re.I
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("report") / "run"
    make_record(directory)  # 300 steps, a NaN loss at 200, an escalation at 6
    return directory


@pytest.fixture(scope="module")
def page(run) -> tuple[Path, str]:
    [path] = report.write_report(run)
    return path, path.read_text(encoding="utf-8")


def _plot_data(html: str, div: str) -> list[dict]:
    """The traces ``Plotly.newPlot`` draws in the div ``div``, arrays decoded."""
    start = re.search(rf'Plotly\.newPlot\(\s*"{div}",\s*', html)
    assert start, f"no chart {div}"
    data, _ = json.JSONDecoder().raw_decode(html, start.end())
    return [{k: _decoded(v) for k, v in trace.items()} for trace in data]


def _decoded(value):
    if isinstance(value, dict) and "bdata" in value:
        array = np.frombuffer(base64.b64decode(value["bdata"]), np.dtype(value["dtype"]))
        shape = value.get("shape")
        return array.reshape([int(n) for n in str(shape).split(",")]) if shape else array
    return value


# -- the HTML file ----------------------------------------------------------------------
def test_the_report_is_written_beside_the_record_and_is_self_contained(run, page):
    path, html = page
    assert path == run / "report.html"
    assert not EXTERNAL.search(html), EXTERNAL.search(html)
    assert "cdn.plot.ly" not in re.sub(r"<script[^>]*>.*?</script>", "", html, flags=re.S)
    from plotly.offline import get_plotlyjs

    assert html.count(get_plotlyjs()[:2000]) == 1  # plotly.js inlined exactly once
    for key in CHARTS:
        assert f'id="fig-{key}"' in html and f'"fig-{key}"' in html
    assert "Left out" not in html
    assert "synthetic" in html and "finished" in html and "300 (step 0 … 299)" in html


def test_the_gradient_flow_holds_the_recorded_gradient_norms(run, page):
    recorded = RunRecord(run).layers("grad_norm")
    heat, bars = _plot_data(page[1], "fig-gradient_flow")
    assert heat["type"] == "heatmap" and heat["y"] == list(recorded.names)
    np.testing.assert_array_equal(np.asarray(heat["x"]), recorded.steps)
    np.testing.assert_allclose(heat["z"], np.log10(recorded.values.T), rtol=1e-6)
    np.testing.assert_allclose(heat["customdata"], recorded.values.T, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bars["x"], float), recorded.latest(), rtol=1e-6)
    # the input side at the top, the last parameter vanishing at the bottom
    fig = report.figures(RunRecord(run))["gradient_flow"]
    assert fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.xaxis2.type == "log"


def test_the_loss_chart_marks_the_nan_the_findings_and_the_escalation(run, page):
    record = RunRecord(run)
    traces = {t.get("name", ""): t for t in _plot_data(page[1], "fig-loss")}
    loss = traces["training loss"]
    np.testing.assert_allclose(np.asarray(loss["y"], float), record.losses().values, rtol=1e-6)
    [nan] = [t for name, t in traces.items() if name.startswith("non-finite loss")]
    assert list(np.asarray(nan["x"])) == [200] and nan["yaxis"] == "y2"
    errors = traces["error finding"]
    assert list(errors["x"]) == [200] and "nonfinite_loss" in errors["text"][0]
    assert list(traces["validation loss"]["x"]) == [99, 199, 299]
    shade = traces["sampler escalated (all detectors every step)"]
    assert shade["x"][:4] == [6, 6, 299, 299] and shade["fill"] == "toself"


def test_every_finding_is_a_row_that_links_to_its_step(run, page):
    html = page[1]
    findings = RunRecord(run).findings()
    assert findings
    table = html[html.index('<section id="findings">') :]
    assert table.count("<tr class=") == len(findings)
    for f in findings:
        assert f"stShow({f.step}, this)" in table
        assert f'<td class="sev">{f.severity.value}</td>' in table
        assert f.message.replace("'", "&#x27;")[:60] in table


def test_a_chart_without_data_is_left_out_with_a_sentence(tmp_path):
    make_record(tmp_path / "run", steps=120, nan_at=None)
    with sqlite3.connect(tmp_path / "run" / "record.sqlite") as con:
        con.execute("DELETE FROM layers WHERE kind IN ('weight_hist', 'grad_hist', 'dead')")
    con.close()
    out = tmp_path / "elsewhere" / "r.html"
    assert report.write_report(tmp_path / "run", output=out) == [out]
    html = out.read_text(encoding="utf-8")
    assert "Left out: No weight or gradient distributions were recorded." in html
    assert 'id="fig-distributions"' not in html and 'id="fig-dead_saturated"' in html
    assert set(report.figures(tmp_path / "run")) == set(CHARTS) - {"distributions"}


def test_a_record_without_steps_leaves_every_chart_out(tmp_path):
    make_record(tmp_path / "run", steps=0, nan_at=None)
    [path] = report.write_report(tmp_path / "run" / "record.sqlite")
    html = path.read_text(encoding="utf-8")
    assert html.count("Left out: ") == len(CHARTS)
    assert "Plotly.newPlot" not in html and "No findings" in html
    assert report.figures(tmp_path / "run") == {}


def test_plotly_is_imported_only_for_a_report():
    code = (
        "import sys, stethoscope, stethoscope.record, stethoscope.cli; "
        "print('plotly' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_without_plotly_the_report_says_what_to_install(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)
    with pytest.raises(RuntimeError, match=r'pip install "stethoscope\[report\]"'):
        report.write_report(run, output=run / "never.html")
    assert not (run / "never.html").exists()


# -- the figures, on their own ----------------------------------------------------------
def _series(kind: str, steps: int, names: int, values=None) -> LayerSeries:
    rng = np.random.default_rng(0)
    if values is None:
        values = 10.0 ** rng.uniform(-5, -1, (steps, names))
    return LayerSeries(kind, tuple(f"p{i}" for i in range(names)), np.arange(steps) * 10, values)


def test_long_series_are_thinned_and_say_so():
    steps = np.arange(1_000_000)
    values = 1.0 / (1 + steps * 1e-4)
    values[123_457] = 1e6  # a spike survives the thinning
    values[500_000] = np.nan
    curve = Curve(steps, values, steps // 1000)
    fig = loss_figure(curve, Curve(steps[:0], values[:0], steps[:0]), [])
    line = next(t for t in fig.data if t.name == "training loss")
    assert len(line.x) <= 4000 and 123_457 in line.x and np.nanmax(line.y) == 1e6
    assert "4,000 of 1,000,000 steps shown" in fig.layout.title.text
    heat = gradient_flow_figure(_series("grad_norm", 5000, 10))
    assert heat.data[0].z.shape == (10, 2000) and "2,000 of 5,000" in heat.layout.title.text
    assert heat.data[0].x[-1] == 49_990  # the last step is kept
    many = update_ratio_figure(_series("update_ratio", 3000, 200))
    assert many.data[0].type == "heatmap" and many.data[0].z.shape[1] <= 2000


def test_the_update_ratio_band_and_zero_updates():
    values = np.full((50, 3), 1e-3)
    values[:, 2] = 0.0  # a frozen parameter stays on the chart, at the bottom
    fig = update_ratio_figure(_series("update_ratio", 50, 3, values))
    assert "1e-04 … 1e-02" in fig.layout.title.text and fig.layout.yaxis.type == "log"
    [band] = fig.layout.shapes
    assert (band.y0, band.y1) == (1e-4, 1e-2)
    frozen = fig.data[2]
    assert np.all(np.asarray(frozen.y) > 0) and np.all(np.asarray(frozen.customdata) == 0)


def test_non_finite_gradients_are_red_cells_and_the_bars_say_which_step():
    values = 10.0 ** np.tile(np.arange(-4.0, 0.0), (30, 1))  # steps 0 … 290, 4 parameters
    values[20] = np.nan  # step 200: the loss went NaN, every gradient with it
    values[25, 1] = np.inf
    values[27, 3] = np.nan  # not measured on step 270: a gap, not a red cell
    values[28:] = np.nan  # nothing finite after step 270
    fig = gradient_flow_figure(_series("grad_norm", 30, 4, values), bad_steps=[200])
    _, red, bars = fig.data
    cells = np.asarray(red.z, float)
    assert red.name == "non-finite" and np.nansum(cells) == 4 + 1  # step 200, and the inf
    assert np.all(cells[:, 20] == 1) and cells[1, 25] == 1 and np.isnan(cells[3, 27])
    assert "latest finite sample (step 270)" in [a.text for a in fig.layout.annotations]
    np.testing.assert_allclose(bars.customdata[:, 0], [1e-4, 1e-3, 1e-2, 1e-1])
    np.testing.assert_array_equal(bars.customdata[:, 1], [270, 270, 270, 260])
    assert all(c.startswith("rgb") for c in bars.marker.color)  # colours, not numbers
    assert "red: non-finite" in fig.layout.title.text
    assert fig.layout.coloraxis.cmin == -4 and fig.layout.coloraxis.cmax == -1


def test_the_update_ratio_shows_the_weight_matrices_the_detectors_judge():
    config = {
        "model": {
            "parameters": [
                {"name": "p0", "shape": [4, 3]},
                {"name": "p1", "shape": [4]},  # a bias: starts at zero, moves by big ratios
                {"name": "p2", "shape": [3, 3, 2, 2]},
            ]
        }
    }
    matrices = report.weight_matrices(config)
    assert matrices == ["p0", "p2"]
    fig = update_ratio_figure(_series("update_ratio", 20, 3), matrices)
    assert [t.name for t in fig.data] == ["p0", "p2"]
    assert "per weight matrix (2 of 3 parameters)" in fig.layout.title.text
    assert report.weight_matrices({"model": "MLP"}) is None
    assert len(update_ratio_figure(_series("update_ratio", 20, 3), None).data) == 3


def test_a_run_of_a_few_steps_has_whole_step_ticks():
    fig = gradient_flow_figure(_series("grad_norm", 1, 3))
    assert fig.layout.xaxis.dtick == 1


def test_distribution_quantiles_follow_the_bins():
    counts = np.zeros((3, DISTRIBUTION_BINS))
    counts[0, 11] = 100  # all in (e9, e10]
    counts[1, [0, 11, -1]] = [50, 40, 10]  # half zeros, a tenth non-finite
    q, zeros, bad = report.distribution_quantiles(counts)
    low, high = np.log10(DISTRIBUTION_EDGES[9]), np.log10(DISTRIBUTION_EDGES[10])
    np.testing.assert_allclose(q[0], low + np.array(report.QUANTILES) * (high - low))
    assert q[1, 0] == report.ZERO_LOG10 and low < q[1, 4] <= high
    np.testing.assert_allclose([zeros[1], bad[1]], [0.5, 0.1])
    assert np.isnan(q[2]).all() and np.isnan(zeros[2])


def test_the_distribution_chart_has_a_frame_per_parameter():
    counts = np.zeros((40, 300, DISTRIBUTION_BINS))
    counts[..., 20] = 7
    weights = _series("weight_hist", 40, 300, counts)
    fig = distribution_figure(weights, None)
    assert len(fig.frames) == 300 and len(fig.data) == 4
    assert [b.label for b in fig.layout.updatemenus[0].buttons][:2] == ["p0", "p1"]
    assert dead_saturated_figure(None, None) == (
        "No dead-unit or saturation fractions were recorded."
    )


def test_escalations_end_when_the_sampler_returns():
    def sampler(step, value):
        return Finding(step, 0, "sampler", "info", "hot", value=value)

    found = [sampler(5, 1), sampler(40, None), Finding(50, 0, "loss_spike", "warning", "x")]
    found += [sampler(60, 1), sampler(61, 1)]
    assert report.escalations(found, 99) == [(5, 40, "hot"), (60, 99, "hot (still escalated)")]


# -- in a browser -----------------------------------------------------------------------
def test_the_report_draws_in_chromium_without_errors(page, tmp_path):
    def interact(tab):
        for key in CHARTS:
            assert tab.locator(f"#fig-{key} .main-svg").count() >= 2, key
        assert tab.locator("#fig-gradient_flow .heatmaplayer image").count() >= 1
        tab.locator("#findings a").last.click()
        tab.wait_for_function("document.querySelector('tr.picked') !== null")
        shapes = tab.evaluate(
            "[...document.querySelectorAll('.st-chart .plotly-graph-div')]"
            ".map(gd => (gd.layout.shapes || []).filter(s => s.x0 === 200).length)"
        )
        menu = "#fig-distributions .updatemenu-"
        tab.locator(f"{menu}header-group").click()
        options = tab.locator(f"{menu}dropdown-button")
        chosen = options.nth(2).text_content()
        options.nth(2).click()
        tab.wait_for_function(
            "([menu, name]) => document.querySelector(menu + 'header').textContent === name",
            arg=[menu, chosen],
        )
        shown = tab.evaluate("document.getElementById('fig-distributions').data[2].hovertemplate")
        return shapes, chosen, shown

    shot = tmp_path / "report.png"
    errors, (shapes, chosen, shown) = open_in_chromium(page[0], shot, interact)
    assert errors == []
    assert shapes == [1] * len(CHARTS)  # a line at step 200 on every chart
    assert chosen in shown  # the dropdown drew the chosen parameter's distribution
    assert_not_blank(shot)


# -- PNG --------------------------------------------------------------------------------
def test_png_figures(run, tmp_path):
    if report.find_browser() is None:
        pytest.skip("no Chrome or Chromium for kaleido")
    pytest.importorskip("kaleido")
    from PIL import Image

    written = report.write_report(run, output=tmp_path / "r.html", png_dir=tmp_path / "png")
    assert written == [tmp_path / "r.html"] + [tmp_path / "png" / f"{k}.png" for k in CHARTS]
    for path in written[1:]:
        image = np.asarray(Image.open(path).convert("RGB"))
        assert image.shape[1] == report.PNG_WIDTH and image.shape[0] >= 380, path
        assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50 and image.std() > 10, path


def test_without_a_browser_the_html_is_written_and_pngs_are_refused(run, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "find_browser", lambda: None)
    with pytest.raises(RuntimeError, match=r"need Chrome or Chromium.*apt-get install chromium"):
        report.write_report(run, output=tmp_path / "r.html", png_dir=tmp_path / "png")
    assert (tmp_path / "r.html").stat().st_size > 100_000
    assert not (tmp_path / "png").exists()


def test_browser_path_is_honoured(tmp_path, monkeypatch):
    fake = tmp_path / "my-chrome"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BROWSER_PATH", str(fake))
    assert report.find_browser() == str(fake)
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "nothing"))
    assert report.find_browser() != str(tmp_path / "nothing")


def test_a_browser_path_that_names_nothing_is_no_browser_whoever_finds_it(tmp_path, monkeypatch):
    # kaleido's own finder reads BROWSER_PATH too and hands it back unchecked: here it is
    # the only finder left (nothing on PATH), as on a machine without Chromium
    pytest.importorskip("choreographer")
    from choreographer.browsers.chromium import Chromium

    nothing = str(tmp_path / "nothing")
    monkeypatch.setenv("BROWSER_PATH", nothing)
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    monkeypatch.setattr(Chromium, "find_browser", staticmethod(lambda **kw: nothing))
    assert report.find_browser() is None


def test_one_sample_is_said_in_one_line_instead_of_a_chart():
    one = LayerSeries("fp8_weight_e4m3", ("w",), np.array([0]), np.array([[0.1]]))
    two = LayerSeries("fp8_weight_e4m3", ("w",), np.array([0, 16]), np.array([[0.1], [0.2]]))
    from stethoscope.record.precision_figures import fp8_figure

    said = fp8_figure(one, None)
    assert isinstance(said, str) and "step 0 only" in said and "\n" not in said
    assert not isinstance(fp8_figure(two, None), str)
    assert not isinstance(fp8_figure(one, two), str)  # the panel of two steps is drawn
    at3, none = np.array([3]), np.array([], np.int64)
    loss = loss_figure(Curve(at3, np.array([1.0]), at3 * 0), Curve(none, none * 1.0, none), [])
    assert isinstance(loss, str) and "step 3 only" in loss


def test_a_finished_record_leaves_no_log_beside_it_after_a_report(tmp_path):
    directory = tmp_path / "run"
    make_record(directory, steps=50, nan_at=None)
    report.write_report(directory)
    with RunRecord(directory) as record:
        assert record.meta["status"] == "finished"
    assert sorted(p.name for p in directory.iterdir()) == ["record.sqlite", "report.html"]


# -- the command ------------------------------------------------------------------------
def test_the_command_prints_what_it_wrote(run, tmp_path, capsys):
    out = tmp_path / "x.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(out)]


def _garbage(path: Path) -> Path:
    path.mkdir()
    (path / "record.sqlite").write_bytes(b"not a database " * 1000)
    return path


def _truncated(path: Path) -> Path:
    make_record(path, steps=50, nan_at=None)
    data = (path / "record.sqlite").read_bytes()
    (path / "record.sqlite").write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "missing", "no such file or directory"),
        (lambda p: p, "holds no run record"),
        (lambda p: _garbage(p / "g"), "damaged"),
        (lambda p: _truncated(p / "t"), "damaged"),
    ],
    ids=["missing", "empty-dir", "garbage", "truncated"],
)
def test_an_unreadable_record_is_one_sentence_and_exit_2(tmp_path, capsys, make, says):
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stethoscope: ") and says in lines[0]
    assert "Traceback" not in out.err
    assert not list(tmp_path.rglob("report.html"))


@pytest.mark.parametrize("browser", ["found", "none"])
def test_an_output_that_cannot_be_written_is_one_sentence_and_exit_2(
    run, tmp_path, capsys, monkeypatch, browser
):
    # the path is the user's to mend whether or not a browser is installed: checked first
    if browser == "none":
        monkeypatch.setattr(report, "find_browser", lambda: None)
    afile = tmp_path / "afile"
    afile.write_text("")
    for args in (
        ["-o", str(afile / "x.html")],
        ["-o", str(tmp_path / "r.html"), "--png", str(afile)],
        ["-o", str(tmp_path / "r.html"), "--png", str(afile / "under")],
    ):
        assert main(["report", str(run), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"stethoscope: cannot write {afile}")


def test_the_header_says_when_the_detectors_fired_more_often_than_was_reported():
    epochs = [
        {"rows": [{"status": "error", "count": 300}, {"status": "ok", "count": 0}]},
        {"rows": [{"status": "warning", "count": 16}]},
    ]
    assert "fired 316 times" in report._repeats(epochs, 5)
    assert report._repeats(epochs, 316) == ""


def test_the_precision_and_fp8_charts_hold_what_was_recorded(run):
    record = RunRecord(run)
    figs = report.figures(record)
    lost = record.layers("update_lost")
    assert lost.names == NAMES  # every parameter was held in bfloat16
    traces = {(t.legendgroup, t.name): t for t in figs["precision"].data}
    for j, name in enumerate(lost.names):
        line = traces[("rounded away", name)]
        np.testing.assert_allclose(np.asarray(line.y, float), lost.values[:, j], rtol=1e-6)
    scale = traces[("scale", "loss scale")]
    assert (
        np.asarray(scale.y, float)[0] == 2.0**16 and figs["precision"].layout.yaxis3.type == "log"
    )
    fp8 = {(t.legendgroup, t.name): t for t in figs["fp8"].data}
    e5m2 = record.layers("fp8_grad_e5m2")
    np.testing.assert_allclose(
        np.asarray(fp8[("lost in e5m2", NAMES[0])].y, float), e5m2.values[:, 0]
    )


def test_a_float32_record_leaves_the_precision_chart_out_with_a_sentence(tmp_path):
    make_record(tmp_path / "run", steps=120, nan_at=None)
    with sqlite3.connect(tmp_path / "run" / "record.sqlite") as con:
        con.execute(
            "DELETE FROM layers WHERE kind IN "
            "('update_lost', 'grad_subnormal', 'loss_scale', 'scale_skipped')"
        )
    con.close()
    [path] = report.write_report(tmp_path / "run")
    assert "Left out: The run held nothing in 16 bits" in path.read_text(encoding="utf-8")
