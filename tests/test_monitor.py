"""The framework-free core: plan, observe, escalate, dedupe, isolate sinks, stop, summarise."""

from __future__ import annotations

import io
import json
import warnings
from typing import ClassVar

import numpy as np
import pytest
from rich.console import Console

from stethoscope.detectors import (
    DETECTORS,
    Detector,
    LossSpike,
    RepeatedData,
    default_detectors,
)
from stethoscope.engine.monitor import Monitor
from stethoscope.findings import SAMPLER, Finding
from stethoscope.observation import Observation
from stethoscope.sinks.base import RunContext, Sink
from stethoscope.statistics import EVENT, GATHERED, STATISTICS
from stethoscope.summary import EpochSummary
from stethoscope.testing import CapturingSink

NAMES = ("blocks[0].w", "blocks[0].b", "head.w", "head.b")
GRAD = np.array([0.5, 0.05, 0.8, 0.1])


#: What a sampled step of the default detectors asks for: every planned statistic (the
#: gathered ones come from the collective of a distributed run, never from a step's plan)
#: but the trace (requested after a non-finite loss) and the distributions (which no
#: default detector reads).
#: What a float32 run measures: not the precision statistics, whose rules do not apply.
LOW_PRECISION = frozenset({"precision", "loss_scale", "fp8"})
SAMPLED = frozenset(STATISTICS) - EVENT - GATHERED - {"trace", "distributions"} - LOW_PRECISION
#: The detectors a single float32 process runs: all but those that compare ranks, those
#: of low precision and the reports a run asks for.
LOCAL = tuple(
    n
    for n, cls in DETECTORS.items()
    if not cls.needs & GATHERED and cls().applies() and not cls.opt_in
)


def make_obs(step: int, loss: float | None = 2.3, probes=("grads", "weights", "updates"), **kw):
    """An observation at ``step`` with healthy values for the probes asked for."""
    values = {
        "grads": kw.pop("grads", GRAD),
        "weights": kw.pop("weights", np.full(4, 10.0)),
        "updates": kw.pop("updates", np.full(4, 1e-2)),
    }
    field = {"grads": "grad_norm", "weights": "weight_norm", "updates": "update_norm"}
    arrays = {field[p]: np.asarray(values[p], dtype=float) for p in probes if p in field}
    return Observation(
        step=step,
        loss=loss,
        names=NAMES,
        numel=np.array([4096, 64, 640, 10]),
        is_matrix=np.array([True, False, True, False]),
        **arrays,
        **kw,
    )


class Scripted(Detector):
    """Emits the findings of its script, keyed by step: (severity, where) or a suspect reason."""

    name = "scripted"
    needs: ClassVar[frozenset[str]] = frozenset({"loss"})
    advice = "do what the script says"

    def __init__(self, script: dict[int, tuple[str, str | None]] | None = None) -> None:
        self.script = dict(script or {})
        super().__init__()

    def _update(self, obs: Observation) -> list[Finding]:
        action = self.script.get(obs.step)
        if action is None:
            return []
        severity, where = action
        if severity == "suspect":
            self.suspect = where
            return []
        return [
            self.finding(obs, severity, f"Scripted {severity} at step {obs.step}.", where=where)
        ]


class OtherScripted(Scripted):
    name = "other_scripted"


class Spy(Detector):
    """Records the steps it ran at."""

    name = "spy_grads"
    needs: ClassVar[frozenset[str]] = frozenset({"grads"})
    base_interval = 4

    def _initial_state(self) -> dict:
        return {"steps": []}

    def _update(self, obs: Observation) -> list[Finding]:
        self.state["steps"].append(obs.step)
        return []


class UpdateSpy(Spy):
    name = "spy_updates"
    needs: ClassVar[frozenset[str]] = frozenset({"updates"})
    base_interval = 16


class LossSpy(Spy):
    name = "spy_loss"
    needs: ClassVar[frozenset[str]] = frozenset({"loss"})
    base_interval = 1


