"""KerasStethoscope under ``tf.distribute.MultiWorkerMirroredStrategy``: two workers.

Two processes on this machine, one CPU replica each, find each other through
``TF_CONFIG`` (``localhost``, two free ports) and run every scenario of
``_multiworker_worker.py`` in the same order (~45 s for both, most of it importing
TensorFlow and tracing), started once for the module; each test asserts on the facts
both wrote. A worker still running after ``TIMEOUT`` is killed, and the test fails with
both logs: a collective that one worker never enters would otherwise wait forever.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from _launch import run_processes, source_path

# the fits run in the workers: this process need not import TensorFlow (~8 s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("keras") is None or importlib.util.find_spec("tensorflow") is None,
    reason="needs keras and tensorflow",
)

WORKER = Path(__file__).with_name("_multiworker_worker.py")
#: Seconds for both workers to import TensorFlow and run every scenario (~45 s).
TIMEOUT = 240
NAMES = ["mlp/hidden/kernel", "mlp/hidden/bias", "mlp/head/kernel", "mlp/head/bias"]
#: Steps per epoch: 256 samples in global batches of 32.
EPOCH = 8
NAN_STEP = 5  # the worker's: the global batch that is NaN in worker 1's data
BAR_STEP = 3  # the worker's: the step that worker 1's bars alone judge bad
DAMAGE_STEP = 9  # the worker's: the step whose error worker 1's detector alone raises


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> list[dict]:
    """Both workers' facts, in worker order, from one run of the two."""
    out = tmp_path_factory.mktemp("multiworker")
    ports = ",".join(str(p) for p in _free_ports(2))
    env = {**os.environ, "PYTHONPATH": source_path(), "KERAS_BACKEND": "tensorflow"}
    env.pop("TF_CONFIG", None)  # each worker writes its own
    commands = [
        ([sys.executable, str(WORKER), str(index), ports, str(out)], env) for index in (0, 1)
    ]
    run_processes(commands, out, TIMEOUT, who="workers")
    results = [json.loads((out / f"worker{i}.json").read_text()) for i in (0, 1)]
    assert [r["replicas"] for r in results] == [2, 2]
    return results


def test_a_healthy_run_is_quiet_on_both_workers_and_rank_zero_alone_writes(workers):
    zero, one = workers[0]["healthy"], workers[1]["healthy"]
    for run in (zero, one):
        assert run["findings"] == [] and run["stopped_by"] is None
        assert run["steps"] == 2 * EPOCH  # both workers ran every step
        assert run["clean"]  # every wrapper removed on both
        assert run["meetings"] == zero["meetings"] > 0  # the same meetings on both
    # rank zero: the summaries and the record (replica_divergence compared the workers'
    # identical weights every 4 steps, and found nothing)
    assert zero["summaries"] == 2
    assert zero["record"]["losses"] == 2 * EPOCH and zero["record"]["finished"]
    assert zero["record"]["sampled"] > 0
    # worker 1 writes nothing: no summary, no finding, an empty record directory
    assert one["summaries"] == 0 and one["record_files"] == []
    # the one warning: the straggler detector has nothing to time (said by rank zero)
    assert len(zero["warnings"]) == 1 and "straggler" in zero["warnings"][0]
    assert one["warnings"] == []


