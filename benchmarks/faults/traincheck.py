"""The TrainCheck family: silent training bugs from public reports, each rebuilt in
Lightning from its mechanism beside a healthy twin that differs only by the fix.

TrainCheck (Jiang et al., OSDI 2025) reproduced silent bugs from real reports: training
that goes on without an error and learns wrongly (its workloads:
``OrderLab/TrainCheck-Evaluation-Workloads``, ``silent-issue-detection/bug-reprod-scripts``).
Eleven of them can be rebuilt as small trainings on a CPU, seven in one process
(``traincheck_models.py``) and four on two DDP ranks over gloo (``traincheck_ddp.py``,
started once for all of them). Each is read from its report and scripts and rebuilt from
the mechanism, not copied: the models are small and the data synthetic. stethoscope
watches every fit with its defaults (``stop_on="error"``: an error ends the fit).

A bug is *named* when a detector it expects reports a warning or an error (an error where
the row says so) whose message names the cause (the row's phrases); a twin must report no
warning and no error at all. The table gives, for each bug, what stethoscope reported
first of the expected detectors (detector, severity, step, the message's first words)
and what it reported on the twin.

Run::

    OMP_NUM_THREADS=1 python -m benchmarks.faults.traincheck
    OMP_NUM_THREADS=1 python -m benchmarks.faults.traincheck --only pytorch-51800,deepspeed-1801
    OMP_NUM_THREADS=1 python -m benchmarks.faults.traincheck --markdown --json runs/traincheck.json

Exit status 0 when at least 10 of the bugs run are named (all of them, with ``--only``)
and no twin raised a warning or an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUGS", "Bug", "Row", "render", "run_family"]


@dataclass(frozen=True)
class Bug:
    """One reproduced report and what stethoscope must say of it.

    Args:
        name: The report's directory in the TrainCheck workloads.
        report: Where it was reported.
        bug: The mechanism, in a few words.
        twin: The healthy twin: the same code with the fix.
        expected: The detectors that name it (any of them).
        says: Phrases the finding's message must hold (case-insensitive): its cause.
        severity: The least severity that counts.
        ranks: Whether it runs on two DDP ranks.
    """

    name: str
    report: str
    bug: str
    twin: str
    expected: tuple[str, ...]
    says: tuple[str, ...]
    severity: str = "warning"
    ranks: bool = False


BUGS: tuple[Bug, ...] = (
    Bug(
        "pytorch-115607",
        "https://github.com/pytorch/pytorch/issues/115607",
        "Adam's step traced by dynamo on a step with no gradients replays that no-op",
        "no optimizer step where no gradient exists",
        ("frozen_weights", "small_updates"),
        ("does not reach these tensors",),
    ),
    Bug(
        "stackoverflow-60335387",
        "https://stackoverflow.com/questions/60335387",
        "a hand-written loop (MNIST CNN, Adam 1e-4) without optimizer.zero_grad()",
        "zero_grad() every step",
        ("unzeroed_gradients",),
        ("never zeroed", "zero_grad"),
    ),
    Bug(
        "stackoverflow-67180955",
        "https://stackoverflow.com/questions/67180955",
        "2 loader workers copy the dataset's numpy generator: the same random samples",
        "worker_init_fn reseeds each worker's generator",
        ("repeated_data",),
        ("workers serve the same batches", "worker_init_fn"),
    ),
    Bug(
        "pytorch-104336",
        "https://github.com/pytorch/pytorch/issues/104336",
        "the model's data moved away and back after DDP wrapped it: its hooks are gone",
        "offloaded and restored in place",
        ("replica_divergence",),
        ("diverged", "not all-reduced"),
        ranks=True,
    ),
    Bug(
        "x-jxmnop-ddp-out-of-sync",
        "https://x.com/jxmnop/status/1778520637193240892",
        "every other step's backward goes around the DDP wrapper",
        "every backward through the strategy",
        ("replica_divergence",),
        ("diverged", "not all-reduced", "bypassed the ddp wrapper"),
        ranks=True,
    ),
    Bug(
        "pytorch-84803",
        "https://github.com/pytorch/pytorch/issues/84803",
        "an all-reduce whose received data a rank loses (5% of buckets)",
        "the same hook, lossless",
        ("replica_divergence",),
        ("diverged", "not all-reduced", "communication hook"),
        ranks=True,
    ),
    Bug(
        "deepspeed-1801",
        "https://github.com/microsoft/DeepSpeed/pull/1801",
        "clipping skips the replicated layer-norm gradients off rank 0",
        "the rank test only where the norm is computed",
        ("replica_divergence",),
        ("diverged", "not all-reduced", "clipping"),
        ranks=True,
    ),
    Bug(
        "pytorch-forum-84911",
        "https://discuss.pytorch.org/t/obtaining-abnormal-changes-in-loss-and-accuracy/84911",
        "the optimizer holds only the new head, and the head is frozen",
        "the head trains; the optimizer over what requires grad",
        ("frozen_weights",),
        ("nothing trains", "requires_grad=false"),
        severity="error",
    ),
    Bug(
        "transformers-33844",
        "https://github.com/huggingface/transformers/pull/33844",
        "attention's dropout_p passed whatever the mode: validation drops",
        "dropout_p=0.0 unless training",
        ("validation_mode",),
        ("dropout_p>0", "eval mode"),
    ),
    Bug(
        "pytorch-51800",
        "https://github.com/pytorch/pytorch/issues/51800",
        "spectral_norm evaluated (validate() before fit) before any training-mode forward",
        "one training-mode forward first",
        ("validation_mode",),
        ("spectral", "power iteration", "training-mode forward"),
    ),
    Bug(
        "mmpretrain-702",
        "https://github.com/open-mmlab/mmpretrain/issues/702",
        "frozen stages frozen in a train() override Lightning never calls",
        "frozen in __init__ too",
        ("train_override",),
        ("train() is never called", "__init__"),
    ),
)

_ORDER = {"info": 0, "warning": 1, "error": 2}


@dataclass
class Row:
    """What stethoscope reported on one bug and on its twin (findings as dicts)."""

    bug: Bug
    found: list[dict[str, Any]] = field(default_factory=list)
    twin_found: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def naming(self) -> dict[str, Any] | None:
        """The first finding that names the bug, or None."""
        return next((f for f in self.found if _names(self.bug, f)), None)

    @property
    def named(self) -> bool:
        return self.naming is not None

    @property
    def twin_alarms(self) -> list[dict[str, Any]]:
        return [f for f in self.twin_found if _ORDER[f["severity"]] >= 1]

    @property
    def ok(self) -> bool:
        return self.named and not self.twin_alarms


def _names(bug: Bug, finding: dict[str, Any]) -> bool:
    message = finding["message"].lower()
    return (
        finding["detector"] in bug.expected
        and _ORDER[finding["severity"]] >= _ORDER[bug.severity]
        and all(phrase in message for phrase in bug.says)
    )


# -- running -------------------------------------------------------------------------------
def _quiet() -> None:
    """Lightning's banners and hints, and the loader's, are not what the table is about
    (set after Lightning's import, which sets its loggers' levels)."""
    import lightning  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_one(name: str, *, buggy: bool) -> list[dict[str, Any]]:
    """Fit one bug of one process (or its twin) under stethoscope; its findings."""
    import lightning as L

    from benchmarks.faults.lightning_suite import ON_ONE_CPU
    from benchmarks.faults.traincheck_models import BUILDERS
    from stethoscope import LightningStethoscope
    from stethoscope.testing import CapturingSink

    model, data, val, trainer_kw = BUILDERS[name](buggy)
    validate_first = trainer_kw.pop("validate_first", False)  # an evaluation before training
    sink = CapturingSink()
    trainer = L.Trainer(
        max_epochs=-1,
        **ON_ONE_CPU,
        callbacks=[LightningStethoscope(sinks=[sink])],
        **({"limit_val_batches": 0} if val is None else {}),
        **trainer_kw,
    )
    if validate_first:
        trainer.validate(model, val, verbose=False)
    trainer.fit(model, data, val)
    return [f.to_dict(json_safe=True) for f in sink.findings]


def _read_ranks(out: Path, name: str, kind: str) -> list[dict[str, Any]]:
    path = out / f"{name}-{kind}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_family(
    only: Sequence[str] | None = None, *, timeout: float = 300.0, printer: Any = None
) -> list[Row]:
    """Run every bug (those of ``only``) and its twin; the rows in :data:`BUGS`' order.

    The bugs of one process are fitted here, one after another; those on ranks in one
    launch of two processes, which go through all of them in turn."""
    from benchmarks.faults.traincheck_ddp import launch

    _quiet()
    bugs = [b for b in BUGS if not only or b.name in only]
    rows = {b.name: Row(b) for b in bugs}
    say = printer or (lambda line: None)
    ranked = [b.name for b in bugs if b.ranks]
    if ranked:
        with tempfile.TemporaryDirectory(prefix="traincheck-") as tmp:
            start = time.perf_counter()
            runs = [f"{name}:{kind}" for name in ranked for kind in ("bug", "twin")]
            launch(runs, Path(tmp), timeout=timeout)
            each = (time.perf_counter() - start) / len(ranked)
            for name in ranked:
                row = rows[name]
                row.found = _read_ranks(Path(tmp), name, "bug")
                row.twin_found = _read_ranks(Path(tmp), name, "twin")
                row.seconds = each
                say(f"{name}: {'named' if row.named else 'not named'} (2 ranks)")
    for bug in bugs:
        if bug.ranks:
            continue
        start = time.perf_counter()
        row = rows[bug.name]
        row.found = run_one(bug.name, buggy=True)
        row.twin_found = run_one(bug.name, buggy=False)
        row.seconds = time.perf_counter() - start
        say(f"{bug.name}: {'named' if row.named else 'not named'}")
    return [rows[b.name] for b in bugs]


# -- the table -------------------------------------------------------------------------------
def _said(finding: dict[str, Any] | None, words: int = 9) -> str:
    if finding is None:
        return "-"
    first = " ".join(finding["message"].split()[:words])
    return f"{finding['detector']} {finding['severity']}@{finding['step']}: {first} ..."


def _found_cell(row: Row) -> str:
    if row.named:
        return _said(row.naming)
    alarms = [f for f in row.found if _ORDER[f["severity"]] >= 1]
    return f"NOT NAMED; {_said(alarms[0]) if alarms else 'nothing'}"


def _twin_cell(row: Row) -> str:
    alarms = row.twin_alarms
    if not alarms:
        return "quiet"
    return f"{len(alarms)} ALARM(S): {_said(alarms[0], 6)}"


def render(rows: Sequence[Row], *, markdown: bool = False) -> str:
    """The table: each bug, its expected detectors, what was found on it and on its twin,
    and the count of bugs named and twins quiet."""
    head = ("bug", "expected", "found on the bug", "twin (the fix)")
    body = [
        (
            row.bug.name,
            " | ".join(row.bug.expected) if not markdown else " or ".join(row.bug.expected),
            _found_cell(row),
            f"{_twin_cell(row)} ({row.bug.twin})",
        )
        for row in rows
    ]
    named = sum(r.named for r in rows)
    quiet = sum(not r.twin_alarms for r in rows)
    total = f"{named}/{len(rows)} named, {quiet}/{len(rows)} twins quiet"
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in body]
        return "\n".join([*lines, "", total])
    widths = [max(len(str(r[i])) for r in (head, *body)) for i in range(2)]
    pad = " " * (widths[0] + widths[1] + 4)
    lines = [f"{head[0]:<{widths[0]}}  {head[1]:<{widths[1]}}  {head[2]}", f"{pad}twin: ..."]
    for r in body:
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}")
        lines.append(f"{pad}twin: {r[3]}")
    return "\n".join([*lines, "", total])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.traincheck",
        description="Rebuild TrainCheck's silent bugs beside their healthy twins and report "
        "what stethoscope says on each.",
    )
    p.add_argument("--only", default="", help="comma-separated bug names (default: all)")
    p.add_argument("--markdown", action="store_true", help="print a GitHub-markdown table")
    p.add_argument("--json", metavar="PATH", help="write every finding of every run")
    p.add_argument("--list", action="store_true", help="list the bugs and exit")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the DDP ranks")
    args = p.parse_args(argv)
    known = {b.name for b in BUGS}
    args.only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(args.only) - known)
    if unknown:
        p.error(f"unknown bugs {unknown}; choose among {sorted(known)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.list:
        for b in BUGS:
            where = "2 DDP ranks" if b.ranks else "1 process"
            print(f"{b.name} ({where}): {b.bug}; expected {' or '.join(b.expected)}")
            print(f"    twin: {b.twin}; {b.report}")
        return 0
    start = time.perf_counter()
    rows = run_family(args.only, timeout=args.timeout, printer=lambda s: print(s, flush=True))
    print()
    print(render(rows, markdown=args.markdown))
    print(f"{2 * len(rows)} fits in {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        runs = [
            {
                **{k: v for k, v in asdict(r.bug).items()},
                "named": r.named,
                "found": r.found,
                "twin_found": r.twin_found,
            }
            for r in rows
        ]
        Path(args.json).write_text(json.dumps(runs, indent=1))
    needed = len(rows) if args.only else 10
    good = sum(r.named for r in rows) >= needed and all(not r.twin_alarms for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
