"""Sharded training: two real CPU ranks (gloo) under Lightning's ``ModelParallelStrategy``
(FSDP2, each rank holding half of every parameter's rows as a DTensor; HSDP; tensor
parallelism) and ``FSDPStrategy`` (FSDP1's flat slices, through a CPU seam: see
``_fsdp_worker.CPUFSDPStrategy``).

Both ranks run every scenario of ``_fsdp_worker.py`` once; each test reads what they
wrote. The ``ddp_norms`` scenario is the DDP twin of ``fsdp_norms``: the same weights,
the same batches, so the same statistics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _launch import needs_gloo, run_ranks
from _rank_files import assert_drift_named, compare_statistics, findings, observed, ranks

from stethoscope.record import RunRecord

WORKER = Path(__file__).with_name("_fsdp_worker.py")
SCENARIOS = (
    "fsdp_norms",
    "ddp_norms",
    "fsdp_nan",
    "fsdp_skip",
    "fsdp_twin",
    "fsdp_rollback",
    "fsdp_rollback_disk",
    "fsdp_uncombined",
    "hsdp_norms",
    "hsdp_perturb",
    "tp_norms",
    "fsdp_same_norms",
    "fsdp_bf16",
    "ddp_bf16",
    "fsdp1_norms",
    "fsdp1_skip",
    "fsdp1_twin",
    "fsdp1_rollback",
    "fsdp1_rollback_disk",
    "ddp_rollback",
)
#: What four ranks run: FSDP1's HYBRID_SHARD (2 replicas of 2 shards) and its DDP twin.
ON_FOUR_RANKS = (
    "ddp_norms",
    "hsdp1_norms",
    "hsdp1_perturb",
    "hsdp1_gate",
    "ddp_gate",
    "hsdp1_skip",
    "hsdp1_twin",
)
#: What the two ranks run as two nodes of one process each.
ON_TWO_NODES = ("fsdp_norms", "fsdp_nan", "fsdp_rollback_disk")
#: Seconds for both ranks to import torch and Lightning and run every scenario (~15 s).
TIMEOUT = 180

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run both ranks through every scenario; the directory of what they wrote."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("fsdp"), SCENARIOS, TIMEOUT)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    """Four ranks through :data:`ON_FOUR_RANKS`: FSDP1's hybrid strategy needs two ranks
    in each of two replicas (with one rank per shard group torch makes it NO_SHARD)."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("four"), ON_FOUR_RANKS, TIMEOUT, world=4)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Path:
    """The same ranks as two nodes (``NODE_RANK`` 0 and 1, each ``LOCAL_RANK`` 0), each
    writing its findings and record under ``node{NODE_RANK}``, as on its own disk."""
    out = tmp_path_factory.mktemp("nodes")
    return run_ranks(WORKER, out, ON_TWO_NODES, TIMEOUT, nodes=True)


@pytest.mark.parametrize(
    ("layout", "reference"),
    [
        ("fsdp_norms", "ddp_norms"),  # every parameter Shard(0) over both ranks
        ("hsdp_norms", "ddp_norms"),  # (Replicate(), Shard(0)): each counted by rank 0
        # tensor parallelism, both ranks on the same batches: weights Shard(0) and
        # Shard(1), the row-split layers' biases Replicate()
        ("tp_norms", "fsdp_same_norms"),
        # FSDP1, use_orig_params: each parameter a 1-D slice of its elements, empty on
        # some rank (wrapped by hand on the CPU, where Lightning would not wrap)
        ("fsdp1_norms", "ddp_norms"),
    ],
)
def test_sharded_statistics_equal_those_of_the_unsharded_model(runs, layout, reference):
    sharded, replicated = observed(runs, layout), observed(runs, reference)
    # every other step sampled, under both strategies alike
    assert sorted(sharded) == sorted(replicated) == list(range(0, 24, 2))
    # the norms to rel. 1e-5; which units got no gradient, and the histograms, exactly
    compared = compare_statistics(sharded, replicated, rtol=1e-5)
    assert compared == {
        "grad_norm",
        "weight_norm",
        "update_norm",
        "prev_weight_norm",
        "unit_zero",
        "grad_hist",
        "stale_grads",
    }