class Broken(Sink):
    def emit(self, finding):
        raise OSError("disk full")

    def epoch_end(self, summary):
        raise OSError("disk full")

    def flush(self):
        raise OSError("disk full")


def feed(monitor: Monitor, steps, loss=2.3, **kw):
    """Observe each step with the probes the monitor planned; the decisions."""
    return [monitor.observe(make_obs(t, loss=loss, probes=monitor.plan(t), **kw)) for t in steps]


# -- plan and observe -----------------------------------------------------------------------------
def test_plan_loss_only_on_unsampled_steps():
    m = Monitor(detectors=[*default_detectors(), UpdateSpy()], escalate=False)
    assert m.plan(1) == m.plan(15) == m.plan(17) == {"loss"}
    assert m.plan(0) == SAMPLED
    # poor_initialization is finished after step 10: the layer-output hooks go with it
    # (UpdateSpy asks for updates every 16 steps; the default update detectors, every 32)
    assert m.plan(16) == m.plan(32) == SAMPLED - {"outputs"}


def test_finished_detectors_are_neither_run_nor_planned():
    m = Monitor(detectors=default_detectors(), escalate=False)
    imbalance = next(d for d in m.detectors if d.name == "class_imbalance")
    assert "labels" in m.plan(16)
    chance = next(d for d in m.detectors if d.name == "loss_at_chance")
    imbalance.state["judged"] = True  # judged once, after its first 500 labels
    blocks = next(d for d in m.detectors if d.name == "unshuffled_data")
    blocks.state["judged"] = True  # it warned: batches of one class
    assert "labels" in m.plan(32)  # loss_at_chance is still counting them
    chance.state["chance"] = 1.38  # counted: it keeps judging the loss, without labels
    assert "labels" not in m.plan(48) and "loss" in m.plan(48)
    before = imbalance.state_dict()
    m.observe(make_obs(48, probes=SAMPLED, labels=np.zeros(600, int)))
    assert imbalance.state_dict() == before


def test_an_epochs_first_step_measures_what_detectors_compare_epochs_by():
    """repeated_data reads the prints at each epoch's (and run's) first step, whatever the
    schedule, and only there: a run without prints costs nothing on the steps after."""
    m = Monitor(detectors=[RepeatedData(), LossSpike()], escalate=False)
    m.begin(fresh=True)
    assert "prints" in m.plan(0)
    feed(m, range(21))
    assert m.plan(21) == {"loss"}
    m.end_epoch(0)
    assert m.plan(21) == {"loss", "prints"}
    assert m.plan(21) == {"loss", "prints"}  # asked again for the same step: the same
    # and the detector that reads it runs there, although its schedule does not
    prints = np.arange(8.0)
    m.observe(Observation(step=21, epoch=1, loss=2.3, sample_prints=prints))
    assert m.detectors[0].state["epoch"] == 1 and m.detectors[0].state["start"] == 21
    # a batch seen before asks for the next one: a request is for the steps after the one
    # that raised it, even one that carried the statistic
    m.observe(Observation(step=32, epoch=1, loss=2.3, sample_prints=prints))
    assert m.plan(33) == {"loss", "prints"}
    m.observe(Observation(step=33, epoch=1, loss=2.3, sample_prints=prints + 100))
    assert m.plan(34) == {"loss"}
    assert m.plan(48) == {"loss", "prints"}  # the detector's own schedule
    m.load_state_dict(m.state_dict())  # a resumed run's first step
    assert m.plan(25) == {"loss", "prints"}
    assert m.plan(26) == {"loss"}  # its observation never came: forgotten
    # a validation's prints run it too, whatever it needs on a training step
    m.observe_validation(40, 2, None, val_prints=np.arange(64.0))
    assert m.detectors[0].state["epoch"] == 1  # judged (no training batch moved it)
    assert m.reads("val_prints") and not m.reads("grads")
    done = Monitor(detectors=[RepeatedData(), LossSpike()], escalate=False)
    done.detectors[0].state["warned"] = ["stuck", "order", "resume", "overlap"]
    done.end_epoch(0)
    assert done.plan(1) == {"loss"}  # it has said all it can: nothing to measure


