"""ConsoleSink: one coloured line per finding, and the epoch summary table."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import rich
from rich.console import Console
from rich.text import Text

from stethoscope.findings import Severity
from stethoscope.sinks.base import RunContext, Sink

if TYPE_CHECKING:
    from rich.console import RenderableType

    from stethoscope.findings import Finding
    from stethoscope.summary import EpochSummary

__all__ = ["ConsoleSink"]

_TAG_STYLE = {Severity.INFO: "cyan", Severity.WARNING: "yellow", Severity.ERROR: "bold red"}
_TAG_WIDTH = max(len(s.value) for s in Severity)  # tags line up: "INFO   ", "WARNING"


class ConsoleSink(Sink):
    """Prints findings as compact coloured lines and each epoch's summary table.

    A line reads ``WARNING step 120 exploding_gradients at layer1.weight: <message>``.

    Training frameworks draw progress bars, and text printed straight to stdout
    garbles them. So the sink renders everything to a string (ANSI colours
    included, at the width of the target console) and hands it to a printer: by
    default the target console, and during training the progress bar's own print,
    which the run's context brings (:meth:`start`).

    Args:
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        show_summary: Print each epoch's summary at its end.
        verbose: The full summary table for every epoch. By default a quiet epoch (no
            warning and no error) costs one line: what was checked, how often, that
            nothing was found; the table comes when something happened.
        console: The rich console to print to and whose width and colour support
            to render for; ``None`` uses rich's global console (``rich.get_console()``).

    Raises:
        ValueError: ``min_severity`` is not a severity.
        TypeError: ``show_summary`` is not a bool, or ``console`` is not a
            ``rich.console.Console``.

    Example:
        >>> sink = ConsoleSink(min_severity="warning")
        >>> LightningStethoscope(sinks=[sink])  # doctest: +SKIP

        A pickled copy prints to rich's global console: a console and a progress
        bar's print belong to one process.
    """

    def __init__(
        self,
        *,
        min_severity: Severity | str = "info",
        show_summary: bool = True,
        verbose: bool = False,
        console: Console | None = None,
    ) -> None:
        super().__init__(min_severity=min_severity)
        for name, value in (("show_summary", show_summary), ("verbose", verbose)):
            if not isinstance(value, bool):
                raise TypeError(f"ConsoleSink: {name}={value!r} must be True or False")
        if console is not None and not isinstance(console, Console):
            raise TypeError(
                f"ConsoleSink: console={console!r} must be a rich.console.Console or None"
            )
        self.show_summary = show_summary
        self.verbose = verbose
        self._console = console
        self._printer: Callable[[str], None] | None = None

    @property
    def console(self) -> Console:
        """The console printed to and rendered for."""
        # Looked up on use, not in __init__: a copy made in another process must find
        # that process's console, and rich's global one follows sys.stdout.
        return self._console if self._console is not None else rich.get_console()

    def start(self, context: RunContext) -> None:
        """Print through the run's printer (the progress bar's) until :meth:`close`."""
        self.use_printer(context.printer)

    def use_printer(self, fn: Callable[[str], None] | None) -> None:
        """Send rendered output to ``fn`` instead of the console, or back with ``None``.

        :meth:`start` passes the run's printer: the progress bar's print (Lightning's
        ``ProgressBar.print``), which prints above the bar instead of through it.

        Args:
            fn: Called with each rendered finding line or summary table: a string
                that may hold ANSI colour codes and newlines, without a trailing
                newline (``print`` adds one). ``None`` restores the console.

        Raises:
            TypeError: ``fn`` is neither callable nor ``None``.
        """
        if fn is not None and not callable(fn):
            raise TypeError(f"ConsoleSink.use_printer: fn={fn!r} must be callable or None")
        self._printer = fn

    def emit(self, finding: Finding) -> None:
        """Print one line for ``finding`` if it is at or above ``min_severity``."""
        if not self.accepts(finding):
            return
        self._print(_line(finding))

    def epoch_end(self, summary: EpochSummary) -> None:
        """Print the epoch's summary, if ``show_summary``: one line for a quiet epoch
        (unless ``verbose``), the table otherwise."""
        if not self.show_summary:
            return
        if self.verbose or summary.status in ("warning", "error") or summary.dropped:
            self._print(summary)
        else:
            self._print(Text(f"stethoscope · epoch {summary.epoch} · {summary.verdict}"))

    def close(self) -> None:
        """Let go of the progress bar's printer. Safe to call more than once.

        The sink holds nothing else: a finding emitted later still prints, to the
        console.
        """
        self._printer = None

    def __repr__(self) -> str:
        return (
            f"ConsoleSink(min_severity={self.min_severity.value!r}, "
            f"show_summary={self.show_summary!r}, verbose={self.verbose!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # A Console holds a file and locks, the printer is bound to a progress bar:
        # neither can cross to another process.
        state = self.__dict__.copy()
        state.pop("_console", None)
        state.pop("_printer", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._console = None
        self._printer = None

    def _print(self, renderable: RenderableType) -> None:
        """Render ``renderable`` for the target console and hand it to the printer."""
        target = self.console
        text = _render(renderable, target).removesuffix("\n")
        if self._printer is not None:
            self._printer(text)
        else:
            # Text.from_ansi keeps the colours and lets the console (or a rich Live
            # around it) place the output; soft_wrap stops a second wrapping of lines
            # already wrapped at this width.
            target.print(Text.from_ansi(text), soft_wrap=True)


def _line(finding: Finding) -> Text:
    """The one-line form of a finding."""
    severity = finding.severity
    # Text, not markup: a message or layer name with [brackets] must print as is.
    tag = severity.value.upper()
    line = Text.assemble(
        (tag, _TAG_STYLE[severity]),
        " " * (_TAG_WIDTH - len(tag)),
        f" step {finding.step} ",
        (finding.detector, "bold"),
    )
    if finding.where:
        line.append(" at ")
        line.append(finding.where, style="italic")
    line.append(": ")
    line.append(finding.message)
    return line


def _render(renderable: RenderableType, target: Console) -> str:
    """``renderable`` as a string with ANSI codes, as ``target`` would print it."""
    buffer = io.StringIO()
    Console(
        file=buffer,
        force_terminal=target.is_terminal,
        color_system=target.color_system,  # type: ignore[arg-type]
        no_color=target.no_color,
        width=target.width,
        safe_box=target.safe_box,
        # In a notebook rich would display() instead of writing to the buffer.
        force_jupyter=False,
        force_interactive=False,
        # We want ANSI codes in the string; the target converts them if it must.
        legacy_windows=False,
    ).print(renderable)
    return buffer.getvalue()
