"""A game trained by hand (a GAN: two optimizers, manual optimization): the detectors that
assume the loss should fall sit it out, the others judge it as usual."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink


class GAN(L.LightningModule):
    """A small GAN on a mixture of four 2-D Gaussians; ``nan_at``: a NaN in the real
    batch of that step (a fault the game does not excuse)."""

    def __init__(self, nan_at: int = -1, jump_at: int = -1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.nan_at, self.jump_at = nan_at, jump_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if batch_idx == self.nan_at:
            x = x.clone()
            x[0, 0] = math.nan
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        real, fake_label = torch.ones(len(x), 1), torch.zeros(len(x), 1)
        fake = self.G(torch.randn(len(x), 8))
        d_loss = bce(self.D(x), real) + bce(self.D(fake.detach()), fake_label)
        if batch_idx == self.jump_at:  # the discriminator's gradient 30x on one batch
            d_loss = 30 * d_loss
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.D(fake), real)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        return g_loss  # the generator's loss: it rises as the discriminator learns

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.G.parameters(), 2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.D.parameters(), 2e-4, betas=(0.5, 0.999)),
        ]


def _train(model: GAN, sink: CapturingSink, epochs: int = 4) -> LightningStethoscope:
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    x = centers[torch.randint(0, 4, (4096,), generator=g)] + 0.2 * torch.randn(4096, 2, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    callback = LightningStethoscope(sinks=[sink], stop_on=None)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model, data)
    return callback


def test_a_healthy_gan_is_not_told_its_loss_does_not_fall():
    torch.manual_seed(0)
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        callback = _train(GAN(), sink)
    alarms = [(f.step, f.detector) for f in sink.findings if f.severity != "info"]
    assert alarms == []  # loss_not_decreasing warned at steps 200 and 400 before
    # Lightning counts each optimizer's step: the summary says batches and names the steps
    first = callback.summaries[0]
    assert first.extent == "64 batches, steps 0–126"  # was "64 steps", findings to 126
    assert first.verdict.startswith("Healthy: no warnings in 64 batches, steps 0–126")


def test_a_nan_in_a_gan_is_still_caught():
    torch.manual_seed(0)
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        _train(GAN(nan_at=20), sink, epochs=1)
    assert sink.by_detector("nonfinite_loss") or sink.by_detector("nonfinite_gradients")


def test_a_discriminators_lone_jump_is_the_game_not_an_explosion():
    """A discriminator's gradient swings with the generator's moves (a DCGAN's, measured:
    11x its recent median from one batch to the next on a healthy run); here one batch
    makes it 30x. Outside a game, such a jump is a warning (test_gradients)."""
    torch.manual_seed(0)
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        _train(GAN(jump_at=40), sink, epochs=1)  # batch 40: step 80, a sampled one
    assert sink.by_detector("exploding_gradients") == []
    assert [f for f in sink.findings if f.severity != "info"] == []


class EncoderAndHead(GAN):
    """Two optimizers stepped in turn after one backward pass of one loss (an encoder at
    one learning rate, a head at another): they step as a GAN's players do, but descend
    one loss, so this is not a game."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        loss = (self.D(self.G(torch.randn(len(x), 8))) - x[:, :1]).pow(2).mean()
        opt_g.zero_grad()
        opt_d.zero_grad()
        self.manual_backward(loss)
        opt_g.step()
        opt_d.step()


def test_two_optimizers_after_one_backward_pass_are_not_a_game():
    import warnings

    torch.manual_seed(0)
    sink = CapturingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(EncoderAndHead(), sink, epochs=1)
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "several optimizers by hand" in m]
    # and it returned nothing: its loss is the one it backpropagated
    assert not [m for m in said if "no scalar loss" in m]


class LayerByLayer(GAN):
    """Greedy layer-wise training, one optimizer per layer: the first layer fits its own
    objective until it has converged, then the second takes over with one of its own (a
    loss that starts far above the first's end, as forward-forward's next layer does)."""

    def __init__(self, per_layer: int) -> None:
        super().__init__()
        self.per_layer, self.it = per_layer, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        k = 0 if self.it < self.per_layer else 1
        self.it += 1
        net, opt = (self.D, self.G)[k], self.optimizers()[1 - k]
        z = x if k == 0 else torch.randn(len(x), 8)
        target = x.sum(1, keepdim=True) if k == 0 else x
        loss = (net(z) - target).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.G.parameters(), 1e-2),
            torch.optim.Adam(self.D.parameters(), 1e-2),
        ]


def test_the_next_stage_of_layer_wise_training_is_not_a_loss_spike():
    torch.manual_seed(0)
    sink = CapturingSink()
    _train(LayerByLayer(per_layer=192), sink, epochs=5)  # 64 batches an epoch: the switch
    alarms = [(f.step, f.detector, f.severity.value) for f in sink.at_least("warning")]
    assert alarms == []


def test_a_stage_begins_where_every_optimizer_differs_from_the_batch_befores():
    from stethoscope.callbacks._lightning.game import GameWatch

    optimizers = [torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1) for _ in range(3)]
    watch = GameWatch(optimizers)
    stages = []
    for batch, ks in enumerate([[0]] * 5 + [[1]] * 5 + [[2]] * 5 + [[0, 1]] * 3):
        for k in ks:
            optimizers[k].step()
        watch.batch_done()
        stages += [batch] if watch.new_stage else []
    assert stages == [5, 10]  # layer 1 takes over, then layer 2; 0 and 1 again: no new one
    watch.close()
