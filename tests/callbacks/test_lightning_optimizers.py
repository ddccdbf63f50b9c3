"""What the optimizers hold and how they step, on tiny real Lightning models: an optimizer
over parameters that get no gradient (frozen, unused, or not the model's any more), one
that leaves trainable layers out, a closure optimizer (LBFGS), layer-wise training with
an optimizer per layer, and an optimizer left stepping parameters the loss no longer
reaches. Each fault beside its healthy twin, which must raise no warning."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from _models import CLASSES, FEATURES, fit, problems
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stethoscope import LightningStethoscope
from stethoscope.detectors import default_detectors
from stethoscope.testing import CapturingSink, RecordingDetector

ce = nn.functional.cross_entropy


def _quiet_fit(model: L.LightningModule, **kw: Any) -> tuple[L.Trainer, CapturingSink]:
    """``fit``, keeping the callback's own RuntimeWarnings (a detector sitting out) out of
    the test's way unless a test asks for them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer, sink = fit(model, **kw)
    assert sink is not None
    return trainer, sink


# -- an optimizer over parameters that get no gradient: nothing trains ----------------------
class NewHead(L.LightningModule):
    """A backbone and a new head (a forum report: the head frozen by mistake, the
    optimizer built over it alone, the backbone in no optimizer). ``how`` builds the
    optimizer one way or another; ``manual``: manual optimization."""

    def __init__(self, how: str, *, manual: bool = False) -> None:
        super().__init__()
        self.how = how
        self.automatic_optimization = not manual
        self.backbone = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)
        self.spare = nn.Linear(32, CLASSES)  # forward never uses it
        if how in ("frozen-head", "fine-tune"):
            (self.head if how == "frozen-head" else self.backbone).requires_grad_(False)
        if how == "fine-tune-all-held":
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ce(self(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        how = self.how
        if how == "frozen-head":  # the report: requires_grad=False on the head, by mistake
            return torch.optim.Adam(self.head.parameters(), 1e-3)
        if how == "frozen-in-configure":  # the same, written where the optimizer is built
            self.head.requires_grad_(False)
            return torch.optim.Adam(self.head.parameters(), 1e-3)
        if how == "unused-module":
            return torch.optim.Adam(self.spare.parameters(), 1e-3)
        if how == "layers-replaced-after":
            opt = torch.optim.Adam(self.parameters(), 1e-3)
            self.backbone = copy.deepcopy(self.backbone)
            self.head = copy.deepcopy(self.head)
            return opt
        if how == "fine-tune":
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), 1e-3)
        return torch.optim.Adam(self.parameters(), 1e-3)  # every parameter, frozen ones too


@pytest.mark.parametrize(
    ("how", "manual", "cause"),
    [
        pytest.param("frozen-head", False, "head.weight (requires_grad=False)", id="frozen-head"),
        pytest.param(
            "frozen-head", True, "head.weight (requires_grad=False)", id="frozen-head-manual"
        ),
        pytest.param(
            "frozen-in-configure",
            False,
            "head.weight (requires_grad=False)",
            id="frozen-in-configure_optimizers",
        ),
        pytest.param("unused-module", False, "spare.weight (no gradient)", id="unused-module"),
        pytest.param(
            "layers-replaced-after",
            False,
            "4 tensor(s) that are not the model's parameters",
            id="layers-replaced-after-the-optimizer",
        ),
    ],
)
def test_an_optimizer_that_steps_nothing_with_a_gradient_is_named_at_once(how, manual, cause):
    torch.manual_seed(0)
    trainer, sink = _quiet_fit(NewHead(how, manual=manual), steps=40)
    found = sink.by_detector("frozen_weights")
    assert found, [(f.detector, f.step) for f in problems(sink)]
    first = found[0]
    assert (first.step, first.severity.value, first.where) == (0, "error", "backbone.0.weight")
    assert first.message.startswith("Nothing trains: the optimizer stepped no parameter")
    assert cause in first.message
    assert "backbone.0.weight, backbone.0.bias" in first.message  # what does get gradients
    assert "are in no optimizer" in first.message
    assert trainer.should_stop  # an error stops the run
    assert len(found) == 1  # the parameters in no optimizer are not named again


