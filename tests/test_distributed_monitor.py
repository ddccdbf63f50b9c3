"""The framework-free half of distributed runs: packets, reductions, and monitors that meet.

Several :class:`Monitor` instances stand for the ranks of one run; :func:`meet` does what
the adapter's all-gather does (stack every rank's packet) and hands the result to each.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

import numpy as np
import pytest

from stethoscope.detectors import Detector, default_detectors
from stethoscope.distributed import MAIL_BYTES, REDUCTIONS, SYNC_EVERY, Gathered, Letter, Packet
from stethoscope.findings import Finding
from stethoscope.monitor import SAMPLER, Monitor
from stethoscope.observation import RANK_PROBES, REPLICATED_PROBES, Observation
from stethoscope.testing import CapturingSink

NAN = float("nan")


def finding(step: int = 3, rank: int = 1, **kw) -> Finding:
    base = dict(
        step=step, epoch=0, detector="nonfinite_loss", severity="error", message="NaN.", rank=rank
    )
    return Finding(**{**base, **kw})


def ranks(n: int, script=None, **kw) -> tuple[list[Monitor], list[CapturingSink]]:
    """``n`` monitors joined as the ranks of one run, each with its own capturing sink and
    the default detectors, plus a :class:`Scripted` one running ``script[rank]``."""
    sinks = [CapturingSink() for _ in range(n)]
    script = script or {}
    monitors = [
        Monitor(sinks=[s], detectors=[*default_detectors(), Scripted(script.get(r))], **kw)
        for r, s in enumerate(sinks)
    ]
    for r, m in enumerate(monitors):
        m.distribute(rank=r, world_size=n)
    return monitors, sinks


def meet(monitors: list[Monitor], step: int, stats=None, *, capacity: int = MAIL_BYTES):
    """One meeting: every rank's packet, stacked as an all-gather returns them, agreed on."""
    parts = [m.outgoing(capacity) for m in monitors]
    extra = stats or [{}] * len(monitors)
    sizes = {k: 1 for k in parts[0][0]} | {k: len(v) for k, v in extra[0].items()}
    packet = Packet(sizes, mail_bytes=capacity)
    gathered = packet.unpack(
        np.stack(
            [packet.pack({**flags, **extra[r]}, body) for r, (flags, body) in enumerate(parts)]
        )
    )
    return [m.agree(step, 0, gathered) for m in monitors], gathered


def loss_obs(step: int, loss: float, rank: int) -> Observation:
    return Observation(step=step, rank=rank, loss=loss)


class Scripted(Detector):
    """Raises its script's finding at a step: ``{step: (severity, where)}``, or a suspicion."""

    name = "scripted"
    needs: ClassVar[frozenset[str]] = frozenset({"loss"})
    advice = "do what the script says"

    def __init__(self, script=None) -> None:
        self.script = dict(script or {})
        super().__init__()

    def _update(self, obs: Observation) -> list[Finding]:
        todo = self.script.get(obs.step, [])
        out = []
        for severity, where in todo if isinstance(todo, list) else [todo]:
            if severity == "suspect":
                self.suspect = where
            else:
                out.append(self.finding(obs, severity, f"Scripted at {obs.step}.", where=where))
        return out


# -- packets ----------------------------------------------------------------------------------
def test_every_declared_reduction():
    p = Packet({"stop": 1, "backlog": 1, "val_sum": 1, "busy": 1, "checksums": 3})
    rows = [
        {"stop": 0, "backlog": 2, "val_sum": 1.5, "busy": 0.1, "checksums": [1, 2**62, -3]},
        {"stop": 1, "backlog": 7, "val_sum": 2.5, "busy": 0.3, "checksums": [1, 2**62 + 1, -3]},
        {"stop": 0, "backlog": 7, "val_sum": 0.0, "busy": 0.2, "checksums": [1, 2**62, -3]},
    ]
    g = p.unpack(np.stack([p.pack(r) for r in rows]))
    assert g.reduced("stop") is True and g.ranks("stop") == [1]
    assert g.reduced("backlog") == 7 and g.ranks("backlog") == [1, 2]
    assert g.reduced("val_sum") == 4.0
    assert g.reduced("busy")[:, 0].tolist() == [0.1, 0.3, 0.2]
    # checksums travel as int64, bit for bit, never through a float
    assert g.per_rank["checksums"].dtype == np.int64
    assert g.per_rank["checksums"][1, 1] - g.per_rank["checksums"][0, 1] == 1
    assert set(REDUCTIONS.values()) <= {"sum", "mean", "max", "any", "rank"}


def test_a_global_mean_from_per_rank_sums():
    p = Packet({"val_sum": 1, "val_count": 1})
    g = p.unpack(np.stack([p.pack({"val_sum": 3.0, "val_count": 1}), p.pack({"val_count": 0})]))
    assert g.mean_of("val_sum", "val_count") == 3.0  # the rank that had none does not count
    g = p.unpack(np.stack([p.pack({}), p.pack({})]))
    assert g.mean_of("val_sum", "val_count") is None


