"""The framework-free half of distributed runs: packets, reductions, and ranks that meet.

Several :class:`Monitor` instances stand for the ranks of one run, each with its
:class:`RankMeeting`; a :class:`World` joins them with a real all-gather across threads
(each rank's call waits for every rank's packet and returns them stacked, as the
framework's collective does).
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np
import pytest

from stethoscope.advice import TrainingSetup
from stethoscope.detectors import Detector, default_detectors
from stethoscope.distributed import (
    FLAGS,
    MAIL_BYTES,
    SYNC_EVERY,
    Entry,
    Gathered,
    Letter,
    Packet,
    RankMeeting,
)
from stethoscope.engine.monitor import Monitor
from stethoscope.findings import SAMPLER, Finding
from stethoscope.observation import Observation
from stethoscope.sinks.base import RunContext
from stethoscope.statistics import GATHERED, REPLICATED
from stethoscope.testing import CapturingSink, RecordingDetector

NAN = float("nan")


def finding(step: int = 3, rank: int = 1, **kw) -> Finding:
    base = dict(
        step=step, epoch=0, detector="nonfinite_loss", severity="error", message="NaN.", rank=rank
    )
    return Finding(**{**base, **kw})


class World:
    """The ranks of one run: a monitor, a capturing sink and a meeting each, the meetings
    joined by an all-gather across threads."""

    def __init__(self, monitors: list[Monitor], sinks: list[CapturingSink]) -> None:
        self.monitors, self.sinks = monitors, sinks
        self.capacity = MAIL_BYTES
        self._slots: list[np.ndarray | None] = [None] * len(monitors)
        self._barrier = threading.Barrier(len(monitors), timeout=10)
        self.meetings = [RankMeeting(m, self._gather(r)) for r, m in enumerate(monitors)]

    def _gather(self, rank: int):
        def all_gather(packet: np.ndarray) -> np.ndarray:
            self._slots[rank] = packet
            self._barrier.wait()  # every rank has put its packet
            out = np.stack(self._slots)
            self._barrier.wait()  # every rank has read them all
            return out

        return all_gather

    def due(self, step: int) -> bool:
        answers = {meeting.due(step) for meeting in self.meetings}
        assert len(answers) == 1, f"ranks disagree on meeting at step {step}"
        return answers.pop()

    def meet(self, step: int, shared=None, *, capacity: int = MAIL_BYTES):
        """Every rank meets at ``step`` (each in its own thread); their decisions."""
        shared = shared or [None] * len(self.meetings)
        for meeting in self.meetings:
            meeting.mail_bytes = capacity
        with ThreadPoolExecutor(len(self.meetings)) as pool:
            futures = [
                pool.submit(meeting.meet, step, 0, shared[r])
                for r, meeting in enumerate(self.meetings)
            ]
            return [f.result() for f in futures]


def ranks(n: int, script=None, **kw) -> World:
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
    return World(monitors, sinks)


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
def test_every_reduction():
    p = Packet(
        {
            "stop": Entry(1, "any"),
            "backlog": Entry(1, "max"),
            "val_loss": Entry(2, "sum"),
            "rank_busy": Entry(1, "rank"),
            "replica_sums": Entry(3, "rank", "int64"),
        }
    )
    rows = [
        {"stop": 0, "backlog": 2, "val_loss": [1.5, 1], "rank_busy": 0.1},
        {"stop": 1, "backlog": 7, "val_loss": [2.5, 1], "rank_busy": 0.3},
        {"stop": 0, "backlog": 7, "val_loss": [0.0, 0], "rank_busy": 0.2},
    ]
    sums = [[1, 2**62, -3], [1, 2**62 + 1, -3], [1, 2**62, -3]]
    g = p.unpack(
        np.stack([p.pack({**r, "replica_sums": c}) for r, c in zip(rows, sums, strict=True)])
    )
    assert g.reduced("stop") is True and g.ranks("stop") == [1]
    assert g.reduced("backlog") == 7 and g.ranks("backlog") == [1, 2]
    assert g.reduced("val_loss").tolist() == [4.0, 2.0] and g.mean_of("val_loss") == 2.0
    assert g.reduced("rank_busy")[:, 0].tolist() == [0.1, 0.3, 0.2]
    # checksums travel as int64, bit for bit, never through a float
    assert g.per_rank["replica_sums"].dtype == np.int64
    assert g.per_rank["replica_sums"][1, 1] - g.per_rank["replica_sums"][0, 1] == 1
    assert set(FLAGS.values()) <= {"max", "any"}


def test_a_pooled_mean_counts_only_the_ranks_that_had_one():
    p = Packet({"val_loss": Entry(2, "sum")})
    g = p.unpack(np.stack([p.pack({"val_loss": [3.0, 1]}), p.pack({"val_loss": [0.0, 0]})]))
    assert g.mean_of("val_loss") == 3.0
    g = p.unpack(np.stack([p.pack({}), p.pack({})]))
    assert g.mean_of("val_loss") is None


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ({"stop": Entry(-1, "any")}, "size of 'stop' is -1"),
        ({"stop": Entry(1, "mean")}, "op of 'stop' is 'mean'"),
        ({"stop": Entry(1, "any", "int8")}, "dtype of 'stop' is 'int8'"),
    ],
)
def test_a_bad_layout_is_refused(entries, match):
    with pytest.raises(ValueError, match=match):
        Packet(entries)


def test_a_meeting_refuses_a_field_no_rank_gathers_or_pools():
    world = ranks(2)
    with pytest.raises(ValueError, match=r"'grad_norm' is not a field of a statistic.*rank_busy"):
        world.meetings[0].meet(0, 0, {"grad_norm": 1.0})


def test_a_value_of_the_wrong_size_or_a_letter_too_long_is_refused():
    p = Packet({"busy": Entry(1, "rank")}, mail_bytes=16)
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


def test_a_letter_carries_a_rank_s_ask_for_a_roll_back():
    ask = finding(step=30, message="updates as large as the weights")
    body, _ = Letter(rollback=ask).encode(1024)
    back = Letter.decode(body)
    assert back.rollback is not None and back.rollback.step == 30 and back.reason is None
    assert Letter.decode(Letter().encode(1024)[0]).rollback is None


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
    meeting = RankMeeting(m, all_gather=lambda packet: packet[None])
    assert not any(meeting.due(t) for t in range(200))
    assert all(meeting.gathers(t) == frozenset() for t in range(200))
    assert all(not (m.plan(t) & GATHERED) for t in range(200))
    assert {"replica_divergence", "straggler"} <= m.planner.idle
    assert "straggler" not in m.summary(0).quiet


def test_distribute_validates_and_sets_who_writes():
    m = Monitor()
    with pytest.raises(ValueError, match="world_size=0"):
        m.distribute(rank=0, world_size=0)
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, 2\)"):
        m.distribute(rank=2, world_size=2)
    m.distribute(rank=1, world_size=2)
    assert not m.writes
    m.distribute(rank=0, world_size=2)
    assert m.writes


# -- who judges what ------------------------------------------------------------------------------
#: What a float32 run neither measures nor judges: its precision.
LOW_PRECISION = frozenset({"precision", "loss_scale", "fp8"})
NOT_APPLYING = frozenset(d.name for d in default_detectors() if not d.applies())


def test_off_rank_zero_the_shared_statistics_are_neither_planned_nor_judged():
    world = ranks(2, escalate=False)
    zero, one = world.monitors
    # no default detector reads the distributions; a float32 run, not the precision ones
    assert zero.plan(0) >= REPLICATED - {"distributions"} - LOW_PRECISION
    assert not (one.plan(0) & REPLICATED)
    assert {"loss", "inputs", "labels", "activations"} <= one.plan(0)
    replicated = {d.name for d in default_detectors() if d.needs <= REPLICATED}
    assert replicated | NOT_APPLYING == set(one.planner.idle)
    assert world.meetings[0].gathers(0) == GATHERED


def test_with_sharded_parameters_every_rank_judges_its_own():
    m = Monitor()
    m.distribute(rank=1, world_size=2, replicated=False)
    assert m.plan(0) >= REPLICATED - {"distributions"} - LOW_PRECISION
    assert m.planner.idle == NOT_APPLYING and m.judges_replicated
    m.distribute(rank=1, world_size=2)
    assert not m.judges_replicated


class WantsDistributions(CapturingSink):
    """A sink that wants the weight histograms every 8 steps, as a record does."""

    wants = frozenset({"distributions"})
    wants_every = 8


def sharded_ranks(n: int, **kw) -> World:
    """:func:`ranks` whose parameters are sharded: the ranks combine what each measured."""
    sinks = [WantsDistributions() for _ in range(n)]
    monitors = [Monitor(sinks=[s], **kw) for s in sinks]
    for r, m in enumerate(monitors):
        m.distribute(rank=r, world_size=n, sharded=True)
    return World(monitors, sinks)


def test_with_sharded_parameters_every_rank_measures_the_whole_model_rank_zero_judges():
    zero, one = sharded_ranks(2, escalate=False).monitors
    assert zero.sharded and one.sharded
    # the same statistics of the whole model on both ranks, the sink's included...
    assert zero.plan(0) & REPLICATED == one.plan(0) & REPLICATED
    assert {"grads", "weights", "distributions"} <= one.plan(0)
    # ...but only rank zero judges them
    replicated = {d.name for d in default_detectors() if d.needs <= REPLICATED}
    assert replicated <= set(one.planner.idle)
    assert not replicated & set(zero.planner.idle) - NOT_APPLYING  # precision rules: float32
    assert zero.judges_replicated and not one.judges_replicated


@pytest.mark.parametrize("sharded", [False, True])
def test_off_rank_zero_the_precision_rules_stay_idle_in_a_low_precision_run(sharded):
    """A bf16 run makes the precision rules apply at its start; off rank zero they still
    judge nothing (rank zero judges them), though under sharding that rank measures their
    statistics all the same. (Before, every rank judged them under DDP: each rank 1
    finding repeated rank zero's.)"""
    zero, one = sharded_ranks(2).monitors if sharded else ranks(2).monitors
    bf16 = RunContext(setup=TrainingSetup(precision="bf16-true", low_precision=True))
    for m in (zero, one):
        m.start(bf16)
    assert not zero.schedule.idle("rounded_updates")
    assert one.schedule.idle("rounded_updates") and one.schedule.idle("gradient_underflow")
    if sharded:  # measured for rank zero's rules, in the same collective
        assert "precision" in one.plan(0)
        assert zero.plan(0) & REPLICATED == one.plan(0) & REPLICATED


@pytest.mark.parametrize("sharded", [False, True])
def test_off_rank_zero_a_rule_of_its_own_outputs_leaves_the_gradients_to_rank_zero(sharded):
    """overflow_risk judges each rank's own layer outputs, and wants the gradients' peaks
    too: those are the whole model's, judged by rank zero. (Before, rank 1 measured them
    under DDP and judged them under both: its finding repeated rank zero's.)"""
    world = sharded_ranks(2) if sharded else ranks(2)
    zero, one = world.monitors
    fp16 = RunContext(setup=TrainingSetup(precision="16-true", low_precision=True))
    for m in (zero, one):
        m.start(fp16)
    assert not one.schedule.idle("overflow_risk")  # its outputs are its own
    if not sharded:  # nothing of the whole model measured for nobody
        assert not (one.plan(0) & REPLICATED)
    found = []
    for rank, m in enumerate((zero, one)):
        obs = Observation(
            step=0,
            rank=rank,
            loss=1.0,
            names=("w",),
            dtypes=("float16",),
            grad_peak=np.array([30000.0]),  # past 1/16 of float16's largest
            act_names=("layer",),
            act_kinds=("layer",),
            act_dtypes=("float16",),
            act_max=np.array([1.0]),
            act_rms=np.array([0.5]),
            act_saturated=np.array([0.0]),
        )
        m.observe(obs, forced=True)
        found.append(
            {f.detector for f in world.sinks[rank].findings}
            | {f.detector for f in m.judge.held.findings}
        )
    assert "overflow_risk" in found[0] and "overflow_risk" not in found[1]


def test_a_detector_that_cannot_read_sits_out_on_every_rank_and_rank_zero_says_so():
    zero, one = sharded_ranks(2, escalate=False).monitors
    with pytest.warns(RuntimeWarning, match="replica_divergence cannot judge .* so it is off"):
        assert zero.cannot_measure(frozenset({"replicas"}), "no replicas") == ["replica_divergence"]
    # dead_relu is idle on rank one (rank zero judges it), which measures its units all
    # the same: it must stop measuring them where rank zero does, or the ranks' combining
    # collectives would no longer match
    assert one.cannot_measure(frozenset({"units"}), "no units") == ["dead_relu"]  # no warning
    with pytest.warns(RuntimeWarning, match="dead_relu cannot judge"):
        zero.cannot_measure(frozenset({"units"}), "no units")
    for m in (zero, one):
        assert "units" not in m.plan(0) and m.schedule.idle("dead_relu")
    assert zero.plan(0) & REPLICATED == one.plan(0) & REPLICATED


@pytest.mark.parametrize("seed", range(3))
def test_sharded_ranks_plan_the_whole_model_alike_whatever_rank_zero_judges(seed):
    """The no-deadlock invariant of sharded statistics: the ranks combine them in a
    collective, so every rank must plan them at the same steps, though only rank zero
    judges them (its detectors finish, want, escalate and stop on what it sees)."""
    rng = np.random.default_rng(seed)
    world = sharded_ranks(2, hot_steps=8, stop_on=None)
    monitors = world.monitors
    names = ("net.0.weight", "net.0.bias")
    for t in range(300):
        plans = [m.plan(t) & REPLICATED for m in monitors]
        assert plans[0] == plans[1], f"step {t}: {plans}"
        for r, m in enumerate(monitors):
            loss = 2.3 * rng.lognormal(0, 0.05) * (30 if rng.random() < 0.02 else 1)
            obs = Observation(step=t, rank=r, loss=loss)
            if "grads" in plans[r]:  # the combined norms, the same on every rank
                grads = np.abs(rng.normal(1.0, 0.1, 2)) * (1e4 if rng.random() < 0.05 else 1)
                obs.grad_norm, obs.names = grads, names
                obs.numel, obs.is_matrix = np.array([64.0, 8.0]), np.array([True, False])
            m.observe(obs)
        if world.due(t):
            world.meet(t)


# -- held decisions, agreed ------------------------------------------------------------------------
def test_a_nan_on_rank_one_is_held_then_every_rank_stops_at_the_next_meeting():
    world = ranks(2, escalate=False)
    monitors, sinks = world.monitors, world.sinks
    stops = {0: [], 1: []}
    for t in range(60):
        for r, m in enumerate(monitors):
            loss = NAN if (r == 1 and t == 37) or t >= 38 else 2.3  # NaN spreads at the all-reduce
            assert not m.observe(loss_obs(t, loss, r)).stop, "no rank stops on its own"
        if world.due(t):
            decisions = world.meet(t)
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
    world = ranks(2, script, escalate=False, stop_on="warning", raise_on={"scripted"})
    for t in range(8):
        for r, m in enumerate(world.monitors):
            m.observe(loss_obs(t, 2.3, r))
    decisions = world.meet(16)
    assert all(d.raise_ and d.reason.step == 3 for d in decisions)


class ScriptedGradients(Scripted):
    """A Scripted rule of what every rank holds alike (rank zero judges it for all)."""

    name = "scripted_gradients"
    needs: ClassVar[frozenset[str]] = frozenset({"grads"})


def test_at_the_same_step_the_rank_whose_own_data_went_bad_is_the_reason():
    """Rank 1's loss goes NaN at step 5, and the all-reduce of that very step carries it
    into the gradients rank zero judges for every rank: rank 1 is where it began. (Before,
    the tie went to the lower rank: rank zero's gradient finding.)"""
    monitors, sinks = [], []
    for r in range(2):
        sinks.append(CapturingSink())
        mine = Scripted({5: ("error", "loss")} if r == 1 else None)
        shared = ScriptedGradients({5: ("error", "net.0.weight")} if r == 0 else None)
        monitors.append(Monitor(sinks=[sinks[-1]], detectors=[mine, shared], escalate=False))
    for r, m in enumerate(monitors):
        m.distribute(rank=r, world_size=2)
    world = World(monitors, sinks)
    for r, m in enumerate(monitors):
        obs = Observation(step=5, rank=r, loss=2.3, grad_norm=np.ones(1), names=("w",))
        m.observe(obs, forced=True)
    decisions = world.meet(16)
    assert all(d.stop for d in decisions)
    assert {(d.reason.detector, d.reason.rank) for d in decisions} == {("scripted", 1)}


def test_suspicion_on_one_rank_escalates_every_rank_at_the_meeting():
    world = ranks(2, {1: {70: ("suspect", "odd loss")}}, hot_steps=8)
    monitors, sinks = world.monitors, world.sinks
    for t in range(100):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, 2.3, r))
        if world.due(t):
            world.meet(t)
    # calibration ends at 8 * log2(32) = 40; from there the ranks meet every 16 steps, so
    # rank 1's suspicion at 70 is agreed at 80, where both start sampling every step
    assert monitors[0].sampler.state_dict() == monitors[1].sampler.state_dict()
    assert monitors[0].sampler.hot_since == 80
    assert all(world.due(t) for t in range(80, 88))
    notes = [f for f in sinks[0].findings if f.detector == SAMPLER]
    assert notes[0].step == 80 and "rank 1: scripted: odd loss" in notes[0].message
    assert not sinks[1].findings


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_meets_on_the_same_steps_whatever_each_one_sees(seed):
    """The no-deadlock invariant: suspicions, spikes and NaNs on some ranks only never
    make the ranks disagree on where they meet next."""
    rng = np.random.default_rng(seed)
    world = ranks(3, hot_steps=8, stop_on=None)
    monitors = world.monitors
    for t in range(600):
        for r, m in enumerate(monitors):
            loss = 2.3 * rng.lognormal(0, 0.05)
            if rng.random() < 0.01:
                loss *= 20  # a spike on this rank only
            if rng.random() < 0.003:
                loss = NAN
            m.observe(loss_obs(t, loss, r))
        if world.due(t):  # asserts that every rank gives the same answer
            world.meet(t)
            states = [json.dumps(m.sampler.state_dict()) for m in monitors]
            assert len(set(states)) == 1


