"""The TrainCheck bugs of one process, each rebuilt in Lightning from its mechanism.

Each ``build_<bug>(buggy)`` returns ``(module, train loader, validation loader or None,
Trainer arguments)``; ``buggy=False`` is the healthy twin, the same code with the fix.
The models are small and the data synthetic (or scikit-learn's bundled digits), so
each fit takes a second or two on one core.
"""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

__all__ = ["BUILDERS"]

FEATURES, CLASSES = 20, 4

Built = tuple[L.LightningModule, DataLoader, DataLoader | None, dict[str, Any]]


def _gaussian(n: int, *, seed: int) -> TensorDataset:
    """Standardised Gaussian features labelled by a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1))


def _loader(data: Dataset, *, shuffle: bool = True, **kw: Any) -> DataLoader:
    return DataLoader(
        data, batch_size=32, shuffle=shuffle, generator=torch.Generator().manual_seed(1), **kw
    )


def _digits() -> TensorDataset:
    """scikit-learn's 8x8 digits as 1x8x8 images scaled to [0, 1] (the report's MNIST)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(x, torch.tensor(digits.target))


class _Classifier(L.LightningModule):
    """Cross-entropy on ``self.net``, Adam; a validation loss where there is validation."""

    lr = 1e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )


# -- pytorch-115607 ----------------------------------------------------------------------
class TracedAdam(torch.optim.Adam):
    """Adam whose ``step`` behaves as ``torch._dynamo``'s trace of it did in PyTorch 2.2
    (pytorch issue 115607): traced once on a step where every gradient was None (a no-op,
    as eager Adam skips such parameters), the trace is replayed on every later step
    without a guard on the gradients, so from then on the step updates nothing."""

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.traced_noop = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.traced_noop:
            if closure is not None:
                with torch.enable_grad():
                    closure()
            return None
        if all(p.grad is None for g in self.param_groups for p in g["params"]):
            self.traced_noop = True
        return super().step(closure)


class StaleOptimizer(_Classifier):
    """The report's loop, by hand: ``zero_grad(set_to_none=True)``, a batch skipped (no
    loss, no backward) at :attr:`SKIP`, ``optimizer.step()`` every step. The fix (the
    report's first): step only where a gradient exists."""

    SKIP = 4  # the report's i != 1 (or 3): a batch without a loss

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.buggy, self.net, self.batches = buggy, _mlp(), 0
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        if self.batches != self.SKIP:
            self.manual_backward(self.loss(batch))
        self.batches += 1
        if self.buggy or any(p.grad is not None for p in self.parameters()):
            opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return TracedAdam(self.parameters(), lr=self.lr)


def build_pytorch_115607(buggy: bool) -> Built:
    return StaleOptimizer(buggy), _loader(_gaussian(1024, seed=0)), None, {"max_steps": 48}


# -- stackoverflow-60335387 --------------------------------------------------------------
class NoZeroGrad(_Classifier):
    """The report's MNIST CNN (two convolutions, two dense layers) at Adam 1e-4, its loop
    by hand, with ``optimizer.zero_grad()`` missing. The fix: zero the gradients first."""

    lr = 1e-4

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.buggy = buggy
        self.automatic_optimization = False
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        if not self.buggy:
            opt.zero_grad()  # the line the report's loop was missing
        self.manual_backward(self.loss(batch))
        opt.step()


def build_stackoverflow_60335387(buggy: bool) -> Built:
    return NoZeroGrad(buggy), _loader(_digits()), None, {"max_steps": 48}


# -- stackoverflow-67180955 --------------------------------------------------------------
class DrawnOnTheFly(Dataset):
    """Samples drawn when asked for from a numpy generator the dataset holds (the report's
    ``np.random.randint`` in ``__getitem__``). Every loader worker starts from a copy of
    the dataset as it was, generator and all; since PyTorch 1.9 (its PR 56488) torch
    reseeds each worker's global NumPy generator, but not one a dataset holds."""

    def __init__(self, n: int = 512) -> None:
        self.n = n
        self.rng = np.random.RandomState(0)
        self.teacher = np.random.RandomState(1).standard_normal((FEATURES, CLASSES))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.rng.standard_normal(FEATURES).astype(np.float32)
        return torch.from_numpy(x), int((x @ self.teacher).argmax())


def reseed_worker(worker_id: int) -> None:
    """The fix: each worker reseeds the dataset's generator from its own seed."""
    info = get_worker_info()
    info.dataset.rng = np.random.RandomState(info.seed % 2**32)