def test_plan_follows_the_sampler_through_calibration():
    m = Monitor(escalate=True, hot_steps=4)
    assert m.plan(1) == SAMPLED  # calibrating: every step
    feed(m, range(40))
    assert m.plan(41) == {"loss"}
    assert m.plan(48) == SAMPLED - {"outputs", "updates"}  # the update detectors: every 32


def test_observe_runs_only_due_detectors_with_their_probes():
    spy, loss_spy = Spy(), LossSpy()
    m = Monitor(detectors=[spy, loss_spy], escalate=False)
    for t in range(16):
        probes = () if t == 8 else ("grads",)  # the grads probe did not run at step 8
        m.observe(make_obs(t, loss=None if t == 5 else 2.3, probes=probes))
    assert spy.state["steps"] == [0, 4, 12]
    assert loss_spy.state["steps"] == [t for t in range(16) if t != 5]


def test_observe_skips_nonfinite_gradients_on_unsampled_steps():
    sink = CapturingSink()
    m = Monitor(sinks=[sink], escalate=False, stop_on=None)
    bad = np.array([0.5, np.nan, 0.8, 0.1])
    m.observe(make_obs(5, grads=bad))  # not a sampled step: ignored even though present
    m.observe(make_obs(16, grads=bad))
    assert [(f.step, f.detector, f.where) for f in sink.findings] == [
        (16, "nonfinite_gradients", "blocks[0].b")
    ]


# -- escalation -----------------------------------------------------------------------------------
def test_a_warning_escalates_and_the_sampler_reports_it():
    sink = CapturingSink()
    m = Monitor(sinks=[sink], hot_steps=4)
    rng = np.random.default_rng(0)
    losses = 2.3 * rng.lognormal(0.0, 0.02, 200)
    losses[100] = 23.0
    for t, x in enumerate(losses):
        m.observe(make_obs(t, loss=float(x), probes=m.plan(t)))
        if t == 99:
            assert sink.findings == []  # calibration ended silently
            assert m.interval("exploding_gradients") == 16
        if t == 100:
            assert m.interval("exploding_gradients", 101) == 1
            assert "grads" in m.plan(101)
    found = [(f.step, f.detector, f.severity.value) for f in sink.findings]
    # hot for 4 steps, then every 2, 4, 8, 16 steps for 4 steps each: back at base (32) at 120
    assert found == [(100, "loss_spike", "warning"), (100, SAMPLER, "info"), (120, SAMPLER, "info")]
    up, back = sink.by_detector(SAMPLER)
    assert up.message == (
        "loss_spike warning: running all detectors every step for 4 steps, then back off"
    )
    assert back.message == "no new suspicion for 20 steps: detectors back to their base intervals"
    (row,) = [r for r in m.summary(0).rows if r.detector == SAMPLER]
    assert row.verdict == "escalated 1x this epoch; back at base intervals"


def test_a_suspect_escalates_without_a_finding():
    sink = CapturingSink()
    detectors = [Scripted({50: ("suspect", "odd loss")}), Spy()]
    m = Monitor(detectors=detectors, sinks=[sink], hot_steps=4)
    feed(m, range(70))
    assert [(f.step, f.detector) for f in sink.findings] == [(50, SAMPLER), (58, SAMPLER)]
    assert sink.findings[0].message.startswith("scripted: odd loss: running all detectors")
    assert 51 in detectors[1].state["steps"]  # the spy ran off its 4-step grid


def test_a_detector_that_warned_escalates_again_only_for_a_graver_finding():
    """Once a detector said its warning, its suspicions and its warnings (say, a dead
    layer suspected again at every look) raise the sampler no more: nothing is left to
    confirm but an error, which does; another detector's suspicion still does."""
    script = {20: ("warning", "fc"), 100: ("suspect", "dead again"), 200: ("warning", "fc")}
    script[300] = ("error", "fc")
    sink = CapturingSink()
    detectors = [Scripted(script), OtherScripted({400: ("suspect", "odd")}), Spy()]
    m = Monitor(detectors=detectors, sinks=[sink], hot_steps=4, stop_on=None)
    feed(m, range(420))
    escalated = [f.step for f in sink.findings if f.detector == SAMPLER and "running" in f.message]
    assert escalated == [20, 300, 400]
    assert 101 not in detectors[2].state["steps"] and 201 not in detectors[2].state["steps"]