def test_findings_that_do_not_fit_wait_and_nothing_is_lost():
    script = {1: {5: [("warning", f"layer{i}") for i in range(30)]}}
    world = ranks(2, script, escalate=False, stop_on=None)
    monitors, sinks = world.monitors, world.sinks
    for t in range(6):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, 2.3, r))
    assert monitors[1].backlog == 30
    rounds = 0
    while True:  # what the adapter does at an epoch end
        world.meet(16, capacity=1024)
        rounds += 1
        if not world.meetings[0].pending:
            assert not world.meetings[1].pending
            break
    assert rounds > 1 and monitors[1].backlog == 0
    got = [f.where for f in sinks[0].findings if f.detector == "scripted"]
    assert got == [f"layer{i}" for i in range(30)]
    assert all(f.rank == 1 for f in sinks[0].findings if f.detector == "scripted")


def test_shared_facts_are_acted_on_at_once_and_not_forwarded():
    world = ranks(2)
    monitors, sinks = world.monitors, world.sinks
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
    world = ranks(2, escalate=False, stop_on=None)
    monitors, sinks = world.monitors, world.sinks
    for t in (10, 11):
        for r, m in enumerate(monitors):
            m.observe(loss_obs(t, NAN, r))
    world.meet(16)
    got = [(f.step, f.rank) for f in sinks[0].findings if f.detector == "nonfinite_loss"]
    assert got == [(10, 0), (10, 1)]  # 11 repeats 10 on each rank; rank 1 is news


