"""KerasStethoscope under ``tf.distribute.MirroredStrategy``: two logical CPU devices.

TensorFlow fixes its logical devices when it initialises, so the fits run in a process
of their own (``_mirrored_worker.py``, ~30 s for every scenario), started once for the
module; each test asserts on the facts it wrote. Every scenario that compares with one
device trains the same model on the same batches without a strategy in that process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# the fits run in the worker: this process need not import TensorFlow (~8 s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("keras") is None or importlib.util.find_spec("tensorflow") is None,
    reason="needs keras and tensorflow",
)

WORKER = Path(__file__).with_name("_mirrored_worker.py")
#: Seconds for the worker to import TensorFlow and run every scenario (~30 s).
TIMEOUT = 300
NAMES = ["mlp/hidden/kernel", "mlp/hidden/bias", "mlp/head/kernel", "mlp/head/bias"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every scenario's facts, from one run of the worker."""
    out = tmp_path_factory.mktemp("mirrored") / "results.json"
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "KERAS_BACKEND": "tensorflow"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["replicas"] == 2
    return results


def test_a_healthy_run_finds_nothing_and_leaves_the_model_as_it_was(runs):
    healthy = runs["healthy"]
    assert healthy["alarms"] == []
    assert healthy["summaries"] == 2  # one per epoch, not one per replica
    assert healthy["steps"] == 15  # 2 epochs of 8 global batches: steps, not replica-steps
    assert healthy["clean"]  # compute_loss, apply, the all-reduce and every call unwrapped
    assert healthy["archive_mentions"] == []
    assert healthy["loaded_equal"]
    # the record (on here) holds the global batches' statistics, once, not per replica
    record = healthy["record"]
    assert record["losses"] == 16 and record["sampled"] > 0
    assert record["every_weight_once"] and record["finished"]


def test_the_loss_judged_is_the_global_loss_keras_logs(runs):
    for name in ("mirrored", "single"):
        run = runs["measured"][name]
        logged = [run["logged"][step] for step in run["steps"]]
        np.testing.assert_allclose(run["losses"], logged, rtol=1e-5)
    np.testing.assert_allclose(
        runs["measured"]["mirrored"]["losses"], runs["measured"]["single"]["losses"], rtol=1e-5
    )


@pytest.mark.parametrize("style", ["own", "named"])
def test_a_train_step_of_its_own_has_its_global_loss_judged(runs, style):
    """Its loss comes from its logs (the step's tensor, or a tracker's share), one share
    per replica, and the shares sum to the global batch's loss, as on one device."""
    mirrored, single = runs["own_loss"][f"{style}/mirrored"], runs["own_loss"][f"{style}/single"]
    assert mirrored["warnings"] == [] and single["warnings"] == []
    assert len(mirrored["losses"]) == 256 // 32 and mirrored["clean"]
    np.testing.assert_allclose(mirrored["losses"], single["losses"], rtol=1e-5)


def test_sampled_steps_measure_the_global_batch_as_one_device_does(runs):
    mirrored, single = runs["measured"]["mirrored"], runs["measured"]["single"]
    assert mirrored["steps"] == single["steps"] == [0, 3, 6]
    assert mirrored["clean"] and single["clean"]
    first = mirrored["sampled"][0]
    # the gradient of the whole first batch, taken by a tape on a copy with no strategy
    np.testing.assert_allclose(first["grad_norm"], runs["measured"]["tape_grad_norm"], rtol=1e-5)
    assert first["input_count"] == 32  # both shards of 16
    assert sum(first["labels"]) == 32
    for m, s in zip(mirrored["sampled"], single["sampled"], strict=True):
        assert m["step"] == s["step"] and m["names"] == s["names"] == NAMES
        for key in ("grad_norm", "update_norm", "weight_norm", "input_sq", "act_rms", "act_max"):
            np.testing.assert_allclose(m[key], s[key], rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(m["act_saturated"], s["act_saturated"], atol=1e-6)
        np.testing.assert_allclose(m["update_norm"], 0.05 * np.array(m["grad_norm"]), rtol=1e-4)
        assert m["input_count"] == s["input_count"] and m["labels"] == s["labels"]
        assert m["unit_zero"] == s["unit_zero"]
        assert m["act_names"] == s["act_names"] == ["hidden", "hidden/tanh", "head"]


@pytest.mark.parametrize("replica", [1, 0])
def test_a_nan_in_one_replicas_shard_is_named_with_that_replica_and_stops(runs, replica):
    run = runs[f"nan_replica{replica}"]
    stopped = run["stopped_by"]
    assert stopped["step"] == 5 and stopped["detector"] == "nonfinite_loss"
    assert stopped["rank"] == replica
    assert run["epochs"] == 1  # stopped in the first of three epochs
    at5 = {f["detector"]: f for f in run["at5"]}
    # the NaN step's own gradients (summed across replicas) and weights, named at once
    assert {"nonfinite_loss", "nonfinite_gradients", "nonfinite_weights"} <= set(at5)
    assert at5["nonfinite_gradients"]["where"] in NAMES
    assert at5["nonfinite_weights"]["where"] in NAMES
    assert at5["nonfinite_gradients"]["rank"] == replica
    # one finding each, not one per replica
    assert len([f for f in run["at5"] if f["detector"] == "nonfinite_loss"]) == 1
    assert run["clean"]


def test_raise_on_raises_training_problem_under_the_strategy(runs):
    run = runs["nan_replica1"]
    assert run["raised"] is not None and "nonfinite_loss (error) at step 5" in run["raised"]
    assert run["raise_clean"]


def test_an_exploding_learning_rate_is_caught_as_on_one_device(runs):
    mirrored, single = runs["exploding_lr"]["mirrored"], runs["exploding_lr"]["single"]
    assert single["first"] is not None and single["stopped_by"] is not None
    assert mirrored["first"]["detector"] == single["first"]["detector"]
    assert abs(mirrored["first"]["step"] - single["first"]["step"]) <= 1
    assert mirrored["stopped_by"]["detector"] == single["stopped_by"]["detector"]
    assert abs(mirrored["stopped_by"]["step"] - single["stopped_by"]["step"]) <= 1
    assert mirrored["first"]["step"] >= 20  # not before the fault


def test_other_strategies_are_refused_by_name_and_clipping_is_warned_about(runs):
    refused = runs["refusals"]
    assert refused["central"] is not None and "CentralStorageStrategy" in refused["central"]
    assert len(refused["clip_warnings"]) == 1 and "MirroredStrategy" in refused["clip_warnings"][0]


def test_recover_skips_a_replicas_bad_batch_on_every_replica_as_if_never_seen(runs):
    recover = runs["recover"]
    assert recover["acts"] == [[3, "skip"], [6, "skip"]]
    # nothing hidden: the non-finite step is reported (a ReLU that maps NaN to 0, built
    # explicitly as TensorFlow's fused one behaves on some CPUs, turns the NaN input into
    # a NaN gradient, not a NaN loss) and named with the replica that saw it (a repeat of
    # the same error is counted in the summary, not reported again)
    assert recover["nonfinite"] == [[3, "nonfinite_gradients", 0]]
    # weights, slots and iterations, bit for bit as the strategy's own fit without those
    # batches, and as one device's up to the order of the replicas' sums
    assert recover["same_as_twin"] and recover["close_to_one_device"]
    assert recover["clean"]
    acts = recover["rollback_acts"]
    assert acts[:4] == [[5, "skip"], [5, "cool"], [6, "skip"], [6, "rollback"]]
    assert "steps_per_execution=2" in recover["several_steps"]
