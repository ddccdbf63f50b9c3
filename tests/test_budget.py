"""The overhead budget: measured as training runs, it stretches the sampled detectors'
intervals to stay within the budget, never the every-step ones, never past the longest
interval, and never while the sampler is hot."""

from __future__ import annotations

import pytest

from stethoscope.detectors import default_detectors
from stethoscope.engine.budget import LONGEST, OverheadBudget, parse_budget
from stethoscope.engine.monitor import Monitor


def _feed(budget: OverheadBudget, *, quiet: float, sampled: float, every: int, steps: int):
    """Clock ``steps`` steps of ``quiet`` seconds, one in ``every`` taking ``sampled``;
    return the stretches the budget asked for."""
    asked = []
    for t in range(steps):
        got = budget.clock(sampled if t % every == 0 else quiet, sampled=t % every == 0)
        if got is not None:
            asked.append(got)
            every = 16 * got
    return asked


def test_a_dear_sampled_step_is_stretched_until_it_fits():
    """4 ms steps, a sampled one 2 ms dearer every 16: 3.1% of step time. Within 1% that
    is every 64 steps (0.8%), and there it stays."""
    budget = OverheadBudget(0.01, shortest=16)
    assert _feed(budget, quiet=0.004, sampled=0.006, every=16, steps=3000) == [4]
    assert budget.stretch == 4
    assert budget.measured == pytest.approx(0.002 / (64 * 0.004), rel=0.1)
    assert "gradients every 64 steps at 0.8% cost (overhead budget 1%, 4x" in budget.note(64)


def test_a_cheap_sampled_step_keeps_its_interval_and_room_gives_steps_back():
    budget = OverheadBudget(0.05, shortest=16)
    assert _feed(budget, quiet=0.004, sampled=0.006, every=16, steps=3000) == []
    assert budget.note(16) == "; gradients every 16 steps at 3.1% cost (overhead budget 5%)"
    budget = OverheadBudget(0.01, shortest=16)
    budget.stretch = 8  # stretched when the steps were dearer; now 0.5% at 16: halve
    assert _feed(budget, quiet=0.004, sampled=0.0043, every=128, steps=800)[:1] == [4]


def test_executions_of_several_steps_are_judged_every_window_of_steps():
    """Keras' steps_per_execution=8: each clock is an execution of 8 steps. Sampling every
    16 steps would leave no quiet execution to compare with (sampled, after, sampled...):
    the budget starts at 2x. A sampled execution 2 ms dearer than a 32 ms one every 4
    executions costs 1.6%: judged after 256 steps (32 executions), not 256 executions."""
    budget = OverheadBudget(0.01, shortest=16)
    asked = []
    every = 2
    for t in range(200):
        got = budget.clock(0.034 if t % every == 0 else 0.032, sampled=t % every == 0, steps=8)
        if got is not None:
            asked.append((t, got))
            every = 2 * got
    assert asked[:2] == [(0, 2), (32, 4)]
    assert budget.least == 2
    assert budget.measured == pytest.approx(0.002 / (8 * 0.032), rel=0.01)


def test_a_stretch_given_back_keeps_quiet_executions_between_sampled_ones():
    budget = OverheadBudget(0.05, shortest=16)
    budget.clock(0.032, sampled=False, steps=8)
    assert budget.stretch == 2
    for t in range(400):  # nearly free: room to spare, but not below 2x
        budget.clock(0.0321 if t % 4 == 0 else 0.032, sampled=t % 4 == 0, steps=8)
    assert budget.stretch == 2
    single = OverheadBudget(0.01, shortest=16)  # one step an interval: no floor
    single.clock(0.004, sampled=False)
    assert single.stretch == 1 and single.least == 1


def test_sampled_steps_of_several_kinds_are_costed_at_their_mean():
    """One sampled step in four measures more and costs 5 ms more, the others 1 ms: 2 ms
    on average, every 16 steps of 4 ms, 3.1% (a median of them would say 1.6%): 4x, not
    2x. A single outlier (a collection, say) is trimmed."""
    budget = OverheadBudget(0.01, shortest=16)
    for t in range(256):
        sampled = t % 16 == 0
        extra = (0.005 if t % 64 == 0 else 0.001) if sampled else 0.0
        if t == 160:
            extra = 0.1
        got = budget.clock(0.004 + extra, sampled=sampled)
    assert got == 4
    assert budget.measured == pytest.approx(0.002 / 0.004 / 16 / 4, rel=0.1)


