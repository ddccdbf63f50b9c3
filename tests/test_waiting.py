"""Quiet steps wait to be judged a few at a time: the same findings, at the same steps, in
the same order, and what needs acting on is judged at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stethoscope.detectors import default_detectors
from stethoscope.detectors.base import Detector
from stethoscope.engine.monitor import Monitor
from stethoscope.engine.waiting import WaitingLosses
from stethoscope.observation import Observation
from stethoscope.testing import CapturingSink


def _run(losses, monkeypatch=None, *, waiting: bool = True) -> tuple[Monitor, CapturingSink, list]:
    """Feed a single process's monitor loss-only observations (what an adapter sends on the
    steps it measures nothing else); a sampled step carries the same loss alone, so only
    the schedule tells them apart."""
    if not waiting:
        monkeypatch.setattr(WaitingLosses, "BATCH", 1)  # nothing ever waits
    sink = CapturingSink()
    monitor = Monitor(detectors=default_detectors(), sinks=[sink], stop_on="error")
    decisions = []
    for step, loss in enumerate(losses):
        decisions.append(monitor.observe(Observation(step=step, epoch=0, loss=float(loss))))
    monitor.summary(0)
    return monitor, sink, decisions


def _curve(n: int = 1500, seed: int = 0) -> np.ndarray:
    """A loss that falls, then climbs back for good from step 800 (unstable_loss warns)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = 2.3 * np.exp(-t / 200) + 0.2 + np.where(t > 800, (t - 800) / 400, 0.0)
    return level * rng.lognormal(0.0, 0.05, n)


def test_waiting_changes_no_finding(monkeypatch):
    _, waited, _ = _run(_curve())
    with monkeypatch.context() as m:
        _, at_once, _ = _run(_curve(), m, waiting=False)
    key = [(f.step, f.detector, f.severity, f.message) for f in waited.findings]
    assert key == [(f.step, f.detector, f.severity, f.message) for f in at_once.findings]
    assert any(f.detector == "unstable_loss" for f in waited.findings)


def test_quiet_steps_wait_and_are_judged_in_order():
    monitor, _, _ = _run(_curve(600))
    spike = next(d for d in monitor.detectors if d.name == "loss_spike")
    before = len(spike.state["window"])
    for step in range(600, 605):  # quiet steps (not on the 1-in-16 grid): they wait
        monitor.observe(Observation(step=step, epoch=0, loss=0.3))
    assert len(monitor.judge.waiting.steps) == 5 and len(spike.state["window"]) == before
    state = monitor.state_dict()  # saving catches up first
    assert monitor.judge.waiting.steps == [] and monitor.last_step == 604
    assert state["last_step"] == 604


def test_a_nan_is_judged_at_once_after_the_steps_that_waited():
    losses = list(_curve(600)) + [0.3] * 5 + [math.nan]
    monitor, _, decisions = _run(losses)
    assert decisions[-1].stop and decisions[-1].reason.detector == "nonfinite_loss"
    assert monitor.last_step == 605 and monitor.judge.waiting.steps == []


def test_a_spike_is_judged_at_once():
    losses = list(_curve(600))
    monitor, sink, _ = _run(losses)
    seen = len(sink.findings)
    monitor.observe(Observation(step=601, epoch=0, loss=50.0))  # a quiet step's number
    found = [(f.detector, f.step) for f in sink.findings[seen:]]
    assert found == [("loss_spike", 601), ("sampler", 601)]  # and the sampler escalates


@pytest.mark.parametrize("world_size", [2])
def test_nothing_waits_in_a_distributed_run_or_under_recovery(world_size):
    monitor = Monitor(detectors=default_detectors(), sinks=[])
    for step, loss in enumerate(_curve(300)):
        monitor.observe(Observation(step=step, epoch=0, loss=float(loss)))
    assert monitor.judge.waiting.bar > 0  # a single process: quiet steps may wait
    monitor.spare(frozenset({"loss_spike"}))  # a recovery ladder acts on every step
    monitor.observe(Observation(step=300, epoch=0, loss=0.3))
    assert monitor.judge.waiting.bar == -math.inf
    monitor.spare(frozenset())
    monitor.distribute(rank=0, world_size=world_size)
    monitor.observe(Observation(step=301, epoch=0, loss=0.3))
    assert monitor.judge.waiting.bar == -math.inf and monitor.judge.waiting.steps == []


def test_a_validation_counts_the_training_losses_that_waited():
    monitor, _, _ = _run(_curve(600))
    monitor.observe_validation(599, 0, 1.0)  # closes the window so far
    for step in range(600, 605):
        monitor.observe(Observation(step=step, epoch=0, loss=0.25))
    assert len(monitor.judge.waiting.steps) == 5
    spy = []
    original = monitor.judge.now
    monitor.judge.now = lambda obs, **kw: spy.append(obs) or original(obs, **kw)
    monitor.observe_validation(604, 0, 1.0)
    assert spy[0].train_loss == pytest.approx(0.25)  # the mean of the five that waited


