"""Smoke test of the fault-injection suite (benchmarks/faults): its runner, scoring and report.

Two scenarios, one seed, cut short to keep CI fast: the NaN-input fault (onset at
step 150, run to step 160; three sampling settings and the baselines watching one
fit) and a healthy control (150 steps, the adaptive default). It checks the
structure of what the suite reports and that the NaN is caught at its onset step;
the suite's numbers themselves are for ``python -m benchmarks.faults``, not for CI.
The Keras implementation runs the same NaN-input fault (one fit per setting), and
the command line once, with ``--framework keras``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed: import it from the checkout
    sys.path.insert(0, str(ROOT))

from benchmarks.faults import SCENARIOS, judge, judge_baseline, select  # noqa: E402
from benchmarks.faults.lightning_suite import quiet  # noqa: E402
from benchmarks.faults.report import build_tables, render_markdown, render_rich  # noqa: E402
from benchmarks.faults.runner import run_all  # noqa: E402
from benchmarks.faults.scenarios import DETECTOR_NAMES  # noqa: E402

SETTINGS = ("adaptive", "every", "sparse")


@pytest.fixture(scope="module")
def suite():
    quiet()
    fault, control = select(["nan_input", "healthy_standardized"])
    fault, control = _short(fault, 160), _short(control, 150)
    runs = run_all([fault], [0], SETTINGS) + run_all([control], [0], ("adaptive",))
    return [fault, control], runs


def _short(sc, steps):
    return dataclasses.replace(sc, train=dataclasses.replace(sc.train, max_steps=steps))


def test_an_adam_epsilon_zero_in_float16_is_named_with_no_other_cause_blamed():
    """Adam at eps=1e-8 over float16 weights turns them NaN at the first step: named, with
    no other cause blamed (rounded_updates once read the NaN weights, whose bits no longer
    change, as updates that rounded away); the same epsilon on float32 weights is quiet."""
    fault, twin = select(["fp16_adam_epsilon_zero", "healthy_fp16_adam_mixed"])
    runs = run_all([fault, twin], [0], ("adaptive",), baselines=False)
    v = judge(fault, runs[0], "adaptive")
    assert v.detected and v.latency == 0 and v.misdiagnoses == (), v.misdiagnoses
    assert judge(twin, runs[1], "adaptive").false_alarms == ()


def test_an_autocast_in_float16_without_a_scaler_is_named_as_an_underflow():
    """A float16 autocast written in training_step over float32 weights, with no
    GradScaler: its gradients are float32 but were computed on float16's grid, and
    gradient_underflow names them, with no vanishing or frozen cause blamed; the same
    autocast in bfloat16 is quiet."""
    fault, twin = select(["fp16_autocast_without_scaler", "healthy_bf16_autocast"])
    runs = run_all([fault, twin], [0], ("adaptive",), baselines=False)
    v = judge(fault, runs[0], "adaptive")
    assert v.detected and v.misdiagnoses == (), (v.first_alarm, v.misdiagnoses)
    assert judge(twin, runs[1], "adaptive").false_alarms == ()


def test_the_suite_declares_enough_scenarios():
    faults = [s for s in SCENARIOS if not s.healthy]
    controls = [s for s in SCENARIOS if s.healthy]
    assert len(faults) >= 16 and len(controls) >= 6
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    for s in faults:
        assert set(s.expect) <= DETECTOR_NAMES and s.window >= 0
    with pytest.raises(ValueError, match="no_such_scenario"):
        select(["no_such_scenario"])


def test_nan_input_is_caught_at_its_onset(suite):
    scenarios, runs = suite
    sc, run = scenarios[0], runs[0]
    assert (run.scenario, run.seed, run.error) == ("nan_input", 0, None)
    assert run.steps == sc.train.max_steps  # stop_on=None: the run goes on after the error
    assert set(run.findings) == set(SETTINGS)
    for setting in SETTINGS:
        first = next(f for f in run.findings[setting] if f["detector"] == "nonfinite_loss")
        assert first["step"] == sc.onset == 150
        assert first["severity"] == "error"
        v = judge(sc, run, setting)
        assert v.detected and v.latency == 0 and not v.early
        assert run.probe_counts[setting]["loss"] == run.steps
    # every step reads gradients in the "every" setting, not in the sparse one
    assert run.probe_counts["every"]["grads"] == run.steps
    assert run.probe_counts["sparse"]["grads"] < run.steps // 4


def test_baselines_record_the_step_they_would_stop_at(suite):
    scenarios, runs = suite
    sc, run = scenarios[0], runs[0]
    assert run.baselines["nan_check"] == {"step": 150, "reason": "non-finite"}
    # EarlyStopping checks at epoch end: 32 steps per epoch, so the epoch holding step 150
    # ends at step 159
    assert run.steps_per_epoch == 32
    assert run.baselines["early_stopping"] == {"step": 159, "reason": "non-finite"}
    v = judge_baseline(sc, run, "early_stopping")
    assert v.latency == 9 and not v.detected  # outside the 1-step window
    assert "spike_detection" in run.baselines


def test_healthy_control_is_judged_as_a_control(suite):
    scenarios, runs = suite
    sc, run = scenarios[1], runs[1]
    assert sc.healthy and run.error is None and run.onset is None
    assert run.steps == sc.train.max_steps
    v = judge(sc, run, "adaptive")
    assert v.healthy and not v.detected and v.latency is None


@pytest.mark.parametrize("name", ["healthy_gan", "healthy_near_perfect_fit"])
def test_the_game_and_the_near_perfect_fit_are_quiet_controls(name):
    """A GAN trained by hand (its generator's loss is not meant to fall), and a fit that
    learns its task in one epoch and then wobbles by thousandths: no false alarm."""
    (sc,) = select([name])
    (run,) = run_all([sc], [0], ("adaptive",))
    assert run.error is None and run.steps == sc.train.max_steps
    assert judge(sc, run, "adaptive").false_alarms == ()


@pytest.mark.parametrize(
    ("fault", "twin"),
    [
        ("labels_sorted", "healthy_skewed_labels"),
        ("lr_decay_per_batch", "healthy_step_decay"),
        ("left_in_eval", "healthy_frozen_bn"),
        ("grads_never_zeroed", "healthy_accumulate"),
        ("batch_served_again", "healthy_full_batch"),
        ("same_order_every_epoch", "healthy_sequential"),
        ("validation_leak", "healthy_digits_validated"),
        ("batch_norm_statistics_lag", "healthy_cnn_bn_validated"),
        ("softmax_then_cross_entropy", "healthy_softmax_output"),
        ("summed_softmax_in_training_step", "healthy_summed_cross_entropy"),
        ("softmax_in_own_loss", "healthy_own_loss"),
        ("logits_to_nll", "healthy_softmax_output"),
        ("loss_broadcast", "healthy_regression"),
    ],
)
def test_each_pipeline_bug_is_named_and_its_twin_is_quiet(fault, twin):
    """The pipeline bugs in Lightning, each beside a healthy twin that does the same thing
    right: the bug is named within its window, with no other cause blamed."""
    bug, right = select([fault, twin])
    runs = run_all([bug, right], [0], ("adaptive",), baselines=False)
    v = judge(bug, runs[0], "adaptive")
    assert v.detected and v.misdiagnoses == (), (v.first_alarm, v.misdiagnoses)
    assert judge(right, runs[1], "adaptive").false_alarms == ()


def test_a_framework_that_cannot_make_a_fault_does_not_train_it():
    (sc,) = select(["left_in_eval"])
    assert sc.frameworks == ("lightning",)
    assert run_all([sc], [0], ("adaptive",), baselines=False, framework="keras") == []


def test_a_confident_classifier_that_fell_to_chance_is_caught():
    """Random labels and a 4x initialisation: the loss falls from its confident start to
    ln 4, which loss_not_decreasing counts as progress; loss_at_chance names it."""
    (sc,) = select(["random_labels_confident"])
    (run,) = run_all([sc], [0], ("adaptive",))
    v = judge(sc, run, "adaptive")
    assert v.detected and v.misdiagnoses == () and v.early == ()
    assert v.first_alarm.startswith("loss_at_chance")


def test_report_has_every_table(suite):
    scenarios, runs = suite
    tables, numbers = build_tables(scenarios, runs, SETTINGS, available={"nonfinite_loss"})
    titles = [t.title for t in tables]
    assert any(t.startswith("Fault scenarios") for t in titles)
    assert any(t.startswith("Healthy controls") for t in titles)
    assert any(t.startswith("Adaptive sampling, shown") for t in titles)
    assert any(t.startswith("What users use today") for t in titles)
    for t in tables:
        assert all(len(row) == len(t.columns) for row in t.rows), t.title
    assert numbers["overall"]["runs"] == 1 and numbers["overall"]["detected"] == 1
    assert numbers["overall"]["healthy_runs"] == 1
    assert set(numbers["settings"]) == set(SETTINGS)
    assert numbers["settings"]["every"]["overall"]["detected"] == 1
    md = render_markdown(tables, ["header"])
    assert "| nan_input |" in md and "healthy_standardized" in md
    from rich.console import Console

    out = io.StringIO()
    render_rich(tables, ["header"], Console(file=out, width=200, color_system=None))
    assert "nan_input" in out.getvalue()


# -- the Keras implementation ----------------------------------------------------------


@pytest.fixture(scope="module")
def keras_suite():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    if keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on the environment
        pytest.skip("the Keras fault suite injects through TensorFlow")
    from benchmarks.faults.keras_suite import quiet as keras_quiet

    keras_quiet()
    fault = _short(select(["nan_input"])[0], 160)
    return fault, run_all([fault], [0], SETTINGS, framework="keras")[0]


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_keras_fits_per_setting_agree_and_catch_the_nan(keras_suite):
    sc, run = keras_suite
    assert (run.framework, run.error) == ("keras", None)  # no error: the three fits agreed
    assert run.steps == sc.train.max_steps and run.steps_per_epoch == 32
    assert set(run.findings) == set(SETTINGS)
    for setting in SETTINGS:
        # The scenario's ReLUs zero the NaN (as TensorFlow's fused one does on some CPUs;
        # built explicitly, so on every CPU): the loss stays finite, the first kernel's
        # gradient is NaN, and every setting names it on the onset step (an unsampled one
        # for two of them: the light train function's gradient check)
        first = next(f for f in run.findings[setting] if f["severity"] == "error")
        assert (first["step"], first["detector"]) == (150, "nonfinite_gradients")
        assert judge(sc, run, setting).latency == 0
        assert run.probe_counts[setting]["loss"] == run.steps
    assert run.probe_counts["every"]["grads"] == run.steps
    assert run.probe_counts["sparse"]["grads"] < run.steps // 4
    # The baselines watch an unwatched fit of their own, where the same ReLUs keep the NaN
    # from the loss: neither NaN check stops it (the running mean of the epoch's losses is
    # all Keras hands callbacks, so the two agree).
    assert set(run.baselines) == {"early_stopping", "terminate_on_nan", "nan_check"}
    assert run.baselines["terminate_on_nan"] is None and run.baselines["nan_check"] is None


def test_keras_report_and_the_frameworks_side_by_side(suite, keras_suite):
    from benchmarks.faults.report import build_comparison
    from benchmarks.faults.results import KERAS_BASELINES

    sc, krun = keras_suite
    tables, numbers = build_tables(
        [sc],
        [krun],
        SETTINGS,
        available={"nonfinite_loss", "nonfinite_gradients"},
        baselines=KERAS_BASELINES,
    )
    assert numbers["overall"]["detected"] == 1
    today = next(t for t in tables if t.title.startswith("What users use today"))
    assert today.columns[-3:] == ["EarlyStopping", "TerminateOnNaN", "NaN check"]
    _, lruns = suite
    both = build_comparison([sc], {"lightning": lruns[:1], "keras": [krun]}, SETTINGS)
    assert both.columns[2:4] == ["lightning (adaptive)", "keras (adaptive)"]
    assert both.rows[0][:4] == ["nan_input", "nonfinite", "1/1 · 0", "1/1 · 0"]
    assert all(len(row) == len(both.columns) for row in both.rows)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_command_line_runs_keras_and_reports_again(keras_suite, tmp_path, capsys):
    from benchmarks.faults.__main__ import main

    path = tmp_path / "keras.json"
    argv = ["--framework", "keras", "--quick", "--only", "nan_input", "--no-baselines"]
    assert main([*argv, "--markdown", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    row = "| nan_input | MLP 2x64 relu | nonfinite_loss \\| nonfinite_gradients | 150 + 1 | 1/1 |"
    assert row in out
    assert "keras 3." in out and "tensorflow" in out
    payload = json.loads(path.read_text())
    assert payload["config"]["framework"] == "keras"
    assert payload["config"]["separate_fits"] is True
    assert main(["--report-from", str(path), "--markdown"]) == 0
    assert "| nan_input | MLP 2x64 relu |" in capsys.readouterr().out