class GradScripted(Scripted):
    """A scripted detector of the gradient norms (every 4 steps)."""

    name = "grad_scripted"
    needs: ClassVar[frozenset[str]] = frozenset({"grads"})
    base_interval = 4


def test_a_suspicion_raises_the_detectors_that_read_what_its_detector_read():
    """A gradient norm that looks odd has the next steps' gradient norms looked at (the
    detectors that read them alone), not every statistic; a warning raises them all."""
    sink = CapturingSink()
    grads, updates = Spy(), UpdateSpy()
    script = {60: ("suspect", "norm 40x"), 200: ("warning", None)}
    m = Monitor(detectors=[GradScripted(script), grads, updates], sinks=[sink], hot_steps=4)
    feed(m, range(230))
    up = [f for f in sink.findings if f.detector == SAMPLER and "running" in f.message]
    assert [f.step for f in up] == [60, 200]
    assert up[0].message == (
        "grad_scripted: norm 40x: running grad_scripted and spy_grads every step for 4 "
        "steps, then back off"
    )
    assert {61, 62, 63} <= set(grads.state["steps"])  # off its grid of 4
    assert not set(range(61, 64)) & set(updates.state["steps"])
    assert "running all detectors" in up[1].message
    assert 201 in updates.state["steps"]


def test_a_suspicion_of_the_loss_raises_every_detector():
    """A loss that looks odd may have its cause in any statistic."""
    sink = CapturingSink()
    updates = UpdateSpy()
    m = Monitor(detectors=[Scripted({60: ("suspect", "odd")}), updates], sinks=[sink], hot_steps=4)
    feed(m, range(70))
    assert 61 in updates.state["steps"]


class SetupScripted(Scripted):
    """A finding about the training's setup: nothing a closer look at the next steps adds."""

    name = "setup_scripted"
    escalates = False


@pytest.mark.parametrize(("cls", "escalated"), [(Scripted, True), (SetupScripted, False)])
def test_a_warning_about_the_setup_does_not_escalate(cls, escalated):
    sink = CapturingSink()
    spy = Spy()
    m = Monitor(detectors=[cls({60: ("warning", "loss")}), spy], sinks=[sink], hot_steps=4)
    feed(m, range(70))
    assert (60, cls.name) in [(f.step, f.detector) for f in sink.findings]
    assert (SAMPLER in sink.detectors()) is escalated
    assert (61 in spy.state["steps"]) is escalated  # off its grid of 4 only when escalated


def test_escalate_false_never_reports():
    sink = CapturingSink()
    m = Monitor(sinks=[sink], escalate=False, stop_on=None)
    feed(m, range(60), loss=float("nan"))
    assert sink.detectors() == {"nonfinite_loss"}


# -- repeats --------------------------------------------------------------------------------------
def test_identical_findings_not_resent_within_repeat_after_but_counted():
    script = {t: ("warning", "blocks[0].w") for t in (10, 11, 12, 109, 110, 111, 250)}
    script[13] = ("warning", "head.w")  # another place: not a repeat
    script[14] = ("error", "blocks[0].w")  # another severity: not a repeat
    sink = CapturingSink()
    m = Monitor(detectors=[Scripted(script)], sinks=[sink], escalate=False, stop_on=None)
    feed(m, range(300))
    sent = [(f.step, f.severity.value, f.where) for f in sink.findings]
    assert sent == [
        (10, "warning", "blocks[0].w"),
        (13, "warning", "head.w"),
        (14, "error", "blocks[0].w"),
        (110, "warning", "blocks[0].w"),  # 100 steps after the last one sent
        (250, "warning", "blocks[0].w"),
    ]
    (row,) = m.summary(0).rows
    assert (row.detector, row.count) == ("scripted", 9)


