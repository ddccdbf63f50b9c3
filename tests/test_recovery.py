"""The recovery ladder on its own: its settings, its rungs in order, and how a monitor's
policy hands it the errors it answers."""

from __future__ import annotations

import pytest

from stethoscope import Monitor
from stethoscope.findings import RECOVERY, Finding
from stethoscope.observation import Observation
from stethoscope.recovery import Ladder, Recoverer, Recovery, parse_recover
from stethoscope.testing import CapturingSink


def test_recover_takes_false_true_or_a_recovery():
    assert parse_recover(False) is None and parse_recover(None) is None
    assert parse_recover(True) == Recovery()
    custom = Recovery(cool_after=5)
    assert parse_recover(custom) is custom
    with pytest.raises(ValueError, match=r"recover='yes' is not valid; use False .* True .*"):
        parse_recover("yes")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"cool_factor": 2.0}, r"cool_factor=2.0 must be a number in \(0, 1\)"),
        ({"window": 0}, "window=0 must be an integer >= 1"),
        ({"max_rollbacks": -1}, "max_rollbacks=-1 must be an integer >= 0"),
        ({"snapshot_in": "cloud"}, "snapshot_in='cloud' is not valid; use one of 'auto'"),
        ({"cool_steps": 2.5}, "cool_steps=2.5 must be an integer"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Recovery(**kwargs)


def _ladder(**kw) -> Ladder:
    settings = {"cool_after": 3, "window": 10, "cool_steps": 20, "rollback_after": 2}
    return Ladder(Recovery(**{**settings, **kw}))


def test_skips_spread_out_never_cool_but_three_in_a_window_do():
    ladder = _ladder()
    for step in (5, 20, 35, 50):  # one per window
        found, action = ladder.skipped(step, 0, "the loss is NaN")
        assert action is None and [f.where for f in found] == ["skip"]
    assert ladder.lr_scale(51) == 1.0
    ladder.skipped(52, 0, "x")
    found, action = ladder.skipped(55, 0, "the gradient norm is past its bar")
    assert action is None and [f.where for f in found] == ["skip", "cool"]
    cool = found[1]
    assert cool.detector == RECOVERY and cool.severity == "warning"
    assert "3 steps skipped in 10" in cool.message and "scaled by 0.1 for 20 steps" in cool.message
    assert ladder.lr_scale(56) == 0.1 and ladder.lr_scale(75) == 0.1 and ladder.lr_scale(76) == 1
    assert ladder.saw(70, 0, troubled=False) == []
    [restored] = ladder.saw(76, 0, troubled=False)
    assert restored.where == "restore_lr" and ladder.lr_scale(77) == 1.0
    assert ladder.counts == {"skip": 6, "cool": 1, "rollback": 0, "stop": 0}


def test_skips_during_a_cool_down_roll_back_then_cool_again_then_stop():
    ladder = _ladder(max_rollbacks=1)
    for step in (1, 2, 3):
        ladder.skipped(step, 0, "x")
    assert ladder.cooling(4)
    _, action = ladder.skipped(5, 0, "x")
    assert action is None
    _, action = ladder.skipped(6, 0, "x")
    assert action == "rollback"
    found = ladder.rolled_back(6, 0, to_step=0, what="weights, optimizer")
    assert [f.where for f in found] == ["rollback", "cool"]
    assert "rolled back to the snapshot of step 0" in found[0].message.lower()
    assert "the updates of steps 1…6 are discarded" in found[0].message
    assert "roll back 1 of 1" in found[0].message
    # the snapshot taken when training started holds the state before its step
    start = _ladder().rolled_back(6, 0, to_step=0, what="weights", start=True)
    assert "the snapshot taken before step 0 (weights)" in start[0].message
    assert "the updates of steps 0…6 are discarded" in start[0].message
    # cooling afresh; a skip before the roll back is still a step that was not applied
    assert ladder.cooling(7) and ladder.was_skipped(3)
    ladder.applied(7)  # the restored weights moved again
    ladder.skipped(8, 0, "x")
    found, action = ladder.skipped(10, 0, "x")
    assert action == "stop"
    stop = found[-1]
    assert stop.severity == "error" and stop.where == "stop"
    assert "gave up" in stop.message and "after 1 roll backs" in stop.message
    assert "skipped 7 steps (from step 1 to 10)" in stop.message  # the history, in short
    assert "cool at 3; rollback at 6; cool at 6" in stop.message
    assert ladder.counts == {"skip": 7, "cool": 2, "rollback": 1, "stop": 1}


def test_two_steps_judged_bad_right_after_an_applied_one_roll_back_at_once():
    ladder = _ladder(cool_after=5)
    ladder.applied(149)
    found, action = ladder.skipped(150, 0, "the loss is past its bar")  # a bad batch?
    assert action is None and [f.where for f in found] == ["skip"]
    _, action = ladder.skipped(151, 0, "the loss is past its bar")  # no: the weights
    assert action == "rollback"
    # one bad batch between two applied steps is only skipped
    other = _ladder(cool_after=5)
    for step in (10, 20, 30):
        other.applied(step - 1)
        assert other.skipped(step, 0, "x")[1] is None
        other.applied(step + 1)
    assert other.counts["rollback"] == 0


def test_two_skips_their_batches_explain_are_no_sign_of_a_harmful_update():
    # the same NaN batch served last in an epoch and first in the next: two skips right
    # after an applied step, but the data explains them, not the weights
    ladder = _ladder(cool_after=5)
    ladder.applied(18)
    assert ladder.skipped(19, 0, "the inputs hold NaN", bad_data=True)[1] is None
    assert ladder.skipped(20, 1, "the inputs hold NaN", bad_data=True)[1] is None
    assert ladder.was_skipped(19) and ladder.was_skipped(20)
    # nor is a step judged bad on its own right after a bad batch
    ladder.applied(21)
    assert ladder.skipped(22, 1, "the inputs hold NaN", bad_data=True)[1] is None
    assert ladder.skipped(23, 1, "the gradient is past its bar")[1] is None
    assert ladder.counts["rollback"] == 0
    # two judged bad on their own still are
    ladder.applied(30)
    ladder.skipped(31, 1, "the gradient is past its bar")
    assert ladder.skipped(32, 1, "the loss is past its bar")[1] == "rollback"
    # a checkpoint keeps what the data explained
    again = _ladder()
    again.load_state_dict(ladder.state_dict())
    assert again.s.bad_data_at == 22


def test_skips_right_after_a_roll_back_are_the_data_and_roll_back_no_more():
    ladder = _ladder(rollback_after=1, window=10)
    ladder.applied(40)
    ladder.skipped(41, 0, "x")
    assert ladder.skipped(42, 0, "x")[1] == "rollback"
    ladder.rolled_back(42, 0, to_step=30, what="x")
    # the restored weights are healthy: a stretch of bad batches is skipped, no more
    for step in range(43, 50):
        assert ladder.skipped(step, 0, "x")[1] is None
    # ... but a run whose every step is skipped ends in a stop, not a loop
    found, action = ladder.skipped(50, 0, "x")  # 41 to 50
    assert action == "stop" and "every one of the last 10 steps was skipped" in found[-1].message


def test_after_a_roll_back_the_cool_down_starts_from_the_snapshots_learning_rate():
    ladder = _ladder(cool_steps=20)
    assert ladder.lr_ceiling(5) is None
    ladder.rolled_back(50, 0, to_step=40, what="x", learning_rates=[[0.01, 0.02]])
    assert ladder.lr_ceiling(51) == [[0.01, 0.02]] and ladder.lr_scale(51) == 0.1
    again = _ladder(cool_steps=20)
    again.load_state_dict(ladder.state_dict())  # a checkpoint keeps it
    assert again.lr_ceiling(60) == [[0.01, 0.02]]
    ladder.saw(71, 0, troubled=False)  # the cool-down is over: the schedule's own again
    assert ladder.lr_ceiling(72) is None


def test_after_a_rise_of_the_learning_rate_the_cool_down_caps_it_then_cools_if_need_be():
    ladder = _ladder(cool_steps=20)
    # the learning rate rose 300x since the snapshot: a spike explains the damage
    found = ladder.rolled_back(
        50, 0, to_step=40, what="x", learning_rates=[[0.01]], replaced=[[3.0]]
    )
    assert "had risen 300x above the snapshot's" in found[-1].message
    assert ladder.lr_scale(51) == 1.0 and ladder.lr_ceiling(51) == [[0.01]]
    # trouble again during that cool-down: the cap was not enough, it cools as well
    found = ladder.rolled_back(
        60, 0, to_step=40, what="x", learning_rates=[[0.01]], replaced=[[3.0]]
    )
    assert "scaled by 0.1" in found[-1].message and ladder.lr_scale(61) == 0.1
    # no rise: the usual cool-down, below the snapshot's learning rate
    other = _ladder(cool_steps=20)
    other.rolled_back(50, 0, to_step=40, what="x", learning_rates=[[0.01]], replaced=[[0.01]])
    assert other.lr_scale(51) == 0.1 and other.lr_ceiling(51) == [[0.01]]


def test_a_snapshot_taken_shortly_before_the_trouble_began_is_not_trusted():
    ladder = _ladder(snapshot_every=100, trust_after=20)
    assert Recovery(snapshot_every=50).trust_after == 10  # a fifth of it, by default
    ladder.applied(149)
    ladder.skipped(150, 0, "x")
    assert not ladder.trusted(140) and ladder.trusted(130) and ladder.trusted(100)
    ladder.saw(170, 0, troubled=True)  # the same trouble goes on: it began at 150
    assert ladder.trusted(130)
    ladder.saw(400, 0, troubled=True)  # a new one, after a quiet stretch
    assert ladder.trusted(380) and not ladder.trusted(390)


def test_an_error_on_an_applied_step_rolls_back():
    ladder = _ladder()
    bad = Finding(40, 0, "nonfinite_weights", "error", "weights are NaN", where="w")
    found, action = ladder.failed(40, 0, bad)
    assert action == "rollback" and found == []
    ladder_done = _ladder(max_rollbacks=0)
    found, action = ladder_done.failed(40, 0, bad)
    assert action == "stop" and "nonfinite_weights (error) at step 40" in found[0].message


def test_snapshots_only_on_the_cadence_and_only_when_healthy():
    ladder = _ladder(snapshot_every=10)
    assert [s for s in range(1, 41) if ladder.snapshot_due(s)] == [10, 20, 30, 40]
    ladder.saw(23, 0, troubled=True)  # a warning at 23: not healthy until 33
    assert [s for s in range(24, 61) if ladder.snapshot_due(s)] == [40, 50, 60]
    ladder.skipped(61, 0, "x")  # a skipped step leaves the weights healthy
    assert ladder.snapshot_due(70)


def test_a_roll_back_soon_after_a_roll_back_passes_over_the_snapshot_it_went_to(tmp_path):
    from stethoscope.recovery.snapshots import SnapshotStore

    ladder = _ladder(snapshot_every=10)
    assert not ladder.newest_suspect(50)  # no roll back yet
    ladder.rolled_back(50, 0, to_step=40, what="x")
    assert ladder.newest_suspect(55)  # the trouble came back within 10 steps of it
    assert not ladder.newest_suspect(60)
    store = SnapshotStore(Recovery(snapshot_in="disk", snapshot_dir=tmp_path, keep_snapshots=3))
    for step in (20, 30, 40):
        store.keep(step, {"step": step}, 8, 0.0)
    store.discard_newest()
    snap, state = store.newest()
    assert snap.step == state["step"] == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot-20.pkl", "snapshot-30.pkl"]
    store.close()


def test_the_ladder_survives_a_checkpoint():
    ladder = _ladder()
    for step in (1, 2, 3):
        ladder.skipped(step, 0, "x")
    again = _ladder()
    again.load_state_dict(ladder.state_dict())
    assert again.state_dict() == ladder.state_dict()
    assert again.lr_scale(5) == 0.1 and again.history == ladder.history


def _obs(step: int, loss: float) -> Observation:
    return Observation(step=step, epoch=0, loss=loss)


def test_a_monitor_with_a_ladder_does_not_stop_on_what_the_ladder_answers():
    sink = CapturingSink()
    monitor = Monitor(sinks=[sink])
    recoverer = Recoverer(monitor, Recovery(max_rollbacks=1))
    for step in range(3):
        monitor.observe(_obs(step, 1.0))
    # the step was skipped, then judged: the NaN is reported, nothing stops
    assert not recoverer.skipped(3, 0, "the loss is NaN").stop
    recoverer.settle(3)
    decision = recoverer.review(monitor.observe(_obs(3, float("nan"))))
    assert not decision.stop and recoverer.rollback_due is None
    assert sink.at_least("error")[0].detector == "nonfinite_loss"  # nothing hidden
    assert monitor.stopped_by is None
    # a NaN on a step that was applied asks for a roll back
    recoverer.settle(9)
    decision = recoverer.review(monitor.observe(_obs(9, float("nan"))))
    assert not decision.stop and "nonfinite_loss (error) at step 9" in recoverer.rollback_due
    recoverer.rolled_back(9, 0, to_step=0, what="everything")
    assert [f.where for f in sink.findings if f.detector == RECOVERY][-2:] == ["rollback", "cool"]
    # judged before its step was settled (an early micro-batch), it waits for the verdict
    decision = recoverer.review(monitor.observe(_obs(12, float("nan"))))
    assert not decision.stop
    # the next one has no roll back left: stop, for the ladder's reason
    decision = recoverer.settle(12)
    assert decision.stop and decision.reason.detector == RECOVERY
    assert monitor.stopped_by is decision.reason


def test_without_a_snapshot_the_roll_back_is_a_stop():
    monitor = Monitor(sinks=[])
    recoverer = Recoverer(monitor, Recovery())
    recoverer.settle(5)
    recoverer.review(monitor.observe(_obs(5, float("nan"))))
    assert recoverer.rollback_due
    decision = recoverer.no_snapshot(5, 0)
    assert decision.stop and "no healthy snapshot" in decision.reason.message


def test_recovery_takes_keywords_and_paths_and_hints_at_the_class():
    from pathlib import Path

    with pytest.raises(TypeError):
        Recovery(0.5)  # which argument would that be? keywords only
    assert Recovery(snapshot_dir=Path("/tmp/snaps")).snapshot_dir == "/tmp/snaps"
    with pytest.raises(ValueError, match=r"recover=Recovery is the class; use recover="):
        parse_recover(Recovery)


def test_an_epoch_the_ladder_saved_says_so_in_its_verdict():
    monitor = Monitor(sinks=[])
    recoverer = Recoverer(monitor, Recovery())
    for step in range(3):
        monitor.observe(_obs(step, 1.0))
    recoverer.skipped(3, 0, "the loss is nan")
    recoverer.settle(3)
    recoverer.review(monitor.observe(_obs(3, float("nan"))))
    verdict = monitor.end_epoch(0).verdict
    assert verdict.startswith("1 error(s)") and verdict.endswith("recovered: skipped 1 step")


def test_a_warning_that_the_weights_drifted_rolls_back_but_other_warnings_do_not():
    from stethoscope.engine.policy import Decision

    monitor = Monitor(sinks=[])
    recoverer = Recoverer(monitor, Recovery())
    recoverer.settle(40)
    spike = Finding(39, 0, "loss_spike", "warning", "one bad batch", where="loss")
    recoverer.review(Decision(spared=(spike,)))
    assert recoverer.rollback_due is None  # one bad batch: not damage
    climbed = Finding(40, 0, "unstable_loss", "warning", "the loss climbed back", where="loss")
    recoverer.review(Decision(spared=(climbed,)))
    assert "unstable_loss (warning) at step 40" in recoverer.rollback_due


def test_a_step_not_applied_hands_the_detectors_no_update():
    # a skipped step moved no weight: its update statistics (zero) would read as a layer
    # too slow to learn, and small_updates would call the sampler in
    import numpy as np

    sink = CapturingSink()
    recoverer = Recoverer(Monitor(sinks=[sink]), Recovery(rollback_after=1, cool_after=1))
    recoverer.skipped(3, 0, "the loss is NaN")
    recoverer.ladder.not_applied(4)  # a GradScaler's
    recoverer.settle(5)
    for step, kept in ((3, False), (4, False), (5, True)):
        obs = Observation(step=step, epoch=0, loss=1.0)
        obs.update_norm, obs.prev_weight_norm = np.zeros(2), np.ones(2)
        recoverer.drop_unapplied_update(obs)
        assert (obs.update_norm is not None) == kept and (obs.prev_weight_norm is not None) == kept
    # past the roll back that forgets its skips, the skipped step is still known
    recoverer.skipped(6, 0, "the loss is NaN")
    recoverer.rolled_back(6, 0, to_step=0, what="everything")
    obs = Observation(step=6, epoch=0, loss=1.0)
    obs.update_norm, obs.prev_weight_norm = np.zeros(2), np.ones(2)
    recoverer.drop_unapplied_update(obs)
    assert obs.update_norm is None