@pytest.mark.parametrize("how", ["all", "fine-tune", "fine-tune-all-held"])
def test_an_optimizer_over_what_trains_is_quiet(how):
    torch.manual_seed(0)
    trainer, sink = _quiet_fit(NewHead(how), steps=40)
    assert problems(sink) == []
    assert trainer.global_step == 40


# -- trainable layers left out of the optimizer -----------------------------------------------
class Normed(L.LightningModule):
    """Batch norm before each bias-free linear layer. ``leave_norms``: the optimizer is
    built over the linear layers alone, so the norms' parameters get gradients that no
    optimizer applies (or zeroes). ``zero``: whether the training step zeroes the
    gradients (manual optimization)."""

    def __init__(self, *, leave_norms: bool = False, manual: bool = False, zero: bool = True):
        super().__init__()
        self.leave_norms, self.zero = leave_norms, zero
        self.automatic_optimization = not manual
        self.net = nn.Sequential(
            nn.BatchNorm1d(FEATURES),
            nn.Linear(FEATURES, 32, bias=False),
            nn.ReLU(),
            nn.BatchNorm1d(32),
            nn.Linear(32, CLASSES, bias=False),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ce(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            if self.zero:
                opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        linear = [m.weight for m in self.net if isinstance(m, nn.Linear)]
        params = linear if self.leave_norms else list(self.parameters())
        return torch.optim.SGD(params, 1e-2, momentum=0.9)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_norms_left_out_of_the_optimizer_are_in_no_optimizer_not_unzeroed(manual):
    torch.manual_seed(0)
    _, sink = _quiet_fit(Normed(leave_norms=True, manual=manual), steps=40)
    # was: unzeroed_gradients at step 2, "4 of the 2 parameters stepped still held a
    # gradient": the norms' gradients, which no optimizer zeroes, counted against the two
    # weights it steps
    assert [(f.detector, f.step, f.severity.value) for f in problems(sink)] == [
        ("frozen_weights", 0, "warning")
    ]
    (f,) = problems(sink)
    assert "in no optimizer (4: net.0.weight, net.0.bias, net.3.weight, net.3.bias)" in f.message


def test_norms_in_the_optimizer_are_quiet():
    torch.manual_seed(0)
    _, sink = _quiet_fit(Normed(), steps=40)
    assert problems(sink) == []


def test_gradients_never_zeroed_are_counted_over_the_parameters_stepped():
    torch.manual_seed(0)
    _, sink = _quiet_fit(Normed(leave_norms=True, manual=True, zero=False), steps=40)
    (f,) = sink.by_detector("unzeroed_gradients")
    assert "2 of the 2 parameters stepped still held a gradient" in f.message


# -- a closure optimizer: LBFGS ---------------------------------------------------------------
class Sine(L.LightningModule):
    """pytorch/examples' time sequence prediction, small: two LSTM cells and a linear
    read-out predict the next value of sine waves, in float64, with LBFGS at lr 0.8.
    ``leave_out``: the read-out is in no optimizer."""

    def __init__(self, *, leave_out: bool = False, hidden: int = 8) -> None:
        super().__init__()
        self.hidden, self.leave_out = hidden, leave_out
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)
        self.before: list[torch.Tensor] = []
        self.moved: list[list[float]] = []  # the norm of each parameter's update, per step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = h2 = c2 = x.new_zeros(len(x), self.hidden)
        out = []
        for t in range(x.shape[1]):
            h, c = self.lstm1(x[:, t : t + 1], (h, c))
            h2, c2 = self.lstm2(h, (h2, c2))
            out.append(self.linear(h2))
        return torch.cat(out, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = [p.detach() for p in self.parameters()]
        self.moved.append([float((a - b).norm()) for a, b in zip(now, self.before, strict=True)])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        held = [p for n, p in self.named_parameters() if not n.startswith("linear")]
        return torch.optim.LBFGS(held if self.leave_out else self.parameters(), lr=0.8)


def _waves(n: int = 16, length: int = 10) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(length + 1) + torch.randint(-40, 40, (n, 1), generator=g)
    s = torch.sin(t / 4.0).double()
    return DataLoader(TensorDataset(s[:, :-1], s[:, 1:]), batch_size=n)


def _fit_sine(model: Sine, steps: int) -> tuple[CapturingSink, RecordingDetector]:
    spy = RecordingDetector({"weights", "updates"}, name="spy")
    sink = CapturingSink()
    callback = LightningStethoscope(detectors=[*default_detectors(), spy], sinks=[sink])
    fit(model, steps=steps, data=_waves(), callback=callback, precision="64-true")
    return sink, spy


def test_lbfgs_updates_are_measured_over_the_whole_step():
    torch.manual_seed(0)
    model = Sine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the next test's
        sink, spy = _fit_sine(model, steps=8)
    assert spy.seen
    names = [n for n, _ in model.named_parameters()]
    for obs in spy.seen:
        # LBFGS calls its closure, and Lightning the hook there, up to 20 times a step:
        # the update is measured once, from before the first call to the step's end
        # (was: every parameter 20 times over, measured from the last call)
        assert list(obs.names) == names
        truth = model.moved[obs.step]
        assert obs.update_norm == pytest.approx(truth, rel=1e-5)
        assert min(truth) > 0
    assert problems(sink) == []


def test_lbfgs_sits_out_the_update_ratios_and_still_names_a_layer_left_out():
    torch.manual_seed(0)
    sitting_out = r"small_updates and large_updates cannot judge this run \(LBFGS takes"
    with pytest.warns(RuntimeWarning, match=sitting_out):
        sink, _ = _fit_sine(Sine(leave_out=True), steps=4)
    # an LBFGS step moves the weights by many times their norm, as its search finds:
    # large_updates, judging it as a learning rate's step, would stop the run at step 0
    assert [(f.detector, f.step, f.where) for f in problems(sink)] == [
        ("frozen_weights", 0, "linear.weight")
    ]


# -- layer-wise training (forward-forward): one optimizer steps at a time ---------------------
class LayerWise(L.LightningModule):
    """Forward-forward-style training, layer by layer: layer 0 learns alone for
    ``switch`` steps (its goodness, the mean square of its output, high on the real
    inputs and low on inputs with their features permuted), then layer 1 on layer 0's
    detached output, while layer 0 trains no more.

    ``how``: ``"optimizer-per-layer"`` (manual optimization, one optimizer per layer of
    which one steps at a time), ``"swapped-groups"`` (one optimizer whose parameters are
    swapped at the switch), ``"one-optimizer"`` (one optimizer over both layers, a loss of
    the current layer's). ``zeroes``: the layers whose optimizer the training step zeroes
    (manual optimization)."""

    def __init__(self, how: str, *, switch: int = 30, zeroes: tuple[int, ...] = (0, 1)) -> None:
        super().__init__()
        self.how, self.switch, self.zeroes = how, switch, zeroes
        self.automatic_optimization = how != "optimizer-per-layer"
        self.layers = nn.ModuleList([nn.Linear(FEATURES, 32), nn.Linear(32, 32)])
        self.permutation = torch.randperm(FEATURES, generator=torch.Generator().manual_seed(2))
        self.batches = 0

    def _layer_loss(self, x: torch.Tensor, k: int) -> torch.Tensor:
        real, fake = x, x[:, self.permutation]
        for layer in self.layers[:k]:
            real, fake = torch.relu(layer(real)).detach(), torch.relu(layer(fake)).detach()
        layer = self.layers[k]
        good = torch.relu(layer(real)).square().mean(1)
        bad = torch.relu(layer(fake)).square().mean(1)
        soft = nn.functional.softplus
        return (soft(1.0 - good) + soft(bad - 1.0)).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        k = int(self.batches >= self.switch)
        self.batches += 1
        loss = self._layer_loss(x, k)
        if self.how == "optimizer-per-layer":
            opt = self.optimizers()[k]
            if k in self.zeroes:
                opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.how == "swapped-groups" and self.batches == self.switch:
            (group,) = self.trainer.optimizers[0].param_groups
            group["params"] = list(self.layers[1].parameters())

    def configure_optimizers(self) -> Any:
        if self.how == "optimizer-per-layer":
            return [torch.optim.Adam(layer.parameters(), 3e-3) for layer in self.layers]
        held = self.layers[0] if self.how == "swapped-groups" else self.layers
        return torch.optim.Adam(held.parameters(), 3e-3)


@pytest.mark.parametrize("how", ["optimizer-per-layer", "swapped-groups", "one-optimizer"])
def test_layer_wise_training_is_neither_unzeroed_nor_a_game(how):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _, sink = fit(LayerWise(how), steps=60)
    # was: "several optimizers by hand (a game such as a GAN ...)": the loss detectors off
    # for a run whose one optimizer at a time trains for a long stretch
    assert not [w for w in said if "several optimizers" in str(w.message)]
    # was: unzeroed_gradients, "2 of the 2 parameters stepped still held a gradient":
    # layer 0's last gradients, counted against layer 1's
    assert problems(sink) == []


def test_layer_wise_training_that_never_zeroes_is_caught_on_the_layer_stepped():
    torch.manual_seed(0)
    # the second layer's optimizer is never zeroed: its gradients alone are counted, not
    # the first layer's left over from its own stretch (was: "4 of the 2 parameters")
    _, sink = _quiet_fit(LayerWise("optimizer-per-layer", switch=10, zeroes=(0,)), steps=40)
    (found,) = sink.by_detector("unzeroed_gradients")
    assert found.step > 10
    assert "2 of the 2 parameters stepped" in found.message


@pytest.mark.parametrize(
    ("steps", "game"),
    [
        pytest.param([[0, 1]] * 4, True, id="both-players-every-batch"),
        pytest.param([[0]] * 4 + [[0, 1]] + [[0]] * 4 + [[0, 1]], True, id="critic-five-to-one"),
        pytest.param([[0], [1]] * 3, True, id="players-on-alternate-batches"),
        pytest.param([[0]] * 40 + [[1]] * 40, False, id="layer-by-layer"),
        pytest.param([[0]] * 40 + [[1]] * 40 + [[2]] * 40, False, id="three-layers-in-turn"),
        pytest.param([[0]] * 20 + [[1]] * 20 + [[0]] * 20, False, id="back-after-a-long-stretch"),
    ],
)
def test_a_game_is_players_stepping_in_turn(steps, game):
    from stethoscope.callbacks._lightning.game import GameWatch

    optimizers = [torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1) for _ in range(3)]
    watch = GameWatch(optimizers)
    found = False
    for batch in steps:
        for k in batch:
            optimizers[k].step()
        found = watch.batch_done() or found
    assert found is game
    watch.close()


def test_optimizers_sharing_parameters_are_not_players():
    from stethoscope.callbacks._lightning.game import GameWatch

    shared = list(nn.Linear(2, 2).parameters())
    optimizers = [torch.optim.SGD(shared, 0.1), torch.optim.SGD(shared, 0.2)]
    watch = GameWatch(optimizers)
    for _ in range(4):
        for opt in optimizers:
            opt.step()
        assert not watch.batch_done()
    watch.close()
    assert not optimizers[0]._optimizer_step_post_hooks  # no hook left on them


# -- an optimizer left stepping parameters the loss no longer reaches -------------------------
class Replaced(L.LightningModule):
    """An MLP whose layers are replaced at step ``at`` (None: never) after the optimizer
    was built, which goes on stepping the old ones; it zeroes its gradients to zeros."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at = at
        self.net = self._make()

    @staticmethod
    def _make() -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ce(self.net(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.at:
            self.net = self._make()

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), 1e-2)


def test_updates_of_exactly_zero_are_not_told_to_raise_the_learning_rate():
    torch.manual_seed(0)
    _, sink = _quiet_fit(Replaced(at=20), steps=45)
    # was: small_updates, "changes by 0x its norm per step at a learning rate of 0.01 ...
    # raise the learning rate (try 10-100x)"
    assert sink.by_detector("small_updates") == []
    assert not any("raise the learning rate" in f.message for f in sink.findings)
    (f,) = sink.by_detector("frozen_weights")
    assert 20 <= f.step <= 40 and f.severity.value == "warning"
    assert "their gradients are exactly zero, so no learning rate would move them" in f.message
    assert "built before the layers were replaced" in f.message


def test_an_optimizer_over_the_layers_in_use_is_quiet():
    torch.manual_seed(0)
    _, sink = _quiet_fit(Replaced(at=None), steps=45)
    assert problems(sink) == []
