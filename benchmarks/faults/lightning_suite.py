"""The Lightning implementation of the scenarios: one ``Trainer.fit`` per scenario and seed.

How a run works. The scenario's data (``data.py``) becomes an in-memory loader that
reshuffles every epoch from the seed; its model spec becomes a small ``nn.Module``
(MLP, CNN or GRU) inside :class:`SuiteModule`, a ``LightningModule`` that trains with
cross-entropy, logs ``train_loss`` every step (and ``val_loss`` per validation epoch)
and injects the fault at its onset through ordinary Lightning hooks: the batch in
``training_step``, the learning rate and biases in ``on_train_batch_start``, a weight
right after the update in ``optimizer_step``, a gradient through a tensor hook
registered in ``on_fit_start``, the initialisation and parameter groups when the
model and optimizer are built.

Every watcher rides in the same fit, as an observer that never changes training:

* one ``LightningStethoscope(sinks=[CapturingSink()], stop_on=None)`` per sampling
  setting asked for (``adaptive``: the defaults; ``every``: an interval of 1 for
  every detector and no escalation; ``sparse``: the default base intervals and no
  escalation). ``stop_on=None`` lets the run go on after the first error, so the
  suite sees every collateral finding a longer run would show; the latency is the
  step of the first finding, which ``stop_on`` does not change (stopping happens
  after the finding). Several stethoscopes in one Trainer need distinct
  ``state_key``\\ s, which the small subclass here gives them; it changes nothing
  else. The findings of one setting do not depend on the others being present:
  they only read tensors, and training is deterministic for a seed (``--separate-fits``
  runs one fit per setting instead; on seven scenarios, from NaN to overfitting, it
  gave the same findings, values included).
* the baselines (``results.BASELINES``), each wrapped so that it records the step
  at which it would have stopped training and then lets the run continue:
  Lightning's ``EarlyStopping`` (its ``should_stop`` is recorded and undone) and
  ``SpikeDetection`` (its ``TrainingSpikeException`` is caught and recorded), and a
  hand-written NaN check. Their step is that of the last batch they saw: for
  ``EarlyStopping``, which checks at the end of a training epoch, the epoch's last
  step. The runs are deterministic, so the first stop a watcher records is the
  step at which it would have stopped a run of its own.

Lightning's ``SpikeDetection`` (``lightning.pytorch.callbacks.SpikeDetection``, a
Lightning callback wrapping the Fabric utility) is used as it ships; it writes its
``skip_batches.json`` into a temporary directory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from benchmarks.faults.data import Arrays, make_data
from benchmarks.faults.results import RunResult
from benchmarks.faults.scenarios import ModelSpec, Scenario, resolve_onset, setting_kwargs
from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink

__all__ = [
    "FRAMEWORK",
    "ON_ONE_CPU",
    "SuiteModule",
    "WatchedStethoscope",
    "baseline_callbacks",
    "build_net",
    "configure",
    "environment",
    "make_loader",
    "quiet",
    "run_scenario",
    "setting_kwargs",
]

FRAMEWORK = "lightning"

try:  # SpikeDetection ships with Lightning >= 2.2 and needs torchmetrics >= 1.0
    from lightning.fabric.utilities.spike import TrainingSpikeException
    from lightning.pytorch.callbacks import SpikeDetection

    SPIKE_DETECTION: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed Lightning
    SpikeDetection = None  # type: ignore[assignment,misc]
    SPIKE_DETECTION = f"SpikeDetection is not available: {exc}"


#: The Trainer arguments of every benchmark fit: one CPU process, nothing written, no
#: bar or summary printed.
ON_ONE_CPU: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet() -> None:
    """Silence Lightning's banners and the warnings a tiny in-memory run triggers."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", module="lightning_utilities.*")
    warnings.filterwarnings("ignore", module="torchmetrics.*")
    warnings.filterwarnings("ignore", message=".*validation_step.*but have no.*val_dataloader.*")


