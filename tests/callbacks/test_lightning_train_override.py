"""train_override on real Lightning models: a backbone that freezes its first stage in
its own ``train()`` (as mmpretrain's do), which Lightning never calls, beside twins."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import CLASSES, FEATURES, fit
from torch import nn

from stethoscope.callbacks._lightning.train_override import bypassed_train


class Backbone(nn.Module):
    """A stem, its batch norm and a stage; ``train()`` freezes the stem and rests the
    norm (``frozen_stages=1, norm_eval=True``), and ``at_init`` freezes it at once too."""

    def __init__(self, *, at_init: bool = False, freezes: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, 32)
        self.norm = nn.BatchNorm1d(32)
        self.stage = nn.Linear(32, 32)
        self.freezes = freezes
        if at_init:
            self._freeze_stages()

    def _freeze_stages(self) -> None:
        if not self.freezes:
            return
        self.norm.eval()
        for p in [*self.stem.parameters(), *self.norm.parameters()]:
            p.requires_grad = False

    def train(self, mode: bool = True) -> Backbone:
        super().train(mode)
        self._freeze_stages()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.stage(F.relu(self.norm(self.stem(x)))))


class Classifier(L.LightningModule):
    def __init__(self, *, calls_train: bool = False, **backbone) -> None:
        super().__init__()
        self.backbone = Backbone(**backbone)
        self.head = nn.Linear(32, CLASSES)
        self.calls_train = calls_train

    def on_train_start(self) -> None:
        if self.calls_train:
            self.train()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trained, lr=0.05)


def test_stages_frozen_in_a_train_override_that_lightning_never_calls_are_named():
    model = Classifier()
    before = model.backbone.stem.weight.detach().clone()
    _, sink = fit(model, steps=8)
    (found,) = sink.by_detector("train_override")
    assert (found.severity.value, found.step) == ("warning", 0)
    assert "backbone overrides train() to set requires_grad=False on backbone.stem.weight, " in (
        found.message
    )
    assert found.where == "backbone"
    assert "put backbone.norm in eval mode" in found.message
    assert "Lightning never calls train()" in found.message
    assert not torch.equal(model.backbone.stem.weight, before)  # the "frozen" stem trained
    assert [f for f in sink.at_least("warning") if f.detector != "train_override"] == []


@pytest.mark.parametrize(
    "kw",
    [{"calls_train": True}, {"at_init": True}, {"freezes": False}],
    ids=["train-called-at-start", "frozen-in-init-too", "an-override-that-changes-nothing"],
)
def test_an_override_that_has_done_its_work_or_has_none_to_do_is_quiet(kw):
    _, sink = fit(Classifier(**kw), steps=8)
    assert sink.at_least("warning") == []


def test_looking_leaves_the_model_exactly_as_it_was():
    model = Classifier()
    model.head.weight.requires_grad_(False)  # the user's own choices stay
    model.backbone.stage.eval()
    flags = [p.requires_grad for p in model.parameters()]
    modes = [m.training for m in model.modules()]
    assert bypassed_train(model).startswith("backbone overrides train()")
    assert [p.requires_grad for p in model.parameters()] == flags
    assert [m.training for m in model.modules()] == modes
    assert bypassed_train(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))) == ""


def test_an_override_that_raises_is_no_guess_and_no_harm():
    class Broken(nn.Module):
        def train(self, mode: bool = True):
            raise RuntimeError("needs a runner")

    model = nn.Sequential(nn.Linear(2, 2), Broken())
    assert bypassed_train(model) == ""
    assert all(m.training for m in model.modules())
