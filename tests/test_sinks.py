"""The sink layer of the contract suite, then what each sink promises on its own."""

from __future__ import annotations

import csv
import inspect
import io
import json
import logging
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rich
from rich.console import Console

import stethoscope.sinks
from _sinkkit import tb_scalars
from stethoscope.findings import FIELDS, Finding, Severity
from stethoscope.sinks import (
    ConsoleSink,
    CSVSink,
    JSONLSink,
    LoggingSink,
    MLflowSink,
    Sink,
    TensorBoardSink,
)
from stethoscope.summary import EpochSummary, SummaryRow
from stethoscope.testing import CapturingSink

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def make_finding(step: int = 1, severity: str = "warning", **changes: Any) -> Finding:
    fields: dict[str, Any] = {
        "epoch": 0,
        "detector": "exploding_gradients",
        "message": "Gradient norm 12.5 exceeds 10; clip gradients.",
        "value": 12.5,
        "threshold": 10.0,
        "where": "layer1.weight",
    }
    fields.update(changes)
    return Finding(step=step, severity=severity, **fields)


def make_summary() -> EpochSummary:
    return EpochSummary(
        epoch=2,
        steps=50,
        rows=(
            SummaryRow(
                detector="exploding_gradients",
                status="warning",
                count=3,
                value=12.5,
                threshold=10.0,
                where="fc1.weight",
                interval=1,
                verdict="too large",
            ),
            SummaryRow(detector="loss_spike", status="ok", interval=10, verdict="quiet"),
        ),
        verdict="One warning this epoch.",
    )


def plain_console(width: int = 100) -> Console:
    """rich's own testing style: no colour, fixed width, output kept in memory."""
    return Console(file=io.StringIO(), width=width, color_system=None)


def colour_console(width: int = 100) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor")


def output(console: Console) -> str:
    return console.file.getvalue()  # type: ignore[attr-defined]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        assert reader.fieldnames == list(FIELDS)
    return rows


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "last line is cut"
    return [json.loads(line, parse_constant=_reject_constant) for line in text.splitlines()]


def finding_from_csv_row(row: dict[str, str]) -> Finding:
    def number(cell: str) -> float | None:
        return float(cell) if cell else None

    return Finding(
        step=int(row["step"]),
        epoch=int(row["epoch"]),
        detector=row["detector"],
        severity=row["severity"],
        message=row["message"],
        value=number(row["value"]),
        threshold=number(row["threshold"]),
        where=row["where"] or None,
        rank=int(row["rank"]),
    )


def comparable(finding: Finding) -> dict[str, Any]:
    """to_dict() with NaN spelled out, since nan != nan."""
    return {
        k: "nan" if isinstance(v, float) and math.isnan(v) else v
        for k, v in finding.to_dict().items()
    }


# --- the contract, over every sink -------------------------------------------------


@dataclass(frozen=True)
class Kit:
    """How to make one kind of sink in a test, and read back what it recorded."""

    name: str
    make: Callable[..., Sink]
    steps: Callable[[Any], list[int]]  # steps of the findings recorded, in order
    file_based: bool


SINK_NAMES = ["console", "csv", "jsonl", "capturing", "logging", "mlflow", "tensorboard"]


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """One real SQLite tracking store for the module (creating one takes seconds)."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.getbasetemp() / 'mlflow-contract.db'}"
    return uri, mlflow.MlflowClient(uri)


@pytest.fixture(params=SINK_NAMES)
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    made: list[Sink] = []

    def track(sink: Sink) -> Sink:
        made.append(sink)
        return sink

    def console_steps(sink: ConsoleSink) -> list[int]:
        return [int(s) for s in re.findall(r" step (\d+) ", output(sink.console))]

    name = request.param
    records: list[logging.LogRecord] = []
    handler: KeepAndDrop | None = None
    if name == "console":
        result = Kit(
            name, lambda **kw: ConsoleSink(console=plain_console(), **kw), console_steps, False
        )
    elif name == "csv":
        result = Kit(
            name,
            lambda **kw: track(CSVSink(tmp_path / "findings.csv", **kw)),
            lambda sink: [int(row["step"]) for row in read_csv(sink.path)],
            True,
        )
    elif name == "jsonl":
        result = Kit(
            name,
            lambda **kw: track(JSONLSink(tmp_path / "findings.jsonl", **kw)),
            lambda sink: [d["step"] for d in read_jsonl(sink.path)],
            True,
        )
    elif name == "logging":
        logger_name = f"stethoscope.test.{request.node.name}"
        handler = KeepAndDrop(records)
        logging.getLogger(logger_name).addFilter(handler)
        result = Kit(
            name,
            lambda **kw: LoggingSink(logger=logger_name, **kw),
            lambda sink: [r.step for r in records if hasattr(r, "finding")],
            False,
        )
    elif name == "mlflow":
        uri, client = request.getfixturevalue("mlflow_store")
        experiment = f"contract-{uuid.uuid4().hex}"
        client.create_experiment(experiment, artifact_location=str(tmp_path / "artifacts"))

        def mlflow_steps(sink: MLflowSink) -> list[int]:
            sink.flush()
            if sink.run_id is None:
                return []
            history = client.get_metric_history(sink.run_id, "stethoscope/exploding_gradients")
            return [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]

        result = Kit(
            name,
            lambda **kw: track(
                MLflowSink(tracking_uri=uri, experiment=experiment, flush_timeout=30, **kw)
            ),
            mlflow_steps,
            False,
        )
    elif name == "tensorboard":
        result = Kit(
            name,
            lambda **kw: track(TensorBoardSink(tmp_path / "tb", **kw)),
            lambda sink: [
                step for step, _ in tb_scalars(sink.log_dir, "stethoscope/exploding_gradients")
            ],
            True,
        )
    else:
        result = Kit(name, CapturingSink, lambda sink: [f.step for f in sink.findings], False)
    yield result
    for sink in made:
        sink.close()
    if handler is not None:
        logging.getLogger(f"stethoscope.test.{request.node.name}").removeFilter(handler)


class KeepAndDrop(logging.Filter):
    """Keeps each record its logger is asked to log, and lets none through to a handler:
    pytest's own capture would put a finding's lone surrogate into the test's report,
    which pytest-xdist cannot send to its controller."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