@pytest.mark.parametrize(
    ("sizes", "match"),
    [({"stpo": 1}, "'stpo' is not declared"), ({"stop": -1}, "size of 'stop' is -1")],
)
def test_a_bad_layout_is_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        Packet(sizes)


def test_a_value_of_the_wrong_size_or_a_letter_too_long_is_refused():
    p = Packet({"busy": 1}, mail_bytes=16)
    with pytest.raises(ValueError, match="'busy' has 2 elements"):
        p.pack({"busy": [1.0, 2.0]})
    with pytest.raises(ValueError, match="exceeds 16"):
        p.pack({}, b"x" * 17)
    with pytest.raises(ValueError, match="expected"):
        p.unpack(np.zeros((2, 5), np.uint8))


def test_a_letter_keeps_a_nan_value_and_the_reason():
    letter = Letter(findings=[finding(value=NAN)], reason=finding(value=math.inf), why="spike")
    body, sent = letter.encode(MAIL_BYTES)
    back = Letter.decode(body)
    assert sent == 1 and back.why == "spike"
    assert math.isnan(back.findings[0].value) and back.reason.value == math.inf
    assert back.findings[0].to_dict(json_safe=True) == finding(value=NAN).to_dict(json_safe=True)


def test_a_full_letter_carries_what_fits_and_cuts_a_giant():
    many = [finding(step=i, message="M" * 200 + ".") for i in range(40)]
    body, sent = Letter(findings=many, reason=many[0]).encode(2048)
    assert len(body) <= 2048 and 0 < sent < 40
    assert [f.step for f in Letter.decode(body).findings] == list(range(sent))
    giant = finding(message="G" * 10_000)
    body, sent = Letter(findings=[giant], reason=giant, why="w" * 5000).encode(1024)
    back = Letter.decode(body)
    assert len(body) <= 1024 and sent == 1 and back.reason is not None
    assert back.findings[0].message.endswith("...")


# -- a single process ---------------------------------------------------------------------------
def test_a_single_process_never_meets_and_leaves_the_rank_detectors_idle():
    m = Monitor()
    assert not any(m.meets(t) for t in range(200))
    assert all(m.shared_probes(t) == frozenset() for t in range(200))
    assert all(not (m.plan(t) & RANK_PROBES) for t in range(200))
    assert {"replica_divergence", "straggler"} <= m._idle
    assert "straggler" not in m.summary(0).quiet


def test_distribute_validates_and_sets_who_emits():
    m = Monitor()
    with pytest.raises(ValueError, match="world_size=0"):
        m.distribute(rank=0, world_size=0)
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, 2\)"):
        m.distribute(rank=2, world_size=2)
    m.distribute(rank=1, world_size=2)
    assert not m.emit
    m.distribute(rank=0, world_size=2)
    assert m.emit


# -- who judges what ------------------------------------------------------------------------------
def test_off_rank_zero_the_shared_statistics_are_neither_planned_nor_judged():
    (zero, one), _ = ranks(2, escalate=False)
    assert zero.plan(0) >= REPLICATED_PROBES
    assert not (one.plan(0) & REPLICATED_PROBES)
    assert {"loss", "inputs", "labels", "activations"} <= one.plan(0)
    replicated = {d.name for d in default_detectors() if d.needs <= REPLICATED_PROBES}
    assert replicated == set(one._idle)
    assert zero.shared_probes(0) == RANK_PROBES


def test_with_sharded_parameters_every_rank_judges_its_own():
    m = Monitor()
    m.distribute(rank=1, world_size=2, replicated=False)
    assert m.plan(0) >= REPLICATED_PROBES and not m._idle and m.judges_replicated
    m.distribute(rank=1, world_size=2)
    assert not m.judges_replicated


# -- held decisions, agreed ------------------------------------------------------------------------
def test_a_nan_on_rank_one_is_held_then_every_rank_stops_at_the_next_meeting():
    monitors, sinks = ranks(2, escalate=False)
    stops = {0: [], 1: []}
    for t in range(60):
        for r, m in enumerate(monitors):
            loss = NAN if (r == 1 and t == 37) or t >= 38 else 2.3  # NaN spreads at the all-reduce
            assert not m.observe(loss_obs(t, loss, r)).stop, "no rank stops on its own"
        if monitors[0].meets(t):
            decisions, _ = meet(monitors, t)
            for r, d in enumerate(decisions):
                if d.stop:
                    stops[r].append(t)
    assert stops == {0: [48], 1: [48]}  # 37 is no meeting; 48 is the next
    assert SYNC_EVERY == 16
    for m in monitors:
        assert (m.stopped_by.step, m.stopped_by.rank) == (37, 1)  # the earliest reason
    mine = [(f.step, f.rank) for f in sinks[0].findings if f.detector == "nonfinite_loss"]
    # rank 0 writes its own at once; rank 1's arrives at the meeting (its 38 repeats its 37)
    assert mine == [(38, 0), (37, 1)]
    assert sinks[1].findings == []  # rank 1 never writes


