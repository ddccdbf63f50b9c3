"""The ``stethoscope`` command: ``report`` draws a run's record, ``watch`` follows it live."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stethoscope.record.store import RecordError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stethoscope",
        description="Look at what stethoscope recorded during training (record='runs/NAME').",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report", help="write one self-contained HTML report of a run (and PNG figures)"
    )
    report.add_argument("record", help="the run's record directory, e.g. runs/NAME")
    report.add_argument(
        "-o", "--output", help="the HTML file to write (default: RECORD/report.html)"
    )
    report.add_argument("--png", metavar="DIR", help="also write each figure as a PNG in DIR")
    watch = commands.add_parser(
        "watch", help="follow a run from another terminal while it trains (Ctrl-C leaves)"
    )
    watch.add_argument("record", help="the run's record directory, e.g. runs/NAME")
    watch.add_argument(
        "--every", type=float, default=1.0, metavar="SECONDS", help="refresh interval"
    )
    watch.add_argument("--once", action="store_true", help="draw the current state once and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (2: the record cannot be read or the
    report cannot be written; 1: what the report needs is not installed)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from stethoscope.record.report import write_report

            written = write_report(args.record, output=args.output, png_dir=args.png)
            for path in written:
                print(path)
        else:
            from stethoscope.record.watch import watch

            watch(args.record, every=args.every, once=args.once)
    except RecordError as exc:
        print(f"stethoscope: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the record was read (a RecordError otherwise): the output
        where = exc.filename if exc.filename is not None else "the report"
        print(f"stethoscope: cannot write {where}: {exc.strerror or exc}.", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # plotly, kaleido or a browser for the PNGs is missing
        print(f"stethoscope: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # python -m stethoscope.cli
    sys.exit(main())
