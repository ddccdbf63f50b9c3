"""Layer 2 under DDP: two real CPU ranks (gloo) with a fault on rank 1 only.

Both ranks are started once, as a launcher would start them (``_ddp_worker.py``), and
run every scenario in turn; each test then reads what rank zero's ``JSONLSink`` wrote
and the step every rank stopped at. No test kills a rank or waits on a hung one: the
ranks have a 60 s collective timeout, and the pair is killed (and the tests fail) if
it has not finished within :data:`TIMEOUT`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import needs_gloo, run_ranks
from _models import TinyMLP, fit
from _rank_files import findings, ranks

from stethoscope import LightningStethoscope
from stethoscope.distributed import RankMeeting
from stethoscope.record import RunRecord
from stethoscope.testing import CapturingSink

WORKER = Path(__file__).with_name("_ddp_worker.py")
SCENARIOS = (
    "healthy",
    "nan",
    "nan_raise",
    "perturb",
    "grad_edit",
    "sleep",
    "buffers",
    "recover",
    "recover_replay",
    "recover_rollback",
)
#: Seconds for both ranks to import torch and Lightning and run every scenario (~15 s).
TIMEOUT = 180

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run both ranks through every scenario; the directory of what they wrote."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("ddp"), SCENARIOS, TIMEOUT)


def test_healthy_run_fires_nothing_and_runs_to_the_end(runs):
    assert findings(runs, "healthy") == []  # BatchNorm, dropout, validation: all quiet
    for r in ranks(runs, "healthy"):
        assert r["global_step"] == 64
        assert r["stopped_by"] is None and not r["should_stop"]


def test_nan_loss_on_one_rank_is_named_and_every_rank_stops_on_the_same_step(runs):
    mine = [f for f in findings(runs, "nan") if f["detector"] == "nonfinite_loss"]
    first = min(mine, key=lambda f: f["step"])
    assert (first["step"], first["rank"], first["severity"], first["where"]) == (
        37,
        1,
        "error",
        "loss",
    )
    # rank 1 decided alone at step 37 (a step the ranks do not meet at); both stop at the
    # next meeting, step 48, after its optimizer step: global_step 49 on every rank
    for r in ranks(runs, "nan"):
        assert r["global_step"] == 49
        assert r["should_stop"]
        assert (r["stopped_by"]["step"], r["stopped_by"]["rank"]) == (37, 1)


def test_rank_zero_records_the_run_and_the_other_ranks_findings(runs):
    with RunRecord(runs / "nan-record") as record:
        losses = record.losses()
        assert list(losses.steps) == list(range(49))  # every step rank zero took
        assert record.finished and record.config["trainer"]["world_size"] == 2
        nan = [(f.step, f.rank) for f in record.findings() if f.detector == "nonfinite_loss"]
        assert min(nan) == (37, 1)  # rank one's finding, kept by rank zero
        assert len(record.layers("grad_norm").steps) > 0
    with RunRecord(runs / "healthy-record") as record:
        assert len(record.losses().steps) == 64 and record.findings() == []
        assert len(record.layers("weight_hist").steps) > 0


def test_raise_on_is_agreed_too(runs):
    for r in ranks(runs, "nan_raise"):
        assert r["raised"] is not None, "every rank raises TrainingProblem"
        assert (r["raised"]["detector"], r["raised"]["step"], r["raised"]["rank"]) == (
            "nonfinite_loss",
            37,
            1,
        )
        assert r["global_step"] == 49


def test_perturbed_replica_names_the_first_differing_parameter_and_stops_every_rank(runs):
    errors = [f for f in findings(runs, "perturb") if f["severity"] == "error"]
    assert [(f["detector"], f["where"], f["rank"], f["step"]) for f in errors] == [
        ("replica_divergence", "net.2.weight", 1, 20)
    ]
    for r in ranks(runs, "perturb"):
        assert r["global_step"] == 21  # stopped at step 20, on both ranks
        assert r["stopped_by"]["detector"] == "replica_divergence"


def test_replicas_that_diverge_say_whether_their_gradients_agreed(runs):
    # perturb: the weights moved on rank 1 after the step, with the same gradients
    (weights,) = [f for f in findings(runs, "perturb") if f["severity"] == "error"]
    assert "gradients agreed as the step used them" in weights["message"]
    assert "not all-reduced" not in weights["message"]
    # grad_edit: rank 1's gradient changed after the all-reduce (clipping on one rank)
    errors = [f for f in findings(runs, "grad_edit") if f["severity"] == "error"]
    assert [(f["detector"], f["where"], f["rank"], f["step"]) for f in errors] == [
        ("replica_divergence", "net.2.weight", 1, 20)
    ]
    message = errors[0]["message"]
    assert "gradients already differed as the step used them (1 of 6 parameters, " in message
    assert "first net.2.weight): they were not all-reduced alike" in message


def test_a_sleeping_rank_is_a_straggler_and_training_goes_on(runs):
    warnings = [f for f in findings(runs, "sleep") if f["severity"] != "info"]
    assert warnings, "no straggler warning"
    assert {(f["detector"], f["where"], f["rank"]) for f in warnings} == {
        ("straggler", "rank 1", 1)
    }
    assert warnings[0]["step"] <= 12  # 8 samples, from step 1 (step 0 is not timed)
    for r in ranks(runs, "sleep"):
        assert r["global_step"] == 24 and r["stopped_by"] is None


def test_unsynchronised_batchnorm_buffers_are_a_warning(runs):
    found = [f for f in findings(runs, "buffers") if f["severity"] != "info"]
    assert found and {f["detector"] for f in found} == {"replica_divergence"}
    assert {f["severity"] for f in found} == {"warning"}
    assert found[0]["where"].endswith(("running_mean", "running_var")) and found[0]["rank"] == 1
    for r in ranks(runs, "buffers"):
        assert r["global_step"] == 24 and r["stopped_by"] is None


def test_a_nan_batch_on_one_rank_is_skipped_by_both_and_the_run_finishes(runs):
    first, second = ranks(runs, "recover")
    for r in (first, second):
        assert r["global_step"] == 64 and not r["should_stop"] and r["stopped_by"] is None
        assert r["skips"] == 1
    assert first["checksum"] == second["checksum"]  # the replicas are still the same
    found = findings(runs, "recover")
    [skip] = [f for f in found if f["detector"] == "recovery"]
    assert skip["step"] == 37 and "on another rank, the loss is non-finite" in skip["message"]
    assert any(f["detector"] == "nonfinite_loss" and f["rank"] == 1 for f in found)


def test_a_fault_one_rank_met_once_is_replayed_by_both_and_applied(runs):
    first, second = ranks(runs, "recover_replay")
    for r in (first, second):
        assert r["global_step"] == 64 and not r["should_stop"] and r["skips"] == 0
        assert [(step, act) for step, act, _ in r["ladder"]] == [(37, "replay")]
    assert first["checksum"] == second["checksum"]  # both applied the same replayed step
    [replay] = [f for f in findings(runs, "recover_replay") if f["detector"] == "recovery"]
    assert replay["step"] == 37 and "transient fault" in replay["message"]


def test_an_error_one_rank_holds_rolls_every_rank_back_alike(runs):
    first, second = ranks(runs, "recover_rollback")
    for r in (first, second):
        assert r["global_step"] == 64 and not r["should_stop"] and r["stopped_by"] is None
    # the same rungs, at the same steps, on both ranks, and the replicas still the same
    assert first["ladder"] == second["ladder"]
    acts = [(step, act) for step, act, _ in first["ladder"]]
    assert [step for step, act in acts if act == "rollback"] == [31]  # at the next meeting
    assert first["checksum"] == second["checksum"]
    found = findings(runs, "recover_rollback")
    rollback = next(f for f in found if f["detector"] == "recovery" and f["where"] == "rollback")
    assert "snapshot of step 24" in rollback["message"], rollback["message"]
    assert any(f["detector"] == "large_updates" and f["rank"] == 1 for f in found)


def test_a_single_process_never_meets(monkeypatch):
    """world_size 1: no collective at all, and the distributed detectors stay idle."""

    def no_collective(*args, **kwargs):
        raise AssertionError("a single process must not gather")

    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink])
    monkeypatch.setattr(RankMeeting, "meet", no_collective)
    trainer, _ = fit(TinyMLP(), steps=40, callback=callback)
    assert trainer.global_step == 40 and not sink.findings
    assert callback._ranks is None
    summary = callback.summaries[-1]
    assert "straggler" not in summary.quiet and "replica_divergence" not in summary.quiet
