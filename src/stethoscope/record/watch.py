"""``stethoscope watch``: follow a run record from a second terminal while training runs.

One view, redrawn about every ``every`` seconds with :class:`rich.live.Live`:

* the run: its directory, framework and model, whether it is running, finished or has
  not been updated for a while; the latest step, epoch and learning rate; how often the
  sampled detectors run now (``every step (escalated)`` while something looks wrong);
* the loss as sparklines (the whole run binned into the terminal's width, and the last
  steps one per column once the run is longer than that), NaN or Inf as a red ``!``;
* the gradient flow of the latest sampled step: each parameter's gradient norm as a bar
  on a shared log10 scale (yellow below 1e-7, red above 1e2 or non-finite), as many as
  the terminal's height allows (an even spread across depth plus every unusual one);
* the latest findings, newest first.

The loss and the findings are read incrementally; the sampled steps and the per-layer
gradient norms are re-read only when a new sampled step arrived, and less often when
that read is slow (a long run's record), so that watching never weighs on training.

A finished run shows ``finished`` and stays on screen, still refreshed (a resumed run
continues its record), until Ctrl-C, which leaves cleanly: the last frame stays, the
cursor comes back, and :func:`watch` returns. A record that cannot be opened raises
:class:`RecordError` before anything is drawn; one that becomes unreadable while
watched (replaced, deleted, damaged) shows why in the view, and the watch retries.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from stethoscope.record.reader import RunRecord
from stethoscope.record.store import RecordError, record_file
from stethoscope.summary import name_tail

__all__ = ["STALE_SECONDS", "sparkline", "watch"]

#: A running record not updated for this long shows "no update for N s".
STALE_SECONDS = 20.0
#: The findings listed, newest first.
FINDINGS_SHOWN = 5
#: A gradient norm below this is coloured as vanishing, above ``LARGE`` as exploding.
SMALL, LARGE = 1e-7, 1e2

_BLOCKS = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_LABEL = 9  # the width of the labels' column


def watch(
    record: str | Path,
    every: float = 1.0,
    once: bool = False,
    *,
    console: Console | None = None,
    stale_after: float = STALE_SECONDS,
) -> None:
    """Show the run record at ``record`` and keep it up to date until Ctrl-C.

    Args:
        record: The record's directory (``record=`` of the callback) or its file.
        every: Seconds between refreshes (at least 0.05).
        once: Draw the current state once and return (for scripts): on a console that
            is not a terminal, every parameter's gradient is listed.
        console: Where to draw (a new :class:`rich.console.Console` by default).
        stale_after: Seconds without an update after which a running record is shown
            as stale.

    Raises:
        RecordError: The record is missing, empty, damaged or written by a newer
            stethoscope (before anything is drawn).
    """
    every = max(float(every), 0.05)
    follower = _Follower(record)
    try:
        follower.read()  # a RecordError here is the caller's, before Live starts
        console = console or Console()
        view = _View(follower, every=every, stale_after=stale_after)
        if once:
            height = console.size.height if console.is_terminal else None
            console.print(view.render(console.size.width, height, live=False))
            return
        _follow(follower, view, console, every)
    finally:
        follower.close()


def _follow(follower: _Follower, view: _View, console: Console, every: float) -> None:
    """Redraw until Ctrl-C; SIGINT only sets a flag, so that it never lands halfway
    through a redraw or a read and the terminal is always restored."""
    stop = threading.Event()
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: a KeyboardInterrupt then
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with Live(
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
            vertical_overflow="crop",
        ) as live:
            while not stop.is_set():
                size = console.size
                live.update(view.render(size.width, size.height - 1, live=True), refresh=True)
                if stop.wait(every):
                    break
                follower.refresh()
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class _Curve:
    """A growing (step, loss) series: amortised appends, no copy per refresh."""

    def __init__(self) -> None:
        self._steps = np.empty(0, np.int64)
        self._values = np.empty(0, np.float64)
        self.n = 0

    def extend(self, steps: np.ndarray, values: np.ndarray) -> None:
        need = self.n + len(steps)
        if need > len(self._steps):
            size = max(need, 2 * len(self._steps), 1024)
            self._steps = np.resize(self._steps, size)
            self._values = np.resize(self._values, size)
        self._steps[self.n : need] = steps
        self._values[self.n : need] = values
        self.n = need

    @property
    def steps(self) -> np.ndarray:
        return self._steps[: self.n]

    @property
    def values(self) -> np.ndarray:
        return self._values[: self.n]


class _Follower:
    """What the view shows, kept up to date from the record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.record = RunRecord(path)
        self._inode = _inode(self.record.path)
        self.error: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.meta: dict[str, str] = {}
        self.model: str | None = None
        self.base_interval: int | None = None  # the sampled detectors' shortest base
        self.loss = _Curve()
        self.epoch: int | None = None
        self.min_loss, self.min_step = math.inf, -1
        self.nonfinite = 0
        self.stale = 0.0
        self.interval: int | None = None
        self.lr = math.nan
        self.grad_step = -1
        self.grad_names: tuple[str, ...] = ()
        self.grad_values = np.empty(0)
        self._slow_due = 0.0  # monotonic time before which the slow reads wait
        self._sampled_last = -1
        self.findings: deque = deque(maxlen=FINDINGS_SHOWN)
        self.finding_count = 0
        self.severities: Counter[str] = Counter()
        self.escalated = False  # an escalation the sampler has not ended yet

    def close(self) -> None:
        self.record.close()

    @property
    def finished(self) -> bool:
        return self.meta.get("status") == "finished"

    def refresh(self) -> None:
        """Read what is new; a record that became unreadable is kept as ``error``
        (the last state read stays shown) and retried at the next refresh."""
        try:
            self._reopen_if_replaced()
            self.read()
        except RecordError as exc:
            self.error = str(exc)
        else:
            self.error = None

    def _reopen_if_replaced(self) -> None:
        """A fresh run replaces the file (the old one becomes record.previous.sqlite)."""
        file = record_file(self.path)
        inode = _inode(file)
        if inode is None:
            raise RecordError(f"There is no run record at {str(file)!r} any more.")
        if inode != self._inode:
            fresh = RunRecord(self.path)
            self.record.close()
            self.record, self._inode = fresh, inode
            self._reset()

    def read(self) -> None:
        """Read what was committed since the last read."""
        record = self.record
        meta = record.meta
        if self.meta and meta.get("started") != self.meta.get("started"):
            self._reset()  # resumed from a checkpoint: the steps past it were rewritten
        if not self.meta:
            self.model, self.base_interval = _describe(meta.get("config"))
        self.meta = meta
        self.stale = record.seconds_since_update()
        since = int(self.loss.steps[-1]) if self.loss.n else -1
        curve = record.losses(since=since)
        if len(curve.steps):
            self.loss.extend(curve.steps, curve.values)
            self.epoch = int(curve.epochs[-1])
            finite = np.isfinite(curve.values)
            self.nonfinite += int((~finite).sum())
            if finite.any():
                i = int(np.argmin(np.where(finite, curve.values, np.inf)))
                if curve.values[i] < self.min_loss:
                    self.min_loss, self.min_step = float(curve.values[i]), int(curve.steps[i])
        for f in record.findings(since_id=self.finding_count):
            self.findings.appendleft(f)
            self.finding_count += 1
            self.severities[str(f.severity)] += 1
            if f.detector == "sampler":  # 1: escalated (every interval capped); None: ended
                self.escalated = f.value == 1
        if time.monotonic() >= self._slow_due:
            self._read_sampled()

    def _read_sampled(self) -> None:
        """The sampled steps and the latest gradient norms since the last read (still
        the heaviest reads: at most ~10% of the time)."""
        began = time.monotonic()
        sampled = self.record.sampled(since=self._sampled_last)
        if not len(sampled.steps):
            self._slow_due = began + 10 * (time.monotonic() - began)
            return
        self._sampled_last = int(sampled.steps[-1])
        self.interval = int(sampled.interval[-1])
        known = sampled.lr[np.isfinite(sampled.lr)]
        self.lr = float(known[-1]) if len(known) else math.nan
        if self.epoch is None:
            self.epoch = int(sampled.epochs[-1])
        grads = self.record.layers("grad_norm", since=self.grad_step)
        if len(grads.steps):
            self.grad_step = int(grads.steps[-1])
            self.grad_names, self.grad_values = grads.names, grads.latest()
        self._slow_due = began + 10 * (time.monotonic() - began)