def test_the_precision_rules_judge_a_sharded_bf16_run_as_an_unsharded_one(runs):
    sharded, replicated = observed(runs, "fsdp_bf16"), observed(runs, "ddp_bf16")
    assert sorted(sharded) == sorted(replicated) and len(replicated) >= 3
    for step, want in replicated.items():  # shares of counts summed over the shards
        for field in ("grad_subnormal", "grad_zero", "grad_peak", "update_lost"):
            assert sharded[step][field] == want[field], (field, step)
    fp8 = [step for step, want in replicated.items() if "fp8_underflow" in want]
    assert fp8, "fp8_readiness measured nothing"
    for step in fp8:  # counted against each whole tensor's peak, agreed first
        for field in ("fp8_underflow", "fp8_amax"):
            assert sharded[step][field] == replicated[step][field], (field, step)
    for scenario in ("fsdp_bf16", "ddp_bf16"):  # once, from rank zero, under both
        found = [(f["detector"], f["where"], f["rank"]) for f in findings(runs, scenario)]
        assert found == [("rounded_updates", "net.4.weight", 0)], scenario


def test_the_first_sampled_step_checks_the_combined_norms_against_torchs(runs):
    for r in ranks(runs, "fsdp_norms"):  # combined right: nothing to say
        assert not any("disagree" in w for w in r["warnings"])
    first, second = ranks(runs, "fsdp_uncombined")  # each rank's own shards' norms
    (warning,) = [w for w in first["warnings"] if "disagree" in w]
    assert "may be wrong" in warning
    assert not any("disagree" in w for w in second["warnings"])  # rank zero says it


def test_a_replica_that_drifts_under_hsdp_is_named_and_every_rank_stops(runs):
    # HSDP's replicas are compared as DDP's are: each tensor's checksum, summed over its
    # shards, on every rank
    assert_drift_named(runs, "hsdp_perturb")
    # tensor parallelism's replicated biases are compared too, and agree
    assert findings(runs, "tp_norms") == []


def test_a_sharded_run_is_quiet_and_records_the_whole_model(runs):
    assert findings(runs, "fsdp_norms") == []
    replicated = observed(runs, "ddp_norms")
    with RunRecord(runs / "fsdp_norms-record") as record:
        assert list(record.losses().steps) == list(range(24))
        grads = record.layers("grad_norm")  # the whole model's, in rank zero's record
        assert grads.names == tuple(replicated[0]["names"])
        np.testing.assert_allclose(grads.values[0], replicated[0]["grad_norm"], rtol=1e-5)
        hist = record.layers("weight_hist")  # every element counted once, over both ranks
        assert hist.values[0].sum(axis=-1).tolist() == [
            float(n) for n in (640, 32, 1024, 32, 1024, 32, 128, 4)
        ]


@pytest.mark.parametrize("layout", ["fsdp_norms", "fsdp1_norms", "tp_norms"])
def test_the_record_describes_the_whole_model(runs, layout):
    # FSDP1's parameters are 1-D slices under wrapped names; a DTensor's shape is whole
    with (
        RunRecord(runs / f"{layout}-record") as sharded,
        RunRecord(runs / "ddp_norms-record") as ddp,
    ):
        assert sharded.config["model"]["parameters"] == ddp.config["model"]["parameters"]


def test_nan_loss_on_one_rank_is_named_and_every_rank_stops_on_the_same_step(runs):
    found = findings(runs, "fsdp_nan")
    first = min((f for f in found if f["detector"] == "nonfinite_loss"), key=lambda f: f["step"])
    assert (first["step"], first["rank"], first["where"]) == (37, 1, "loss")
    # agreed at the next meeting, step 48, where every rank measured its shards: the
    # gradients of the whole model are named there, in backward order
    gradients = next(f for f in found if f["detector"] == "nonfinite_gradients")
    assert gradients["step"] == 48 and gradients["where"] == "net.4.bias"
    for r in ranks(runs, "fsdp_nan"):
        assert r["global_step"] == 49 and r["should_stop"]
        assert (r["stopped_by"]["step"], r["stopped_by"]["rank"]) == (37, 1)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp1"])
def test_a_skipped_nan_batch_leaves_every_shard_as_if_never_seen(runs, layout):
    pairs = zip(ranks(runs, f"{layout}_skip"), ranks(runs, f"{layout}_twin"), strict=True)
    for skipped, twin in pairs:
        assert [(step, act) for step, act, _ in skipped["ladder"]] == [(5, "skip")]
        assert skipped["global_step"] == 20 and twin["global_step"] == 19
        assert skipped["shards"] == twin["shards"]  # bit for bit, on each rank
    mine, other = ranks(runs, f"{layout}_skip")[1]["ladder"][0][2], ranks(runs, f"{layout}_skip")[0]
    assert "the loss is nan" in mine and "on another rank" in other["ladder"][0][2]