def test_the_gradients_judged_are_those_of_one_process_on_the_global_batch(workers):
    zero, one = workers[0]["measured"], workers[1]["measured"]
    run, single = zero["workers"], zero["single"]
    assert run["grad_steps"] == single["grad_steps"] == [0, 3, 6]
    assert run["names"] == single["names"] == [NAMES] * 3
    for key in ("grad_norm", "update_norm", "weight_norm"):
        np.testing.assert_allclose(run[key], single[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert one["workers"]["grad_steps"] == []  # rank zero alone judges the shared gradients
    # every step's loss is judged on both workers, each its own half of the global batch,
    # whose mean is the single process's loss
    assert run["loss_steps"] == one["workers"]["loss_steps"] == list(range(EPOCH))
    assert run["ranks"] == [0] and one["workers"]["ranks"] == [1]
    mean = (np.array(run["losses"]) + np.array(one["workers"]["losses"])) / 2
    np.testing.assert_allclose(mean, single["losses"], rtol=1e-5)
    # and its own data: 16 of the 32 samples each
    assert run["input_count"] == one["workers"]["input_count"] == [16, 16, 16]
    assert single["input_count"] == [32, 32, 32]
    assert run["clean"] and one["workers"]["clean"]


def test_a_nan_on_worker_1_is_named_with_its_rank_and_both_workers_stop_on_the_same_step(
    workers,
):
    zero, one = workers[0]["nan_on_worker1"], workers[1]["nan_on_worker1"]
    # worker 1's own loss went NaN first: reported by rank zero, with rank 1
    named = {(f["step"], f["detector"], f["rank"]) for f in zero["findings"]}
    assert (NAN_STEP, "nonfinite_loss", 1) in named
    # the summed gradients carry it to rank zero, whose loss follows a step later
    assert (NAN_STEP + 1, "nonfinite_loss", 0) in named
    assert one["findings"] == []  # worker 1 sends its findings to rank zero
    # both stop for the same finding, of that step, and take the same steps
    assert zero["stopped_by"] == one["stopped_by"] and zero["stopped_by"]["step"] == NAN_STEP
    # where it began: worker 1's loss, not the gradients rank zero judges for both
    assert (zero["stopped_by"]["detector"], zero["stopped_by"]["rank"]) == ("nonfinite_loss", 1)
    assert zero["steps"] == one["steps"] < 3 * EPOCH
    assert zero["epochs"] == one["epochs"] == 1
    assert zero["clean"] and one["clean"]


def test_raise_on_raises_on_both_workers_at_the_same_step(workers):
    zero, one = workers[0]["nan_on_worker1"], workers[1]["nan_on_worker1"]
    assert zero["raised"] is not None and zero["raised"] == one["raised"]
    assert zero["raised"]["step"] == NAN_STEP
    assert zero["raised_steps"] == one["raised_steps"]
    assert zero["raise_clean"] and one["raise_clean"]


def test_recover_skips_worker_1s_nan_batch_on_both_workers_as_if_never_seen(workers):
    zero, one = workers[0]["recover_nan"], workers[1]["recover_nan"]
    for run in (zero, one):
        assert run["stopped_by"] is None and run["finite"] and run["clean"]
        # both skipped the same step, the same batch: the optimizer applied the other 7
        assert run["skipped"] == [[NAN_STEP, 0, NAN_STEP]]
        assert run["applied"] == EPOCH - 1
        # bit for bit a fit on the same global batches but that one
        assert run["same_as_twin"] and run["digest"] == run["twin_digest"]
    assert zero["digest"] == one["digest"]
    # rank zero reports the skip once, with the worker whose loss made it: its own loss
    # was finite (the NaN was in worker 1's half of the global batch)
    assert [[s, w] for s, w, _ in zero["acts"]] == [[NAN_STEP, "skip"]]
    [message] = zero["messages"]
    assert "on another worker, the loss is non-finite" in message


def test_a_resumed_run_skips_again_on_both_workers_from_rank_zeros_record(workers):
    zero, one = workers[0]["recover_resumed"], workers[1]["recover_resumed"]
    for run in (zero, one):
        assert run["crashed"] and run["stopped_by"] is None and run["clean"]
        # epoch 1's batch NAN_STEP skipped again on clean data: 7 of 8 applied per epoch,
        # bit for bit a fit that never saw that global batch, in either epoch
        assert run["applied"] == 2 * (EPOCH - 1) and run["same_as_twin"]
    assert zero["digest"] == one["digest"]
    # worker 1's record is empty (another node's): rank zero's numbering and skips rule
    [(step, where, message)] = zero["acts"]
    assert (step, where) == (EPOCH + NAN_STEP, "skip") and "skipped again" in message
    assert "on another worker, the loss is non-finite" in message  # as it was first skipped
    assert one["acts"] == []
    record = zero["record"]
    assert record["steps"] == list(range(2 * EPOCH))  # numbered on, each step once
    assert record["skipped"] == [NAN_STEP, EPOCH + NAN_STEP]


def test_an_error_on_worker_1_alone_rolls_both_workers_back_to_the_same_snapshot(workers):
    zero, one = workers[0]["recover_rollback"], workers[1]["recover_rollback"]
    assert len(zero["rolled"]) == 1 and zero["rolled"] == one["rolled"]
    rolled = zero["rolled"][0]
    # agreed at the first meeting after the error (the default schedule meets at its
    # step), paid there on both workers, to the same snapshot from before the error, and
    # the weights restored are the same, bit for bit (the digest after the restore)
    assert rolled["step"] == DAMAGE_STEP and rolled["to_step"] < DAMAGE_STEP
    for run in (zero, one):
        assert run["stopped_by"] is None and run["clean"]
    assert zero["applied"] == one["applied"] and zero["digest"] == one["digest"]
    # rank zero says so, once (then the ladder cools the learning rate, as it does)
    assert [a for a in zero["acts"] if a[1] == "rollback"] == [[DAMAGE_STEP, "rollback", 0]]


def test_a_step_one_workers_bars_alone_judge_bad_is_skipped_by_both(workers):
    zero, one = workers[0]["recover_bars"], workers[1]["recover_bars"]
    for run in (zero, one):
        assert run["skipped"] == [[BAR_STEP, 0, BAR_STEP]] and run["applied"] == EPOCH - 1
    assert zero["digest"] == one["digest"]
    # rank zero's own bars would have applied the step: its skip says whose verdict it took
    [(step, where, message)] = zero["acts"]
    assert (step, where) == (BAR_STEP, "skip") and "on another worker" in message


def test_recover_with_several_steps_per_execution_is_refused_by_name_on_every_worker(workers):
    for worker in workers:
        refused = worker["nan_on_worker1"]["recover_several_steps"]
        assert refused is not None and "steps_per_execution=2" in refused
        assert "recover=False" in refused


def test_a_weight_changed_on_one_worker_alone_is_named_by_replica_divergence(workers):
    zero, one = workers[0]["diverged"], workers[1]["diverged"]
    stopped = zero["stopped_by"]
    assert stopped["detector"] == "replica_divergence" and stopped["rank"] == 1
    assert stopped["where"] == "mlp/hidden/kernel"
    # nudged as step 10 begins, after step 9 was judged; compared every 4 steps at most
    assert 9 <= stopped["step"] <= 13
    assert one["stopped_by"] == stopped and zero["steps"] == one["steps"]