def test_raise_wins_over_stop_on_every_rank():
    script = {0: {5: ("warning", "x")}, 1: {3: ("warning", "y")}}
    monitors, _ = ranks(2, script, escalate=False, stop_on="warning", raise_on={"scripted"})
    for t in range(8):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, 2.3, r))
    decisions, _ = meet(monitors, 16)
    assert all(d.raise_ and d.reason.step == 3 for d in decisions)


def test_suspicion_on_one_rank_escalates_every_rank_at_the_meeting():
    monitors, sinks = ranks(2, {1: {70: ("suspect", "odd loss")}}, hot_steps=8)
    for t in range(100):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, 2.3, r))
        assert monitors[0].meets(t) == monitors[1].meets(t)
        if monitors[0].meets(t):
            meet(monitors, t)
    # calibration ends at 8 * log2(32) = 40; from there the ranks meet every 16 steps, so
    # rank 1's suspicion at 70 is agreed at 80, where both start sampling every step
    assert monitors[0].sampler.state_dict() == monitors[1].sampler.state_dict()
    assert monitors[0].sampler.hot_since == 80
    assert all(monitors[0].meets(t) for t in range(80, 88))
    notes = [f for f in sinks[0].findings if f.detector == SAMPLER]
    assert notes[0].step == 80 and "rank 1: scripted: odd loss" in notes[0].message
    assert not sinks[1].findings


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_meets_on_the_same_steps_whatever_each_one_sees(seed):
    """The no-deadlock invariant: suspicions, spikes and NaNs on some ranks only never
    make the ranks disagree on where they meet next."""
    rng = np.random.default_rng(seed)
    monitors, _ = ranks(3, hot_steps=8, stop_on=None)
    for t in range(600):
        for r, m in enumerate(monitors):
            loss = 2.3 * rng.lognormal(0, 0.05)
            if rng.random() < 0.01:
                loss *= 20  # a spike on this rank only
            if rng.random() < 0.003:
                loss = NAN
            m.observe(loss_obs(t, loss, r))
        due = {m.meets(t) for m in monitors}
        assert len(due) == 1, f"ranks disagree on meeting at step {t}"
        if due.pop():
            meet(monitors, t)
            states = [json.dumps(m.sampler.state_dict()) for m in monitors]
            assert len(set(states)) == 1


def test_findings_that_do_not_fit_wait_and_nothing_is_lost():
    script = {1: {5: [("warning", f"layer{i}") for i in range(30)]}}
    monitors, sinks = ranks(2, script, escalate=False, stop_on=None)
    for t in range(6):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, 2.3, r))
    assert monitors[1].backlog == 30
    rounds = 0
    while True:  # what the adapter does at an epoch end
        _, g = meet(monitors, 16, capacity=1024)
        rounds += 1
        if not g.reduced("backlog"):
            break
    assert rounds > 1 and monitors[1].backlog == 0
    got = [f.where for f in sinks[0].findings if f.detector == "scripted"]
    assert got == [f"layer{i}" for i in range(30)]
    assert all(f.rank == 1 for f in sinks[0].findings if f.detector == "scripted")


def test_shared_facts_are_acted_on_at_once_and_not_forwarded():
    monitors, sinks = ranks(2)
    sums = np.array([[1, 2, 3], [1, 5, 3]], dtype=np.int64)
    obs = Observation(
        step=0,
        replica_names=("a", "b", "c"),
        replica_buffer=np.zeros(3, bool),
        replica_sums=sums,
    )
    decisions = [
        m.observe_shared(Observation(**{**vars(obs), "rank": r})) for r, m in enumerate(monitors)
    ]
    assert all(d.stop and d.reason.where == "b" and d.reason.rank == 1 for d in decisions)
    assert monitors[1].backlog == 0  # rank 0 found the same: nothing to forward
    assert [f.detector for f in sinks[0].findings] == ["replica_divergence", SAMPLER]


def test_the_same_problem_on_another_rank_is_not_a_repeat():
    monitors, sinks = ranks(2, escalate=False, stop_on=None)
    for t in (10, 11):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, NAN, r))
    meet(monitors, 16)
    got = [(f.step, f.rank) for f in sinks[0].findings if f.detector == "nonfinite_loss"]
    assert got == [(10, 0), (10, 1)]  # 11 repeats 10 on each rank; rank 1 is news


def test_gathered_reductions_on_an_empty_world_are_not_needed():
    g = Gathered(per_rank={"stop": np.zeros((2, 1))}, letters=[Letter(), Letter()])
    assert g.world_size == 2 and g.ranks("stop") == [] and g.reduced("stop") is False