def test_repeat_after_zero_sends_every_finding():
    script = {t: ("warning", "x") for t in range(5)}
    sink = CapturingSink()
    m = Monitor(
        detectors=[Scripted(script)], sinks=[sink], escalate=False, stop_on=None, repeat_after=0
    )
    feed(m, range(5))
    assert len(sink.findings) == 5


def test_a_monitor_that_does_not_write_sends_nothing_but_still_decides():
    sink = CapturingSink()
    m = Monitor(detectors=[Scripted({3: ("error", None)})], sinks=[sink], writes=False)
    decisions = feed(m, range(5))
    assert decisions[3].stop
    m.end_epoch(0)
    assert sink.findings == sink.summaries == []
    assert sink.flush_count == 0


# -- sinks ----------------------------------------------------------------------------------------
def test_a_failing_sink_warns_once_and_the_others_still_receive():
    before, after = CapturingSink(), CapturingSink()
    script = {t: ("warning", f"p{t}") for t in (1, 2, 3)}
    m = Monitor(
        detectors=[Scripted(script)], sinks=[before, Broken(), after], escalate=False, stop_on=None
    )
    with pytest.warns(RuntimeWarning, match=r"Broken\.emit\(\) failed with OSError") as record:
        feed(m, range(5))
        m.end_epoch(0)
        m.close()
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    for sink in (before, after):
        assert [f.step for f in sink.findings] == [1, 2, 3]
        assert len(sink.summaries) == 1
        assert sink.closed


def test_close_is_idempotent():
    class Counting(Sink):
        closes = 0

        def close(self):
            Counting.closes += 1

    m = Monitor(sinks=[Counting()])
    m.close()
    m.close()
    assert Counting.closes == 1


# -- stopping -------------------------------------------------------------------------------------
def test_stopped_by_is_the_first_stop():
    script = {3: ("warning", None), 5: ("error", "head.w"), 7: ("error", "blocks[0].w")}
    m = Monitor(detectors=[Scripted(script)], escalate=False)
    decisions = feed(m, range(10))
    assert [t for t, d in enumerate(decisions) if d.stop] == [5, 7]
    assert not any(d.raise_ for d in decisions)
    assert decisions[5].reason.step == 5
    assert (m.stopped_by.step, m.stopped_by.where) == (5, "head.w")


def test_raise_on_turns_the_stop_into_a_raise():
    m = Monitor(detectors=[Scripted({4: ("warning", None)})], stop_on=None, raise_on="warning")
    d = feed(m, range(6))[4]
    assert (d.stop, d.raise_, d.reason.step) == (True, True, 4)
    assert m.stopped_by is d.reason


def test_report_records_outside_findings():
    sink = CapturingSink()
    m = Monitor(sinks=[sink])
    f = Finding(step=2, epoch=0, detector="nonfinite_loss", severity="error", message="x.")
    assert m.submit([f]).stop
    assert sink.findings == [f]
    assert m.summary(0).rows[0].detector == "nonfinite_loss"


# -- the epoch summary ----------------------------------------------------------------------------
def _summary_run(stop_on="error") -> tuple[Monitor, CapturingSink, EpochSummary]:
    sink = CapturingSink()
    dets = [
        *default_detectors(),
        Scripted({3: ("warning", "head.w"), 4: ("warning", "head.w")}),
        OtherScripted({6: ("error", "blocks[0].w")}),
    ]
    m = Monitor(detectors=dets, sinks=[sink], escalate=False, stop_on=stop_on)
    feed(m, range(10))
    return m, sink, m.end_epoch(0)


