"""MLflowSink against real MLflow: a SQLite store, and a real ``mlflow server`` on 127.0.0.1.

Everything is read back through ``mlflow.MlflowClient``; nothing of MLflow is mocked.
The server is started once for the module (it takes seconds); the test that kills it
starts it again, and leaves it running for the tests after it.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest

from _sinkkit import MlflowServer, silent_server
from stethoscope.findings import Finding
from stethoscope.sinks import MLflowSink
from stethoscope.summary import EpochSummary, SummaryRow


def finding(step: int, detector: str = "exploding_gradients", **changes: Any) -> Finding:
    fields: dict[str, Any] = {
        "epoch": 0,
        "severity": "warning",
        "message": f"Gradient norm at step {step} exceeds 10; clip gradients.",
        "value": 12.5 + step,
        "threshold": 10.0,
        "where": "layer1.weight",
    }
    fields.update(changes)
    return Finding(step=step, detector=detector, **fields)


def summary(stopped_by: Finding | None = None) -> EpochSummary:
    return EpochSummary(
        epoch=0,
        steps=10,
        rows=(SummaryRow(detector="exploding_gradients", status="warning", count=3),),
        verdict="3 warning(s) in 10 steps",
        stopped_by=stopped_by.to_dict(json_safe=True) if stopped_by else None,
    )


def metric(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    history = client.get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def artifact_text(client: Any, run_id: str, path: str, tmp_path: Path) -> str:
    local = client.download_artifacts(run_id, path, str(tmp_path))
    return Path(local).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    uri = f"sqlite:///{tmp_path_factory.getbasetemp() / 'mlflow-sink.db'}"
    return uri, mlflow.MlflowClient(uri)


@pytest.fixture
def experiment(store: tuple[str, Any], tmp_path: Path) -> str:
    """A fresh experiment whose artifacts live in this test's tmp_path."""
    _, client = store
    name = f"exp-{uuid.uuid4().hex}"
    client.create_experiment(name, artifact_location=str(tmp_path / "artifacts"))
    return name