class Drawn(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _mlp()


def build_stackoverflow_67180955(buggy: bool) -> Built:
    data = DataLoader(
        DrawnOnTheFly(),
        batch_size=32,
        num_workers=2,
        worker_init_fn=None if buggy else reseed_worker,
    )
    return Drawn(), data, None, {"max_steps": 8}


# -- pytorch-forum-84911 -----------------------------------------------------------------
class Transfer(_Classifier):
    """A "pretrained" backbone (convolutions with batch norm) and a new head ``fc``; the
    report's code: the optimizer over ``fc`` alone, every backbone parameter not under
    ``bn`` frozen, and then ``fc`` frozen too (``requires_grad = False``), so nothing
    trains. The fix: ``fc`` left trainable, and the optimizer built over what requires
    grad (the report's own fix leaves its trainable bn weights out of the optimizer)."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.buggy = buggy
        self.backbone = nn.Sequential()
        self.backbone.add_module("conv1", nn.Conv2d(1, 16, 3, padding=1))
        self.backbone.add_module("bn1", nn.BatchNorm2d(16))
        self.backbone.add_module("relu1", nn.ReLU())
        self.backbone.add_module("conv2", nn.Conv2d(16, 16, 3, padding=1))
        self.backbone.add_module("bn2", nn.BatchNorm2d(16))
        self.backbone.add_module("relu2", nn.ReLU())
        self.backbone.add_module("pool", nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, 10)  # the new head
        for name, p in self.backbone.named_parameters():
            if "bn" not in name:
                p.requires_grad = False
        for p in self.fc.parameters():
            p.requires_grad = not buggy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone(x).flatten(1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.buggy:
            return torch.optim.Adam(self.fc.parameters(), lr=self.lr)
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def build_pytorch_forum_84911(buggy: bool) -> Built:
    return Transfer(buggy), _loader(_digits()), None, {"max_steps": 32}


# -- transformers-33844 ------------------------------------------------------------------
class FlashStyleAttention(nn.Module):
    """Self-attention written as M2M100FlashAttention2 was: the dropout probability passed
    to the attention kernel whatever the mode. The fix (transformers PR 33844): ``0.0``
    unless training."""

    def __init__(self, width: int, heads: int, dropout: float, *, buggy: bool) -> None:
        super().__init__()
        self.heads, self.dropout, self.buggy = heads, dropout, buggy
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, w = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, w // self.heads).unbind(2)
        p = self.dropout if self.buggy or self.training else 0.0
        h = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p
        )
        return self.out(h.transpose(1, 2).reshape(n, t, w))


class Encoder(_Classifier):
    """A one-layer transformer encoder over sequences, pooled into 4 classes."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 32)
        self.attention = FlashStyleAttention(32, 4, 0.1, buggy=buggy)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.norm(h + self.attention(h))
        return self.head(h.mean(1))


def _sequences(n: int, *, seed: int) -> TensorDataset:
    """4 classes of 16-step sequences of 8 channels: a class template plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, 16, 8, generator=torch.Generator().manual_seed(99))
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(0.7 * templates[y] + torch.randn(n, 16, 8, generator=g), y)


def build_transformers_33844(buggy: bool) -> Built:
    train, val = _loader(_sequences(512, seed=0)), _loader(_sequences(128, seed=1), shuffle=False)
    return Encoder(buggy), train, val, {"max_steps": 16, "val_check_interval": 8}


# -- pytorch-51800 -----------------------------------------------------------------------
class SpectralNet(_Classifier):
    """The report's model: dense layers initialised orthogonally, two of them under
    ``torch.nn.utils.spectral_norm``, PReLU between, evaluated before training to judge
    its initialisation (``trainer.validate()`` before ``fit``); spectral norm's power
    iteration runs only in training-mode forwards. The fix (the report's): one
    training-mode forward before evaluating."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.buggy = buggy
        layers: list[nn.Module] = []
        width = FEATURES
        for _ in range(2):
            fc = nn.Linear(width, 64)
            nn.init.zeros_(fc.bias)
            nn.init.orthogonal_(fc.weight)
            layers += [nn.utils.spectral_norm(fc), nn.PReLU(64)]
            width = 64
        out = nn.Linear(width, CLASSES)
        nn.init.zeros_(out.bias)
        nn.init.orthogonal_(out.weight)
        self.net = nn.Sequential(*layers, out)
        if not buggy:  # the report's fix: a dummy forward in training mode first
            self.train()
            with torch.no_grad():
                self(torch.zeros(1, FEATURES))


def build_pytorch_51800(buggy: bool) -> Built:
    train, val = _loader(_gaussian(512, seed=0)), _loader(_gaussian(128, seed=1), shuffle=False)
    kw = {"max_steps": 16, "val_check_interval": 8, "validate_first": True}
    return SpectralNet(buggy), train, val, kw


# -- mmpretrain-702 ----------------------------------------------------------------------
class VGG(nn.Module):
    """mmpretrain's VGG backbone in small: stages of conv-bn-relu, the first
    ``frozen_stages`` of them frozen by ``_freeze_stages``, which its ``train()`` override
    calls (mmpretrain's runner calls ``model.train()`` every epoch; Lightning never does).
    The fix: freeze in ``__init__`` too, as mmpretrain's ResNet does."""

    def __init__(self, frozen_stages: int, *, freeze_in_init: bool) -> None:
        super().__init__()
        self.frozen_stages = frozen_stages
        widths = [1, 16, 16, 32]
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU())
            for a, b in itertools.pairwise(widths)
        )
        if freeze_in_init:
            self._freeze_stages()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x

    def _freeze_stages(self) -> None:
        for stage in self.stages[: self.frozen_stages]:
            stage.eval()
            for p in stage.parameters():
                p.requires_grad = False

    def train(self, mode: bool = True) -> VGG:
        super().train(mode)
        self._freeze_stages()
        return self


class Finetune(_Classifier):
    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = VGG(frozen_stages=1, freeze_in_init=not buggy)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean((2, 3)))


def build_mmpretrain_702(buggy: bool) -> Built:
    return Finetune(buggy), _loader(_digits()), None, {"max_steps": 24}


#: bug -> its builder
BUILDERS = {
    "pytorch-115607": build_pytorch_115607,
    "stackoverflow-60335387": build_stackoverflow_60335387,
    "stackoverflow-67180955": build_stackoverflow_67180955,
    "pytorch-forum-84911": build_pytorch_forum_84911,
    "transformers-33844": build_transformers_33844,
    "pytorch-51800": build_pytorch_51800,
    "mmpretrain-702": build_mmpretrain_702,
}
