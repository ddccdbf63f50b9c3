"""validation_mode's spectral-norm rule on real Lightning models (pytorch issue 51800):
a validation before any training-mode forward divides a ``spectral_norm`` weight by the
``u @ W @ v`` of random vectors, since power iteration runs only in training mode; each
way a user gets there beside twins that must stay quiet."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import CLASSES, FEATURES, loader
from torch import nn
from torch.nn.utils import parametrizations, spectral_norm

from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning.spectral_norms import (
    normalized_weights,
    spectral_estimates,
)
from stethoscope.detectors import ValidationMode
from stethoscope.observation import Observation
from stethoscope.testing import CapturingSink


class Net(L.LightningModule):
    """20-64-64-4 whose hidden layers are spectrally normalized as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        fc1, fc2 = nn.Linear(FEATURES, 64), nn.Linear(64, 64)
        if how == "conv":
            fc2 = nn.Conv1d(1, 8, 8)  # a weight reshaped to a matrix
        if how.startswith("parametrized"):
            fc1, fc2 = parametrizations.spectral_norm(fc1), parametrizations.spectral_norm(fc2)
            if how == "parametrized-then-initialized":  # its u, v iterated on other weights
                nn.init.orthogonal_(fc1.parametrizations.weight.original, 3.0)
        else:
            fc1, fc2 = spectral_norm(fc1), spectral_norm(fc2)
        self.fc1, self.fc2 = fc1, fc2
        self.out = nn.Linear(64 if how != "conv" else 8 * 57, CLASSES)
        # a critic the validation never runs (a GAN validates its generator)
        self.critic = spectral_norm(nn.Linear(CLASSES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = self.fc2(h.unsqueeze(1)).flatten(1) if self.how == "conv" else self.fc2(h)
        return self.out(F.relu(h))

    def on_fit_start(self) -> None:
        if self.how == "warmed":  # the fix: one training-mode forward first
            self.train()
            with torch.no_grad():
                self(torch.randn(8, FEATURES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _trainer(sink: CapturingSink, *, sanity: int = 2) -> L.Trainer:
    return L.Trainer(
        max_steps=16,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=sanity,
        val_check_interval=8,
        callbacks=[LightningStethoscope(sinks=[sink])],
    )


def _fit(how: str, *, sanity: int = 2, validate_first: bool = False) -> CapturingSink:
    sink = CapturingSink()
    trainer, model = _trainer(sink, sanity=sanity), Net(how)
    if validate_first:
        trainer.validate(model, loader(seed=1), verbose=False)
    trainer.fit(model, loader(), loader(seed=1))
    return sink


BUGS = [
    ("hooked", "fc2.weight"),  # a trainer.validate() before any training step
    ("conv", "fc2.weight"),
    (
        "parametrized-then-initialized",
        "fc1.parametrizations.weight",
    ),  # a weight set after registration
]


@pytest.mark.parametrize(("how", "weight"), BUGS, ids=[b[0] for b in BUGS])
def test_a_validation_that_divides_by_a_random_sigma_is_named_once(how, weight):
    sink = _fit(how, validate_first=True)
    found = sink.by_detector("validation_mode")
    assert len(found) == 1 and found[0].severity == "warning", found
    message = found[0].message
    assert weight in message and "too large" in message and "power iteration" in message.lower()
    assert "training-mode forward" in message and "parametrizations.spectral_norm" in message
    assert found[0].step == 0 and found[0].value >= 2.0
    assert "critic" not in message  # the validation never ran it
    assert [f for f in sink.at_least("warning") if f.detector != "validation_mode"] == []


@pytest.mark.parametrize("how", ["hooked", "conv"])
def test_the_sanity_check_alone_is_an_info_lightning_discards_its_numbers(how):
    sink = _fit(how)  # the sanity check, before any training step, validates
    found = sink.by_detector("validation_mode")
    assert len(found) == 1 and found[0].severity == "info", found
    assert found[0].message.startswith("Lightning's sanity check divided")
    assert "discards the sanity check's numbers" in found[0].message
    assert sink.at_least("warning") == []


@pytest.mark.parametrize("sanity", [2, 0], ids=["then-sanity-check", "no-sanity-check"])
def test_a_validate_before_fit_is_named_as_the_fit_starts(sanity):
    sink = _fit("hooked", sanity=sanity, validate_first=True)
    found = sink.by_detector("validation_mode")
    assert len(found) == 1 and "fc1.weight" in found[0].message and found[0].step == 0
    assert "trainer.validate() before fit" in found[0].message


def test_a_validate_alone_leaves_nothing_behind():
    sink, model = CapturingSink(), Net("hooked")
    trainer = _trainer(sink)
    trainer.validate(model, loader(seed=1), verbose=False)
    assert sink.findings == []  # no fit: nothing is judged
    assert all(not m._forward_hooks for m in model.modules())


TWINS = [
    ("warmed", 2),  # one training-mode forward before the sanity check
    ("hooked", 0),  # no sanity check: the first validation comes after 8 steps
    ("parametrized", 2),  # it iterates 15 times when it is registered
]


@pytest.mark.parametrize(("how", "sanity"), TWINS, ids=[f"{h}-sanity{s}" for h, s in TWINS])
def test_a_spectral_norm_iterated_before_validating_is_quiet(how, sanity):
    sink = _fit(how, sanity=sanity)
    assert sink.at_least("warning") == [], sink.at_least("warning")


def test_the_measure_reads_what_the_eval_forward_divides_by():
    layer = spectral_norm(nn.Linear(30, 40))
    nn.init.orthogonal_(layer.weight_orig)  # every singular value 1
    ((name, _, parts),) = normalized_weights(nn.Sequential(layer))
    ((_, used, true, cosine),) = spectral_estimates([(name, parts)])
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 30))  # eval mode: sets weight = weight_orig / sigma, u and v kept
    assert name == "0.weight" and math.isclose(true, 1.0, rel_tol=1e-5)
    divided_by = (layer.weight_orig / layer.weight).detach()  # sigma, everywhere
    assert torch.allclose(divided_by, torch.full_like(divided_by, used), rtol=1e-4)
    assert abs(cosine) < 0.5  # random u, v: u is not along W @ v


def test_a_model_without_spectral_norm_hooks_nothing():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(), nn.BatchNorm1d(4))
    assert normalized_weights(model) == []
    assert spectral_estimates([]) == ()


CASES = [  # (used, true, cosine), warned
    ((0.03, 1.0, 0.03), True),  # divided by a random, small sigma: 33x too large
    ((-0.02, 1.0, -0.02), True),  # of the wrong sign
    ((0.0, 1.0, 0.0), True),
    ((0.45, 1.0, 0.45), True),  # 2.2x
    ((0.55, 1.0, 0.55), False),  # under 2x
    ((0.4, 1.0, 1.0), False),  # power iteration's own, still converging: training's too
    ((0.99, 1.0, 0.999), False),
    ((0.0, 0.0, 0.0), False),  # a zero weight
    ((float("nan"), float("nan"), float("nan")), False),
]


@pytest.mark.parametrize(("row", "warned"), CASES)
def test_the_rule_on_one_weight(row, warned):
    detector = ValidationMode()
    found = detector.update(Observation(step=0, val_spectral=(("net.0.weight", *row),)))
    assert bool(found) is warned
    assert detector.state["spectral"] and not detector.finished(0)
    assert detector.update(Observation(step=1, val_spectral=(("w", 0.01, 1.0, 0.01),))) == []
    detector.update(Observation(step=2, val_training_calls=()))
    assert detector.finished(2)


@pytest.mark.parametrize("how", ["hooked", "parametrized"])
@pytest.mark.parametrize(
    "layer",
    [lambda: nn.ConvTranspose2d(4, 6, 3), lambda: nn.Conv1d(3, 5, 4), lambda: nn.Linear(7, 9)],
    ids=["conv-transpose-dim1", "conv1d", "linear"],
)
def test_the_matrix_read_is_the_one_spectral_norm_divides(how, layer):
    torch.manual_seed(0)
    module = layer()
    module = spectral_norm(module) if how == "hooked" else parametrizations.spectral_norm(module)
    module.train()
    x = torch.randn(2, 4, 5, 5) if isinstance(module, nn.ConvTranspose2d) else None
    x = torch.randn(2, 3, 8) if isinstance(module, nn.Conv1d) else x
    x = torch.randn(2, 7) if x is None else x
    with torch.no_grad():
        for _ in range(50):  # power iteration, converged
            module(x)
    ((name, _, parts),) = normalized_weights(module)
    ((_, used, true, cosine),) = spectral_estimates([(name, parts)])
    assert math.isclose(used, true, rel_tol=0.02) and cosine > 0.999