def test_quiet_steps_planned_ahead_are_the_schedule_step_by_step():
    """The planner plans quiet steps up to 32 ahead and plans again when a detector judges
    or the sampler escalates: every step's plan is what planning that step alone gives,
    through a calibration, label counting that finishes, an escalation and its decay."""
    monitor = Monitor(detectors=default_detectors(), sinks=[])
    planner = monitor.planner
    rng = np.random.default_rng(0)
    losses = _curve(900)
    losses[500] = 40.0  # a spike: the sampler escalates
    for step, loss in enumerate(losses):
        plan = monitor.plan(step)
        assert plan == planner._plan(step), step
        obs = Observation(step=step, epoch=0, loss=float(loss))
        if "labels" in plan:
            obs.labels = rng.integers(0, 4, 64)
        monitor.observe(obs)
    assert monitor.sampler.escalations >= 1
    assert all(d.finished(900) for d in monitor.detectors if d.name == "class_imbalance")


def test_a_run_judged_every_step_plans_each_step_about_once(monkeypatch):
    """A full-batch run validates at every step, and each validation is judged, which may
    change the plan ahead: a plan made 16 steps ahead would be thrown away at every step.
    After a change the planner plans one step ahead, and twice as far while nothing
    changes, so such a run plans each step about once, and a run judged now and then
    still plans far ahead."""
    monitor = Monitor(detectors=default_detectors(), sinks=[])
    planner = monitor.planner
    calls = []
    original = type(planner)._plan
    monkeypatch.setattr(
        type(planner), "_plan", lambda self, t: calls.append(t) or original(self, t)
    )
    losses = _curve(700)
    for step, loss in enumerate(losses):
        if step == 300:
            calls.clear()  # past the sampler's calibration
        plan = monitor.plan(step)
        assert plan == original(planner, step), step
        monitor.observe_loss(step, step, float(loss))
        monitor.observe_validation(step, step, float(loss) * 1.1)  # judged: may change plans
    assert len(calls) <= 2 * 400, len(calls)  # each of the 400 steps planned about once


def test_observe_loss_keeps_a_quiet_step_as_numbers_until_it_cannot_wait():
    monitor, sink, _ = _run(_curve(600))
    assert monitor.observe_loss(601, 0, 0.3, lr=0.1) is None  # waits
    assert monitor.judge.waiting.steps == [(601, 0, 0.3, 0.1)]
    decision = monitor.observe_loss(602, 0, math.nan)  # judged at once, after 601
    assert decision.stop and decision.reason.detector == "nonfinite_loss"
    assert monitor.judge.waiting.steps == [] and monitor.last_step == 602
    assert sink.findings[-1].step == 602


