"""validation_mode on real Lightning models: a validation that still behaves as training
(a dropout that drops, a batch norm that moves its running statistics), in each place a
user writes it, beside twins that must stay quiet."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import CLASSES, FEATURES, loader
from torch import nn

from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning.validation_modes import training_behaviour_of
from stethoscope.testing import CapturingSink


class Net(L.LightningModule):
    """20-32-4 with a dropout or a batch norm written as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(FEATURES, 32)
        self.norm = nn.BatchNorm1d(32, track_running_stats=how != "bn-without-running-stats")
        self.attend = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, CLASSES)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.how.startswith("bn"):
            h = self.norm(h)
        h = F.relu(h)
        how = self.how
        if how == "functional-dropout":  # training defaults to True
            h = F.dropout(h, 0.3)
        elif how == "functional-dropout-fixed":
            h = F.dropout(h, 0.3, training=self.training)
        elif how == "module-dropout":
            h = self.drop(h)
        elif how == "aten-dropout":
            h = torch.dropout(h, 0.3, True)
        elif how.startswith("attention"):
            q = self.attend(h).reshape(len(h), 4, 8)  # 4 tokens of 8
            p = 0.2 if how == "attention-dropout" else (0.2 if self.training else 0.0)
            h = F.scaled_dot_product_attention(q, q, q, dropout_p=p).reshape(len(h), 32)
        elif how == "sampling":  # a VAE-like draw: random on purpose, drops nothing
            h = h + 0.01 * torch.randn_like(h)
        return self.fc2(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.how == "bn-train-in-validation":
            self.norm.train()  # the batch norm updates its running statistics here
        loss = F.cross_entropy(self(x), y)
        if self.how == "dropout-in-validation-step":
            loss = F.dropout(loss.reshape(1), 0.1).sum()
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _trainer(callbacks: list) -> L.Trainer:
    return L.Trainer(
        max_steps=32,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=16,
        callbacks=callbacks,
    )


def _fit(how: str) -> CapturingSink:
    sink = CapturingSink()
    _trainer([LightningStethoscope(sinks=[sink])]).fit(Net(how), loader(), loader(seed=1))
    return sink


BUGS = [
    ("functional-dropout", "F.dropout(training=True) in <model>"),
    ("aten-dropout", "torch.dropout(train=True) in <model>"),
    ("attention-dropout", "scaled_dot_product_attention(dropout_p>0) in <model>"),
    ("bn-train-in-validation", "F.batch_norm(training=True) in norm"),
    ("dropout-in-validation-step", "F.dropout(training=True) in the step"),
]


@pytest.mark.parametrize(("how", "call"), BUGS, ids=[b[0] for b in BUGS])
def test_a_validation_that_behaves_as_training_is_named_once(how, call):
    sink = _fit(how)
    found = sink.by_detector("validation_mode")
    assert len(found) == 1 and found[0].severity == "warning", found
    assert call in found[0].message and found[0].step == 15
    assert [f for f in sink.at_least("warning") if f.detector != "validation_mode"] == []


TWINS = [
    "functional-dropout-fixed",
    "module-dropout",
    "attention-fixed",
    "bn",
    "bn-without-running-stats",
    "sampling",
]


@pytest.mark.parametrize("how", TWINS)
def test_a_validation_in_eval_behaviour_is_quiet(how):
    sink = _fit(how)
    assert sink.at_least("warning") == []


def test_watching_changes_nothing_of_the_run():
    # the watch reads arguments only: the run's random draws and weights are a twin's
    def weights(callbacks: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Net("functional-dropout")
        with_it = [LightningStethoscope(sinks=[CapturingSink()])] if callbacks else []
        _trainer(with_it).fit(model, loader(), loader(seed=1))
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(weights(True), weights(False), strict=True):
        assert torch.equal(a, b)


def test_a_call_is_read_by_its_own_argument_wherever_it_is_given():
    x = torch.ones(2, 3)
    stats = torch.zeros(3)
    assert training_behaviour_of(F.dropout, (x, 0.5), {}) == "F.dropout(training=True)"
    assert training_behaviour_of(F.dropout, (x, 0.5, False), {}) is None
    assert training_behaviour_of(F.dropout, (x,), {"training": False}) is None
    assert training_behaviour_of(F.rrelu, (x,), {}) is None  # rrelu's default is False
    assert training_behaviour_of(F.batch_norm, (x, None, None), {"training": True}) is None
    assert training_behaviour_of(F.batch_norm, (x, stats, stats), {"training": True})
    assert training_behaviour_of(F.instance_norm, (x,), {}) is None  # no running stats
    sdpa = F.scaled_dot_product_attention
    assert training_behaviour_of(sdpa, (x, x, x), {"dropout_p": 0.0}) is None
    assert training_behaviour_of(sdpa, (x, x, x, None, 0.1), {})
    assert training_behaviour_of(torch.relu, (x,), {}) is None
