"""Lightning skips the step hooks a step does not need (see
``stethoscope/callbacks/_lightning/hooks.py``): what the hooks are called on is counted
by wrapping the methods themselves, so a call Lightning still made would show."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from _models import TinyMLP, fit

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink

STEPS = 300  # past the calibration window, into sampling every few dozen steps


def _spy(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Wrap ``cls.name`` to note the global step of every call; returns the steps."""
    steps: list[int] = []
    original = getattr(cls, name)

    def spy(self: Any, trainer: L.Trainer, *args: Any, **kwargs: Any) -> Any:
        steps.append(trainer.global_step)
        return original(self, trainer, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)
    return steps


def _sampled_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps whose plan the callback sampled, as each step starts."""
    steps: list[int] = []
    original = LightningStethoscope.on_train_batch_start

    def spy(self: LightningStethoscope, trainer: L.Trainer, *args: Any) -> None:
        original(self, trainer, *args)
        if self._measures.sampled:
            steps.append(self._measures.step)

    monkeypatch.setattr(LightningStethoscope, "on_train_batch_start", spy)
    return steps


def test_lightning_calls_the_optimizer_hook_on_sampled_steps_only(monkeypatch):
    sampled = _sampled_steps(monkeypatch)
    optimizer = _spy(monkeypatch, LightningStethoscope, "on_before_optimizer_step")
    backward = _spy(monkeypatch, LightningStethoscope, "on_before_backward")
    after_backward = _spy(monkeypatch, L.Callback, "on_after_backward")
    zero_grad = _spy(monkeypatch, L.Callback, "on_before_zero_grad")
    sink = CapturingSink()
    # a schedule that depends on the step alone (no budget's clock): the same every run
    callback = LightningStethoscope(sinks=[sink], overhead_budget=None)
    trainer, _ = fit(TinyMLP(), steps=STEPS, callback=callback)
    assert trainer.global_step == STEPS
    assert optimizer == sampled
    assert 10 < len(sampled) < STEPS // 2  # every step while calibrating, then seldom
    # the backward hook: on the sampled steps that look for gradients left unzeroed only
    assert backward and set(backward) <= set(sampled)
    assert after_backward == zero_grad == []
    assert sink.at_least("warning") == []
    # after the fit, the callback is as its class defines it
    for name in ("on_before_optimizer_step", "on_before_backward", "on_after_backward"):
        assert name not in vars(callback)
        assert callable(getattr(callback, name))


def test_a_sampled_step_still_measures_its_gradients_and_catches_a_fault():
    trainer, sink = fit(TinyMLP(fault="nan_grad", onset=150), steps=STEPS)
    found = sink.by_detector("nonfinite_gradients")
    assert found, [f.detector for f in sink.findings]
    assert trainer.should_stop


def test_a_recovery_ladder_hears_every_step(monkeypatch):
    optimizer = _spy(monkeypatch, LightningStethoscope, "on_before_optimizer_step")
    backward = _spy(monkeypatch, LightningStethoscope, "on_before_backward")
    after_backward = _spy(monkeypatch, L.Callback, "on_after_backward")
    callback = LightningStethoscope(sinks=[CapturingSink()], recover=True)
    fit(TinyMLP(), steps=200, callback=callback)
    assert optimizer == list(range(200))
    assert backward == list(range(200))
    assert after_backward == []


def test_a_subclass_keeps_the_hooks_it_overrides():
    class Counting(LightningStethoscope):
        def __init__(self) -> None:
            super().__init__(sinks=[CapturingSink()])
            self.counts = {"after_backward": 0, "optimizer": 0}

        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.counts["after_backward"] += 1

        def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
            self.counts["optimizer"] += 1
            super().on_before_optimizer_step(trainer, *args)

    callback = Counting()
    fit(TinyMLP(), steps=STEPS, callback=callback)
    assert callback.counts == {"after_backward": STEPS, "optimizer": STEPS}