@pytest.mark.parametrize("layout", ["fsdp", "fsdp1"])
def test_an_error_one_rank_holds_rolls_every_rank_back_alike(runs, layout):
    first, second = ranks(runs, f"{layout}_rollback")
    for r in (first, second):
        assert r["global_step"] == 48 and not r["should_stop"]
    assert first["ladder"] == second["ladder"]
    assert [(step, act) for step, act, _ in first["ladder"]] == [(31, "rollback"), (31, "cool")]
    assert "snapshot of step 24" in first["ladder"][0][2]
    # each rank restored its own shards: they differ, as two halves do...
    assert first["shards"] != second["shards"]
    # ...and the whole model then trains on as under DDP, rolled back alike
    sharded, replicated = observed(runs, f"{layout}_rollback"), observed(runs, "ddp_rollback")
    after = [step for step in replicated if step > 31 and step in sharded]
    assert len(after) >= 4
    for step in after:
        np.testing.assert_allclose(
            sharded[step]["weight_norm"], replicated[step]["weight_norm"], rtol=1e-5
        )


@pytest.mark.parametrize("layout", ["fsdp", "fsdp1"])
def test_snapshots_in_a_directory_both_ranks_share_stay_each_ranks_own(runs, layout):
    # on disk, in one directory: each rank rolls back to its own shards, as in memory
    memory, disk = f"{layout}_rollback", f"{layout}_rollback_disk"
    pairs = zip(ranks(runs, memory), ranks(runs, disk), strict=True)
    for memory, disk in pairs:
        assert disk["ladder"] == memory["ladder"]
        assert disk["shards"] == memory["shards"]


def test_two_nodes_agree_and_only_the_first_node_writes(nodes, runs):
    first, second = ranks(nodes, "fsdp_nan")
    assert (second["node_rank"], second["local_rank"]) == (1, 0)
    for r in (first, second):
        assert r["global_step"] == 49 and r["stopped_by"]["rank"] == 1
    # the statistics, the record and the findings are rank zero's, on its node alone
    assert observed(nodes, "fsdp_norms") == observed(runs, "fsdp_norms")
    assert findings(nodes / "node0", "fsdp_nan") == findings(runs, "fsdp_nan")
    assert (nodes / "node0" / "fsdp_norms-record" / "record.sqlite").is_file()
    # node 1 made its sink's file and its record's directory, to refuse a bad path before
    # training, and wrote nothing in them
    assert (nodes / "node1" / "fsdp_nan.jsonl").read_text() == ""
    assert list((nodes / "node1" / "fsdp_norms-record").iterdir()) == []
    # the snapshots, on a file system both nodes share: each rank's own
    pairs = zip(ranks(runs, "fsdp_rollback"), ranks(nodes, "fsdp_rollback_disk"), strict=True)
    for memory, disk in pairs:
        assert disk["shards"] == memory["shards"]


def test_fsdp1_hybrid_shard_counts_each_replica_once_and_compares_them(four):
    # each rank holds a 1-D slice of every parameter, twice over the run (once per
    # replica): the first replica counts them, and the statistics are DDP's on 4 ranks
    sharded, replicated = observed(four, "hsdp1_norms"), observed(four, "ddp_norms")
    assert sorted(sharded) == sorted(replicated) == list(range(0, 24, 2))
    assert "unit_zero" in compare_statistics(sharded, replicated, rtol=1e-5)
    assert findings(four, "hsdp1_norms") == []
    assert not any("neither" in w for w in ranks(four, "hsdp1_norms")[0]["warnings"])
    # rank 1 moves its slice of net.2.weight after step 20: its replica's whole weight
    # (summed over ranks 0 and 1) differs from the other replica's (ranks 2 and 3)
    errors = [f for f in findings(four, "hsdp1_perturb") if f["severity"] == "error"]
    assert [(f["detector"], f["where"], f["step"]) for f in errors] == [
        ("replica_divergence", "net.2.weight", 20)
    ]
    assert "rank 2, 3 from rank 0" in errors[0]["message"]
    for r in ranks(four, "hsdp1_perturb"):
        assert r["global_step"] == 21 and r["stopped_by"]["detector"] == "replica_divergence"


def test_fsdp1_hybrid_shard_recovers_as_ddp(four):
    # the gate's norm of the whole model counts each replica's slices once (before, it
    # counted both replicas: sqrt(2) too large), on every rank
    reference = ranks(four, "ddp_gate")[0]["gate_norms"]
    assert len(reference) == 12
    for r in ranks(four, "hsdp1_gate"):
        np.testing.assert_allclose(r["gate_norms"], reference, rtol=1e-5)
    # a NaN batch on rank 1 at step 5: skipped by every rank, each slice bit for bit as
    # a twin's whose data never held it
    pairs = zip(ranks(four, "hsdp1_skip"), ranks(four, "hsdp1_twin"), strict=True)
    for skipped, twin in pairs:
        assert [(step, act) for step, act, _ in skipped["ladder"]] == [(5, "skip")]
        assert skipped["shards"] == twin["shards"]
