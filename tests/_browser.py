"""Open a report in a real headless Chromium (Debian's), collect its errors, take a
screenshot: what the report tests and the training tests that end in a report share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CHROMIUM = Path("/usr/bin/chromium")
_BAD = ("error", "warning", "trace")  # plotly.js warns through console.trace
_ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage"]


def open_in_chromium(
    page: Path, screenshot: Path, then: Callable[[Any], Any] | None = None
) -> tuple[list[str], Any]:
    """Open ``page``, wait until its charts are drawn, screenshot the whole page, then
    run ``then(tab)``. Returns the console errors and warnings and the page errors, and
    what ``then`` returned.
    Skips when Chromium or playwright is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1300, "height": 900})
            # warnings too: what plotly.js cannot draw (a colour it cannot read, say)
            tab.on("console", lambda m: errors.append(m.text) if m.type in _BAD else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.as_uri())
            charts = tab.locator(".st-chart .plotly-graph-div").count()
            tab.wait_for_function(
                f"document.querySelectorAll('.st-chart .main-svg').length >= {2 * charts}"
            )
            tab.screenshot(path=str(screenshot), full_page=True)
            result = then(tab) if then is not None else None
        finally:
            browser.close()
    return errors, result


def assert_not_blank(screenshot: Path, *, min_height: int = 2000) -> None:
    """The screenshot is a tall page of many colours: charts, not an empty canvas."""
    from PIL import Image

    image = np.asarray(Image.open(screenshot).convert("RGB"))
    assert image.shape[0] > min_height, image.shape
    colours = np.unique(image.reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 200 and image.std() > 20, (len(colours), image.std())


def chart_data(tab: Any, chart: str, trace: int, field: str) -> np.ndarray:
    """A trace's array as plotly drew it (its decoded data), as float64."""
    rows = tab.evaluate(
        "([id, i, f]) => { const v = document.getElementById(id)._fullData[i][f];"
        " return Array.from(v, r => (typeof r === 'object' ? Array.from(r) : r)); }",
        [f"fig-{chart}", trace, field],
    )
    return np.asarray(rows, dtype=float)