class ListHandler(logging.Handler):
    """Keeps the records it is handed: logging's own way to capture, no mocks."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(level=logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_is_a_sink_with_a_helpful_repr(kit: Kit) -> None:
    sink = kit.make()
    assert isinstance(sink, Sink)
    assert type(sink).__name__ in repr(sink)
    assert sink.dropped == 0


@pytest.mark.parametrize("bad", ["fatal", "WARNING", 3, None])
def test_bad_min_severity_names_the_value_and_the_choices(kit: Kit, bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"min_severity={bad!r}")) as info:
        kit.make(min_severity=bad)
    assert "'info', 'warning', 'error'" in str(info.value)


def test_min_severity_accepts_the_enum_and_its_value(kit: Kit) -> None:
    assert kit.make(min_severity=Severity.ERROR).min_severity is Severity.ERROR
    assert kit.make(min_severity="warning").min_severity is Severity.WARNING


def test_emit_flush_epoch_end_close_and_close_again(kit: Kit) -> None:
    sink = kit.make()
    for step in (1, 2, 3):
        sink.emit(make_finding(step))
    sink.flush()
    sink.epoch_end(make_summary())
    sink.flush()
    assert kit.steps(sink) == [1, 2, 3]
    sink.close()
    sink.close()
    assert kit.steps(sink) == [1, 2, 3]
    assert sink.dropped == 0


def test_min_severity_drops_what_is_below_it(kit: Kit) -> None:
    sink = kit.make(min_severity="warning")
    sink.emit(make_finding(1, "info"))
    sink.emit(make_finding(2, "warning"))
    sink.emit(make_finding(3, "error"))
    assert kit.steps(sink) == [2, 3]


def test_pickling_carries_the_options_and_the_copy_still_emits(
    kit: Kit, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = kit.make(min_severity="warning")
    sink.emit(make_finding(1))
    sink.flush()  # an MLflowSink knows its run after a flush; the copy then logs to it
    clone = pickle.loads(pickle.dumps(sink))
    try:
        assert type(clone) is type(sink)
        assert clone.min_severity is Severity.WARNING
        clone.emit(make_finding(2))
        clone.emit(make_finding(3, "info"))  # still filtered
        clone.flush()
        if kit.name == "console":
            # The copy cannot take the console along; it prints to rich's global one.
            assert " step 2 " in capsys.readouterr().out
        elif kit.name == "capturing":
            assert kit.steps(clone) == [1, 2]  # the copy carries what it captured
        else:
            # Files, TensorBoard, logging, MLflow: the copy writes to the same
            # destination (the same file, log dir, logger or run).
            assert kit.steps(clone) == [1, 2]
    finally:
        clone.close()


def test_emit_after_close(kit: Kit) -> None:
    # A callback reused for a second fit emits after its sinks were closed: nothing is lost.
    sink = kit.make()
    sink.emit(make_finding(4))
    sink.close()
    sink.emit(make_finding(5))
    assert kit.steps(sink) == [4, 5]
    sink.close()


def test_odd_characters_never_cost_a_finding(kit: Kit) -> None:
    # A value a destination rejects would be rejected at every retry and block the queue.
    sink = kit.make()
    sink.emit(make_finding(1, where="\udcff odd \u2028 name"))  # a lone surrogate, a separator
    sink.flush()
    assert kit.steps(sink) == [1]
    assert sink.dropped == 0
    sink.close()


ALL_SINKS = [
    ConsoleSink,
    CSVSink,
    JSONLSink,
    CapturingSink,
    LoggingSink,
    MLflowSink,
    TensorBoardSink,
]


@pytest.mark.parametrize("cls", ALL_SINKS)
def test_options_are_keyword_only(cls: type[Sink]) -> None:
    params = inspect.signature(cls).parameters.values()
    # Only the destination may be positional: CSVSink("f.csv"), TensorBoardSink("runs/x").
    assert all(p.kind is p.KEYWORD_ONLY for p in params if p.name not in ("path", "log_dir"))


def test_package_exports() -> None:
    assert set(stethoscope.sinks.__all__) == {
        "Sink",
        "RunContext",
        "ConsoleSink",
        "CSVSink",
        "JSONLSink",
        "LoggingSink",
        "MLflowSink",
        "TensorBoardSink",
    }
    for name in stethoscope.sinks.__all__:
        assert getattr(stethoscope.sinks, name).__name__ == name


def test_importing_the_sinks_imports_no_optional_dependency() -> None:
    code = (
        "import sys, stethoscope, stethoscope.sinks;"
        "bad = [m for m in ('mlflow', 'tensorboard', 'torch', 'tensorflow') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _bad_argument_cases() -> Iterator[Any]:
    """(factory, kwargs, error, text the message must hold) for each sink's own options."""
    cases: list[tuple[str, Callable[..., Sink], dict[str, Any], type, str]] = [
        ("csv-max_buffer", CSVSink, {"max_buffer": -1}, ValueError, "max_buffer=-1"),
        ("csv-max_buffer-float", CSVSink, {"max_buffer": 1.5}, ValueError, "max_buffer=1.5"),
        ("jsonl-max_buffer-bool", JSONLSink, {"max_buffer": True}, ValueError, "max_buffer=True"),
        ("logging-logger-int", LoggingSink, {"logger": 3}, TypeError, "logger=3"),
        ("logging-logger-empty", LoggingSink, {"logger": ""}, ValueError, "logger=''"),
        ("tb-log_dir-int", TensorBoardSink, {"log_dir": 3}, TypeError, "log_dir=3"),
        ("tb-max_buffer", TensorBoardSink, {"max_buffer": "10"}, ValueError, "max_buffer='10'"),
        ("mlflow-experiment", MLflowSink, {"experiment": 7}, TypeError, "experiment=7"),
        ("mlflow-run_name", MLflowSink, {"run_name": ""}, ValueError, "run_name=''"),
        ("mlflow-run_id", MLflowSink, {"run_id": b"abc"}, TypeError, "run_id=b'abc'"),
        ("mlflow-uri", MLflowSink, {"tracking_uri": " "}, ValueError, "tracking_uri=' '"),
        (
            "mlflow-run_id-and-experiment",
            MLflowSink,
            {"run_id": "abc", "experiment": "x"},
            ValueError,
            "run_id='abc'",
        ),
        ("mlflow-max_buffer", MLflowSink, {"max_buffer": -5}, ValueError, "max_buffer=-5"),
        ("mlflow-flush", MLflowSink, {"flush_timeout": -1}, ValueError, "flush_timeout=-1"),
        (
            "mlflow-close",
            MLflowSink,
            {"close_timeout": float("nan")},
            ValueError,
            "close_timeout=nan",
        ),
    ]
    for case_id, cls, kwargs, error, text in cases:
        yield pytest.param(cls, kwargs, error, text, id=case_id)