def test_the_stretch_stops_at_the_longest_interval():
    budget = OverheadBudget(0.001, shortest=16)
    _feed(budget, quiet=0.001, sampled=0.010, every=16, steps=5000)
    assert budget.stretch == LONGEST // 16


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.01, "1%", True])
def test_a_bad_budget_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"overhead_budget={bad!r}.*between 0 and 1"):
        parse_budget(bad)
    with pytest.raises(ValueError, match="overhead_budget"):
        Monitor(overhead_budget=bad)


def _monitor(**kw) -> Monitor:
    return Monitor(detectors=default_detectors(), sinks=[], overhead_budget=0.01, **kw)


def _train(m: Monitor, steps: int = 3000) -> None:
    """Clock ``steps`` steps as the monitor plans them: 4 ms, a sampled one 2 ms more."""
    for t in range(steps):
        sampled = "grads" in m.plan(t)  # what the stretched detectors measure
        m.clock(0.006 if sampled else 0.004, sampled=sampled)


def test_the_monitor_stretches_only_the_sampled_detectors_and_never_when_hot():
    m = _monitor()
    declared = dict(m.sampler.base)
    m.clock(0.01, sampled=True)  # calibrating (hot): not counted
    assert m.budget._steps == 0
    m.sampler.hot_since = None  # past calibration
    _train(m)
    assert m.sampler.stretch == 4
    for name, every in declared.items():
        expected = every if every == 1 else min(every * 4, LONGEST)
        assert m.sampler.base[name] == expected, name
    assert "grads" not in m.plan(16) and "grads" in m.plan(64)
    m.sampler.escalate(100, "suspicion")  # an escalation still runs everything every step
    assert m.sampler.interval("exploding_gradients", 101) == 1


def test_the_stretch_survives_a_checkpoint_and_a_fresh_run_forgets_it():
    m = _monitor()
    m.sampler.hot_since = None
    _train(m)
    state = m.state_dict()
    resumed = _monitor()
    resumed.load_state_dict(state)
    assert resumed.sampler.stretch == 4 and resumed.sampler.base == m.sampler.base
    assert resumed.budget.stretch == 4
    m.reset()
    assert m.sampler.stretch == 1 and m.sampler.base == m.sampler.declared


def test_without_a_budget_nothing_is_clocked_or_stretched():
    m = Monitor(detectors=default_detectors(), sinks=[])
    m.sampler.hot_since = None
    for t in range(3000):
        m.clock(0.1 if t % 16 == 0 else 0.004, sampled=t % 16 == 0)
    assert m.budget is None and m.sampler.stretch == 1
    assert "budget" not in m.summary(0).verdict


def test_the_step_after_a_sampled_one_counts_toward_its_cost():
    """A sampled step leaves the next one slower (its cache refilled): the cost counts
    both, so 1 ms over a 4 ms step plus 1 ms after it, every 16 steps, is 3.1%."""
    budget = OverheadBudget(0.05, shortest=16)
    for t in range(3000):
        seconds = 0.005 if t % 16 in (0, 1) else 0.004
        budget.clock(seconds, sampled=t % 16 == 0)
    assert budget.measured == pytest.approx(0.002 / (16 * 0.004), rel=0.05)


def test_a_distributed_run_has_no_budget_so_its_ranks_keep_one_schedule():
    m = _monitor()
    m.distribute(rank=1, world_size=2)
    m.sampler.hot_since = None
    _train(m)
    assert m.budget is None and m.sampler.stretch == 1
    m.distribute(rank=0, world_size=1)
    assert m.budget is not None and m.budget.fraction == 0.01


def test_the_longest_stretch_counts_only_the_detectors_that_take_part():
    """loss_scale_collapse (every 4 steps) sits out without a loss scaler: it must not let
    the 16-step detectors stretch to 16 x 64 = 1024 steps instead of LONGEST."""
    from stethoscope.advice import TrainingSetup
    from stethoscope.sinks.base import RunContext

    m = _monitor()
    assert (m.budget.shortest, m.budget.most) == (16, LONGEST // 16)
    m.start(
        RunContext(framework="x", setup=TrainingSetup(low_precision=True, loss_scaler="GradScaler"))
    )
    assert (m.budget.shortest, m.budget.most) == (4, LONGEST // 4)
    m.budget.stretch = 64
    m.start(RunContext(framework="x", setup=TrainingSetup()))  # a second fit, in float32
    assert (m.budget.shortest, m.budget.most, m.budget.stretch) == (16, 16, 16)
