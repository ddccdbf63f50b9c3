"""The one declaration per statistic, and what derives from it."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from stethoscope.engine.monitor import Monitor
from stethoscope.observation import Observation
from stethoscope.statistics import (
    CORE_FIELDS,
    DISTRIBUTION_BINS,
    DISTRIBUTION_EDGES,
    EVENT,
    EVERY_STEP,
    GATHERED,
    PLANNED,
    REPLICATED,
    STATISTICS,
    AcrossRanks,
    Cadence,
    with_requirements,
)
from stethoscope.testing import RecordingDetector


def test_the_observation_has_exactly_the_declared_fields_in_order():
    declared = [f.name for f in CORE_FIELDS]
    for s in STATISTICS.values():
        declared += [f.name for f in s.fields if f.name not in declared]
    assert [f.name for f in dataclasses.fields(Observation)] == declared
    for name in declared:
        assert f"    {name}: " in Observation.__doc__, name


@pytest.mark.parametrize("name", sorted(STATISTICS))
def test_has_says_whether_a_statistic_was_measured(name):
    marker = STATISTICS[name].marker
    assert not Observation(step=0).has(name)
    obs = Observation(step=0, **{marker: np.zeros(1)})
    assert obs.has(name)
    assert pickle.loads(pickle.dumps(obs)).has(name)


def test_a_quiet_steps_observation_equals_one_built_field_by_field():
    quick = Observation.of_loss(7, 1, 0, 1e-3, 2.5)
    full = Observation(step=7, epoch=1, rank=0, lr=1e-3, loss=2.5)
    assert quick == full and repr(quick) == repr(full)
    assert dataclasses.asdict(quick) == dataclasses.asdict(full)
    assert not quick.has("grads") and quick.has("loss")
    quick.grad_norm = np.ones(2)  # its own, not the class's default
    assert Observation.of_loss(8, 1, 0, None, 1.0).grad_norm is None


def test_an_events_observation_equals_one_built_field_by_field():
    fields = {"val_loss": 0.5, "train_loss": 0.4, "val_prints": np.arange(3)}
    quick = Observation.of_event(7, 1, 0, **fields)
    full = Observation(step=7, epoch=1, rank=0, **fields)
    assert repr(quick) == repr(full)
    assert quick.has("val") and quick.has("val_prints") and not quick.has("loss")
    assert Observation.carried_by(fields) == {"val", "val_prints"}  # train_loss marks none
    with pytest.raises(TypeError, match="'val_los'"):
        Observation.of_event(7, 1, 0, val_los=0.5)


def test_the_derived_sets():
    assert {"loss"} == EVERY_STEP
    assert {"val", "val_prints", "val_modes", "val_spectral", "val_norms"} == EVENT
    assert {"replicas", "replica_grads", "ranks"} == GATHERED
    assert {
        "grads",
        "weights",
        "updates",
        "units",
        "distributions",
        "stale_grads",
        "train_mode",
        "precision",
        "loss_scale",
        "fp8",
    } == REPLICATED
    assert set(STATISTICS) - EVENT - GATHERED == PLANNED
    for name in GATHERED:
        assert STATISTICS[name].cadence is Cadence.MEETING
        assert STATISTICS[name].across_ranks is AcrossRanks.GATHERED


def test_a_statistic_brings_what_it_requires():
    assert with_requirements({"updates"}) == {"updates", "weights"}
    assert with_requirements({"loss"}) == {"loss"}
    monitor = Monitor(detectors=[RecordingDetector({"updates"})], escalate=False)
    assert monitor.plan(0) == {"updates", "weights"}


def test_a_new_statistic_needs_no_edit_outside_its_declaration(monkeypatch):
    """The planning and the observation follow the registry: a detector may need any
    declared statistic, and an undeclared one is refused as a programming error."""
    monitor = Monitor(detectors=[RecordingDetector({"distributions"})], escalate=False)
    assert monitor.plan(0) == {"distributions"}
    obs = Observation(step=0, weight_hist=np.zeros((2, DISTRIBUTION_BINS)))
    assert obs.has("distributions")
    with pytest.raises(TypeError, match=r"statistics among .*not \['no_such_statistic'\]"):
        RecordingDetector({"no_such_statistic"})


def test_the_distribution_bins_are_half_decades_with_zeros_overflow_and_non_finite():
    edges = np.array(DISTRIBUTION_EDGES)
    assert edges[0] == pytest.approx(1e-12) and edges[-1] == pytest.approx(1e4)
    assert np.allclose(np.diff(np.log10(edges)), 0.5)
    assert len(edges) + 3 == DISTRIBUTION_BINS
