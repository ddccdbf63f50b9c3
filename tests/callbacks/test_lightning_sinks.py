"""Sinks inside real Lightning fits: the Trainer's loggers lend their run and log dir,
and a failing sink never costs the run."""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from _models import TinyMLP, fit
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

from stethoscope import LightningStethoscope, TrainingProblem
from stethoscope.findings import Finding
from stethoscope.sinks import JSONLSink, MLflowSink, Sink, TensorBoardSink
from stethoscope.testing import CapturingSink


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    uri = f"sqlite:///{tmp_path_factory.getbasetemp() / 'mlflow-lightning.db'}"
    return uri, mlflow.MlflowClient(uri)


@pytest.fixture(autouse=True)
def _restore_mlflow_tracking_uri() -> Iterator[None]:
    # MLFlowLogger sets MLflow's global tracking URI; later tests must not inherit it.
    yield
    mlflow.set_tracking_uri(None)


def scalars(log_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_mlflow_logger_and_sink_share_one_run(store: tuple[str, Any], tmp_path: Path) -> None:
    uri, client = store
    name = f"lightning-{uuid.uuid4().hex}"
    logger = MLFlowLogger(
        experiment_name=name, tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    sink = MLflowSink()
    cb = LightningStethoscope(sinks=[sink, CapturingSink()])
    trainer, _ = fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb, logger=logger)
    assert trainer.should_stop
    assert sink.run_id == logger.run_id and sink.tracking_uri == uri
    experiment_id = client.get_experiment_by_name(name).experiment_id
    assert len(client.search_runs([experiment_id])) == 1  # one run: the logger's
    history = client.get_metric_history(logger.run_id, "stethoscope/nonfinite_loss")
    assert [m.step for m in history] == [30]
    tags = client.get_run(logger.run_id).data.tags
    assert tags["stethoscope/stopped_by"].startswith("nonfinite_loss (error) at step 30")
    artifacts = {a.path for a in client.list_artifacts(logger.run_id, "stethoscope")}
    assert artifacts == {"stethoscope/findings.jsonl", "stethoscope/summary.txt"}
    assert sink.dropped == 0


def test_with_a_record_the_mlflow_run_gets_the_report_and_its_figures(
    store: tuple[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("plotly")
    from stethoscope.record import RunRecord
    from stethoscope.record.report import figures, find_browser

    uri, client = store
    name = f"report-{uuid.uuid4().hex}"
    logger = MLFlowLogger(
        experiment_name=name, tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    sink = MLflowSink()
    cb = LightningStethoscope(sinks=[sink], record=tmp_path / "run")
    fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb, logger=logger)
    listed = {a.path for a in client.list_artifacts(logger.run_id, "stethoscope/report")}
    assert "stethoscope/report/report.html" in listed
    html = Path(
        client.download_artifacts(logger.run_id, "stethoscope/report/report.html", str(tmp_path))
    ).read_text(encoding="utf-8")
    assert "stethoscope report: run" in html and "nonfinite_loss" in html
    with RunRecord(tmp_path / "run") as record:
        assert f"{len(record.losses().steps)} (step 0 … 30)" in html  # the whole record
        drawn = set(figures(record))
    assert {"loss", "gradient_flow"} <= drawn
    if find_browser() is not None:  # PNGs need a Chrome or Chromium
        folder = "stethoscope/report/figures"
        pngs = {a.path for a in client.list_artifacts(logger.run_id, folder)}
        assert pngs == {f"{folder}/{name}.png" for name in drawn}


def test_a_sink_that_closes_before_the_recorder_still_attaches_the_whole_record(
    tmp_path: Path,
) -> None:
    pytest.importorskip("plotly")

    class Attaching(Sink):
        """Writes the run's report at its close, as MLflowSink does."""

        def start(self, context: Any) -> None:
            self.report = context.report

        def emit(self, finding: Finding) -> None:
            pass

        def close(self) -> None:
            self.report(tmp_path / "attached")

    cb = LightningStethoscope(sinks=[Attaching()], record=tmp_path / "run")
    cb.monitor.sinks.reverse()  # the attaching sink now closes first: order must not matter
    fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb)
    html = (tmp_path / "attached" / "report.html").read_text(encoding="utf-8")
    assert "(step 0 … 30)" in html  # every step of the record, its last included
    assert "running, or stopped" not in html  # the record was complete: closed first


def test_an_mlflow_sink_that_names_its_run_keeps_it(store: tuple[str, Any], tmp_path: Path) -> None:
    uri, client = store
    name = f"lightning-{uuid.uuid4().hex}"
    logger = MLFlowLogger(
        experiment_name=name, tracking_uri=uri, artifact_location=str(tmp_path / "a")
    )
    client.create_experiment(f"{name}-own", artifact_location=str(tmp_path / "b"))
    sink = MLflowSink(tracking_uri=uri, experiment=f"{name}-own")
    fit(
        TinyMLP(fault="nan_input", onset=10),
        steps=50,
        callback=LightningStethoscope(sinks=[sink]),
        logger=logger,
    )
    assert sink.run_id != logger.run_id
    assert client.get_run(sink.run_id).info.status == "FINISHED"  # its own, ended by it


def test_training_that_raises_closes_the_mlflow_sink_once_with_its_artifacts(
    store: tuple[str, Any], tmp_path: Path
) -> None:
    uri, client = store
    name = f"raise-{uuid.uuid4().hex}"
    client.create_experiment(name, artifact_location=str(tmp_path / "artifacts"))
    closes: list[int] = []

    class Counted(MLflowSink):
        def close(self) -> None:
            closes.append(1)
            super().close()

    sink = Counted(tracking_uri=uri, experiment=name)
    cb = LightningStethoscope(sinks=[sink], raise_on="error")
    with pytest.raises(TrainingProblem):
        fit(TinyMLP(fault="nan_input", onset=20), steps=200, callback=cb)
    assert closes == [1]  # on_exception closes, teardown finds it closed
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    local = client.download_artifacts(sink.run_id, "stethoscope/findings.jsonl", str(tmp_path))
    steps = [json.loads(line)["step"] for line in Path(local).read_text().splitlines()]
    assert 20 in steps


def test_tensorboard_logger_and_sink_share_one_log_dir(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    sink = TensorBoardSink()
    explicit = TensorBoardSink(tmp_path / "mine")
    cb = LightningStethoscope(sinks=[sink, explicit])
    fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb, logger=logger)
    assert sink.log_dir == Path(logger.log_dir)
    assert explicit.log_dir == tmp_path / "mine"  # a log dir given by the user stays
    assert scalars(logger.log_dir, "stethoscope/nonfinite_loss")[0][0] == 30
    assert scalars(tmp_path / "mine", "stethoscope/nonfinite_loss")[0][0] == 30
    files = os.listdir(logger.log_dir)
    assert sum("tfevents" in f for f in files) == 2  # the logger's file and the sink's


class Raising(Sink):
    def emit(self, finding: Finding) -> None:
        raise RuntimeError("bug in emit")

    def epoch_end(self, summary: Any) -> None:
        raise RuntimeError("bug in epoch_end")

    def flush(self) -> None:
        raise RuntimeError("bug in flush")

    def close(self) -> None:
        raise RuntimeError("bug in close")


def test_a_sink_that_raises_on_every_call_costs_the_fit_nothing() -> None:
    reference, _ = fit(TinyMLP(fault="nan_input", onset=30), steps=200)
    captured = CapturingSink()
    cb = LightningStethoscope(sinks=[Raising(), captured])
    with pytest.warns(RuntimeWarning, match=r"Raising\.\w+\(\) failed") as record:
        trainer, _ = fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb)
    assert trainer.global_step == reference.global_step == 31  # stopped where it would have
    assert captured.by_detector("nonfinite_loss")[0].step == 30 and captured.closed
    assert len([w for w in record if "Raising" in str(w.message)]) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_sink_in_a_fit_is_counted_in_the_summary() -> None:
    captured = CapturingSink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = JSONLSink("/dev/full", max_buffer=1)
        cb = LightningStethoscope(sinks=[full, captured], stop_on=None)
        trainer, _ = fit(TinyMLP(fault="nan_input", onset=5), steps=40, callback=cb)
    assert trainer.global_step == 40
    sent = len(captured.findings)
    assert sent >= 2
    assert captured.summaries[-1].dropped == {"JSONLSink": sent - 1}  # one waited, in vain
    assert full.dropped == sent  # and was given up at close