def test_gathered_reductions_on_an_empty_world_are_not_needed():
    g = Gathered(per_rank={"stop": np.zeros((2, 1))}, letters=[Letter(), Letter()], ops=FLAGS)
    assert g.world_size == 2 and g.ranks("stop") == [] and g.reduced("stop") is False


# -- statistics the meeting carries ---------------------------------------------------------------
def spies(n: int, needs: set[str]) -> tuple[World, list[RecordingDetector]]:
    """``n`` ranks whose only detector records what it is shown."""
    seen = [RecordingDetector(needs) for _ in range(n)]
    sinks = [CapturingSink() for _ in range(n)]
    monitors = [Monitor(detectors=[d], sinks=[s]) for d, s in zip(seen, sinks, strict=True)]
    for r, m in enumerate(monitors):
        m.distribute(rank=r, world_size=n)
    return World(monitors, sinks), seen


def test_gathered_statistics_reach_every_rank_side_by_side():
    world, seen = spies(2, {"replicas", "ranks"})
    names, buffer = ("a", "b"), np.array([False, True])
    shared = [
        {"rank_busy": 0.1 * (r + 1), "replica_sums": np.array([7, 8 + r], np.int64)}
        | {"replica_names": names, "replica_buffer": buffer}
        for r in range(2)
    ]
    world.meet(0, shared)
    for spy in seen:
        (obs,) = spy.seen
        assert obs.rank_busy.tolist() == [0.1, 0.2]  # a number per rank: a vector
        assert obs.replica_sums.tolist() == [[7, 8], [7, 9]]  # a vector per rank: a matrix
        assert obs.replica_sums.dtype == np.int64
        assert obs.replica_names == names and obs.replica_buffer is buffer


def test_a_validation_is_pooled_over_the_ranks_and_closes_each_training_window():
    world, seen = spies(2, {"val"})
    for r, m in enumerate(world.monitors):
        for t in range(4):
            m.observe(loss_obs(t, 1.0 + r + 0.1 * (3 - t), r))  # each rank starts 0.3 higher
    shared = [
        {"val_loss": (2.0 + 2 * r, 1), **m.pooled_losses()} for r, m in enumerate(world.monitors)
    ]
    world.meet(3, shared)
    for spy, m in zip(seen, world.monitors, strict=True):
        (obs,) = spy.seen
        assert (obs.val_loss, obs.train_loss) == (3.0, pytest.approx(1.65))
        assert obs.start_loss == pytest.approx(1.8)  # the ranks' first losses, 1.3 and 2.3
        assert m.pooled_losses()["train_loss"] == (0.0, 0.0)


def test_a_validation_no_rank_had_is_not_judged():
    world, seen = spies(2, {"val"})
    world.meet(3, [{"val_loss": (0.0, 0), "train_loss": (4.0, 2)}] * 2)
    assert all(spy.seen == [] for spy in seen)