@pytest.mark.parametrize(("cls", "kwargs", "error", "text"), list(_bad_argument_cases()))
def test_bad_arguments_name_the_value(
    cls: type[Sink], kwargs: dict[str, Any], error: type, text: str, tmp_path: Path
) -> None:
    args = [tmp_path / "f.out"] if cls in (CSVSink, JSONLSink) else []
    with pytest.raises(error, match=re.escape(text)) as info:
        cls(*args, **kwargs)
    assert cls.__name__ in str(info.value)


# --- file sinks: construction checks ------------------------------------------------

FILE_SINKS = [pytest.param(CSVSink, id="csv"), pytest.param(JSONLSink, id="jsonl")]


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_a_missing_directory_is_created_as_the_readme_quick_start_needs(
    cls: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh directory, as a new user's
    sink = cls("runs/findings.out")
    sink.close()
    assert (tmp_path / "runs" / "findings.out").is_file()
    deep = tmp_path / "a" / "b" / "c" / "findings.out"
    cls(deep).close()
    assert deep.is_file()


@pytest.mark.parametrize("cls", FILE_SINKS)
@pytest.mark.skipif(
    sys.platform == "win32" or os.geteuid() == 0, reason="root and Windows ignore chmod"
)
def test_a_directory_that_cannot_be_created_fails_at_construction(
    cls: type, tmp_path: Path
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError, match="cannot be created"):
            cls(locked / "sub" / "f.out")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_path_that_is_a_directory_fails_at_construction(cls: type, tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=re.escape(repr(str(tmp_path)))):
        cls(tmp_path)


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_parent_that_is_a_file_fails_at_construction(cls: type, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a-file"):
        cls(tmp_path / "a-file" / "findings.out")
    with pytest.raises(NotADirectoryError, match=r"a-file.* is a file, not a directory"):
        cls(tmp_path / "a-file" / "deeper" / "findings.out")


@pytest.mark.parametrize("cls", FILE_SINKS)
@pytest.mark.skipif(
    sys.platform == "win32" or os.geteuid() == 0, reason="root and Windows ignore chmod"
)
def test_unwritable_directory_fails_at_construction(cls: type, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError, match=re.escape(repr(str(locked / "f.out")))):
            cls(locked / "f.out")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_unwritable_directory_is_reported_before_opening(
    cls: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chmod test above cannot run as root (root writes anywhere): check the
    # pre-check's message by making the OS say no.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(PermissionError, match="not writable") as info:
        cls(tmp_path / "f.out")
    assert repr(str(tmp_path / "f.out")) in str(info.value)
    assert not (tmp_path / "f.out").exists()


@pytest.mark.parametrize("cls", FILE_SINKS)
@pytest.mark.parametrize("bad", [b"findings.out", 42, None])
def test_path_of_the_wrong_type_is_a_type_error(cls: type, bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(f"path={bad!r}")):
        cls(bad)


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_append_must_be_a_bool(cls: type, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=re.escape("append='no'")):
        cls(tmp_path / "f.out", append="no")


@pytest.mark.parametrize("cls", FILE_SINKS)
@pytest.mark.parametrize("as_type", [str, Path], ids=["str", "Path"])
def test_path_may_be_str_or_pathlike(cls: type, as_type: type, tmp_path: Path) -> None:
    sink = cls(as_type(tmp_path / "f.out"))
    sink.emit(make_finding())
    sink.close()
    assert sink.closed
    assert sink.path == tmp_path / "f.out"


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_every_emit_is_on_disk_without_flush(cls: type, tmp_path: Path) -> None:
    sink = cls(tmp_path / "f.out", append=False)
    before = (tmp_path / "f.out").read_text()
    sink.emit(make_finding(7))
    after = (tmp_path / "f.out").read_text()  # read by another handle, no flush, no close
    assert after.startswith(before)
    assert after[len(before) :].count("\n") == 1
    assert "exploding_gradients" in after[len(before) :]
    sink.close()


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_emit_after_close_reopens_the_same_file_once(cls: type, tmp_path: Path) -> None:
    path = tmp_path / "f.out"
    sink = cls(path)
    sink.emit(make_finding(1))
    sink.close()
    sink.emit(make_finding(2))
    assert not sink.closed
    sink.close()
    sink.close()
    text = path.read_text()
    assert text.count("exploding_gradients") == 2
    assert text.count("exploding_gradients") == 2
    if cls is CSVSink:
        assert text.splitlines()[0].startswith("step,") and text.count("step,epoch") == 1


@pytest.mark.parametrize("cls", FILE_SINKS)
def test_a_copy_made_after_a_chdir_writes_to_the_same_file(
    cls: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sink = cls("relative.out")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # e.g. Hydra changes directory per run
    clone = pickle.loads(pickle.dumps(sink))
    clone.emit(make_finding())
    clone.close()
    sink.close()
    assert clone.path == tmp_path / "relative.out"
    assert not (tmp_path / "elsewhere" / "relative.out").exists()


# --- CSVSink ------------------------------------------------------------------------

ODD_FINDINGS = [
    make_finding(1),
    make_finding(
        2,
        "error",
        detector="nonfinite_loss",
        value=math.nan,
        threshold=None,
        where="loss",
        message="The loss is NaN; lower the learning rate.",
    ),
    make_finding(3, "info", value=math.inf, threshold=-math.inf, where=None, rank=3),
    make_finding(
        4, value=0.1, threshold=1e-300, message='Commas, "quotes",\nnewlines and ünïcode · survive.'
    ),
]


def test_csv_round_trip_through_dictreader(tmp_path: Path) -> None:
    sink = CSVSink(tmp_path / "findings.csv")
    for finding in ODD_FINDINGS:
        sink.emit(finding)
    sink.close()
    rows = read_csv(tmp_path / "findings.csv")  # asserts the header is exactly FIELDS
    assert rows[1]["value"] == "nan" and rows[2]["threshold"] == "-inf"
    back = [finding_from_csv_row(row) for row in rows]
    assert [comparable(f) for f in back] == [comparable(f) for f in ODD_FINDINGS]
    assert math.isnan(back[1].value)  # type: ignore[arg-type]


def test_csv_header_is_written_at_construction(tmp_path: Path) -> None:
    # A run that found nothing still leaves a file that says so.
    sink = CSVSink(tmp_path / "findings.csv")
    assert read_csv(tmp_path / "findings.csv") == []
    sink.close()


def test_csv_append_false_empties_the_file(tmp_path: Path) -> None:
    path = tmp_path / "findings.csv"
    path.write_text("old run\n")
    CSVSink(path).close()
    assert path.read_text().splitlines() == [",".join(FIELDS)]


def test_csv_append_true_writes_one_header(tmp_path: Path) -> None:
    path = tmp_path / "findings.csv"
    first = CSVSink(path)
    first.emit(make_finding(1))
    first.close()
    second = CSVSink(path, append=True)
    second.emit(make_finding(2))
    second.close()
    assert [row["step"] for row in read_csv(path)] == ["1", "2"]
    assert path.read_text().count("step,epoch") == 1


def test_csv_append_true_to_an_empty_file_writes_the_header(tmp_path: Path) -> None:
    path = tmp_path / "findings.csv"
    path.touch()
    sink = CSVSink(path, append=True)
    sink.emit(make_finding(1))
    sink.close()
    assert [row["step"] for row in read_csv(path)] == ["1"]


def test_csv_append_refuses_a_file_with_another_header(tmp_path: Path) -> None:
    path = tmp_path / "findings.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=re.escape(repr(str(path)))):
        CSVSink(path, append=True)
    assert path.read_text() == "a,b\n1,2\n"


# --- JSONLSink ----------------------------------------------------------------------


def test_jsonl_every_line_is_strict_json(tmp_path: Path) -> None:
    sink = JSONLSink(tmp_path / "findings.jsonl")
    for finding in ODD_FINDINGS:
        sink.emit(finding)
    sink.close()
    lines = read_jsonl(tmp_path / "findings.jsonl")  # raises on NaN / Infinity
    assert [list(d) for d in lines] == [list(FIELDS)] * len(ODD_FINDINGS)
    assert lines[1]["value"] is None and "NaN" in lines[1]["message"]
    assert lines[2]["value"] is None and lines[2]["threshold"] is None
    assert Finding.from_dict(lines[0]) == ODD_FINDINGS[0]
    assert Finding.from_dict(lines[3]) == ODD_FINDINGS[3]


def test_jsonl_appends_by_default_and_empties_on_request(tmp_path: Path) -> None:
    path = tmp_path / "findings.jsonl"
    for step in (1, 2):
        sink = JSONLSink(path)
        sink.emit(make_finding(step))
        sink.close()
    assert [d["step"] for d in read_jsonl(path)] == [1, 2]
    JSONLSink(path, append=False).close()
    assert path.read_text() == ""


def test_jsonl_epoch_end_writes_nothing(tmp_path: Path) -> None:
    sink = JSONLSink(tmp_path / "findings.jsonl")
    sink.epoch_end(make_summary())
    sink.close()
    assert (tmp_path / "findings.jsonl").read_text() == ""


def test_jsonl_accepts_numpy_integer_steps(tmp_path: Path) -> None:
    sink = JSONLSink(tmp_path / "findings.jsonl")
    sink.emit(make_finding(np.int64(5), epoch=np.int32(1)))
    sink.close()
    [line] = read_jsonl(tmp_path / "findings.jsonl")
    assert (line["step"], line["epoch"]) == (5, 1)


_CHILD = textwrap.dedent(
    """
    import sys, time
    from stethoscope.findings import Finding
    from stethoscope.sinks import JSONLSink

    sink = JSONLSink(sys.argv[1], append=False)
    for step in range(3000):
        sink.emit(Finding(
            step=step, epoch=0, detector="nonfinite_loss", severity="error", where="loss",
            value=float("nan") if step % 2 else float(step),
            message=f"The loss is NaN at step {step}; " + "lower the learning rate. " * 20,
        ))
        time.sleep(0.0005)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_jsonl_keeps_every_whole_line_when_the_process_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "findings.jsonl"
    src = Path(stethoscope.sinks.__file__).resolve().parents[2]
    pythonpath = [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 4.0
        while not path.exists() or path.read_bytes().count(b"\n") < 50:
            assert child.poll() is None, child.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the child wrote under 50 lines in 4 s"
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=5)
        child.stderr.close()  # type: ignore[union-attr]
    assert child.returncode == -signal.SIGKILL  # killed mid-run, not finished
    lines = read_jsonl(path)  # every line strict JSON, the last one whole
    assert len(lines) >= 50
    assert [d["step"] for d in lines] == list(range(len(lines)))


# --- ConsoleSink --------------------------------------------------------------------


def test_console_line_shows_severity_step_detector_where_and_message() -> None:
    console = plain_console()
    ConsoleSink(console=console).emit(make_finding(12))
    text = output(console)
    assert text.startswith("WARNING step 12 exploding_gradients at layer1.weight: Gradient norm")
    assert text.endswith("Gradient norm 12.5 exceeds 10; clip gradients.\n")  # 100 wide: one line
    assert "\x1b" not in text  # color_system=None: plain text


def test_console_line_without_where() -> None:
    console = plain_console()
    ConsoleSink(console=console).emit(make_finding(3, "info", where=None))
    assert output(console).startswith("INFO    step 3 exploding_gradients: Gradient norm")


def test_console_prints_brackets_literally() -> None:
    console = plain_console()
    ConsoleSink(console=console).emit(make_finding(where="blocks[attn].w", message="[bold]x[/]"))
    assert "at blocks[attn].w: [bold]x[/]" in output(console)


def test_console_keeps_colours_on_a_terminal() -> None:
    console = colour_console()
    ConsoleSink(console=console).emit(make_finding(4, "error"))
    text = output(console)
    assert "\x1b[1;31mERROR\x1b[0m" in text  # bold red tag
    assert ANSI.sub("", text).startswith("ERROR   step 4 exploding_gradients at layer1.weight")


def test_console_wraps_long_lines_once_at_the_console_width() -> None:
    console = plain_console(width=40)
    message = " ".join(f"word{i}" for i in range(30))
    ConsoleSink(console=console).emit(make_finding(message=message))
    lines = output(console).splitlines()
    assert len(lines) > 2
    assert all(len(line) <= 40 for line in lines)
    assert " ".join(" ".join(lines).split()).endswith(message)


def test_use_printer_receives_the_rendered_string() -> None:
    console = plain_console()
    printed: list[str] = []
    sink = ConsoleSink(console=console)
    sink.use_printer(printed.append)
    sink.emit(make_finding(12))
    assert output(console) == ""
    [line] = printed
    assert line.startswith("WARNING step 12 exploding_gradients at layer1.weight:")
    assert not line.endswith("\n")  # the printer (print, tqdm.write) adds the newline
    sink.use_printer(None)
    sink.emit(make_finding(13))
    assert len(printed) == 1
    assert " step 13 " in output(console)


def test_use_printer_gets_ansi_colours_when_the_console_is_a_terminal() -> None:
    printed: list[str] = []
    sink = ConsoleSink(console=colour_console())
    sink.use_printer(printed.append)
    sink.emit(make_finding(1, "warning"))
    assert "\x1b[33mWARNING\x1b[0m" in printed[0]


def test_use_printer_rejects_what_is_not_callable() -> None:
    with pytest.raises(TypeError, match=re.escape("fn='stdout'")):
        ConsoleSink().use_printer("stdout")  # type: ignore[arg-type]


def test_console_prints_the_epoch_summary_table() -> None:
    console = plain_console()
    ConsoleSink(console=console).epoch_end(make_summary())
    text = output(console)
    assert "stethoscope · epoch 2 · 50 steps" in text
    assert "exploding_gradients" in text and "loss_spike" in text
    assert "12.5 / 10" in text and "fc1.weight" in text and "too large" in text
    assert "One warning this epoch." in text


def _quiet_summary() -> EpochSummary:
    return EpochSummary(
        epoch=4,
        steps=57,
        rows=(
            SummaryRow(detector="sampler", status="info", count=1, verdict="back at base"),
            SummaryRow(detector="18 others", status="ok", verdict="nothing found"),
        ),
        verdict="Healthy: no warnings in 57 steps (loss checked every step, gradients on 4 steps)",
    )


def test_a_quiet_epoch_costs_one_line_unless_verbose() -> None:
    console = plain_console(120)
    ConsoleSink(console=console).epoch_end(_quiet_summary())
    assert output(console).splitlines() == [
        "stethoscope · epoch 4 · Healthy: no warnings in 57 steps (loss checked every step, "
        "gradients on 4 steps)"
    ]
    console = plain_console()
    ConsoleSink(console=console, verbose=True).epoch_end(_quiet_summary())
    assert "18 others" in output(console) and "┃ detector" in output(console)  # the table
    with pytest.raises(TypeError, match="verbose='yes' must be True or False"):
        ConsoleSink(verbose="yes")  # type: ignore[arg-type]


def test_console_summary_goes_to_the_printer_as_one_string() -> None:
    printed: list[str] = []
    sink = ConsoleSink(console=plain_console())
    sink.use_printer(printed.append)
    sink.epoch_end(make_summary())
    [table] = printed
    assert "stethoscope · epoch 2 · 50 steps" in table and "loss_spike" in table


def test_console_show_summary_false_prints_no_summary() -> None:
    console = plain_console()
    ConsoleSink(console=console, show_summary=False).epoch_end(make_summary())
    assert output(console) == ""


def test_console_close_lets_go_of_the_printer() -> None:
    console = plain_console()
    printed: list[str] = []
    sink = ConsoleSink(console=console)
    sink.use_printer(printed.append)
    sink.close()
    sink.emit(make_finding(9))
    assert printed == []
    assert " step 9 " in output(console)


def test_console_copy_drops_the_console_and_the_printer() -> None:
    printed: list[str] = []
    sink = ConsoleSink(console=plain_console(), show_summary=False, min_severity="error")
    sink.use_printer(printed.append)
    clone = pickle.loads(pickle.dumps(sink))
    assert clone.console is rich.get_console()
    assert (clone.show_summary, clone.min_severity) == (False, Severity.ERROR)
    clone.emit(make_finding(1, "error"))
    assert printed == []


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [({"show_summary": "yes"}, "show_summary='yes'"), ({"console": "stdout"}, "console='stdout'")],
)
def test_console_bad_arguments_name_the_value(kwargs: dict[str, Any], shown: str) -> None:
    with pytest.raises(TypeError, match=re.escape(shown)):
        ConsoleSink(**kwargs)


# --- CapturingSink ------------------------------------------------------------------


def test_capturing_sink_helpers() -> None:
    sink = CapturingSink()
    sink.emit(make_finding(1, "info", detector="loss_spike"))
    sink.emit(make_finding(2, "warning"))
    sink.emit(make_finding(3, "error", detector="nonfinite_loss"))
    sink.emit(make_finding(4, "error"))
    sink.epoch_end(make_summary())
    sink.flush()
    sink.flush()
    assert [f.step for f in sink.by_detector("exploding_gradients")] == [2, 4]
    assert sink.by_detector("straggler") == []
    assert sink.detectors() == {"loss_spike", "exploding_gradients", "nonfinite_loss"}
    assert [f.step for f in sink.at_least("warning")] == [2, 3, 4]
    assert [f.step for f in sink.at_least(Severity.ERROR)] == [3, 4]
    assert sink.summaries == [make_summary()]
    assert sink.flush_count == 2
    assert not sink.closed
    assert "findings=4" in repr(sink)
    sink.clear()
    assert (sink.findings, sink.summaries, sink.flush_count) == ([], [], 0)
    sink.close()
    assert sink.closed


def test_capturing_sink_at_least_rejects_a_bad_severity() -> None:
    with pytest.raises(ValueError, match=re.escape("severity='fatal'")):
        CapturingSink().at_least("fatal")


def test_capturing_sink_copy_keeps_what_it_captured() -> None:
    sink = CapturingSink()
    sink.emit(make_finding(1))
    sink.epoch_end(make_summary())
    clone = pickle.loads(pickle.dumps(sink))
    assert clone.findings == sink.findings and clone.summaries == sink.summaries


# --- LoggingSink --------------------------------------------------------------------


@pytest.fixture
def captured_logger(request: pytest.FixtureRequest) -> Iterator[tuple[str, list]]:
    name = f"stethoscope.test.{request.node.name}"
    records: list[logging.LogRecord] = []
    handler = ListHandler(records)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield name, records
    logger.removeHandler(handler)


def test_logging_levels_match_the_severity(captured_logger: tuple[str, list]) -> None:
    name, records = captured_logger
    sink = LoggingSink(logger=name)
    for step, severity in enumerate(["info", "warning", "error"]):
        sink.emit(make_finding(step, severity))
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING, logging.ERROR]
    assert records[1].getMessage() == (
        "step 1 exploding_gradients at layer1.weight: Gradient norm 12.5 exceeds 10; "
        "clip gradients."
    )
    assert records[0].name == name


def test_logging_puts_the_finding_in_extra(captured_logger: tuple[str, list]) -> None:
    name, records = captured_logger
    f = make_finding(7, "error", value=math.nan, where=None)
    LoggingSink(logger=logging.getLogger(name)).emit(f)
    [record] = records
    assert record.finding == f.to_dict(json_safe=True)  # strict JSON: the NaN is None
    assert json.loads(json.dumps(record.finding, allow_nan=False)) == record.finding
    assert (record.step, record.epoch, record.detector, record.severity) == (
        7,
        0,
        "exploding_gradients",
        "error",
    )
    assert (record.value, record.threshold, record.where, record.rank) == (None, 10.0, None, 0)
    formatted = logging.Formatter("%(levelname)s %(detector)s@%(step)d %(message)s").format(record)
    assert formatted.startswith("ERROR exploding_gradients@7 step 7 exploding_gradients: ")


def test_logging_summary_at_the_level_of_its_worst_row(
    captured_logger: tuple[str, list],
) -> None:
    name, records = captured_logger
    LoggingSink(logger=name).epoch_end(make_summary())  # one warning row
    LoggingSink(logger=name, min_severity="error").epoch_end(make_summary())  # filtered
    [record] = records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "epoch 2 (50 steps): One warning this epoch."
    assert record.summary["rows"][0]["detector"] == "exploding_gradients"


def test_logging_copy_logs_through_the_same_named_logger(
    captured_logger: tuple[str, list],
) -> None:
    name, records = captured_logger
    clone = pickle.loads(pickle.dumps(LoggingSink(logger=name, min_severity="warning")))
    assert clone.logger is logging.getLogger(name)
    clone.emit(make_finding(1, "info"))
    clone.emit(make_finding(2))
    assert [r.step for r in records] == [2]
    assert repr(clone) == f"LoggingSink(logger={name!r}, min_severity='warning')"


# -- the base ------------------------------------------------------------------------------------
def test_the_base_holds_min_severity_for_every_sink() -> None:
    sink = Sink(min_severity="warning")
    assert not sink.accepts(make_finding(severity="info")) and sink.accepts(
        make_finding(severity="error")
    )
    with pytest.raises(ValueError, match=r"min_severity='loud'.*'info', 'warning', 'error'"):
        Sink(min_severity="loud")


def test_a_sink_that_skips_the_base_constructor_accepts_everything() -> None:
    class Mine(Sink):
        def __init__(self) -> None:
            self.kept: list = []

        def emit(self, f) -> None:
            if self.accepts(f):
                self.kept.append(f)

    sink = Mine()
    sink.emit(make_finding(severity="info"))
    assert len(sink.kept) == 1 and sink.min_severity is Severity.INFO


# --- the summary at 80 and 120 columns -------------------------------------------------


def _long_summary() -> EpochSummary:
    return EpochSummary(
        epoch=0,
        steps=7,
        rows=(
            SummaryRow(
                detector="exploding_gradients",
                status="error",
                count=2,
                value=180.0,
                threshold=12.7,
                where="model.transformer.h.11.attn.c_attn.weight",
                interval=1,
                verdict="stopped training at step 6; lower the LR, add warm-up or clip gradients",
            ),
            SummaryRow(
                detector="large_updates",
                status="warning",
                count=1,
                value=9.82,
                threshold=1.0,
                where="net.4.weight",
                interval=1,
                verdict="lower the LR or add warm-up",
            ),
            SummaryRow(detector="16 others", status="ok", verdict="nothing found (every 1 steps)"),
        ),
        verdict="Stopped at step 6 by exploding_gradients (error) in net.4.weight.",
        quiet=tuple(f"quiet_detector_{i}" for i in range(16)),
    )


@pytest.mark.parametrize("width", [80, 120])
def test_the_summary_never_splits_a_name_and_fits_the_width(width: int) -> None:
    console = plain_console(width)
    console.print(_long_summary())
    out = console.file.getvalue()
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    for name in ("exploding_gradients", "large_updates", "net.4.weight", "16 others"):
        assert name in out, name  # whole, on one line
    assert "c_attn.weight" in out and "…" in out  # a long place keeps its end
    first = next(i for i, line in enumerate(lines) if "stopped training" in line)
    last = next(i for i in range(first, len(lines)) if lines[i].rstrip(" │").endswith("gradients"))
    assert last - first + 1 <= 3  # the verdict on three lines at most (ten, before)
    if width >= 100:
        assert "┃ detector" in out or "| detector" in out  # the table
        assert "Quiet: quiet_detector_0, " in out  # and the quiet ones by name
    else:
        assert "error   exploding_gradients  n=2  180 / 12.7" in out  # a row per line
        assert "quiet_detector" not in out  # counted by their row, not listed


def test_a_severity_orders_against_a_severitys_name_as_a_severity() -> None:
    """``finding.severity >= "warning"`` in a sink of the user's own: "error" sorts below
    "warning" as a string, never as a severity."""
    assert Severity.ERROR >= "warning" and Severity.ERROR > "warning"
    assert not Severity.INFO >= "warning" and Severity.INFO < "error"
    assert Severity.WARNING <= "warning" and not Severity.WARNING < "warning"
    with pytest.raises(TypeError):
        Severity.ERROR < 3  # noqa: B015