def test_end_epoch_rows_errors_first_and_quiet_folded():
    m, sink, summary = _summary_run(stop_on=None)
    assert [(r.detector, r.status, r.count) for r in summary.rows] == [
        ("other_scripted", "error", 1),
        ("scripted", "warning", 2),
        (f"{len(LOCAL)} others", "ok", 0),
    ]
    assert summary.quiet == LOCAL  # replica_divergence, straggler: idle in one process
    assert summary.rows[0].where == "blocks[0].w"
    assert summary.rows[0].verdict == "do what the script says"
    assert summary.rows[-1].verdict == "nothing found (every 1-32 steps)"
    assert summary.status == "error"
    assert summary.steps == 10
    assert summary.verdict == (
        "1 error(s), 2 warning(s) in 10 steps; worst: other_scripted at step 6"
    )
    assert sink.summaries == [summary]
    assert sink.flush_count == 1
    assert m.summary(1).rows == (m.summary(1).rows[-1],)  # a new epoch starts empty


def test_end_epoch_after_a_stop():
    _, _, summary = _summary_run()
    assert summary.verdict == "Stopped at step 6 by other_scripted (error) in blocks[0].w."
    assert summary.stopped_by["step"] == 6
    assert summary.rows[0].verdict.startswith("stopped training at step 6; ")
    json.dumps(summary.to_dict(), allow_nan=False)


def test_healthy_verdict_counts_gradient_steps():
    m = Monitor(escalate=False)
    feed(m, range(40))
    summary = m.end_epoch(0)
    assert summary.verdict == (
        "Healthy: no warnings in 40 steps (loss checked every step, gradients on 3 steps)"
    )
    assert summary.status == "ok"


def test_summary_renders_with_rich():
    _, _, summary = _summary_run()
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(summary)
    out = console.file.getvalue()
    assert "stethoscope · epoch 0 · 10 steps" in out
    assert "blocks[0].w" in out  # brackets verbatim, not eaten as markup
    assert " ".join(summary.verdict.split()) in " ".join(out.split())
    assert "other_scripted" in out
    assert "Quiet:" in out


# -- state ----------------------------------------------------------------------------------------
def _run_data(n: int, seed: int = 0) -> list[dict]:
    """Per-step values for every probe; faults after step 300."""
    rng = np.random.default_rng(seed)
    data = []
    for t in range(n):
        row = {
            "loss": float(2.3 * np.exp(-t / 1000) * rng.lognormal(0.0, 0.05)),
            "grads": GRAD * rng.lognormal(0.0, 0.1, 4),
            "weights": np.full(4, 10.0) * rng.lognormal(0.0, 0.01, 4),
            "updates": np.full(4, 1e-2) * rng.lognormal(0.0, 0.1, 4),
        }
        if t == 320:
            row["loss"] *= 10
        if 330 <= t < 350:
            row["grads"] = row["grads"] * 1000
        if t == 360:
            row["grads"][1] = np.nan
        if t == 380:
            row["weights"][2] = np.inf
        if t == 400:
            row["loss"] = float("nan")
        if t >= 410:
            row["loss"] *= 3
        data.append(row)
    return data


def _drive(m: Monitor, data: list[dict], steps: range) -> None:
    for t in steps:
        planned = m.plan(t)
        row = data[t]
        m.observe(
            make_obs(
                t,
                loss=row["loss"],
                probes=planned,
                **{p: row[p] for p in planned if p != "loss" and p in row},
            )
        )


def test_state_dict_round_trip_gives_the_same_findings():
    data = _run_data(460)
    a_sink, b_sink, c_sink = CapturingSink(), CapturingSink(), CapturingSink()
    a = Monitor(sinks=[a_sink], stop_on=None)
    _drive(a, data, range(300))
    state = a.state_dict()
    text = json.dumps(state, allow_nan=False)
    b = Monitor(sinks=[b_sink], stop_on=None)
    b.load_state_dict(json.loads(text))
    assert b.state_dict() == state
    c = Monitor(sinks=[c_sink], stop_on=None)  # not restored: relearns its baselines
    for m in (a, b, c):
        _drive(m, data, range(300, 460))
    a_found = [f.to_dict(json_safe=True) for f in a_sink.findings if f.step >= 300]
    b_found = [f.to_dict(json_safe=True) for f in b_sink.findings]
    assert b_found == a_found
    assert {f["detector"] for f in a_found} >= {
        "loss_spike",
        "exploding_gradients",
        "nonfinite_gradients",
        "nonfinite_weights",
        "nonfinite_loss",
        SAMPLER,
    }
    assert [f.to_dict(json_safe=True) for f in c_sink.findings] != a_found
    assert b.state_dict() == a.state_dict()


