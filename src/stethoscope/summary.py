"""The epoch summary: plain data that renders itself as a rich table."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

__all__ = ["EpochSummary", "SummaryRow", "epoch_extent", "name_tail"]

_STATUS_STYLE = {"ok": "green", "info": "cyan", "warning": "yellow", "error": "bold red"}
#: Consoles at least this wide get the table; narrower ones, a list of rows.
WIDE = 100
_WHERE = 18  # characters of a place in the table: longer ones keep their end


@dataclass(frozen=True)
class SummaryRow:
    """One line of the summary table.

    Args:
        detector: Detector name, or a list of names for the folded "ok" row.
        status: ``ok``, ``info``, ``warning`` or ``error``: the worst this epoch.
        count: Findings this epoch, repeats included.
        value: The worst value seen this epoch.
        threshold: The bound that value is judged against.
        where: Where the worst value was seen.
        interval: The detector's current sampling interval in steps.
        verdict: One line: what it means.
    """

    detector: str
    status: str
    count: int = 0
    value: float | None = None
    threshold: float | None = None
    where: str | None = None
    interval: int | None = None
    verdict: str = ""


def epoch_extent(count: int, first: int | None, last: int | None) -> str:
    """How long an epoch of ``count`` judged steps, ``first`` to ``last``, was, in the
    findings' unit: "N steps", or, where the step count moves by more than one a batch
    (Lightning's manual optimization counts each optimizer's step), "N batches, steps
    A–B", so that the findings' step numbers fall inside what the summary says."""
    if first is None or last is None or last - first + 1 == count:
        return f"{count} steps"
    return f"{count} batches, steps {first}–{last}"


@dataclass(frozen=True)
class EpochSummary:
    """What the monitor saw during one training epoch.

    Args:
        epoch: The epoch (0-based).
        steps: Optimizer steps seen this epoch.
        rows: Detectors with findings first (worst first), then one folded row
            for the quiet ones.
        verdict: One line for the whole epoch.
        stopped_by: The finding that stopped training, if it did.
        quiet: Detectors that found nothing this epoch (folded into one row).
        dropped: Findings each sink had to give up on so far in the run (its
            destination kept failing and its buffer was full), by sink; only sinks
            that dropped something are listed.
        first_step: The first step judged this epoch (None: none).
        last_step: The last one.
    """

    epoch: int
    steps: int
    rows: tuple[SummaryRow, ...] = field(default_factory=tuple)
    verdict: str = ""
    stopped_by: dict[str, Any] | None = None
    quiet: tuple[str, ...] = ()
    dropped: dict[str, int] = field(default_factory=dict)
    first_step: int | None = None
    last_step: int | None = None

    @property
    def extent(self) -> str:
        """How long the epoch was (see :func:`epoch_extent`)."""
        return epoch_extent(self.steps, self.first_step, self.last_step)

    @property
    def status(self) -> str:
        """The worst status among the rows (``ok`` when there are none)."""
        order = ("ok", "info", "warning", "error")
        return max((r.status for r in self.rows), key=order.index, default="ok")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # a table of seven columns needs ~100 columns; narrower, it would cut names in
        # half and wrap each verdict over ten lines: a list of rows instead
        if options.max_width < WIDE:
            yield self._narrow(options.max_width)
        else:
            yield self._table()

    def _caption(self, quiet_names: bool = True) -> str:
        caption = self.verdict
        if quiet_names and self.quiet and any(r.status != "ok" for r in self.rows):
            caption += "\nQuiet: " + ", ".join(self.quiet)
        if self.dropped:
            lost = ", ".join(f"{name} {n}" for name, n in self.dropped.items())
            caption += f"\nSinks dropped findings they could not write: {lost}."
        return caption

    def _narrow(self, width: int) -> Group:
        """Each row as a line of its own (status, detector, count, worst, where; names
        never split: a long place loses its start), its verdict indented below."""
        lines: list[Any] = [Text(f"stethoscope · epoch {self.epoch} · {self.extent}", "bold")]
        for row in self.rows:
            head = Text(f"{row.status:<8}", _STATUS_STYLE.get(row.status, ""))
            head.append(row.detector)
            if row.count:
                head.append(f"  n={row.count}")
            worst = _value_vs_threshold(row.value, row.threshold)
            if worst:
                head.append(f"  {worst}")
            if row.where:
                room = width - len(head.plain) - 5
                head.append(f"  at {name_tail(row.where, max(room, 12))}")
            head.no_wrap, head.overflow = True, "ellipsis"
            lines.append(head)
            if row.verdict:
                lines.append(Padding(Text(row.verdict), (0, 0, 0, 8)))
        # the quiet detectors' names would take six lines at 80 columns: their row ("29
        # others") counts them, and the wide table and the record name them
        lines.append(Text(self._caption(quiet_names=False)))
        return Group(*lines)

    def _table(self) -> Table:
        caption = self._caption()
        table = Table(
            title=f"stethoscope · epoch {self.epoch} · {self.extent}",
            caption=Text(caption),
            caption_justify="left",
            expand=False,
        )
        table.add_column("detector", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("n", justify="right")
        table.add_column("worst / limit", justify="right")
        table.add_column("where", no_wrap=True, max_width=_WHERE)
        table.add_column("every", justify="right", no_wrap=True)
        table.add_column("verdict", ratio=1)
        for row in self.rows:
            # Text, not str: names like "blocks[0].w" must not be parsed as rich markup
            table.add_row(
                Text(row.detector),
                Text(row.status, style=_STATUS_STYLE.get(row.status, "")),
                str(row.count) if row.count else "·",
                _value_vs_threshold(row.value, row.threshold),
                Text(name_tail(row.where or "", _WHERE)),  # whole names, or their end
                f"{row.interval}" if row.interval is not None else "",
                Text(row.verdict),
            )
        return table


def name_tail(name: str, room: int) -> str:
    """``name`` whole, or its end after an ellipsis, in ``room`` characters: the end of a
    parameter's name says which one it is."""
    return name if len(name) <= room else "…" + name[len(name) - room + 1 :]


def format_number(x: float | None) -> str:
    """Short human form: 3 significant digits, nan/inf spelled out."""
    if x is None:
        return ""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def _value_vs_threshold(value: float | None, threshold: float | None) -> str:
    if value is None and threshold is None:
        return ""
    if threshold is None:
        return format_number(value)
    return f"{format_number(value)} / {format_number(threshold)}"