@pytest.fixture
def quick_http(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MLflow's client retries a dead server for minutes by default; tests cannot wait."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    # A sink that could not upload keeps its local copy of the findings for the user;
    # in a test, that copy belongs in the test's own directory.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


# --- a local store ------------------------------------------------------------------


def test_metrics_tags_and_artifacts_land_in_the_run(
    store: tuple[str, Any], experiment: str, tmp_path: Path
) -> None:
    uri, client = store
    sink = MLflowSink(tracking_uri=uri, experiment=experiment, run_name="lr-too-high")
    found = [
        finding(3),
        finding(4, value=None),  # no value: the series marks the step with 1.0
        finding(5, "nonfinite_loss", severity="error", value=math.nan, where="loss"),
        finding(7, message="The [last] one \u00b7 with odd characters."),
    ]
    for f in found:
        sink.emit(f)
    sink.epoch_end(summary(stopped_by=found[2]))
    sink.close()
    run = client.get_run(sink.run_id)
    assert run.info.run_name == "lr-too-high"
    assert run.info.status == "FINISHED"  # the sink started the run, so it ends it
    assert client.get_experiment(run.info.experiment_id).name == experiment
    assert metric(client, sink.run_id, "stethoscope/exploding_gradients") == [
        (3, 15.5),
        (4, 1.0),
        (7, 19.5),
    ]
    [(step, value)] = metric(client, sink.run_id, "stethoscope/nonfinite_loss")
    assert step == 5 and math.isnan(value)
    tags = run.data.tags
    assert tags["stethoscope/exploding_gradients/first"].startswith("step 3 (warning) at layer1")
    assert tags["stethoscope/exploding_gradients/last"] == (
        "step 7 (warning) at layer1.weight: The [last] one \u00b7 with odd characters."
    )
    assert tags["stethoscope/nonfinite_loss/first"] == tags["stethoscope/nonfinite_loss/last"]
    assert tags["stethoscope/stopped_by"].startswith("nonfinite_loss (error) at step 5 in loss:")
    assert tags["stethoscope/verdict"] == "3 warning(s) in 10 steps"
    lines = artifact_text(client, sink.run_id, "stethoscope/findings.jsonl", tmp_path)
    back = [Finding.from_dict(json.loads(line)) for line in lines.splitlines()]
    assert [f.step for f in back] == [3, 4, 5, 7] and back[0] == found[0]
    table = artifact_text(client, sink.run_id, "stethoscope/summary.txt", tmp_path / "s")
    assert "stethoscope · epoch 0 · 10 steps" in table and "exploding_gradients" in table
    assert sink.dropped == 0


def test_joins_the_active_run_and_leaves_it_running(
    store: tuple[str, Any], experiment: str
) -> None:
    uri, client = store
    mlflow.set_tracking_uri(uri)  # MLflow's global state: restored below
    mlflow.set_experiment(experiment)
    try:
        with mlflow.start_run() as active:
            sink = MLflowSink()  # no run named: the active one
            sink.emit(finding(1))
            sink.close()
            assert sink.run_id == active.info.run_id
            assert client.get_run(active.info.run_id).info.status == "RUNNING"
        assert metric(client, active.info.run_id, "stethoscope/exploding_gradients") == [(1, 13.5)]
    finally:
        mlflow.set_tracking_uri(None)


def test_run_id_logs_to_that_run_and_does_not_end_it(
    store: tuple[str, Any], experiment: str
) -> None:
    uri, client = store
    run = client.create_run(client.get_experiment_by_name(experiment).experiment_id)
    sink = MLflowSink(run_id=run.info.run_id, tracking_uri=uri)
    sink.emit(finding(2))
    sink.close()
    assert metric(client, run.info.run_id, "stethoscope/exploding_gradients") == [(2, 14.5)]
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run


def test_a_sink_that_receives_nothing_starts_no_run(
    store: tuple[str, Any], experiment: str
) -> None:
    uri, client = store
    sink = MLflowSink(tracking_uri=uri, experiment=experiment, min_severity="error")
    sink.emit(finding(1))  # below min_severity
    sink.flush()
    sink.close()
    assert sink.run_id is None
    assert client.search_runs([client.get_experiment_by_name(experiment).experiment_id]) == []


def test_many_findings_go_in_batches_in_order(store: tuple[str, Any], experiment: str) -> None:
    uri, client = store
    sink = MLflowSink(tracking_uri=uri, experiment=experiment)
    for step in range(250):  # three requests of at most 100 findings
        sink.emit(finding(step, where=f"layer{step % 3}"))
    sink.close()
    steps = [s for s, _ in metric(client, sink.run_id, "stethoscope/exploding_gradients")]
    assert steps == list(range(250))
    tags = client.get_run(sink.run_id).data.tags
    assert tags["stethoscope/exploding_gradients/first"].startswith("step 0 ")
    assert tags["stethoscope/exploding_gradients/last"].startswith("step 249 ")


def test_missing_mlflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'stethoscope\[mlflow\]'"):
        MLflowSink()


# --- a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    srv.kill()


def test_findings_reach_a_real_server(server: MlflowServer, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(server.uri)
    sink = MLflowSink(tracking_uri=server.uri, experiment="served", run_name="one")
    for step in range(5):
        sink.emit(finding(step))
    sink.epoch_end(summary())
    sink.close()
    assert [s for s, _ in metric(client, sink.run_id, "stethoscope/exploding_gradients")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    lines = artifact_text(client, sink.run_id, "stethoscope/findings.jsonl", tmp_path)
    assert len(lines.splitlines()) == 5
    assert client.get_run(sink.run_id).info.status == "FINISHED"


def test_server_killed_mid_run_and_restarted_loses_nothing(
    server: MlflowServer, quick_http: None, tmp_path: Path
) -> None:
    client = mlflow.MlflowClient(server.uri)
    sink = MLflowSink(tracking_uri=server.uri, experiment="crash", close_timeout=60)
    for step in range(3):
        sink.emit(finding(step))
    sink.flush()
    assert sink.pending == 0 and sink.run_id is not None
    server.kill()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        start = time.perf_counter()
        for step in range(3, 8):
            sink.emit(finding(step))
        assert time.perf_counter() - start < 1.0  # the dead server costs the steps nothing
        sink.flush()  # epoch end: the send fails, nothing raises, nothing is lost
        deadline = time.monotonic() + 30
        while sink.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sink.last_error is not None
    assert any("could not write to MLflow run" in str(w.message) for w in record)
    assert sink.pending == 5
    server.start()  # the same store, the same port
    sink.flush()  # the next epoch end retries
    sink.close()  # waits for the retry
    assert sink.dropped == 0
    steps = [s for s, _ in metric(client, sink.run_id, "stethoscope/exploding_gradients")]
    assert steps == list(range(8))
    lines = artifact_text(client, sink.run_id, "stethoscope/findings.jsonl", tmp_path)
    assert [json.loads(line)["step"] for line in lines.splitlines()] == list(range(8))


def test_a_server_that_never_answers_never_stalls_a_step(quick_http: None) -> None:
    with silent_server() as uri:
        sink = MLflowSink(tracking_uri=uri, experiment="x", flush_timeout=0.5, close_timeout=1)
        slowest = 0.0
        for step in range(200):
            start = time.perf_counter()
            sink.emit(finding(step))
            slowest = max(slowest, time.perf_counter() - start)
        # A queue append and a local spool line, never a request (which would hang 5 s);
        # the bound leaves room for a loaded CI machine.
        assert slowest < 0.25
        start = time.perf_counter()
        sink.flush()
        assert time.perf_counter() - start < 2.5  # flush_timeout (0.5 s), then training goes on
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="still sending after close_timeout=1.0s"):
            sink.close()
        assert time.perf_counter() - start < 4  # close_timeout (1 s), not the 5 s request
        assert sink.dropped == 200  # counted, and the local copy keeps them all
