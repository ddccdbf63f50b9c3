"""Layer 1: replica_divergence and straggler on synthetic facts gathered from every rank."""

from __future__ import annotations

import numpy as np
import pytest

from stethoscope.detectors import ReplicaDivergence, Straggler
from stethoscope.observation import Observation

NAMES = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "bn.running_mean")
BUFFER = np.array([False, False, False, False, True])


def replicas(step: int, ranks: int = 2, *, changes=()) -> Observation:
    """Checksums of :data:`NAMES` on each rank; ``changes``: (rank, tensor index) that differ."""
    sums = np.tile(np.arange(len(NAMES), dtype=np.int64) * 1_000_003 + step, (ranks, 1))
    for rank, i in changes:
        sums[rank, i] += 1 + rank  # a few ulps somewhere in that tensor, by rank
    return Observation(step=step, replica_names=NAMES, replica_buffer=BUFFER, replica_sums=sums)


def busy(step: int, times) -> Observation:
    return Observation(step=step, rank_busy=np.asarray(times, dtype=float))


def run(detector, observations):
    return [f for o in observations for f in detector.update(o)]


# -- replica_divergence -------------------------------------------------------------------------
def test_identical_replicas_are_quiet_and_remember_when_they_agreed():
    d = ReplicaDivergence()
    assert run(d, [replicas(t, ranks=4) for t in range(50)]) == []
    assert d.state == {"agreed": 49}


@pytest.mark.parametrize(
    ("ranks", "changes", "where", "rank", "reference"),
    [
        pytest.param(2, [(1, 2)], "net.2.weight", 1, "rank 0", id="two-ranks"),
        pytest.param(2, [(1, 3), (1, 2)], "net.2.weight", 1, "rank 0", id="first-in-order"),
        pytest.param(4, [(2, 1)], "net.0.bias", 2, "the majority", id="odd-one-out"),
        pytest.param(4, [(0, 0)], "net.0.weight", 0, "the majority", id="rank-zero-is-odd"),
        pytest.param(3, [(1, 3), (2, 3), (2, 4)], "net.2.bias", 1, "rank 0", id="no-majority"),
    ],
)
def test_a_differing_parameter_is_an_error_naming_it_and_the_rank(
    ranks, changes, where, rank, reference
):
    d = ReplicaDivergence()
    run(d, [replicas(t, ranks) for t in range(10)])
    (f,) = d.update(replicas(10, ranks, changes=changes))
    assert (f.severity.value, f.where, f.rank, f.step) == ("error", where, rank, 10)
    assert f"differs on rank {rank}" in f.message and f"from {reference}" in f.message
    assert "they still agreed at step 9" in f.message
    assert f.value == len({i for _, i in changes})


@pytest.mark.parametrize(
    ("grads", "says", "not_says"),
    [
        (None, "changes the weights on one rank only", "gradients"),
        ("same", "gradients agreed as the step used them", "not all-reduced"),
        ("differ", "(1 of 4 parameters, first net.2.weight): they were not all-reduced", "agreed"),
    ],
    ids=["unknown", "gradients-agree", "gradients-differ"],
)
def test_the_cause_follows_whether_the_gradients_agreed(grads, says, not_says):
    obs = replicas(10, changes=[(1, 2)])
    if grads is not None:
        obs.replica_grad_sums = np.tile(np.arange(4, dtype=np.int64), (2, 1))
        if grads == "differ":
            obs.replica_grad_sums[1, 2] += 7
    (f,) = ReplicaDivergence().update(obs)
    assert says in f.message and not_says not in f.message


def test_a_buffer_alone_is_a_warning_and_a_parameter_wins_over_it():
    d = ReplicaDivergence()
    (f,) = d.update(replicas(0, changes=[(1, 4)]))
    assert (f.severity.value, f.where, f.rank) == ("warning", "bn.running_mean", 1)
    assert "SyncBatchNorm" in f.message and "still agreed" not in f.message
    (f,) = d.update(replicas(1, changes=[(1, 4), (1, 3)]))
    assert (f.severity.value, f.where) == ("error", "net.2.bias")


def test_divergence_persists_and_is_reported_at_each_check():
    d = ReplicaDivergence()
    found = run(d, [replicas(t, changes=[(1, 0)] if t >= 5 else ()) for t in range(10)])
    assert [f.step for f in found] == [5, 6, 7, 8, 9]
    assert d.state == {"agreed": 4}