class _Observing(CapturingSink):
    """Also keeps what every step's observation looked like to a sink that observes (the
    run's record does), and how often the sampled detectors ran there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float | None, int]] = []

    def observe(self, obs: Observation, interval: int) -> None:
        self.seen.append((obs.step, obs.loss, interval))


class _Clockwork(Detector):
    """Says any finite loss may wait, then raises a warning at steps 137 and 1637 and a
    suspicion at 391 and 1891 (a detector's own rule may do what its bar did not say),
    all of them steps that wait."""

    name = "clockwork"
    needs = frozenset({"loss"})

    def waits_below(self, steps: int) -> float:
        return math.inf

    def _update(self, obs: Observation) -> list:
        if obs.step in (391, 1891):
            self.suspect = f"step {obs.step}"
        if obs.step in (137, 1637):
            return [self.finding(obs, "warning", f"step {obs.step}")]
        return []


def _everything(losses, labels_seed: int = 0) -> tuple[Monitor, _Observing]:
    """A run that raises every kind of outcome on loss-only steps: spikes (findings, an
    escalation and its decay), a rise (unstable_loss's suspicion and warning), warnings
    and suspicions among the steps that wait, labels counted while loss_at_chance and
    class_imbalance want them, and validations."""
    rng = np.random.default_rng(labels_seed)
    sink = _Observing()
    # unshuffled_data reads labels all run long, so its state follows which steps the
    # plan measured them on; the clockwork's alarms on steps that wait (which no real
    # detector raises there: see waits_below) escalate a few steps later than at once,
    # and move those plans
    detectors = [*default_detectors(unshuffled_data=None), _Clockwork()]
    monitor = Monitor(detectors=detectors, sinks=[sink], stop_on=None)
    for step, loss in enumerate(losses):
        plan = monitor.plan(step)
        obs = Observation(step=step, epoch=step // 500, loss=float(loss), lr=0.1)
        if "labels" in plan:
            obs.labels = rng.integers(0, 4, 64)
        monitor.observe(obs)
        if step % 500 == 499:
            monitor.observe_validation(step, step // 500, float(loss) * 1.1)
            monitor.end_epoch(step // 500)
    monitor.close()
    return monitor, sink


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_judged_together_end_as_if_judged_one_by_one(monkeypatch, seed):
    losses = _curve(2000, seed)
    losses[700] *= 30  # a spike, judged at once; the steps around it may wait
    losses[1200:1230] *= 3.0  # a rise that unstable_loss first suspects
    waited, waited_sink = _everything(losses)
    assert waited.sampler.escalations >= 1
    with monkeypatch.context() as m:
        m.setattr(WaitingLosses, "BATCH", 1)  # nothing ever waits
        at_once, at_once_sink = _everything(losses)

    def key(sink):
        return [(f.step, f.detector, f.severity, f.message) for f in sink.findings]

    assert key(waited_sink) == key(at_once_sink)
    assert {f.detector for f in waited_sink.findings} >= {"loss_spike", "sampler", "clockwork"}
    assert waited_sink.seen == at_once_sink.seen
    assert [s.to_dict() for s in waited_sink.summaries] == [
        s.to_dict() for s in at_once_sink.summaries
    ]
    assert waited.state_dict() == at_once.state_dict()


def _summed(n: int = 1500, seed: int = 0) -> np.ndarray:
    """A loss summed over its batch, 12 batches an epoch, the last of 16 samples where
    the others hold 128 (pytorch/examples' VAE): every window holds a few losses 8x
    below the rest. The loss per sample falls by a third, as a VAE's does, then climbs
    back from step 900."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    per_sample = 0.7 + 0.3 * np.exp(-t / 200) + np.where(t > 900, (t - 900) / 300, 0.0)
    per_sample = per_sample * rng.lognormal(0.0, 0.03, n)
    return per_sample * np.where(t % 12 == 11, 16, 128)


def test_a_summed_losss_small_last_batches_still_let_quiet_steps_wait(monkeypatch):
    """unstable_loss bounded the level by the window's extremes: a window that held one
    small last batch made every step be judged at once (the VAE: 1040 of 960 steps
    judged one by one, a tenth of its step). The level moves one place of the window a
    step: most quiet steps wait, with the same findings."""
    kept = []
    keep = WaitingLosses.keep

    def counting(self, *args):
        kept.append(keep(self, *args))
        return kept[-1]

    with monkeypatch.context() as m:
        m.setattr(WaitingLosses, "keep", counting)
        _, waited, _ = _run(_summed())
    assert sum(kept[200:900]) > 0.8 * 700  # quiet steps past the calibration wait
    with monkeypatch.context() as m:
        _, at_once, _ = _run(_summed(), m, waiting=False)
    key = [(f.step, f.detector, f.severity, f.message) for f in waited.findings]
    assert key == [(f.step, f.detector, f.severity, f.message) for f in at_once.findings]
    assert any(f.detector == "unstable_loss" for f in waited.findings)


def test_a_full_batch_run_keeps_its_plans_ahead_through_quiet_validations(monkeypatch):
    """Every step of a full-batch run is an epoch with a validation. A validation that
    raises nothing changes no plan, nor does judging loss readers whose part in the plans
    stays the same: the plans ahead are kept (they were thrown away at every step), and
    each step's plan is still what planning that step alone gives, through a spike's
    escalation, label counting that finishes and a rise of the validation loss."""
    monitor = Monitor(detectors=default_detectors(), sinks=[])
    planner = monitor.planner
    changes = []
    original = type(planner).changed
    monkeypatch.setattr(type(planner), "changed", lambda self: changes.append(1) or original(self))
    rng = np.random.default_rng(0)
    losses = _curve(900)
    losses[500] = 40.0
    for step, loss in enumerate(losses):
        if step == 300:
            changes.clear()  # past the sampler's calibration
        if step == 500:
            quiet_stretch = len(changes)
        plan = monitor.plan(step)  # an epoch's first step may also take the samples' prints
        assert plan - {"prints"} == planner._plan(step) - {"prints"}, step
        if plan <= {"loss"}:
            monitor.observe_loss(step, step, float(loss))
        else:
            obs = Observation(step=step, epoch=step, loss=float(loss))
            if "labels" in plan:
                obs.labels = rng.integers(0, 4, 64)
            monitor.observe(obs)
        val = float(loss) * 1.1 if step < 700 else 3.0 + step / 100  # overfits from 700
        monitor.observe_validation(step, step, val)
        monitor.end_epoch(step)
    assert quiet_stretch <= 200 // 4, quiet_stretch  # not at every step
    assert monitor.sampler.escalations >= 2  # the spike, the validation's rise


def test_steps_wait_no_longer_than_the_bar_holds_though_judged_early():
    """The bar is worked out for the 16 steps after a step judged at once. An epoch's end
    judges the waiting steps early; the steps after it may wait only for what is left of
    those 16, not 16 more."""
    quiet = [d for d in default_detectors() if d.needs <= {"loss"} and not d.wants]
    monitor = Monitor(detectors=quiet, sinks=[])  # every step is quiet
    losses = _curve(600)
    for step, loss in enumerate(losses):
        monitor.observe(Observation(step=step, epoch=0, loss=float(loss)))
    monitor.judge.now(Observation(step=600, epoch=0, loss=0.3))  # judged at once: a new bar
    kept = 0
    for step in range(601, 640):
        if step == 606:
            monitor.summary(0)  # an epoch's end: the five that waited are judged
        if monitor.observe_loss(step, 0, 0.3) is not None:
            break
        kept += 1
    assert kept == WaitingLosses.BATCH - 1, kept