def configure(threads: int) -> None:
    """Run torch's CPU ops on ``threads`` threads."""
    torch.set_num_threads(threads)


def environment() -> dict[str, Any]:
    """Versions of what this implementation runs on."""
    return {
        "versions": f"torch {torch.__version__}, lightning {L.__version__}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "torch_threads": torch.get_num_threads(),
    }


# -- models ----------------------------------------------------------------------------


class _GRUNet(nn.Module):
    """One GRU layer; a linear classifier on its last output, or on every step's
    (``ModelSpec.output`` ``"steps"``: scores ``(N, C, T)`` as ``cross_entropy`` takes a
    sequence's; ``"steps_softmax"``: their softmax over the classes, dim 1)."""

    def __init__(self, features: int, hidden: int, classes: int, output: str = "logits") -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)
        self.output = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        if not self.output.startswith("steps"):
            return self.head(out[:, -1])
        scores = self.head(out).transpose(1, 2)  # (N, T, C) -> (N, C, T)
        return scores.softmax(dim=1) if self.output == "steps_softmax" else scores


_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def build_net(
    spec: ModelSpec, input_shape: tuple[int, ...], classes: int
) -> tuple[nn.Module, list[nn.Module]]:
    """The network of ``spec`` and its layers with weights, from the input."""
    if spec.arch == "mlp":
        act = _ACTIVATIONS[spec.activation]
        mods: list[nn.Module] = [nn.Flatten()]
        layers: list[nn.Module] = []
        width = int(np.prod(input_shape))
        for _ in range(spec.depth):
            lin = nn.Linear(width, spec.width, bias=spec.hidden_bias)
            layers.append(lin)
            mods.append(lin)
            if spec.batchnorm:
                mods.append(nn.BatchNorm1d(spec.width, **_bn_kwargs(spec)))
            mods.append(act())
            width = spec.width
        if spec.dropout:
            mods.append(nn.Dropout(spec.dropout))
        head = nn.Linear(width, classes)
        layers.append(head)
        if spec.output in ("softmax", "sigmoid"):
            last = nn.Softmax(dim=1) if spec.output == "softmax" else nn.Sigmoid()
            mods += [head, last]
            return nn.Sequential(*mods), layers
        return nn.Sequential(*mods, head), layers
    if spec.arch == "cnn":
        c1, c2 = nn.Conv2d(input_shape[0], 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        side = input_shape[1] // 2
        head = nn.Linear(32 * side * side, classes)
        mods = [c1]
        if spec.batchnorm:
            mods.append(nn.BatchNorm2d(16, **_bn_kwargs(spec)))
        mods += [nn.ReLU(), c2]
        if spec.batchnorm:
            mods.append(nn.BatchNorm2d(32, **_bn_kwargs(spec)))
        mods += [nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
        if spec.dropout:
            mods.append(nn.Dropout(spec.dropout))
        return nn.Sequential(*mods, head), [c1, c2, head]
    if spec.arch == "gru":
        net = _GRUNet(input_shape[-1], spec.width, classes, spec.output)
        return net, [net.gru, net.head]
    raise ValueError(f"arch={spec.arch!r}; use 'mlp', 'cnn' or 'gru'")


def _bn_kwargs(spec: ModelSpec) -> dict[str, float]:
    """A batch norm's arguments: torch's momentum is the share each batch takes."""
    return {} if spec.bn_momentum is None else {"momentum": spec.bn_momentum}


def _weight(layer: nn.Module) -> nn.Parameter:
    """A layer's first weight tensor (``weight_ih_l0`` for a GRU)."""
    return next(p for name, p in layer.named_parameters() if name.startswith("weight"))


class SuiteModule(L.LightningModule):
    """A scenario's model, data faults and training recipe as a LightningModule."""

    def __init__(self, scenario: Scenario, arrays: Arrays) -> None:
        super().__init__()
        self.sc = scenario
        self.classes = arrays.classes
        self.net, layers = build_net(scenario.model, arrays.input_shape, arrays.classes)
        self._layers = layers  # a plain list: the modules are registered once, under net
        self.val_losses: list[list[float]] = []
        self._val_sum, self._val_n = 0.0, 0
        f = scenario.fault
        onset = scenario.onset if isinstance(scenario.onset, int) else -1
        self._onset = onset
        # the step-time faults, resolved once: no per-step dictionary lookups
        self._batch_fault = f.kind if f and f.kind in _BATCH_FAULTS else None
        self._lr_fault = f.kind if f and f.kind in ("lr_scale", "lr_growth") else None
        self._init_faults()
        for i in scenario.model.frozen:
            for p in layers[i].parameters():
                p.requires_grad_(False)
        if scenario.model.frozen_bn:
            for m in self._batch_norms():
                m.eval()  # at once too: Lightning never calls train() when it fits
                for p in m.parameters():
                    p.requires_grad_(False)

    def _batch_norms(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def train(self, mode: bool = True) -> SuiteModule:
        """Train mode, but frozen batch norms stay in eval mode (as fine-tuning keeps
        them, on their running statistics)."""
        super().train(mode)
        if self.sc.model.frozen_bn:
            for m in self._batch_norms():
                m.eval()
        return self

    def _init_faults(self) -> None:
        f = self.sc.fault
        if f is None:
            return
        with torch.no_grad():
            if f.kind == "init_scale":
                for layer in self._layers[:-1]:
                    _weight(layer).mul_(f["factor"])
            elif f.kind == "init_std":
                for layer in self._layers:
                    for name, p in layer.named_parameters():
                        if name.startswith("weight"):
                            p.normal_(0.0, f["std"])
                        else:
                            p.zero_()
            elif f.kind == "zero_init":
                for i in f["layers"]:
                    _weight(self._layers[i]).zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    # -- faults at a step ---------------------------------------------------------------
    def on_fit_start(self) -> None:
        f = self.sc.fault
        if f is not None and f.kind in ("inf_gradient", "inf_gradients"):
            onset, every = self._onset, f.kind == "inf_gradients"

            def poison(grad: torch.Tensor) -> torch.Tensor:
                if self.global_step != onset and not (every and self.global_step > onset):
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = math.inf
                return grad

            self._hook = _weight(self._layers[f["layer"]]).register_hook(poison)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.global_step
        kind = self._lr_fault
        if kind is not None and (
            step == self._onset or (kind == "lr_growth" and step > self._onset)
        ):
            for opt in self.trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] *= self.sc.fault["factor"]
        f = self.sc.fault
        if f is not None and f.kind == "kill_units" and step == self._onset:
            bias = self._layers[f["layer"]].bias
            with torch.no_grad():
                bias[: round(f["fraction"] * bias.numel())] = f["bias"]
        if f is not None and f.kind == "eval_mode" and step == self._onset:
            self.eval()  # a side evaluation that never calls .train() again

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        f = self.sc.fault
        if f is not None and f.kind == "no_zero_grad" and self.global_step >= self._onset:
            return  # a loop that forgot zero_grad: the gradients add up
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        step = self.global_step
        super().optimizer_step(*args, **kwargs)
        f = self.sc.fault
        if f is not None and f.kind == "nan_weight" and step == self._onset:
            with torch.no_grad():  # an optimizer that writes a NaN into a weight
                _weight(self._layers[f["layer"]]).view(-1)[0] = math.nan

    # -- steps --------------------------------------------------------------------------------
    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The scenario's loss of the network's output (see ``TrainSpec.loss``), in
        float32, times ``TrainSpec.loss_weight``."""
        weight = self.sc.train.loss_weight
        loss = self._unweighted(out.float(), y)
        return loss * weight if weight != 1.0 else loss

    def _unweighted(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kind = self.sc.train.loss
        if kind == "mse":
            return nn.functional.mse_loss(out.squeeze(-1), y)
        if kind == "mse_broadcast":  # (N, 1) against (N,): every pair
            return ((out - y) ** 2).mean()
        if kind == "probabilities":
            return nn.functional.nll_loss(torch.log(out.clamp_min(1e-12)), y)
        if kind == "nll_raw":
            return nn.functional.nll_loss(out, y)
        if kind == "softmax_in_step":  # a softmax in the step, before a loss that has one
            return nn.functional.cross_entropy(torch.softmax(out, dim=1), y)
        if kind == "softmax_in_step_sum":  # the same, summed over the batch
            return nn.functional.cross_entropy(torch.softmax(out, dim=1), y, reduction="sum")
        if kind == "one_hot":  # class probabilities, one-hot (see _targets): right
            return nn.functional.cross_entropy(out, y)
        if kind == "softmax_in_step_one_hot":  # the same after a softmax: a bug
            return nn.functional.cross_entropy(torch.softmax(out, dim=1), y)
        if kind == "sum":  # cross_entropy summed over the batch, of the logits: right
            return nn.functional.cross_entropy(out, y, reduction="sum")
        if kind == "log_softmax_in_step":  # the same place, written right
            return nn.functional.nll_loss(torch.log_softmax(out, dim=1), y)
        if kind == "bce_with_logits":  # multi-label targets (see _targets)
            return nn.functional.binary_cross_entropy_with_logits(out, y)
        if kind == "bce":  # the same of probabilities
            return nn.functional.binary_cross_entropy(out, y)
        if kind == "sigmoid_in_step":  # a sigmoid in the step, before a loss that has one
            return nn.functional.binary_cross_entropy_with_logits(torch.sigmoid(out), y)
        if kind == "smoothed":
            return nn.functional.cross_entropy(out, y, label_smoothing=0.1)
        if kind == "probabilities_smoothed":  # label-smoothed nll of the log-probabilities
            logp = torch.log(out.clamp_min(1e-12))
            return 0.9 * nn.functional.nll_loss(logp, y) - 0.1 * logp.mean(dim=1).mean()
        return nn.functional.cross_entropy(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self._batch_fault is not None and self.global_step == self._onset:
            x, y = _corrupt(self._batch_fault, self.sc.fault.params, x, y, self.classes)
        with _autocast(self.sc.train.precision, x.device.type):
            loss = self._loss(self.net(x), y)
        self.log("train_loss", loss, batch_size=len(y))  # EarlyStopping monitors it
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(self.net(x), y)
        self.log("val_loss", loss, batch_size=len(y), on_epoch=True)
        self._val_sum += float(loss) * len(y)
        self._val_n += len(y)
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking and self._val_n:
            self.val_losses.append([self.global_step, self._val_sum / self._val_n])
        self._val_sum, self._val_n = 0.0, 0

    def configure_optimizers(self) -> Any:
        t, f = self.sc.train, self.sc.fault
        params = [p for p in self.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": params}]
        if f is not None and f.kind in ("exclude_layer", "zero_lr_group"):
            odd = {id(p) for p in self._layers[f["layer"]].parameters()}
            groups = [{"params": [p for p in params if id(p) not in odd]}]
            if f.kind == "zero_lr_group":
                groups.append({"params": [p for p in params if id(p) in odd], "lr": 0.0})
        if t.optimizer == "adam":
            eps = {} if t.eps is None else {"eps": t.eps}
            opt: torch.optim.Optimizer = torch.optim.Adam(groups, lr=t.lr, **eps)
        elif t.optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
        else:
            raise ValueError(f"optimizer={t.optimizer!r}; use 'adam' or 'sgd'")
        if t.schedule is None:
            return opt
        if t.schedule == "warmup":
            n = t.warmup_steps

            def factor(s: int) -> float:
                return min(1.0, s / n)  # exactly 0 at the first step

        elif t.schedule == "cosine":
            last = t.max_steps - 1

            def factor(s: int) -> float:
                return 0.5 * (1.0 + math.cos(math.pi * min(s, last) / last))  # 0 at the last step

        elif t.schedule == "step_decay":

            def factor(s: int) -> float:
                return t.decay ** (s // t.decay_every)

        else:
            raise ValueError(
                f"schedule={t.schedule!r}; use None, 'warmup', 'cosine' or 'step_decay'"
            )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GanModule(L.LightningModule):
    """A GAN on a scenario's inputs (``ModelSpec.arch == "gan"``), trained by hand: two
    optimizers, the discriminator first at every batch. No fault is injected into it."""

    def __init__(self, scenario: Scenario, arrays: Arrays) -> None:
        super().__init__()
        if scenario.fault is not None or scenario.train.validate:
            raise ValueError(f"{scenario.name}: a GAN takes no fault and no validation")
        self.sc = scenario
        self.automatic_optimization = False
        features, width = int(np.prod(arrays.input_shape)), scenario.model.width
        self.G = nn.Sequential(nn.Linear(GAN_NOISE, width), nn.ReLU(), nn.Linear(width, features))
        self.D = nn.Sequential(
            nn.Flatten(), nn.Linear(features, width), nn.LeakyReLU(0.2), nn.Linear(width, 1)
        )
        self.val_losses: list[list[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        real, fake_label = torch.ones(len(x), 1), torch.zeros(len(x), 1)
        fake = self.G(torch.randn(len(x), GAN_NOISE))
        d_loss = bce(self.D(x), real) + bce(self.D(fake.detach()), fake_label)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.D(fake), real)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log("train_loss", g_loss, batch_size=len(x))  # EarlyStopping monitors it
        return g_loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.sc.train.lr
        return [
            torch.optim.Adam(self.G.parameters(), lr, betas=(0.5, 0.999)),
            torch.optim.Adam(self.D.parameters(), lr, betas=(0.5, 0.999)),
        ]


#: The generator's noise features (``ModelSpec.arch == "gan"``).
GAN_NOISE = 8

_BATCH_FAULTS = ("nan_input", "scale_inputs", "corrupt_labels")


def _corrupt(
    kind: str, params: Mapping[str, Any], x: torch.Tensor, y: torch.Tensor, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "nan_input":
        x = x.clone()
        x.view(-1)[0] = math.nan
    elif kind == "scale_inputs":
        x = x * params["factor"]
    elif kind == "corrupt_labels":
        y = (y + 1) % classes
    return x, y


#: Losses of one-hot targets, as float (see ``TrainSpec.loss``): multi-label ones, and
#: class probabilities fed to ``cross_entropy``.
MULTI_LABEL = ("bce_with_logits", "bce", "sigmoid_in_step", "one_hot", "softmax_in_step_one_hot")


def _targets(sc: Scenario, arrays: Arrays, y: np.ndarray | None = None) -> np.ndarray:
    """The targets the loss is fed: the labels, one-hot as float for a multi-label loss,
    or repeated at every step of a sequence whose every step is scored (``(N, T)``)."""
    y = arrays.y if y is None else y
    if sc.train.loss in MULTI_LABEL:
        return np.eye(arrays.classes, dtype=np.float32)[y]
    if sc.model.output.startswith("steps"):
        return np.repeat(y[:, None], arrays.input_shape[0], axis=1)
    return y


def make_loader(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int,
    *,
    order: str = "shuffled",
    stuck_from: int = -1,
) -> DataLoader:
    """Whole batches by one fancy index: no per-sample collation.

    Args:
        order: ``"shuffled"`` (a new order every epoch), ``"fixed"`` (one random order
            every epoch) or ``"sequential"`` (the stored order).
        stuck_from: From this batch on (counted over epochs), the loader serves that
            batch again and again (a ``stuck_batch`` fault); -1: never.
    """
    ds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    if order == "shuffled":
        sampler: Sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
    elif order == "fixed":
        sampler = _FixedOrder(len(ds), seed)
    else:
        sampler = SequentialSampler(ds)
    batches: Sampler = BatchSampler(sampler, batch_size, drop_last=False)
    if stuck_from >= 0:
        batches = _StuckFrom(batches, stuck_from)
    return DataLoader(ds, batch_size=None, sampler=batches)


class _FixedOrder(Sampler):
    """One random order, drawn from ``seed`` at every epoch's start: a DistributedSampler
    whose ``set_epoch`` is never called."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        return iter(torch.randperm(self.n, generator=g).tolist())


class _StuckFrom(Sampler):
    """The batches of ``batches`` until ``onset`` of them were served (over epochs), then
    the one at ``onset`` again and again: a loader that caches a batch."""

    def __init__(self, batches: BatchSampler, onset: int) -> None:
        self.batches, self.onset, self.served = batches, onset, 0
        self.stuck: list[int] | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for indices in self.batches:
            if self.served == self.onset:
                self.stuck = indices
            self.served += 1
            yield self.stuck if self.stuck is not None else indices


# -- watchers ---------------------------------------------------------------------------


class WatchedStethoscope(LightningStethoscope):
    """``LightningStethoscope(sinks=[CapturingSink()], stop_on=None, **kwargs)`` for one setting.

    It differs from the public class only in its ``state_key`` (several can share a
    Trainer) and in counting, per probe, the steps on which its sampler asked for it
    (through the public ``Monitor.plan``, a pure function of the step).
    """

    def __init__(self, setting: str, **kwargs: Any) -> None:
        self.sink = CapturingSink()
        super().__init__(sinks=[self.sink], stop_on=None, **kwargs)
        self.setting = setting
        self.probe_counts: dict[str, int] = {}

    @property
    def state_key(self) -> str:
        return f"LightningStethoscope[{self.setting}]"

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        counts = self.probe_counts
        for probe in self.monitor.plan(trainer.global_step):
            counts[probe] = counts.get(probe, 0) + 1


class _Stops:
    """Records the first step at which a baseline stops (or would stop) training."""

    key = ""

    def _init_stops(self) -> None:
        self.first: dict[str, Any] | None = None
        self.step = -1

    def _mark(self, trainer: L.Trainer) -> None:
        self.step = trainer.global_step

    def _stopped(self, reason: str) -> None:
        if self.first is None:
            self.first = {"step": self.step, "reason": reason}


class EarlyStoppingWatch(_Stops, EarlyStopping):
    """``EarlyStopping(monitor="train_loss", check_finite=True)``, stopping recorded and undone."""

    key = "early_stopping"

    def __init__(self) -> None:
        super().__init__(monitor="train_loss", check_finite=True)
        self._init_stops()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def _watch(self, trainer: L.Trainer, check: Any) -> None:
        before = trainer.should_stop
        check()
        if trainer.should_stop and not before:
            value = trainer.callback_metrics.get(self.monitor)
            finite = value is None or bool(torch.isfinite(torch.as_tensor(value)))
            self._stopped("no improvement" if finite else "non-finite")
            trainer.should_stop = False  # observe only: the run goes on

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._watch(
            trainer, lambda: super(EarlyStoppingWatch, self).on_train_epoch_end(trainer, pl_module)
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._watch(
            trainer, lambda: super(EarlyStoppingWatch, self).on_validation_end(trainer, pl_module)
        )


if SpikeDetection is not None:

    class SpikeDetectionWatch(_Stops, SpikeDetection):  # type: ignore[misc,valid-type]
        """Lightning's ``SpikeDetection()`` with defaults; its exception recorded, not raised."""

        key = "spike_detection"

        def __init__(self, exclude_batches_path: str) -> None:
            super().__init__(exclude_batches_path=exclude_batches_path)
            self._init_stops()

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            self._mark(trainer)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            try:
                super().on_train_batch_end(trainer, *args, **kwargs)
            except TrainingSpikeException:
                self._stopped("spike")


class NanCheck(_Stops, Callback):
    """The check people write: ``if not torch.isfinite(loss): trainer.should_stop = True``."""

    key = "nan_check"

    def __init__(self) -> None:
        self._init_stops()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        if not torch.isfinite(loss):
            self._stopped("non-finite")  # a real one would set trainer.should_stop = True


def baseline_callbacks(tmpdir: str) -> list[Any]:
    """Fresh baseline watchers; SpikeDetection writes its skip list into ``tmpdir``."""
    cbs: list[Any] = [EarlyStoppingWatch()]
    if SpikeDetection is not None:
        cbs.append(SpikeDetectionWatch(f"{tmpdir}/skip_batches.json"))
    cbs.append(NanCheck())
    return cbs


# -- one run --------------------------------------------------------------------------------


#: The precisions a training step writes itself: ``torch.autocast`` around its forward
#: pass and loss, by dtype, under a float32 Trainer (no loss scaler).
_AUTOCAST = {"16-autocast": torch.float16, "bf16-autocast": torch.bfloat16}


def _autocast(precision: str, device: str) -> Any:
    """The training step's own ``torch.autocast`` for a scenario's precision, or nothing."""
    dtype = _AUTOCAST.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def precision_arguments(precision: str) -> dict[str, Any]:
    """The Trainer's arguments for a scenario's precision: ``"16-mixed"`` on the CPU is a
    MixedPrecision plugin with a GradScaler of its own (the Trainer would make it
    bf16-mixed there); an autocast the training step writes trains under float32."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu")
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    if precision in ("32", *_AUTOCAST):
        return {"precision": "32-true"}
    return {"precision": precision}


def run_scenario(
    sc: Scenario,
    seed: int,
    *,
    settings: Sequence[str] = ("adaptive",),
    baselines: bool = True,
) -> RunResult:
    """Train ``sc`` once with ``seed``; every watcher observes the same fit."""
    torch.manual_seed(seed)
    arrays = make_data(sc.data, seed)
    model = GanModule(sc, arrays) if sc.model.arch == "gan" else SuiteModule(sc, arrays)
    t = sc.train
    stuck = sc.onset if sc.fault is not None and sc.fault.kind == "stuck_batch" else -1
    train = make_loader(
        arrays.x,
        _targets(sc, arrays),
        t.batch_size,
        seed,
        order=sc.data.loader_order,
        stuck_from=stuck,
    )
    val = None
    if t.validate:
        if arrays.x_val is None:
            raise ValueError(f"{sc.name}: validate=True needs DataSpec.n_val > 0")
        y_val = _targets(sc, arrays, arrays.y_val)
        val = make_loader(arrays.x_val, y_val, 256, seed, order="sequential")
    watchers = [WatchedStethoscope(s, **setting_kwargs(s)) for s in settings]
    result = RunResult(scenario=sc.name, seed=seed, framework=FRAMEWORK, steps_per_epoch=len(train))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with tempfile.TemporaryDirectory(prefix="stethoscope-faults-") as tmp:
        others = baseline_callbacks(tmp) if baselines else []
        trainer = L.Trainer(
            max_steps=t.max_steps,
            max_epochs=t.max_epochs if t.max_epochs is not None else -1,
            **ON_ONE_CPU,
            gradient_clip_val=t.clip,
            accumulate_grad_batches=t.accumulate,
            **precision_arguments(t.precision),
            deterministic=True,
            default_root_dir=tmp,
            callbacks=[*watchers, *others],
        )
        t0 = time.perf_counter()
        try:
            trainer.fit(model, train, val)
        except Exception as exc:  # a crash is a result too: it counts as a miss, with its cause
            result.error = traceback.format_exception_only(type(exc), exc)[-1].strip()
        finally:
            # Trainer(deterministic=True) switches a process-wide flag: leave it as found
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        result.wall_s = time.perf_counter() - t0
    result.steps = trainer.global_step
    result.val_losses = model.val_losses
    result.onset = resolve_onset(sc, model.val_losses)
    result.findings = {
        w.setting: [f.to_dict(json_safe=True) for f in w.sink.findings] for w in watchers
    }
    result.probe_counts = {w.setting: dict(sorted(w.probe_counts.items())) for w in watchers}
    result.baselines = {cb.key: cb.first for cb in others}
    return result