def test_reset_forgets_baselines_and_schedule():
    m = Monitor(detectors=[Scripted({5: ("error", None)})], hot_steps=4)
    feed(m, range(50))
    m.reset()
    fresh = Monitor(detectors=[Scripted({5: ("error", None)})], hot_steps=4)
    assert m.state_dict() == fresh.state_dict()
    assert m.stopped_by is None


# -- bad arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"intervals": {"nope": 4}}, ValueError, r"\['nope'\]", id="unknown-interval"),
        pytest.param(
            {"intervals": {"loss_spike": 0}}, ValueError, r"'loss_spike' is 0", id="interval-0"
        ),
        pytest.param(
            {"detectors": [LossSpike(), LossSpike()]},
            ValueError,
            r"\['loss_spike'\] more than once",
            id="duplicate-detectors",
        ),
        pytest.param({"repeat_after": -1}, ValueError, r"repeat_after=-1", id="repeat-after-neg"),
        pytest.param({"repeat_after": 1.5}, ValueError, r"repeat_after=1\.5", id="repeat-float"),
        pytest.param({"repeat_after": True}, ValueError, r"repeat_after=True", id="repeat-bool"),
        pytest.param({"repeat_after": "x"}, ValueError, r"repeat_after='x'", id="repeat-str"),
        pytest.param({"sinks": [print]}, TypeError, r"built-in function print", id="sink-func"),
        pytest.param({"sinks": ["console"]}, TypeError, r"'console'", id="sink-str"),
        pytest.param({"stop_on": "fatal"}, ValueError, r"stop_on='fatal'", id="stop-on"),
        pytest.param({"raise_on": {"nope"}}, ValueError, r"raise_on.*\['nope'\]", id="raise-on"),
        pytest.param({"hot_steps": 0}, ValueError, r"hot_steps=0", id="hot-steps"),
    ],
)
def test_bad_constructor_arguments_name_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        Monitor(**kwargs)


# regression of d6cb240: Monitor read d.name before its isinstance check (AttributeError)
@pytest.mark.parametrize(
    ("bad", "match"),
    [("loss_spike", "'loss_spike'"), (object(), "object object")],
)
def test_non_detector_instances_raise_type_error_naming_them(bad, match):
    with pytest.raises(TypeError, match=match):
        Monitor(detectors=[bad])


def test_a_detector_class_instead_of_an_instance_raises_type_error_naming_it():
    with pytest.raises(TypeError, match="LossSpike"):
        Monitor(detectors=[LossSpike])


