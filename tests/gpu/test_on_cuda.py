"""On a CUDA device, for real: no host sync by stethoscope on a training step in any mode
we offer, a NaN reported without a crash, and a skip bit for bit. Skipped without CUDA
(the CPU suite drives the same branches on a simulated device: see
``tests/callbacks/_accelerator.py``). Run on a GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import argparse

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(tmp_path):
    from benchmarks.gpu import Run

    return Run(argparse.Namespace(cpu=False, out=tmp_path, budget=600.0))


SYNC_FREE = [
    "defaults",
    "record=",
    "log_stats=True",
    "recover=True, fused AdamW",
    "recover=True, 16-mixed, GradScaler, fused AdamW",
    "defaults, bf16-true",
    "defaults, 16-mixed, GradScaler",
]


@pytest.mark.parametrize("mode", SYNC_FREE)
def test_no_training_step_waits_for_the_device(mode, tmp_path):
    from benchmarks.gpu import census_fit

    result = census_fit(_run(tmp_path), mode, 120)
    assert result["error"] is None
    assert result["steps"] == 120
    assert result["stethoscope_train"] == 0, result["stethoscope_sites"]


def test_a_foreach_optimizer_under_recover_is_read_on_the_host_twice_a_step(tmp_path):
    from benchmarks.gpu import census_fit

    result = census_fit(_run(tmp_path), "recover=True, AdamW (foreach)", 60)
    assert result["error"] is None
    assert result["stethoscope_train"] == 2 * 60, result["stethoscope_sites"]


def test_the_census_sees_a_sync(tmp_path):
    from benchmarks.gpu import Census, _tracker

    tracker = _tracker()
    tracker.phase = "train"
    with Census(tracker) as census:
        torch.ones(1, device="cuda").sum().item()
    assert len(census.syncs) == 1


@pytest.mark.parametrize("recover", [False, True])
def test_a_nan_loss_is_named_without_a_crash(recover, tmp_path):
    from benchmarks.gpu import fault_fit

    result = fault_fit(_run(tmp_path), "NaN", 120, {60: 1}, recover=recover)
    assert result["error"] is None
    assert any(f["detector"] == "nonfinite_loss" and f["step"] == 60 for f in result["findings"])
    assert result["steps"] == 120 if recover else result["stopped_by"][1] >= 60


@pytest.mark.parametrize("layout", ["FSDP2", "FSDP1"])
def test_sharded_strategies_hand_the_detectors_the_unsharded_norms(layout, tmp_path):
    from benchmarks.gpu_sharded import compare, norms_fit

    run = _run(tmp_path)
    result = compare(norms_fit(run, layout), norms_fit(run, "plain"))
    assert result["steps_compared"] >= 10 and result["names_match"]
    assert max(result["largest_relative_difference"].values()) < 1e-5, result