@pytest.mark.parametrize(
    "sums",
    [np.zeros((1, 5), np.int64), np.zeros((2, 0), np.int64), np.zeros(5, np.int64)],
    ids=["one-rank", "no-tensors", "flat"],
)
def test_nothing_to_compare_is_quiet(sums):
    obs = Observation(step=0, replica_names=NAMES, replica_buffer=BUFFER, replica_sums=sums)
    assert ReplicaDivergence().update(obs) == []


# -- straggler ----------------------------------------------------------------------------------
def jitter(n: int, ranks: int, *, seed: int = 0, base: float = 0.2, sigma: float = 0.15):
    """Healthy per-rank seconds per step: lognormal jitter of ``sigma`` around ``base``."""
    rng = np.random.default_rng(seed)
    return base * rng.lognormal(0.0, sigma, (n, ranks))


@pytest.mark.parametrize("ranks", [2, 4, 64])
@pytest.mark.parametrize("base", [0.0005, 0.2], ids=["1ms-steps", "200ms-steps"])
def test_healthy_jitter_never_fires(ranks, base):
    d = Straggler()
    times = jitter(2000, ranks, base=base)
    # and now and then one rank has a very slow batch (a GC pause, a cache miss)
    rng = np.random.default_rng(1)
    for t in rng.choice(2000, 60, replace=False):
        times[t, rng.integers(ranks)] *= 5
    assert run(d, [busy(t, row) for t, row in enumerate(times)]) == []


@pytest.mark.parametrize(("ranks", "slow"), [(2, 1), (2, 0), (8, 5)])
def test_a_persistently_slow_rank_is_named_once_the_window_is_full(ranks, slow):
    d = Straggler()
    times = jitter(40, ranks, base=0.1, sigma=0.05)
    times[10:, slow] *= 2.0  # from sample 10 on
    found = run(d, [busy(t, row) for t, row in enumerate(times)])
    assert found and {(f.where, f.rank) for f in found} == {(f"rank {slow}", slow)}
    first = found[0]
    # more than half of the last 8 samples slow: 5 of them, at sample 14
    assert first.step == 14 and first.severity.value == "warning"
    assert first.value == pytest.approx(2.0, rel=0.15) and first.threshold == 1.5
    assert f"Rank {slow} is a straggler" in first.message


def test_a_short_slow_spell_is_not_a_straggler():
    d = Straggler()
    times = jitter(40, 2, base=0.1, sigma=0.05)
    times[20:24, 1] *= 10  # 4 of 8 samples, however slow: not more than half the window
    assert run(d, [busy(t, row) for t, row in enumerate(times)]) == []


def test_a_large_ratio_on_tiny_steps_is_not_a_straggler():
    d = Straggler()  # 3x slower, but 2 ms: scheduler noise, not worth a warning
    assert run(d, [busy(t, [0.001, 0.003]) for t in range(30)]) == []
    assert len(run(Straggler(min_excess=0.001), [busy(t, [0.001, 0.003]) for t in range(30)]))


def test_samples_with_a_rank_that_measured_nothing_are_skipped():
    d = Straggler()
    obs = [busy(t, [0.1, 0.3] if t % 2 else [0.1, np.nan]) for t in range(30)]
    found = run(d, obs)
    assert found[0].step == 15  # the 8th sample that counts
    assert all(np.isfinite(x) for row in d.state["ratios"] for x in row)


def test_a_new_world_size_starts_the_window_again():
    d = Straggler()
    run(d, [busy(t, [0.1, 0.3]) for t in range(7)])
    run(d, [busy(t, [0.1, 0.1, 0.3]) for t in range(7, 14)])
    assert len(d.state["ratios"]) == 7 and all(len(r) == 3 for r in d.state["ratios"])
    assert d.update(busy(14, [0.1, 0.1, 0.3]))[0].rank == 2


def test_a_rank_that_takes_no_time_against_others_that_do():
    d = Straggler()  # a zero median (idle ranks): ratios stay finite in the state
    found = run(d, [busy(t, [0.0, 0.0, 0.5]) for t in range(8)])
    assert found and found[0].rank == 2
    assert max(max(r) for r in d.state["ratios"]) == 1e6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"ratio": 1}, "ratio=1"), ({"ratio": 0.9}, "ratio=0.9"), ({"window": 0}, "window=0")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Straggler(**kwargs)