def test_stop_on_may_name_custom_detectors():
    m = Monitor(detectors=[Scripted({2: ("warning", None)})], stop_on={"scripted"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert feed(m, range(3))[2].stop


def test_a_sink_that_fails_to_start_is_warned_about_and_the_others_start():
    class NoStart(Sink):
        def start(self, context):
            raise OSError("no such host")

    good = CapturingSink()
    m = Monitor(sinks=[NoStart(), good])
    with pytest.warns(RuntimeWarning, match=r"NoStart\.start\(\) failed with OSError"):
        m.start(RunContext(framework="test"))
    assert good.context.framework == "test"


def test_epochs_and_validations_shorter_than_the_interval_are_measured_as_often_as_steps():
    """Full-batch training ends an epoch and validates at every step: measured at each,
    the prints of epoch starts and validations would escape the sampler and the budget.
    Past the first, they are measured once the reader's interval has passed."""
    m = Monitor(detectors=[RepeatedData(), LossSpike()], escalate=False)
    m.begin(fresh=True)
    assert "prints" in m.plan(0)
    measured, validated = [], []
    for step in range(64):  # an epoch and a validation every step
        if "prints" in m.plan(step):
            measured.append(step)
        m.observe(Observation(step=step, epoch=step, loss=1.0))
        if m.reads("val_prints"):
            validated.append(step)
        m.end_epoch(step)
    # every 16 steps, repeated_data's interval (its own schedule, and the epoch starts),
    # and at most the step after one, which it asks for to compare the epochs' next batches
    assert [s for s in measured if s % 16 == 0] == [0, 16, 32, 48]
    assert all(s % 16 in (0, 1) for s in measured), measured
    assert [s for s in validated if s % 16 == 0] == [0, 16, 32, 48]
    assert all(s % 16 in (0, 1) for s in validated), validated  # a quiet step waits unjudged
    # while the sampler is hot (its calibration), every event is measured
    hot = Monitor(detectors=[RepeatedData(), LossSpike()], escalate=True)
    hot.begin(fresh=True)
    for step in range(8):
        assert "prints" in hot.plan(step)
        hot.observe(Observation(step=step, epoch=step, loss=1.0))
        assert hot.reads("val_prints") and hot.reads("val_prints")  # asked twice: the same
        hot.end_epoch(step)


def test_an_epoch_with_one_sampled_step_says_one_step():
    m = Monitor(detectors=default_detectors(), escalate=False)
    m.begin(fresh=True)
    m.observe(make_obs(0))
    for step in range(1, 10):
        m.observe(make_obs(step, probes=()))
    verdict = m.end_epoch(0).verdict
    assert "gradients on 1 step;" in verdict or "gradients on 1 step)" in verdict, verdict


def test_a_float32_run_seen_computing_in_float16_brings_the_precision_rules_in():
    """A float32 run leaves the precision rules out at its start; once its forward pass is
    seen in float16 (an autocast in the training step), they take part, every detector's
    setup says so, and the gradients' statistic is planned. Said once: a run already in
    low precision is unchanged."""
    from stethoscope.advice import TrainingSetup
    from stethoscope.detectors import GradientUnderflow

    m = Monitor(detectors=[GradientUnderflow(), LossSpike()], escalate=False)
    m.begin(fresh=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the precision rules are off: said at the start
        m.start(RunContext(framework="test", setup=TrainingSetup(framework="test")))
    assert all("precision" not in m.plan(s) for s in range(40))
    assert m.computes_in("float16") and not m.computes_in("float16")
    assert {d.setup.computes_in for d in m.detectors} == {"float16"}
    assert any("precision" in m.plan(s) for s in range(40, 80))


def _others(summary: EpochSummary) -> str:
    """The line on the detectors that found nothing."""
    return next(r.verdict for r in summary.rows if r.detector.endswith(" others"))


def test_a_quiet_epochs_summary_follows_the_schedule_and_the_silences():
    """A quiet epoch's summary (a full-batch run makes one every step) is worked out once
    and given again while nothing changes: it still follows a stretched schedule, a
    detector that falls silent for want of labels, and a finding."""
    monitor = Monitor(detectors=default_detectors(), sinks=[])
    for step in range(200):  # past the calibration; the adapter never finds labels
        plan = monitor.plan(step)
        obs = Observation(step=step, loss=1.0)
        if "labels" in plan:
            obs.names = ("w",)
        monitor.observe(obs)
    quiet = monitor.end_epoch(0)
    silent = [r.detector for r in quiet.rows if r.verdict.startswith("silent: ")]
    assert "unshuffled_data" in silent
    before = _others(quiet)
    monitor.schedule.stretch(4)
    stretched = _others(monitor.summary(1))
    names = [d.name for d in monitor.detectors if d.name not in silent]
    intervals = sorted({monitor.interval(n) for n in names if not monitor.schedule.idle(n)})
    assert stretched == f"nothing found (every {intervals[0]}-{intervals[-1]} steps)" != before
    monitor.judge.unread.clear()  # the labels came: no longer silent
    assert not any(r.verdict.startswith("silent: ") for r in monitor.summary(1).rows)
    monitor.observe(Observation(step=200, loss=float("nan")))
    assert "nonfinite_loss" in {r.detector for r in monitor.summary(1).rows}
