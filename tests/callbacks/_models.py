"""Tiny real Lightning models with injectable faults, shared by the callback tests."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink

FEATURES, CLASSES = 20, 4


def dataset(
    n: int = 512,
    *,
    seed: int = 0,
    label_noise: float = 0.0,
    scale: float = 1.0,
    majority: float = 0.0,
) -> TensorDataset:
    """Standardised Gaussian features (values past ±1 everywhere), a linear teacher.

    ``scale`` multiplies the inputs (unnormalised data); ``majority`` relabels that
    fraction of the samples as class 0 (imbalanced labels).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher).argmax(1)
    if label_noise:
        flip = torch.rand(n, generator=g) < label_noise
        y[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    if majority:
        y[torch.rand(n, generator=g) < majority] = 0
    return TensorDataset(x * scale, y)


def loader(batch_size: int = 32, **kw: Any) -> DataLoader:
    return DataLoader(
        dataset(**kw),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )


class TinyMLP(L.LightningModule):
    """20-32-32-4 MLP. ``fault`` and ``onset`` inject a problem at a global step."""

    def __init__(
        self,
        *,
        fault: str = "none",
        onset: int = 40,
        lr: float = 1e-2,
        optimizer: str = "adam",
        warmup_steps: int = 0,
        depth: int = 2,
        activation: str = "relu",
        init_scale: float = 1.0,
        init: str = "default",
        exclude: str | None = None,
        zero_lr: str | None = None,
        frozen: str | None = None,
        schedule: str | None = None,
        max_steps: int = 0,
        norm: bool = False,
    ) -> None:
        """Args beyond the fault: ``init`` ``"normal"`` draws every weight from N(0, 1),
        ``"zero_hidden"`` zeroes ``net.2.weight``; ``exclude`` leaves the parameters under
        that prefix out of the optimizer, ``zero_lr`` puts them in a group with LR 0,
        ``frozen`` sets their ``requires_grad=False``; ``schedule="cosine"`` anneals the
        LR to 0 over ``max_steps``; ``norm`` adds BatchNorm and dropout after each layer."""
        super().__init__()
        self.fault, self.onset, self.lr = fault, onset, lr
        self.optimizer_name, self.warmup_steps = optimizer, warmup_steps
        self.exclude, self.zero_lr, self.schedule, self.max_steps = (
            exclude,
            zero_lr,
            schedule,
            max_steps,
        )
        act = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[activation]
        layers: list[nn.Module] = []
        width = FEATURES
        for _ in range(depth):
            layers += [nn.Linear(width, 32), act()]
            if norm:
                layers += [nn.BatchNorm1d(32), nn.Dropout(0.2)]
            width = 32
        self.net = nn.Sequential(*layers, nn.Linear(width, CLASSES))
        if init_scale != 1.0:
            with torch.no_grad():
                for m in self.net:
                    if isinstance(m, nn.Linear):
                        m.weight.mul_(init_scale)
        with torch.no_grad():
            if init == "normal":
                for m in self.net:
                    if isinstance(m, nn.Linear):
                        m.weight.normal_(0.0, 1.0)
            elif init == "zero_hidden":
                self.net[2].weight.zero_()
                self.net[2].bias.zero_()
        if frozen:
            for name, p in self.named_parameters():
                if name.startswith(frozen):
                    p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def active(self) -> bool:
        return self.global_step >= self.onset

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        at_onset = self.global_step == self.onset
        if self.fault == "nan_input" and at_onset:
            x = x.clone()
            x[0, 0] = math.nan
        if self.fault == "spike" and at_onset:
            y = (y + 1) % CLASSES  # a corrupt batch: every label wrong
        loss = nn.functional.cross_entropy(self(x), y)
        if self.fault == "nan_grad" and self.active():
            # finite in the forward pass, NaN in the backward pass (d sqrt(|w|)/dw at 0)
            loss = loss + (self.net[2].weight * 0).abs().sqrt().sum()
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.fault == "nan_weight" and self.global_step == self.onset:
            with torch.no_grad():  # an optimizer that writes a NaN into the weights
                self.net[0].weight[0, 0] = math.nan

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.fault == "lr_jump" and self.global_step == self.onset:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = self.lr * 100
        if self.fault == "dead_bias" and self.global_step == self.onset:
            with torch.no_grad():  # every hidden ReLU now outputs 0 for every input
                for m in list(self.net)[:-1]:
                    if isinstance(m, nn.Linear):
                        m.bias.fill_(-100.0)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = [
            (n, p)
            for n, p in self.named_parameters()
            if p.requires_grad and not (self.exclude and n.startswith(self.exclude))
        ]
        off = [p for n, p in params if self.zero_lr and n.startswith(self.zero_lr)]
        on = [p for n, p in params if not (self.zero_lr and n.startswith(self.zero_lr))]
        groups: list[dict[str, Any]] = [{"params": on}] + (
            [{"params": off, "lr": 0.0}] if off else []
        )
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(groups, lr=self.lr)
        if self.schedule == "cosine":
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.max_steps, eta_min=0.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": cos, "interval": "step"}}
        if not self.warmup_steps:
            return opt
        ramp = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, s / self.warmup_steps)
        )  # warm-up from exactly 0
        return {"optimizer": opt, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}


def fit(
    model: L.LightningModule,
    *,
    steps: int,
    batch_size: int = 32,
    data: DataLoader | None = None,
    callback: LightningStethoscope | None = None,
    sink: CapturingSink | None = None,  # used only when ``callback`` is None
    ckpt_path: Any = None,
    **trainer_kw: Any,
) -> tuple[L.Trainer, CapturingSink | None]:
    """Train ``model`` for at most ``steps`` steps with a capturing stethoscope.

    Returns the trainer and the CapturingSink that the stethoscope actually writes to.
    """
    if callback is not None:
        own = [s for s in callback.monitor.sinks if isinstance(s, CapturingSink)]
        sink = own[0] if own else None  # never hand back a sink nobody writes to
    else:
        sink = sink if sink is not None else CapturingSink()
        callback = LightningStethoscope(sinks=[sink])
    defaults: dict[str, Any] = dict(
        max_steps=steps,
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(trainer_kw)
    extra = defaults.pop("callbacks", [])
    trainer = L.Trainer(callbacks=[callback, *extra], **defaults)
    trainer.fit(model, data if data is not None else loader(batch_size), ckpt_path=ckpt_path)
    return trainer, sink


def problems(sink: CapturingSink) -> list:
    """Findings of warning severity or worse."""
    return sink.at_least("warning")
