"""A network wrapped in ``torch.compile`` inside a LightningModule: an ``OptimizedModule``,
here with dynamo's eager backend (its tracing, without a compiler). Such a module raises
for ``len()`` when the module it wraps has none (a ``transformers`` model), and so for
its truth; the callback once asked a module's children for theirs, and a compiled child
crashed the user's fit before its first step."""

from __future__ import annotations

import torch
from _models import CLASSES, FEATURES, TinyMLP, fit
from torch import nn

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink


class Block(nn.Module):
    """Two layers, and no ``__len__`` (unlike ``nn.Sequential``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x)))


def compiled(**kw) -> TinyMLP:
    torch.manual_seed(0)
    model = TinyMLP(**kw)
    model.net = torch.compile(Block(), backend="eager")
    return model


def test_a_nan_in_a_compiled_network_is_named_and_stops_the_run():
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink])
    trainer, _ = fit(compiled(fault="nan_input", onset=10), steps=40, callback=callback)
    stop = callback.stopped_by
    assert stop is not None and stop.step == 10 and stop.detector.startswith("nonfinite")
    # the parameters are named by the path that reaches them, through the wrapper
    named = {f.detector: f.where for f in sink.findings if f.step == 10}
    assert named["nonfinite_gradients"] == "net._orig_mod.head.bias"  # first in backward
    assert trainer.global_step == 11  # stopped after the step that found it


def test_recover_skips_a_nan_batch_in_a_compiled_network():
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    trainer, _ = fit(compiled(fault="nan_input", onset=10), steps=30, callback=callback)
    assert [(f.step, f.where) for f in sink.findings if f.detector == "recovery"] == [(10, "skip")]
    assert callback.stopped_by is None and trainer.global_step == 30
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
