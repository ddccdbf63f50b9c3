"""The Lightning adapter inside real Trainers: stop, raise, resume, bars, optimisation modes."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from _models import CLASSES, FEATURES, TinyMLP, fit, problems
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from stethoscope import LightningStethoscope, TrainingProblem
from stethoscope.sinks import ConsoleSink, JSONLSink
from stethoscope.testing import CapturingSink


def test_error_stops_training_gracefully():
    trainer, sink = fit(TinyMLP(fault="nan_input", onset=40), steps=200)
    assert trainer.should_stop
    assert trainer.global_step == 41  # the step that saw the NaN completes, no more
    assert sink.by_detector("nonfinite_loss")[0].step == 40
    assert sink.summaries, "the epoch that stopped still gets its summary"
    assert sink.summaries[-1].stopped_by["detector"] == "nonfinite_loss"
    assert sink.closed


def test_raise_on_raises_training_problem_with_the_finding():
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink], raise_on="error")
    with pytest.raises(TrainingProblem) as info:
        fit(TinyMLP(fault="nan_input", onset=30), steps=200, callback=cb)
    assert info.value.finding.detector == "nonfinite_loss"
    assert info.value.finding.step == 30
    assert sink.closed, "sinks are flushed and closed when training raises"


def test_stop_on_none_never_stops():
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink], stop_on=None)
    trainer, _ = fit(TinyMLP(fault="nan_input", onset=30), steps=60, callback=cb)
    assert trainer.global_step == 60
    assert sink.by_detector("nonfinite_loss")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_on": "fatal"}, "stop_on='fatal'"),
        ({"raise_on": {"nonexistent"}}, "nonexistent"),
        ({"intervals": {"exploding_gradients": 0}}, "exploding_gradients"),
        ({"intervals": {"no_such": 4}}, "no_such"),
        ({"max_lag": -1}, "max_lag=-1"),
        ({"hot_steps": 0}, "hot_steps=0"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LightningStethoscope(**kwargs)


def test_resume_from_checkpoint_continues_baselines_and_schedule(tmp_path):
    torch.manual_seed(0)
    first = LightningStethoscope(sinks=[CapturingSink()])
    model = TinyMLP()
    trainer, _ = fit(model, steps=200, callback=first)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = first.monitor.state_dict()
    assert saved["detectors"]["loss_spike"]["initial"] is not None
    assert saved["sampler"]["calibrating"] is False

    seen: dict[str, Any] = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["state"] = resumed.monitor.state_dict()

    resumed = LightningStethoscope(sinks=[CapturingSink()])
    trainer2, _ = fit(TinyMLP(), steps=260, callback=resumed, callbacks=[Peek()], ckpt_path=ckpt)
    assert seen["state"]["detectors"] == saved["detectors"], "baselines were not restored"
    assert seen["state"]["sampler"] == saved["sampler"], "the schedule restarted"
    assert trainer2.global_step == 260
    # a resumed run does not re-learn: the sampler stayed out of its calibration window
    assert resumed.monitor.sampler.calibrating is False


def test_one_callback_serves_two_fits(tmp_path):
    jsonl = tmp_path / "findings.jsonl"
    cb = LightningStethoscope(sinks=[JSONLSink(jsonl)])
    first, _ = fit(TinyMLP(fault="nan_input", onset=20), steps=100, callback=cb)
    assert first.should_stop and cb.stopped_by.detector == "nonfinite_loss"
    second, _ = fit(TinyMLP(), steps=60, callback=cb)
    assert second.global_step == 60, "the first run's stop must not stop the second"
    assert cb.stopped_by is None
    assert cb.summaries[-1].stopped_by is None
    assert cb.monitor.sampler.escalations == 0, "the first run's escalation was forgotten"
    assert cb.monitor.last_step == 59, "the second run's steps start again at 0"
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in lines if r["detector"] == "nonfinite_loss"] == [20]


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar], ids=["tqdm", "rich"])
def test_findings_and_summary_print_through_the_progress_bar(bar, capsys):
    cb = LightningStethoscope(sinks=[ConsoleSink()])
    fit(
        TinyMLP(fault="nan_input", onset=20),
        steps=100,
        callback=cb,
        enable_progress_bar=True,
        callbacks=[bar()],
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    finding = [ln for ln in lines if "nonfinite_loss" in ln and "step 20" in ln]
    assert finding, out[-3000:]
    # the finding starts its own line: not glued after a progress bar's carriage return
    assert finding[0].lstrip().startswith("ERROR") or "ERROR" in finding[0].split("step 20")[0]
    assert any("stethoscope · epoch" in ln for ln in lines)
    assert "stethoscope stopped training at step 20" in out


def test_accumulate_grad_batches_reports_true_batch_losses():
    torch.manual_seed(0)
    seen: list[tuple[int, float]] = []
    cb = LightningStethoscope(sinks=[CapturingSink()])
    observe = cb.monitor.observe

    def spy(obs):
        seen.append((obs.step, obs.loss))
        return observe(obs)

    cb.monitor.observe = spy

    class Recording(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.item())
            return loss

    model = Recording()
    model.losses = []
    trainer, sink = fit(model, steps=30, callback=cb, accumulate_grad_batches=4)
    assert trainer.global_step == 30
    assert len(seen) == 120, "one observation per batch, four batches per optimizer step"
    assert [s for s, _ in seen[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [v for _, v in seen] == pytest.approx(model.losses, rel=1e-5)
    assert problems(sink) == []


def test_accumulate_grad_batches_catches_a_fault():
    trainer, sink = fit(TinyMLP(fault="nan_input", onset=10), steps=50, accumulate_grad_batches=2)
    assert sink.by_detector("nonfinite_loss")[0].step == 10
    assert trainer.should_stop


class TwoOptimizers(L.LightningModule):
    """Manual optimisation with two optimizers, GAN-style: an encoder and a head."""

    def __init__(self, *, fault: str = "none", return_loss: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.fault, self.return_loss = fault, return_loss
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_enc, opt_head = self.optimizers()
        opt_enc.zero_grad()
        opt_head.zero_grad()
        if self.fault == "two_losses":  # each half of the batch backpropagated on its own
            for half in (slice(0, len(x) // 2), slice(len(x) // 2, None)):
                loss = nn.functional.cross_entropy(self.head(self.encoder(x[half])), y[half])
                self.manual_backward(loss)
        else:
            loss = nn.functional.cross_entropy(self.head(self.encoder(x)), y)
            if self.fault == "nan_head" and self.global_step >= 20:
                loss = loss + (self.head.weight * 0).abs().sqrt().sum()
            if self.fault == "nan_loss" and self.global_step >= 20:
                loss = loss * float("nan")
            self.manual_backward(loss)
        opt_enc.step()
        opt_head.step()
        return loss if self.return_loss else None

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.encoder.parameters(), lr=1e-2),
            torch.optim.SGD(self.head.parameters(), lr=1e-2),
        )


def test_manual_optimization_with_two_optimizers_is_watched():
    trainer, sink = fit(TwoOptimizers(), steps=120)
    assert trainer.global_step == 120  # Lightning counts both optimizers: 60 batches
    assert problems(sink) == []
    _, sink = fit(TwoOptimizers(fault="nan_head"), steps=240)
    found = sink.by_detector("nonfinite_gradients")
    assert found and found[0].where == "head.weight"


def test_manual_optimization_returning_no_loss_is_judged_on_the_loss_it_backpropagates():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, sink = fit(TwoOptimizers(fault="nan_loss", return_loss=False), steps=80)
    assert not [w for w in record if "no scalar loss" in str(w.message)]
    found = sink.by_detector("nonfinite_loss")
    assert found and found[0].step == 20  # global_step counts both optimizers: batch 10


def test_a_step_returning_no_loss_that_backpropagates_two_warns_once():
    # two losses backpropagated a step: neither is the training loss
    with pytest.warns(RuntimeWarning, match="returned no scalar loss and backpropagated 2") as rec:
        _, sink = fit(TwoOptimizers(fault="two_losses", return_loss=False), steps=80)
    assert len([w for w in rec if "no scalar loss" in str(w.message)]) == 1
    assert sink.by_detector("nonfinite_loss") == []
    assert sink.by_detector("loss_spike") == []


def test_log_stats_sends_headline_stats_to_the_trainer_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    cb = LightningStethoscope(sinks=[CapturingSink()], log_stats=True)
    fit(TinyMLP(), steps=60, callback=cb, logger=logger)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    grad = [float(r["stethoscope/grad_norm"]) for r in rows if r.get("stethoscope/grad_norm")]
    ratio = [
        float(r["stethoscope/update_ratio"]) for r in rows if r.get("stethoscope/update_ratio")
    ]
    assert len(grad) >= 30, "calibration samples every step for the first 32 steps"
    assert len(ratio) == len(grad)
    assert all(g > 0 and math.isfinite(g) for g in grad)
    assert all(0 < r < 1 for r in ratio)
    assert any(r.get("stethoscope/interval") for r in rows)


def test_log_stats_off_by_default(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    fit(TinyMLP(), steps=20, logger=logger)
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    assert not metrics.exists() or "stethoscope/" not in metrics.read_text()


def test_importing_stethoscope_imports_no_framework():
    code = (
        "import sys, stethoscope, stethoscope.sinks, stethoscope.detectors, stethoscope.testing;"
        "bad = [m for m in ('torch', 'tensorflow', 'keras', 'lightning') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert hasattr(__import__("stethoscope"), "LightningStethoscope")


@pytest.mark.parametrize(("batch_size", "accumulate", "samples"), [(16, 1, 16), (16, 2, 32)])
def test_dead_relu_is_told_the_samples_behind_the_gradient_rows(batch_size, accumulate, samples):
    from stethoscope.detectors import default_detectors
    from stethoscope.testing import RecordingDetector

    spy = RecordingDetector({"units"})
    cb = LightningStethoscope(sinks=[CapturingSink()], detectors=[*default_detectors(), spy])
    fit(TinyMLP(), steps=24, batch_size=batch_size, callback=cb, accumulate_grad_batches=accumulate)
    assert len(spy.seen) >= 20  # every step at the start
    assert {o.unit_samples for o in spy.seen} == {samples}  # 512 samples: no partial batch