class _View:
    """Draws a :class:`_Follower` as one panel that fits the terminal."""

    def __init__(self, follower: _Follower, *, every: float, stale_after: float) -> None:
        self.f = follower
        self.every = every
        self.stale_after = stale_after

    def render(self, width: int, height: int | None, *, live: bool) -> RenderableType:
        """The frame for a ``width`` x ``height`` terminal (``height`` None: unbounded)."""
        f = self.f
        inner = max(width - 4, 20)  # the panel's border and padding
        head = Table.grid(padding=(0, 1), expand=True)
        head.add_column(style="bold", width=_LABEL, no_wrap=True)
        head.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        head.add_row("run", self._run_line())
        head.add_row("step", self._step_line())
        head.add_row("loss", self._loss_line())
        columns = inner - _LABEL - 1
        values = f.loss.values
        if len(values) > columns:
            head.add_row("whole run", sparkline(values, columns))
            head.add_row(f"last {columns}", sparkline(values[-columns:], columns))
        else:
            head.add_row("", sparkline(values, columns))
        parts: list[RenderableType] = [head]
        used = head.row_count + 2 + 1 + 1  # the panel's border, two section titles
        if f.error:  # the whole sentence, wrapped
            error = Text.assemble(("unreadable now: ", "bold red"), (f.error, "red"))
            parts.insert(0, error)
            used += -(-len(error) // inner)
        used += min(len(f.findings), FINDINGS_SHOWN)
        rows = None if height is None else max(height - used, 2)
        parts += [*self._gradients(inner, rows), *self._findings()]
        subtitle = None
        if live:
            subtitle = f"refresh every {self.every:g} s · Ctrl-C leaves"
            if f.finished:
                subtitle = f"the run finished · {subtitle}"
        return Panel(
            Group(*parts),
            title=Text.assemble(("stethoscope watch", "bold"), " · ", str(f.path)),
            title_align="left",
            subtitle=subtitle,
            subtitle_align="right",
            border_style="red" if f.error or f.severities["error"] else "blue",
            padding=(0, 1),
            width=width,
        )

    def _run_line(self) -> Text:
        f = self.f
        if f.finished:
            text = Text("finished", "bold green")
        elif f.stale > self.stale_after:
            text = Text(f"no update for {_duration(f.stale)}", "bold yellow")
        else:
            text = Text("running", "bold cyan")
        text.append(f" · {f.meta.get('framework', '?')}")
        if f.model:
            text.append(f" · {f.model}")
        text.append(f" · {f.path}", "dim")
        return text

    def _step_line(self) -> Text:
        f = self.f
        if not f.loss.n:
            return Text("no step recorded yet", "dim")
        text = Text(f"{int(f.loss.steps[-1]):,}", "bold")
        text.append(f" · epoch {f.epoch}")
        if math.isfinite(f.lr):
            text.append(f" · lr {f.lr:.3g}")
        text.append(" · ")
        if f.interval is None:
            text.append("detectors not sampled yet", "dim")
        elif f.interval == 1 and (f.base_interval is None or f.base_interval > 1):
            if f.escalated:
                text.append("every step (escalated)", "bold yellow")
            else:  # the calibration at the start of a run, not a suspicion
                text.append("every step (warming up)")
        elif f.interval == 1:
            text.append("detectors every step")
        else:
            text.append(f"detectors every {f.interval} steps")
            if f.base_interval is not None and f.interval < f.base_interval:
                text.append(f" (backing off to {f.base_interval})", "yellow")
        return text

    def _loss_line(self) -> Text:
        f = self.f
        if not f.loss.n:
            return Text("—", "dim")
        latest = float(f.loss.values[-1])
        text = Text(_number(latest), "bold red" if not math.isfinite(latest) else "bold")
        if f.min_step >= 0:
            text.append(f" · min {_number(f.min_loss)} at step {f.min_step:,}")
        if f.nonfinite:
            plural = "s" if f.nonfinite > 1 else ""
            text.append(f" · {f.nonfinite:,} non-finite step{plural}", "bold red")
        return text

    def _gradients(self, inner: int, rows: int | None) -> list[RenderableType]:
        f = self.f
        title = _line(Text("gradient flow", "bold"))
        values = f.grad_values
        if not len(values):
            title.append(" · not measured yet", "dim")
            return [title]
        logs = np.log10(values[np.isfinite(values) & (values > 0)])
        # a decade below the smallest, so that it still has a bar
        lo = math.floor(logs.min()) - 1 if len(logs) else -8
        hi = max(math.ceil(logs.max()) if len(logs) else 0, lo + 1)
        title.append(f" · step {f.grad_step:,} · log10 of the norm, 1e{lo} to 1e{hi}", "dim")
        keep, more = _pick(values, rows)
        prefix = _shared_prefix(f.grad_names)
        if prefix:
            title.append(f" · under {prefix}", "dim")
        names = [n[len(prefix) :] for n in f.grad_names]
        name_width = min(max(len(n) for n in names), max(inner * 2 // 5, 12))
        bar_width = max(inner - name_width - 10 - 2, 4)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=name_width, no_wrap=True)
        grid.add_column(width=bar_width, no_wrap=True)
        grid.add_column(width=10, no_wrap=True, justify="right")
        for i in keep:
            name, v = names[i], float(values[i])
            name = name_tail(name, name_width)
            style = _grad_style(v)
            if not math.isfinite(v):
                bar = Text("!", "bold red")
            elif v <= 0:
                bar = Text("")
            else:
                bar = Text(_bar((math.log10(v) - lo) / (hi - lo), bar_width), style or "green")
            grid.add_row(name, bar, Text(_number(v, sci=True), style or ""))
        parts: list[RenderableType] = [title, grid]
        if more:
            parts.append(Text(f"… {more} more", "dim"))
        return parts

    def _findings(self) -> list[RenderableType]:
        f = self.f
        title = _line(Text("findings", "bold"))
        if not f.finding_count:
            title.append(" · none" if f.finished else " · none yet", "dim")
            return [title]
        counts = ", ".join(
            f"{f.severities[s]} {s}{'s' if f.severities[s] > 1 and s != 'info' else ''}"
            for s in ("error", "warning", "info")
            if f.severities[s]
        )
        title.append(f" · {f.finding_count:,} ({counts}), newest first", "dim")
        lines: list[RenderableType] = [title]
        digits = max(len(f"{x.step:,}") for x in f.findings)
        for x in f.findings:
            severity = str(x.severity)
            line = _line(Text(f"{x.step:>{digits},} "))
            line.append(f"{severity:<7} ", _SEVERITY_STYLE.get(severity, ""))
            line.append(x.detector, "bold")
            if x.where:
                line.append(f" @ {x.where}", "dim")
            line.append("  " + " ".join(x.message.split()))
            lines.append(line)
        return lines


def _line(text: Text) -> Text:
    """One line, cut with an ellipsis at the edge rather than wrapped."""
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def sparkline(values: np.ndarray, columns: int) -> Text:
    """``values`` in at most ``columns`` bins of consecutive steps, one block per bin:
    the mean of its finite values, scaled between the bins' lowest and highest; a bin
    holding a NaN or an Inf is a red ``!``."""
    values = np.asarray(values, np.float64)
    n = len(values)
    columns = min(columns, n)
    if columns <= 0:
        return Text("no loss recorded yet", "dim")
    starts = np.linspace(0, n, columns + 1).astype(np.int64)
    finite = np.isfinite(values)
    sums = np.add.reduceat(np.where(finite, values, 0.0), starts[:-1])
    counts = np.add.reduceat(finite.astype(np.int64), starts[:-1])
    bad = counts < np.diff(starts)
    ok = counts > 0
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=ok)
    levels = np.zeros(columns, np.int64)
    if ok.any():
        lo, hi = means[ok].min(), means[ok].max()
        if hi > lo:
            levels = np.rint((means - lo) / (hi - lo) * (len(_BLOCKS) - 1)).astype(np.int64)
        else:
            levels[:] = len(_BLOCKS) // 2
    text = Text()
    for i in range(columns):
        if bad[i]:
            text.append("!", "bold red")
        else:
            text.append(_BLOCKS[int(np.clip(levels[i], 0, len(_BLOCKS) - 1))], "cyan")
    return text


def _pick(values: np.ndarray, rows: int | None) -> tuple[list[int], int]:
    """The parameters to list in ``rows`` lines (one kept for "… N more"): every unusual
    one, then an even spread across depth; and how many are left out."""
    n = len(values)
    if rows is None or n <= rows:
        return list(range(n)), 0
    room = max(rows - 1, 1)
    with np.errstate(invalid="ignore"):
        unusual = np.flatnonzero(~np.isfinite(values) | (values < SMALL) | (values > LARGE))
    chosen = set(unusual[:room].tolist())
    spread = room - len(chosen)
    if spread > 0:
        chosen.update(np.linspace(0, n - 1, spread).round().astype(int).tolist())
    for i in range(n):  # the spread hit unusual ones twice: fill up in order
        if len(chosen) >= room:
            break
        chosen.add(i)
    return sorted(chosen), n - len(chosen)


def _bar(fraction: float, width: int) -> str:
    """A horizontal bar of ``fraction`` of ``width`` cells, in eighths, at least one."""
    eighths = max(round(min(max(fraction, 0.0), 1.0) * width * 8), 1)
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


def _grad_style(v: float) -> str | None:
    if not math.isfinite(v):
        return "bold red"
    if v > LARGE:
        return "red"
    if v < SMALL:
        return "yellow"
    return None


def _number(v: float, *, sci: bool = False) -> str:
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if v == 0:
        return "0"
    if not sci and 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.2e}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "ever"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _describe(config_text: str | None) -> tuple[str | None, int | None]:
    """The model's class and size, and the sampled detectors' shortest base interval
    (None when the record does not say), from the run's configuration."""
    try:
        config = json.loads(config_text) if config_text else {}
    except ValueError:
        return None, None
    if not isinstance(config, dict):
        return None, None
    model = config.get("model")
    if isinstance(model, dict):
        name, total = model.get("class"), model.get("total")
        model = f"{name} ({total:,} parameters)" if isinstance(total, int) else name
    base = None
    detectors = config.get("detectors")
    if isinstance(detectors, dict):
        everies: Sequence[int] = [
            d["every"]
            for d in detectors.values()
            if isinstance(d, dict) and isinstance(d.get("every"), int) and not d.get("idle")
        ]
        sampled = [e for e in everies if e > 1]
        base = min(sampled) if sampled else (1 if everies else None)
    return (str(model) if model else None), base


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _shared_prefix(names: Sequence[str]) -> str:
    """The module path every name starts with (``model.transformer.``), up to and with
    its last separator: it says nothing about a row and eats a narrow terminal."""
    if len(names) < 2:
        return ""
    first, last = min(names), max(names)  # what these two share, every name shares
    same = 0
    while same < min(len(first), len(last)) and first[same] == last[same]:
        same += 1
    common = first[:same]
    cut = max(common.rfind("."), common.rfind("/"))
    return common[: cut + 1]
