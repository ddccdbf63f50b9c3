"""What the ranks of a distributed test wrote, read back: the findings rank zero's sink
kept, each rank's result, and what the detectors were handed (the workers write them:
``_ddp_worker.py``, ``_fsdp_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def findings(out: Path, scenario: str) -> list[dict]:
    """Rank zero's findings of ``scenario``, as its JSONL sink wrote them."""
    path = out / f"{scenario}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def ranks(out: Path, scenario: str) -> list[dict]:
    """What each of the two ranks wrote of ``scenario`` (its last step, its stop...)."""
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in (0, 1)]


def observed(out: Path, scenario: str) -> dict[int, dict]:
    """The per-parameter statistics handed to rank zero's detectors, by step."""
    steps = json.loads((out / f"{scenario}-observed.json").read_text())
    return {int(step): row for step, row in steps.items()}


def assert_drift_named(out: Path, scenario: str) -> None:
    """Rank 1's ``net.2.weight`` moved after step 20 (``rank_fault="perturb"``): the one
    error is ``replica_divergence``'s, at step 20, with rank 1, and both ranks stop."""
    errors = [f for f in findings(out, scenario) if f["severity"] == "error"]
    assert [(f["detector"], f["where"], f["rank"], f["step"]) for f in errors] == [
        ("replica_divergence", "net.2.weight", 1, 20)
    ]
    for r in ranks(out, scenario):
        assert r["global_step"] == 21 and r["stopped_by"]["detector"] == "replica_divergence"


def compare_statistics(
    sharded: dict[int, dict], replicated: dict[int, dict], *, rtol: float, grads_over: float = 1.0
) -> set[str]:
    """Assert that the statistics handed to the detectors of a sharded run (see
    :func:`observed`) are those of the unsharded run, at every step: the norms to
    ``rtol`` (the reference's gradient norms divided by ``grads_over``), the counts
    (dead units, histograms, stale gradients) exactly. Returns the fields compared."""
    compared = set()
    for step, want in replicated.items():
        got = sharded[step]
        assert got["names"] == want["names"] and len(want["names"]) == 8  # 4 layers
        for field in ("grad_norm", "weight_norm", "update_norm", "prev_weight_norm"):
            if field in want:
                a = np.array(got[field], dtype=float)
                b = np.array(want[field], dtype=float) / (grads_over if field == "grad_norm" else 1)
                np.testing.assert_allclose(a, b, rtol=rtol, err_msg=f"{field} at step {step}")
                compared.add(field)
        for field in ("unit_zero", "grad_hist", "stale_grads"):
            if field in want:
                assert got[field] == want[field], (field, step)
                compared.add(field)
    return compared
