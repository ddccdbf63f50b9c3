"""What the Lightning adapter measures for a statistic added through the registry, and
the run's context that its sinks receive."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _histograms import magnitude_histogram
from _models import TinyMLP, fit
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink, RecordingDetector


def test_distributions_are_the_histograms_of_the_steps_weights_and_gradients():
    spy = RecordingDetector({"distributions"})
    torch.manual_seed(0)
    model = TinyMLP()
    fit(model, steps=1, callback=LightningStethoscope(detectors=[spy], sinks=[]))
    (obs,) = spy.seen
    params = dict(model.named_parameters())
    assert obs.names == tuple(params)
    for name, weights, grads in zip(obs.names, obs.weight_hist, obs.grad_hist, strict=True):
        p = params[name]
        # after the step the weights are those of the step; the gradients stay until the
        # next. The bins are found on a float32 log, which may move an element lying within
        # rounding of an edge across it
        assert np.abs(weights - magnitude_histogram(p.detach().numpy())).sum() <= 2, name
        assert np.abs(grads - magnitude_histogram(p.grad.numpy())).sum() <= 2, name
        assert weights.sum() == grads.sum() == p.numel()


def test_distributions_are_not_measured_unless_a_detector_needs_them():
    spy = RecordingDetector({"grads", "weights"})
    fit(TinyMLP(), steps=3, callback=LightningStethoscope(detectors=[spy], sinks=[]))
    assert spy.seen and all(o.weight_hist is None and o.grad_hist is None for o in spy.seen)


def every_step(model: TinyMLP, steps: int) -> list:
    """The observations of each of ``steps`` steps, every one measuring the gradients and
    the update."""
    spy = RecordingDetector({"grads", "updates"})
    torch.manual_seed(0)
    cb = LightningStethoscope(detectors=[spy], sinks=[], intervals={"recorder": 1})
    fit(model, steps=steps, callback=cb)
    assert [o.step for o in spy.seen] == list(range(steps))
    return spy.seen


class SpikedSchedule(TinyMLP):
    """TinyMLP under plain SGD whose per-step schedule (a scheduler bug) multiplies the
    learning rate by 100 for one step, ``SPIKE``, alone."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e-3)
        bug = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 100.0 if s == SPIKE else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": bug, "interval": "step"}}


SPIKE = 6


def test_the_learning_rate_observed_is_the_one_the_steps_update_was_taken_at():
    # Lightning steps the scheduler after the update and before the batch's end: read
    # there, the spiked step was reported at the rate of the next one (1e-3), and the
    # step before it at the spike's
    for o in every_step(SpikedSchedule(depth=1), steps=10):
        taken = 0.1 if o.step == SPIKE else 1e-3
        assert o.lr == taken, o.step
        # plain SGD: each update is the rate it was taken at times the gradient (to the
        # rounding of a small update subtracted from its weight in float32)
        np.testing.assert_allclose(o.update_norm, taken * o.grad_norm, rtol=1e-3)


def warm_up(step: int) -> float:
    """A linear warm-up to 1e-2 over 5 steps, then constant."""
    return 1e-2 * min(1.0, (step + 1) / 5)


class WarmedUpInOptimizerStep(TinyMLP):
    """TinyMLP under plain SGD warmed up by hand in ``optimizer_step`` (Lightning's own
    recipe): the rate is set after the step began, just before the update."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for group in optimizer.param_groups:
            group["lr"] = warm_up(self.trainer.global_step)
        optimizer.step(closure=optimizer_closure)


class WarmedUpAtBatchStart(WarmedUpInOptimizerStep):
    """The same warm-up set in the module's ``on_train_batch_start``, which Lightning calls
    after the callbacks'."""

    def on_train_batch_start(self, batch, batch_idx):
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = warm_up(self.trainer.global_step)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("model", [WarmedUpInOptimizerStep, WarmedUpAtBatchStart])
def test_a_rate_set_after_the_step_began_is_observed_as_the_update_takes_it(model):
    # read when the step begins alone, each step was observed at the rate of the step
    # before it (0 at step 0)
    for o in every_step(model(depth=1), steps=8):
        assert o.lr == pytest.approx(warm_up(o.step)), o.step
        np.testing.assert_allclose(o.update_norm, o.lr * o.grad_norm, rtol=1e-3)


def test_sinks_receive_the_runs_context():
    sink = CapturingSink()
    fit(TinyMLP(), steps=2, sink=sink)
    context = sink.context
    assert (context.framework, context.rank, context.world_size) == ("lightning", 0, 1)
    assert context.printer is None  # no progress bar: print as usual
    assert context.tensorboard_log_dir() is None and context.mlflow_run() is None
    sink = CapturingSink()
    bar = TQDMProgressBar()  # prints through tqdm.write, which keeps the bar whole
    fit(TinyMLP(), steps=2, sink=sink, enable_progress_bar=True, callbacks=[bar])
    assert sink.context.printer == bar.print
    sink = CapturingSink()  # a rich bar sits on rich's console, which places lines itself
    fit(TinyMLP(), steps=2, sink=sink, enable_progress_bar=True, callbacks=[RichProgressBar()])
    assert sink.context.printer is None
