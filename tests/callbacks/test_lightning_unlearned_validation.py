"""unlearned_validation in Lightning: batch norms whose running statistics lag the
batches (momentum 0.001, torch's share taken from each batch) make the model validate
as an untrained one; the twin, torch's default 0.1, validates as it trains."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn

pytest.importorskip("sklearn")

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink


def loaders():
    from sklearn.datasets import load_digits

    d = load_digits()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(d.target), generator=g)
    x = torch.tensor(d.images, dtype=torch.float32)[order, None] / 16.0
    y = torch.tensor(d.target)[order]
    train = torch.utils.data.TensorDataset(x[:1437], y[:1437])
    val = torch.utils.data.TensorDataset(x[1437:], y[1437:])
    return (
        torch.utils.data.DataLoader(train, 64, shuffle=True, generator=g),
        torch.utils.data.DataLoader(val, 128),
    )


class CNN(L.LightningModule):
    def __init__(self, momentum: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16, momentum=momentum),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32, momentum=momentum),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        self.losses: dict[str, list[float]] = {"train": [], "val": []}

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses["train"].append(float(loss))
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)
        if not self.trainer.sanity_checking:
            self.losses["val"].append(float(loss))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def fit(momentum: float):
    L.seed_everything(0, verbose=False)
    module, sink = CNN(momentum), CapturingSink()
    trainer = L.Trainer(
        max_epochs=6,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LightningStethoscope(sinks=[sink])],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, *loaders())
    escalated = [f for f in sink.findings if "unlearned_validation warning" in f.message]
    assert escalated == []  # a validation's finding: no step after it shows more
    return module.losses, [f for f in sink.findings if f.detector == "unlearned_validation"]


def test_lagging_batch_norm_statistics_are_named():
    losses, found = fit(0.001)
    assert losses["train"][-1] < 0.5 * losses["train"][0]  # it trains...
    assert min(losses["val"]) > 0.9 * losses["train"][0]  # ...and validates untrained
    (f,) = found
    assert f.severity.value == "warning" and f.where in ("net.1", "net.4")
    assert "momentum=0.001" in f.message and "torch's default" in f.message


def test_the_twin_at_torchs_default_momentum_is_quiet():
    losses, found = fit(0.1)
    assert losses["val"][-1] < 0.5 * losses["val"][0]
    assert found == []


def test_the_watch_reads_the_norms_that_move_from_their_buffers():
    from stethoscope.callbacks._lightning.running_statistics import RunningStatisticsWatch

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.BatchNorm1d(4, momentum=None),  # a cumulative average: nothing of its start
        nn.BatchNorm1d(4, track_running_stats=False),
        nn.Linear(4, 4),
        nn.BatchNorm1d(4, momentum=0.001),
    )
    watch = RunningStatisticsWatch()
    watch.start(net)
    assert watch.measure() is None  # no step has moved them
    with torch.no_grad():
        for _ in range(40):
            net(3.0 + 0.1 * torch.randn(64, 4))
    lag = watch.measure()
    assert (lag.layer, lag.setting, lag.updates) == ("3", "momentum=0.001", 40)
    assert lag.share == pytest.approx(0.999**40) and lag.lagging
    empty = RunningStatisticsWatch()
    empty.start(nn.Linear(2, 2))
    assert empty.measure() is None
