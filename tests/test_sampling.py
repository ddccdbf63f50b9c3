"""The adaptive sampler: its schedule pinned by units, its invariants by properties."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stethoscope.engine.sampler import AdaptiveSampler

BASE = {"loss": 1, "grads": 16, "acts": 64}


def intervals(s: AdaptiveSampler, step: int) -> dict[str, int]:
    return {name: s.interval(name, step) for name in s.base}


def drive(s: AdaptiveSampler, steps: range, escalate_at=()) -> dict[int, str]:
    """Tick every step (then escalate where asked), as the monitor does; the reports by step.
    ``escalate_at``: steps (every detector raised), or a mapping of steps to the detectors
    a focused escalation raises (None: every detector)."""
    reports = {}
    focus = escalate_at if isinstance(escalate_at, dict) else {}
    for t in steps:
        msg = s.tick(t)
        if t in escalate_at:
            msg2 = s.escalate(t, "suspect", focus.get(t))
            msg = msg2 if msg is None else f"{msg} | {msg2}"
        if msg:
            reports[t] = msg
    return reports


# -- calibration ----------------------------------------------------------------------------------
def test_calibration_every_step_then_doubling_to_base_silently():
    s = AdaptiveSampler(BASE, hot_steps=4)
    expected = {0: 1, 3: 1, 4: 2, 7: 2, 8: 4, 12: 8, 16: 16, 20: 32, 24: 64, 100: 64}
    assert {t: s.interval("acts", t) for t in expected} == expected
    assert {t: s.interval("grads", t) for t in (0, 4, 8, 12, 16, 100)} == {
        0: 1,
        4: 2,
        8: 4,
        12: 8,
        16: 16,
        100: 16,
    }
    assert all(s.interval("loss", t) == 1 for t in range(100))
    assert drive(s, range(200)) == {}  # the calibration window is not news
    assert not s.hot
    assert s.escalations == 0
    assert intervals(s, 1000) == BASE


def test_calibration_due_steps():
    s = AdaptiveSampler({"grads": 16}, hot_steps=4)
    due = [t for t in range(40) if s.is_due("grads", t)]
    # interval 1 to step 3, 2 to 7, 4 to 11, 8 to 15, then 16: due on multiples of it
    assert due == [0, 1, 2, 3, 4, 6, 8, 16, 32]


def test_docstring_example_default_hot_steps():
    s = AdaptiveSampler({"nonfinite_loss": 1, "exploding_gradients": 16})
    assert [t for t in range(200, 240) if s.is_due("exploding_gradients", t)] == [208, 224]
    assert s.due(208) == ["nonfinite_loss", "exploding_gradients"]
    assert s.due(209) == ["nonfinite_loss"]


# -- escalation -----------------------------------------------------------------------------------
def test_escalation_is_reported_and_the_return_too():
    s = AdaptiveSampler(BASE, hot_steps=4)
    assert drive(s, range(100)) == {}
    msg = s.escalate(100, "loss_spike warning")
    assert msg == (
        "loss_spike warning: running all detectors every step for 4 steps, then back off"
    )
    assert s.escalations == 1
    assert intervals(s, 100) == intervals(s, 103) == {"loss": 1, "grads": 1, "acts": 1}
    assert intervals(s, 104) == {"loss": 1, "grads": 2, "acts": 2}
    assert intervals(s, 116) == {"loss": 1, "grads": 16, "acts": 16}
    reports = drive(s, range(101, 200))
    # back to 64 after 6 halvings of 4 steps
    assert reports == {124: "no new suspicion for 24 steps: detectors back to their base intervals"}
    assert not s.hot
    assert intervals(s, 124) == BASE


def test_suspicion_during_calibration_is_reported():
    s = AdaptiveSampler(BASE, hot_steps=4)
    assert drive(s, range(2)) == {}
    assert s.escalate(2, "exploding_gradients: norm 40x") is not None
    assert s.escalations == 1
    reports = drive(s, range(3, 100))
    assert list(reports) == [2 + 24]  # its return is reported, unlike calibration's end


def test_suspicion_in_the_decay_is_reported():
    s = AdaptiveSampler(BASE, hot_steps=4)
    s.escalate(100, "first")
    assert s.interval("acts", 110) == 4
    assert s.escalate(110, "second") is not None  # the rate actually rises again
    assert s.escalations == 2
    assert s.interval("acts", 110) == 1


def test_reescalation_while_every_step_extends_silently():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(100))
    assert s.escalate(100, "first") is not None
    assert s.escalate(102, "second") is None
    assert s.escalations == 1
    assert intervals(s, 105) == {"loss": 1, "grads": 1, "acts": 1}  # 102 + 4 steps
    assert s.interval("acts", 106) == 2
    assert list(drive(s, range(101, 200))) == [102 + 24]


# -- a focused escalation -------------------------------------------------------------------------
def test_a_focused_escalation_raises_its_detectors_alone_and_reports_their_return():
    s = AdaptiveSampler(BASE, hot_steps=4)
    assert drive(s, range(100)) == {}
    msg = s.escalate(100, "grads suspect", ["grads"])
    assert msg == "grads suspect: running grads every step for 4 steps, then back off"
    assert s.escalations == 1 and s.hot
    assert intervals(s, 101) == {"loss": 1, "grads": 1, "acts": 64}
    assert intervals(s, 104) == {"loss": 1, "grads": 2, "acts": 64}
    assert s.due(101) == ["loss", "grads"]
    reports = drive(s, range(101, 200))
    # back to 16 after 4 halvings of 4 steps, not the 6 that acts' 64 would take
    assert reports == {116: "no new suspicion for 16 steps: detectors back to their base intervals"}
    assert not s.hot
    assert intervals(s, 116) == BASE


def test_a_focused_escalation_of_every_step_detectors_alone_changes_nothing():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(100))
    assert s.escalate(100, "loss suspect", ["loss"]) is None
    assert not s.hot and s.escalations == 0


def test_a_focus_during_calibration_outlasts_it_and_is_reported():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(20))
    assert s.interval("grads", 20) == 16  # calibration's cap is 32 there
    assert s.escalate(20, "grads suspect", ["grads"]) is not None
    assert intervals(s, 21) == {"loss": 1, "grads": 1, "acts": 32}
    reports = drive(s, range(21, 100))
    # calibration ends at 24 silently, the focus at 36, reported
    assert reports == {36: "no new suspicion for 16 steps: detectors back to their base intervals"}


def test_a_focus_that_ends_inside_calibration_has_the_calibrations_end_reported():
    """The detectors a suspicion raised come back to base with the rest: the return is
    reported once, where calibration ends, though calibration alone is no news."""
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(2))
    assert s.escalate(2, "grads suspect", ["grads"]) is not None
    reports = drive(s, range(3, 100))
    # the focus ends at 2 + 16, calibration at 24: one report, at 24
    assert reports == {24: "no new suspicion for 22 steps: detectors back to their base intervals"}


def test_foci_join_and_a_warning_takes_them_all_in():
    s = AdaptiveSampler({"a": 16, "b": 16, "c": 16}, hot_steps=4)
    drive(s, range(100))
    assert s.escalate(100, "x", ["a"]) is not None
    assert s.escalate(102, "y", ["a"]) is None  # still every step: extended silently
    assert s.escalate(103, "z", ["b"]) is not None  # b's rate rises
    assert s.focus == {"a", "b"} and s.focus_since == 103
    assert intervals(s, 106) == {"a": 1, "b": 1, "c": 16}
    assert s.escalate(110, "warning", None) is not None
    assert s.focus == frozenset() and intervals(s, 111) == {"a": 1, "b": 1, "c": 1}


def test_a_detector_in_both_windows_runs_at_the_shorter_interval():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(100))
    s.escalate(100, "warning")
    s.escalate(110, "grads suspect", ["grads"])  # the whole window is at cap 4 there
    assert intervals(s, 111) == {"loss": 1, "grads": 1, "acts": 4}
    assert s.due_set(111) == frozenset(s.due(111)) == {"loss", "grads"}


def test_a_focused_window_survives_a_checkpoint():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(101), escalate_at={100: ["grads"]})
    r = AdaptiveSampler(BASE, hot_steps=4)
    r.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert r.focus == {"grads"} and r.focus_since == 100
    assert drive(r, range(101, 200)) == drive(s, range(101, 200)) != {}


def test_escalate_false_keeps_base_intervals_and_never_reports():
    s = AdaptiveSampler(BASE, escalate=False, hot_steps=4)
    assert all(intervals(s, t) == BASE for t in range(0, 300, 7))
    assert drive(s, range(300), escalate_at={5, 50, 51, 200}) == {}
    assert s.escalations == 0
    assert not s.hot
    assert [t for t in range(40) if s.is_due("grads", t)] == [0, 16, 32]


def test_all_base_one_has_nothing_to_escalate():
    s = AdaptiveSampler({"a": 1, "b": 1}, hot_steps=4)
    assert drive(s, range(100), escalate_at={3, 50}) == {}
    assert s.escalations == 0


def test_per_detector_intervals():
    s = AdaptiveSampler({"a": 1, "b": 3, "c": 8}, escalate=False)
    assert [s.due(t) for t in range(9)] == [
        ["a", "b", "c"],
        ["a"],
        ["a"],
        ["a", "b"],
        ["a"],
        ["a"],
        ["a", "b"],
        ["a"],
        ["a", "c"],
    ]
    hot = AdaptiveSampler({"a": 1, "b": 3, "c": 8}, hot_steps=2)
    hot.tick(0)
    assert (hot.interval("b", 2), hot.interval("c", 2)) == (2, 2)  # the cap, under each base
    assert (hot.interval("b", 4), hot.interval("c", 4)) == (3, 4)


def test_empty_sampler():
    s = AdaptiveSampler({})
    assert s.due(0) == []
    assert drive(s, range(50), escalate_at={10}) == {}


# -- bad arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, "2", True, None])
def test_bad_interval_raises_naming_the_value(bad):
    with pytest.raises(ValueError, match=rf"'grads' is {bad!r}"):
        AdaptiveSampler({"loss": 1, "grads": bad})


@pytest.mark.parametrize("bad", [0, -3, 2.5, 4.0, "32", False, True, None])
def test_bad_hot_steps_raises_naming_the_value(bad):
    with pytest.raises(ValueError, match=rf"hot_steps={bad!r}"):
        AdaptiveSampler(BASE, hot_steps=bad)


# -- state ----------------------------------------------------------------------------------------
def test_state_dict_is_json_and_restores_mid_escalation():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(100), escalate_at={60, 90})
    state = json.loads(json.dumps(s.state_dict()))
    r = AdaptiveSampler(BASE, hot_steps=4)
    r.load_state_dict(state)
    assert r.state_dict() == s.state_dict()
    assert drive(r, range(100, 300)) == drive(s, range(100, 300)) != {}


def test_load_empty_state_is_a_fresh_sampler():
    s = AdaptiveSampler(BASE, hot_steps=4)
    drive(s, range(100), escalate_at={60})
    s.load_state_dict({})
    assert s.state_dict() == AdaptiveSampler(BASE, hot_steps=4).state_dict()


# -- properties -----------------------------------------------------------------------------------
bases = st.dictionaries(
    st.sampled_from(["loss", "grads", "weights", "acts", "data"]),
    st.integers(1, 256),
    min_size=1,
)
hot_steps = st.integers(1, 64)
escalations = st.lists(st.integers(0, 400), max_size=8)
#: what an escalation raises: every detector (None), or some of them
names = st.sampled_from(["loss", "grads", "weights", "acts", "data"])
raised = st.one_of(st.none(), st.sets(names))
foci = st.dictionaries(st.integers(0, 400), raised, max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    base=bases,
    hot=hot_steps,
    esc=st.lists(st.tuples(st.integers(0, 3000), raised), max_size=8),
    tick=st.booleans(),
)
def test_interval_is_always_within_1_and_base(base, hot, esc, tick):
    s = AdaptiveSampler(base, hot_steps=hot)
    for step, names in esc:  # in any order, ticking or not
        if tick:
            s.tick(step)
        s.escalate(step, "x", names)
        for t in (step, step + 1, step + hot, step + 10 * hot, max(0, step - 5)):
            for name, b in base.items():
                assert 1 <= s.interval(name, t) <= b
                assert s.is_due(name, t) == (t % s.interval(name, t) == 0)


@settings(max_examples=60, deadline=None)
@given(base=bases, hot=hot_steps, esc=foci)
def test_returns_to_base_within_bound_and_reports_once(base, hot, esc):
    s = AdaptiveSampler(base, hot_steps=hot)
    max_base = max(base.values())
    last = max(esc, default=0)
    bound = hot * (math.ceil(math.log2(max_base)) + 1)
    end = last + bound + 1
    reports = drive(s, range(end + 1), escalate_at=esc)
    after = [t for t in reports if t > last]
    # an escalation that raised something: every detector, or one sampled in what it names
    rising = [
        t for t, names in esc.items() if names is None or any(base.get(n, 1) > 1 for n in names)
    ]
    if not rising or max_base == 1:
        assert after == []  # calibration's end is silent; nothing to escalate
    else:
        assert len(after) <= 1
        assert not after or after[0] <= last + bound
        back = [t for t, msg in reports.items() if "back to their base intervals" in msg]
        reported = [t for t, msg in reports.items() if "running" in msg]
        # every window a report opened is reported closed, once, after it
        assert bool(back) == bool(reported)
        assert not back or back[-1] >= reported[-1]
    assert not s.hot
    for t in range(end - 3, end + 2 * max_base):
        assert intervals(s, t) == base


@settings(max_examples=60, deadline=None)
@given(
    base=bases,
    hot=hot_steps,
    esc=foci,
    cut=st.integers(0, 500),
    escalate=st.booleans(),
)
def test_schedule_is_a_pure_function_of_step_and_state(base, hot, esc, cut, escalate):
    a = AdaptiveSampler(base, hot_steps=hot, escalate=escalate)
    drive(a, range(cut), escalate_at=esc)
    b = AdaptiveSampler(base, hot_steps=hot, escalate=escalate)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    later = {t + cut: names for t, names in esc.items()}
    rest = range(cut, cut + 600)
    assert [b.due(t) for t in rest] == [a.due(t) for t in rest]
    assert drive(b, rest, escalate_at=later) == drive(a, rest, escalate_at=later)
    assert b.state_dict() == a.state_dict()


@settings(max_examples=60, deadline=None)
@given(base=bases, hot=hot_steps, esc=foci)
def test_due_set_is_due_at_every_step(base, hot, esc):
    # the cached answer, keyed by which intervals divide the step, equals the full scan
    s = AdaptiveSampler(base, hot_steps=hot)
    for t in range(600):
        s.tick(t)
        if t in esc:
            s.escalate(t, "x", esc[t])
        assert s.due_set(t) == frozenset(s.due(t))
