"""DeepSpeed's ZeRO under Lightning's ``DeepSpeedStrategy``: two real CPU ranks (gloo),
through a seam (``benchmarks.cpu_deepspeed``: Lightning runs DeepSpeed only on CUDA).
Stage 2 holds whole weights and each rank's slice of the gradients; stage 3 each rank's
slice of the weights too.

Both ranks run the scenarios of ``_fsdp_worker.py`` once; ``ddp_norms`` is the DDP twin
of the ``zero*_norms`` runs: the same weights, the same batches, so the same statistics.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from _launch import needs_gloo, run_ranks
from _rank_files import assert_drift_named, compare_statistics, findings, observed, ranks

from stethoscope.record import RunRecord

WORKER = Path(__file__).with_name("_fsdp_worker.py")
SCENARIOS = (
    "ddp_norms",
    "zero2_norms",
    "zero3_norms",
    "zero2_nan",
    "zero3_nan",
    "zero2_perturb",
    "zero2_recover",
    "zero2_uncombined",
    "zero3_uncombined",
    "zero2_bf16",
    "zero1_bf16",
    "zero1_uncombined",
    "ddp_accumulate",
    "zero2_accumulate",
    "zero3_accumulate",
    "ddp_fp8",
    "zero2_fp8",
    "zero3_fp8",
    "zero2_fp16",
)
#: Seconds for both ranks to import torch, Lightning and DeepSpeed and run every scenario
#: (~20 s).
TIMEOUT = 240

pytestmark = [
    needs_gloo,
    # the Makefile installs it (make test): a missing DeepSpeed is a set-up to mend
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (make test)"
    ),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run both ranks through every scenario; the directory of what they wrote."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("zero"), SCENARIOS, TIMEOUT)


@pytest.mark.parametrize(
    ("layout", "reference", "steps"),
    [
        ("zero2_norms", "ddp_norms", 24),
        ("zero3_norms", "ddp_norms", 24),
        # two batches a step: Lightning calls the engine's step on each, and the
        # callback reads the gradients on the second, where DeepSpeed holds them
        ("zero2_accumulate", "ddp_accumulate", 12),
        ("zero3_accumulate", "ddp_accumulate", 12),
    ],
)
def test_zero_statistics_equal_those_of_the_unsharded_model(runs, layout, reference, steps):
    sharded, replicated = observed(runs, layout), observed(runs, reference)
    assert sorted(sharded) == sorted(replicated) == list(range(0, steps, 2))
    # with two batches a step, Lightning divides the loss by 2 and DeepSpeed's backward
    # divides it by 2 again: DeepSpeed's gradients are half DDP's, and Adam's updates,
    # nearly blind to a gradient's scale, move the weights apart by Adam's epsilon only
    halved, rtol = (2.0, 1e-3) if layout.endswith("_accumulate") else (1.0, 1e-5)
    # the counts exactly: ZeRO-3's gradient buffers outlive the step, and are held no
    # more before the next backward pass, as DDP's zeroed gradients
    compared = compare_statistics(sharded, replicated, rtol=rtol, grads_over=halved)
    norms = {"grad_norm", "weight_norm", "update_norm", "prev_weight_norm", "unit_zero"}
    # the record asks for the histograms (not with two batches a step); the stale
    # gradients are counted where the optimizer steps, over the parameters it steps
    assert compared == norms | ({"grad_hist", "stale_grads"} if halved == 1 else {"stale_grads"})
    found = findings(runs, layout)
    if layout.endswith("_accumulate"):  # said once, an info: the model trains with Adam
        (said,) = found
        assert (said["detector"], said["severity"], said["value"]) == (
            "loss_divided_twice",
            "info",
            2.0,
        )
        assert said["step"] == 0 and "1/2 of the mean" in said["message"]
    else:
        assert found == []  # a healthy run: quiet
    assert findings(runs, reference) == []  # DDP divides once
    if layout.endswith("_norms"):  # the record describes the whole model, as DDP's does
        with (
            RunRecord(runs / f"{layout}-record") as zero,
            RunRecord(runs / f"{reference}-record") as ddp,
        ):
            assert zero.config["model"] == ddp.config["model"]
            assert zero.config["model"]["total"] == 2916  # ZeRO-3's parameters are empty


@pytest.mark.parametrize("layout", ["zero2_fp8", "zero3_fp8"])
def test_fp8_readiness_counts_against_each_whole_tensors_peak_as_ddp(runs, layout):
    sharded, replicated = observed(runs, layout), observed(runs, "ddp_fp8")
    measured = [step for step, want in replicated.items() if "fp8_underflow" in want]
    assert measured and sorted(sharded) == sorted(replicated)
    for step in measured:  # the peaks agreed over the ranks first, then counts summed
        for field in ("fp8_underflow", "fp8_amax"):
            np.testing.assert_allclose(
                sharded[step][field], replicated[step][field], rtol=1e-5, err_msg=field
            )


@pytest.mark.parametrize(
    ("stage", "combined_right"),
    [(2, "zero2_norms"), (3, "zero3_norms"), (1, "zero1_bf16")],  # 1: BF16_Optimizer
)
def test_the_combined_norms_are_checked_against_deepspeeds_own(runs, stage, combined_right):
    for r in ranks(runs, combined_right):  # nothing to say
        assert not any("disagree" in w for w in r["warnings"])
    first, second = ranks(runs, f"zero{stage}_uncombined")  # each rank's own slices
    (warning,) = [w for w in first["warnings"] if "disagree" in w]
    assert "DeepSpeed's gathered gradients" in warning
    assert not any("disagree" in w for w in second["warnings"])  # rank zero says it


@pytest.mark.parametrize("stage", [2, 3])
def test_nan_loss_on_one_rank_is_named_and_every_rank_stops_on_the_same_step(runs, stage):
    found = findings(runs, f"zero{stage}_nan")
    first = min((f for f in found if f["detector"] == "nonfinite_loss"), key=lambda f: f["step"])
    assert (first["step"], first["rank"], first["where"]) == (37, 1, "loss")
    for r in ranks(runs, f"zero{stage}_nan"):  # agreed at the next meeting, step 48
        assert r["global_step"] == 49 and r["should_stop"]
        assert (r["stopped_by"]["step"], r["stopped_by"]["rank"]) == (37, 1)


def test_zero2s_replicas_are_compared_and_zero3_says_it_has_none(runs):
    # below stage 3 every rank holds every weight whole: compared as DDP's replicas
    assert_drift_named(runs, "zero2_perturb")
    assert not any("replica" in w for w in ranks(runs, "zero2_norms")[0]["warnings"])
    (off,) = [w for w in ranks(runs, "zero3_norms")[0]["warnings"] if "replica" in w]
    assert "no replica to compare" in off


def test_recover_is_refused_under_deepspeed_before_any_step(runs):
    for r in ranks(runs, "zero2_recover"):
        assert r["global_step"] == 0
        assert "DeepSpeedZeroOptimizer" in r["refused"] and "recover=False" in r["refused"]


@pytest.mark.parametrize("scenario", ["zero2_bf16", "zero1_bf16"])
def test_bf16_weights_with_master_copies_round_nothing_away(runs, scenario):
    # DeepSpeed updates float32 master copies of the bf16 weights: with a learning rate
    # that rounds most updates of bf16-true weights away (see the FSDP2 test), no update
    # is lost, and rounded_updates does not apply
    steps = observed(runs, scenario)
    assert len(steps) >= 3
    for row in steps.values():
        assert all(v is None for v in row["update_lost"])
        assert all(np.isfinite(row["grad_norm"]))
    assert findings(runs, scenario) == []


def test_bf16_gradients_are_judged_where_deepspeed_keeps_them_in_bf16(runs):
    # ZeRO-2 keeps bf16 gradients: their precision is measured; BF16_Optimizer (stage 1,
    # fp32 accumulation) keeps float32 ones, which the precision rules do not judge
    zero2, zero1 = observed(runs, "zero2_bf16"), observed(runs, "zero1_bf16")
    for row in zero2.values():
        assert all(v is not None for v in row["grad_zero"] + row["grad_peak"])
    for row in zero1.values():
        assert all(v is None for v in row["grad_zero"])


def test_fp16_overflows_are_left_to_deepspeeds_loss_scaler_which_is_read(runs):
    # from a scale of 2**24 the first steps overflow: DeepSpeed's engine skips each of
    # them and lowers its scale. The run goes on (it stopped at step 1 on a
    # nonfinite_gradients error before DeepSpeed's scaler was known), the overflow is an
    # info naming the scaler, and loss_scale_collapse, after the search, is quiet
    for r in ranks(runs, "zero2_fp16"):
        assert r["global_step"] == 40 and r["stopped_by"] is None and not r["should_stop"]
        assert r["skipped_steps"] > 0
    found = findings(runs, "zero2_fp16")
    assert {(f["detector"], f["severity"]) for f in found} == {("nonfinite_gradients", "info")}
    assert "with a finite loss: DeepSpeed's loss scaler skips this step" in found[0]["message"]
    # the scale and the skipped steps handed to the detectors are the engine's own
    measured = {s: row["loss_scale"] for s, row in observed(runs, "zero2_fp16").items()}
    assert sorted(measured) == list(range(0, 40, 2))  # every other step: each counted once
    scales, skipped, counted = zip(*(measured[s] for s in sorted(measured)), strict=True)
    assert scales[0] == 2.0**24 and scales[-1] == ranks(runs, "zero2_fp16")[0]["loss_scale"]
    assert sum(skipped) == ranks(runs, "zero2_fp16")[0]["skipped_steps"]
    assert sum(counted) == 39  # steps 0 to 38, the last one measured
    # a step the engine skipped updated nothing: its all-zero update is not judged
    rows = observed(runs, "zero2_fp16")
    skipped_now = [s for s in sorted(rows) if "update_norm" not in rows[s]]
    assert skipped_now and skipped_now == list(range(0, skipped_now[-1] + 1, 2))
    assert all("update_norm" in rows[s] for s in rows if s > skipped_now[-1])
