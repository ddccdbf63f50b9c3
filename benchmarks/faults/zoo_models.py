"""The zoo's workloads: small rebuilds of the ``pytorch/examples`` programs in Lightning.

Each workload keeps its example's model family, loss, optimizer and hyper-parameters
(the sizes shrink to fit a few CPU seconds, and the data is synthetic or scikit-learn's
bundled digits); where it departs from the example, the builder says so. Each
``LightningModule`` keeps ``trace``, the metric the example prints (its loss, an
episode's reward, a GAN's distance to the data), one number per training step, from
which ``zoo.py`` reads whether the run trained. None of them is a variation of the
fault suite's MLP: they are the healthy controls that Cockpit and TrainCheck measured
their detectors on, from as many model families as there are examples.

The workloads, by name (``WORKLOADS``), and the example each rebuilds:

* ``dcgan``: ``dcgan/main.py``, 16x16 Gaussian blobs; two optimizers, manual optimization.
* ``vae``: ``vae/main.py`` on digits in [0, 1]; ``randn_like`` in validation too.
* ``gcn``: ``gcn/main.py`` on a stochastic block model; sparse features and adjacency.
* ``gat``: ``gat/main.py`` on a stochastic block model; dense adjacency mask.
* ``word_lm``: ``word_language_model`` (tied 2-layer LSTM, SGD lr 20, clip 0.25, BPTT 35).
* ``time_series``: ``time_sequence_prediction`` (LSTMCells, float64, LBFGS lr 0.8).
* ``siamese``: ``siamese_network`` on digit pairs (a small ResNet for its resnet18).
* ``reinforce`` and ``actor_critic``: ``reinforcement_learning`` on a CartPole written here.
* ``forward_forward``: ``mnist_forward_forward``, layer by layer, one Adam per layer.
* ``regression``: ``regression/main.py``, a Linear on x, x^2, x^3, x^4.
* ``resnet``: the ``imagenet`` example's recipe (BasicBlocks, SGD momentum) on 8x8 digits.
* ``mnist_cnn`` and ``mnist_cnn_bf16``: ``mnist/main.py`` (Adadelta, StepLR 0.7), the second
  under ``precision="bf16-mixed"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

__all__ = ["WORKLOADS", "Built", "Workload"]


@dataclass(frozen=True)
class Built:
    """One fit's parts: the module, its loaders and the Trainer's own arguments."""

    module: L.LightningModule
    train: DataLoader
    val: DataLoader | None = None
    trainer: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    """A healthy training program of one model family.

    Args:
        name: Its name on the command line and in the table.
        example: The ``pytorch/examples`` program it rebuilds.
        metric: What ``trace`` holds, in a few words.
        higher_is_better: Whether training should raise the metric (a reward) or lower it.
        steps: Its length in the benchmark, in the unit ``build`` takes (batches, epochs
            of a full-batch graph, episodes, LBFGS steps, forward-forward iterations).
        test_steps: Its length in the smoke test.
        build: ``(seed, steps) -> Built``; called after the seed is set.
    """

    name: str
    example: str
    metric: str
    higher_is_better: bool
    steps: int
    test_steps: int
    build: Callable[[int, int], Built]


class _Traced(L.LightningModule):
    """A module that keeps one number per training step in ``trace``."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[float] = []

    def record(self, value: torch.Tensor | float) -> None:
        """Keep ``value`` (a CPU read: both the watched and the plain fit pay it)."""
        self.trace.append(float(value))


class _Repeat(Dataset):
    """The same full batch ``n`` times: full-batch training with ``batch_size=None``."""

    def __init__(self, batch: tuple[Any, ...], n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self.batch


# -- digits -----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits in [0, 1] as (N, 1, 8, 8), split 80/20 by ``seed``."""
    x, y = _digits_raw()
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    tr, va = order[:cut], order[cut:]
    xt = torch.from_numpy(x).view(-1, 1, 8, 8)
    yt = torch.from_numpy(y)
    return xt[tr], yt[tr], xt[va], yt[va]


def _loader(*tensors: torch.Tensor, batch: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch, shuffle=shuffle)


def _epochs(steps: int, n: int, batch: int) -> dict[str, Any]:
    """Trainer arguments for ``steps`` batches of a dataset of ``n`` (validation each epoch)."""
    return {"max_steps": steps, "max_epochs": math.ceil(steps / math.ceil(n / batch))}


# -- DCGAN ------------------------------------------------------------------------------

NZ, NGF, NDF = 100, 16, 16  # the example's nz; its 64 feature maps shrink with the image


def _weights_init(m: nn.Module) -> None:
    """The example's init: N(0, 0.02) convolutions, N(1, 0.02) batch-norm scales."""
    name = type(m).__name__
    if name.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif name.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 4, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(NGF * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, 1, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class _Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, NDF, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)


class DCGAN(_Traced):
    """``dcgan/main.py``'s loop: D on real then fake (two backwards), then G, BCE, Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.G, self.D = _Generator(), _Discriminator()
        self.G.apply(_weights_init)
        self.D.apply(_weights_init)
        self.criterion = nn.BCELoss()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt_d, opt_g = self.optimizers()
        real = batch[0]
        b = real.size(0)
        # (1) maximise log(D(x)) + log(1 - D(G(z)))
        opt_d.zero_grad()
        label = torch.full((b,), 1.0, device=self.device)
        err_real = self.criterion(self.D(real), label)
        self.manual_backward(err_real)
        fake = self.G(torch.randn(b, NZ, 1, 1, device=self.device))
        label.fill_(0.0)
        err_fake = self.criterion(self.D(fake.detach()), label)
        self.manual_backward(err_fake)
        opt_d.step()
        # (2) maximise log(D(G(z)))
        opt_g.zero_grad()
        label.fill_(1.0)
        err_g = self.criterion(self.D(fake), label)
        self.manual_backward(err_g)
        opt_g.step()
        self.log_dict({"loss_d": err_real + err_fake, "loss_g": err_g})
        with torch.no_grad():  # how far the fakes' pixel moments are from the data's
            f, r = fake.detach().flatten(1), real.flatten(1)
            gap = (f.mean(0) - r.mean(0)).norm() + (f.std(0) - r.std(0)).norm()
        self.record(gap / math.sqrt(f.size(1)))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.D.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        ]


def _blobs(n: int, seed: int) -> torch.Tensor:
    """16x16 Gaussian blobs at random places and widths, in [-1, 1] as the Tanh outputs."""
    rng = np.random.default_rng(seed)
    grid = np.arange(16)[None, :, None]
    cx, cy = rng.uniform(4, 12, (2, n, 1, 1))
    s = rng.uniform(1.5, 3.0, (n, 1, 1))
    img = np.exp(-((grid - cy) ** 2 + (grid.transpose(0, 2, 1) - cx) ** 2) / (2 * s**2))
    return torch.from_numpy(2 * img - 1).float().unsqueeze(1)


def _build_dcgan(seed: int, steps: int) -> Built:
    data = _blobs(2048, seed)
    # global_step counts both optimizers' steps: two per batch
    trainer = {"max_steps": 2 * steps, "max_epochs": math.ceil(steps / 32)}
    return Built(DCGAN(), _loader(data, batch=64), trainer=trainer)


# -- VAE --------------------------------------------------------------------------------


class VAE(_Traced):
    """``vae/main.py``: 784-400-20 MLP (here 64-400-20), BCE + KLD summed, Adam 1e-3."""

    def __init__(self, features: int = 64) -> None:
        super().__init__()
        self.features = features
        self.fc1 = nn.Linear(features, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x.view(-1, self.features)))
        mu, logvar = self.fc21(h1), self.fc22(h1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)  # in validation too, as there
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        recon, mu, logvar = self(x)
        bce = F.binary_cross_entropy(recon, x.view(-1, self.features), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return bce + kld

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.log("train_loss", loss)
        self.record(loss.detach() / len(batch[0]))  # the example prints it per sample
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _build_vae(seed: int, steps: int) -> Built:
    xt, yt, xv, yv = _digits(seed)
    return Built(
        VAE(),
        _loader(xt, yt, batch=128),
        _loader(xv, yv, batch=128, shuffle=False),
        trainer=_epochs(steps, len(xt), 128),
    )


# -- graphs -----------------------------------------------------------------------------


def _block_model(
    seed: int, nodes: int, classes: int, words: int, degree: float = 5.0, homophily: float = 0.8
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stochastic block model with bag-of-words features: (edges (2, E), features, labels).

    Each class has a topic of words; a node holds ~18 words, half from its topic. Its
    edges fall within its class with probability ``homophily``.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, nodes)
    same = labels[:, None] == labels[None, :]
    p_in = degree * homophily / (nodes / classes)
    p_out = degree * (1 - homophily) / (nodes - nodes / classes)
    upper = np.triu(rng.random((nodes, nodes)) < np.where(same, p_in, p_out), 1)
    edges = np.argwhere(upper | upper.T).T
    topics = rng.permutation(words)[: (words // classes) * classes].reshape(classes, -1)
    feats = np.zeros((nodes, words), np.float32)
    for i, c in enumerate(labels):
        feats[i, rng.choice(topics[c], 9)] = 1.0
        feats[i, rng.integers(0, words, 9)] = 1.0
    feats /= feats.sum(1, keepdims=True)  # row-normalised, as the examples' load_cora
    return edges, feats, labels


def _split_nodes(nodes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples' random split: the first 30% for the test, then 20% val, the rest train."""
    idx = torch.from_numpy(np.random.default_rng(seed + 1).permutation(nodes))
    test, val = int(0.3 * nodes), int(0.5 * nodes)
    return idx[val:], idx[test:val]


class _GraphConv(nn.Module):
    """``gcn/main.py``'s layer: ``spmm(adj, input @ kernel)``, no bias by default."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(d_in, d_out))
        nn.init.xavier_normal_(self.kernel)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.spmm(adj, torch.mm(x, self.kernel))


class GCN(_Traced):
    """Two graph convolutions (hidden 16), ReLU, dropout 0.5, log-softmax, NLL on a mask."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.gc1, self.gc2 = _GraphConv(features, 16), _GraphConv(16, classes)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.relu(self.gc1(x, adj)))
        return F.log_softmax(self.gc2(h, adj), dim=1)

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, adj, labels, idx = batch
        return F.nll_loss(self(x, adj)[idx], labels[idx])

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=5e-4)


def _build_gcn(seed: int, steps: int) -> Built:
    nodes = 1000
    edges, feats, labels = _block_model(seed, nodes, classes=7, words=500)
    a = np.zeros((nodes, nodes), np.float32)
    a[edges[0], edges[1]] = 1.0
    a += np.eye(nodes, dtype=np.float32)  # self-loops, then D^-1/2 (A + I) D^-1/2
    d = 1.0 / np.sqrt(a.sum(1))
    adj = torch.from_numpy(d[:, None] * a * d[None, :]).to_sparse()
    x = torch.from_numpy(feats).to_sparse()
    y = torch.from_numpy(labels)
    train, val = _split_nodes(nodes, seed)
    return Built(
        GCN(feats.shape[1], 7),
        DataLoader(_Repeat((x, adj, y, train), 1), batch_size=None),
        DataLoader(_Repeat((x, adj, y, val), 1), batch_size=None),
        trainer={"max_epochs": steps},
    )


class _GraphAttention(nn.Module):
    """``gat/main.py``'s layer: shared W, additive attention per head, masked softmax."""

    def __init__(self, d_in: int, d_out: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.hidden, self.dropout = heads, d_out, dropout
        self.W = nn.Parameter(torch.empty(d_in, d_out * heads))
        self.a = nn.Parameter(torch.empty(heads, 2 * d_out, 1))
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)
        self.leakyrelu = nn.LeakyReLU(0.2)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        wh = F.dropout(torch.mm(h, self.W), self.dropout, training=self.training)
        wh = wh.view(n, self.heads, self.hidden).permute(1, 0, 2)
        e = (
            torch.matmul(wh, self.a[:, : self.hidden])
            + torch.matmul(wh, self.a[:, self.hidden :]).mT
        )
        e = torch.where(adj > 0, self.leakyrelu(e), -9e16 * torch.ones_like(e))
        attention = F.dropout(F.softmax(e, dim=-1), self.dropout, training=self.training)
        return torch.matmul(attention, wh).mean(dim=0)  # heads averaged (concat=False)


class GAT(_Traced):
    """Two attention layers (64 hidden, 8 heads averaged; then 1 head), ELU, NLL on a mask."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.gat1 = _GraphAttention(features, 64, 8, 0.6)
        self.gat2 = _GraphAttention(64, classes, 1, 0.6)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.gat2(F.elu(self.gat1(x, adj)), adj), dim=1)

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, adj, labels, mask = batch
        return F.nll_loss(self(x, adj)[mask], labels[mask])

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.005, weight_decay=5e-4)


def _build_gat(seed: int, steps: int) -> Built:
    nodes = 400  # dense attention is (8 heads, nodes, nodes)
    edges, feats, labels = _block_model(seed, nodes, classes=5, words=300)
    adj = torch.eye(nodes)
    adj[edges[0], edges[1]] = 1.0  # dense, with self-loops, as the example's load_cora
    train, val = _split_nodes(nodes, seed)
    masks = torch.zeros(2, nodes, dtype=torch.bool)
    masks[0, train], masks[1, val] = True, True
    x, y = torch.from_numpy(feats), torch.from_numpy(labels)
    return Built(
        GAT(feats.shape[1], 5),
        DataLoader(_Repeat((x, adj, y, masks[0]), 1), batch_size=None),
        DataLoader(_Repeat((x, adj, y, masks[1]), 1), batch_size=None),
        trainer={"max_epochs": steps},
    )


# -- word language model ----------------------------------------------------------------

VOCAB, BPTT, LM_BATCH = 1000, 35, 20


def _zipf_text(tokens: int, seed: int) -> torch.Tensor:
    """Zipfian tokens with structure to learn: each token has 5 likely successors."""
    rng = np.random.default_rng(seed)
    unigram = 1.0 / np.arange(1, VOCAB + 1)
    unigram /= unigram.sum()
    successors = rng.choice(VOCAB, (VOCAB, 5), p=unigram)
    out = np.empty(tokens, np.int64)
    out[0] = 0
    follow = rng.random(tokens) < 0.6
    pick = rng.integers(0, 5, tokens)
    fresh = rng.choice(VOCAB, tokens, p=unigram)
    for i in range(1, tokens):
        out[i] = successors[out[i - 1], pick[i]] if follow[i] else fresh[i]
    return torch.from_numpy(out)


class _Bptt(Dataset):
    """``batchify`` + ``get_batch``: (BPTT, batch) windows in order, targets the next tokens."""

    def __init__(self, text: torch.Tensor, batch: int) -> None:
        n = text.size(0) // batch
        self.data = text[: n * batch].view(batch, n).t().contiguous()
        self.starts = list(range(0, n - 1, BPTT))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        seq = min(BPTT, len(self.data) - 1 - s)
        return self.data[s : s + seq], self.data[s + 1 : s + 1 + seq].reshape(-1)


class WordLM(_Traced):
    """``RNNModel('LSTM', ntoken, 200, 200, 2, dropout=0.2, tie_weights=True)``, hidden carried
    across windows and detached (truncated BPTT), NLL of log-softmax, plain SGD lr 20."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, 200)
        self.rnn = nn.LSTM(200, 200, 2, dropout=0.2)
        self.decoder = nn.Linear(200, VOCAB)
        self.decoder.weight = self.encoder.weight  # tied
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        decoded = self.decoder(self.drop(out)).view(-1, VOCAB)
        return F.log_softmax(decoded, dim=1), hidden

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        data, targets = batch
        if self.hidden is not None:  # repackage_hidden
            self.hidden = tuple(h.detach() for h in self.hidden)
        output, self.hidden = self(data, self.hidden)
        return F.nll_loss(output, targets)

    def on_train_epoch_start(self) -> None:
        self.hidden = None  # init_hidden at each epoch

    def on_validation_epoch_start(self) -> None:
        self._train_hidden, self.hidden = self.hidden, None

    def on_validation_epoch_end(self) -> None:
        self.hidden = self._train_hidden

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = self._step(batch)
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        self.log("val_loss", self._step(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=20.0)  # the example's p.add_(grad, -lr)


def _build_word_lm(seed: int, steps: int) -> Built:
    per_epoch = 50
    train = _Bptt(_zipf_text(per_epoch * BPTT * LM_BATCH + LM_BATCH, seed), LM_BATCH)
    val = _Bptt(_zipf_text(10 * BPTT * 10 + 10, seed + 1000), 10)  # eval_batch_size 10
    return Built(
        WordLM(),
        DataLoader(train, batch_size=None),
        DataLoader(val, batch_size=None),
        trainer={
            "max_steps": steps,
            "max_epochs": math.ceil(steps / len(train)),
            "gradient_clip_val": 0.25,
        },
    )


# -- time series: LSTMCells, float64, LBFGS ---------------------------------------------


class SineLSTM(_Traced):
    """``time_sequence_prediction``'s ``Sequence``: two LSTMCells (51), a Linear, MSE, LBFGS."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, x: torch.Tensor, future: int = 0) -> torch.Tensor:
        n = x.size(0)
        h1, c1, h2, c2 = (torch.zeros(n, 51, dtype=x.dtype, device=x.device) for _ in range(4))
        outputs = []
        out = x[:, :1]
        for t in range(x.size(1) + future):
            step = x[:, t : t + 1] if t < x.size(1) else out
            h1, c1 = self.lstm1(step, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            out = self.linear(h2)
            outputs.append(out)
        return torch.cat(outputs, dim=1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)  # LBFGS calls the closure, and so this, many times a step
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        x, y = batch
        future = 50  # the example predicts 1000 steps past the input; its loss is on the input
        pred = self(x, future=future)
        self.log("val_loss", F.mse_loss(pred[:, :-future], y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.8)


def _build_time_series(seed: int, steps: int) -> Built:
    T, length, n = 20, 100, 100  # the example's L = 1000 shrinks to 100 steps
    rng = np.random.default_rng(seed)
    x = np.arange(length)[None, :] + rng.integers(-4 * T, 4 * T, (n, 1))
    data = torch.from_numpy(np.sin(x / 1.0 / T))  # float64
    train = (data[3:, :-1], data[3:, 1:])
    test = (data[:3, :-1], data[:3, 1:])
    return Built(
        SineLSTM(),
        DataLoader(_Repeat(train, steps), batch_size=None),
        DataLoader(_Repeat(test, 1), batch_size=None),
        trainer={"max_epochs": 1, "precision": "64-true", "num_sanity_val_steps": 0},
    )


# -- ResNet blocks: the small ResNet and the siamese network's backbone -----------------


class _BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions with batch norm, a shortcut."""

    def __init__(self, d_in: int, d_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(d_in, d_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(d_out)
        self.conv2 = nn.Conv2d(d_out, d_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(d_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or d_in != d_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(d_in, d_out, 1, stride, bias=False), nn.BatchNorm2d(d_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


def _resnet_body() -> nn.Sequential:
    """A 3x3 stem and three stages (16, 32, 64; 8x8 -> 2x2), pooled: 64 features."""
    body = nn.Sequential(
        nn.Conv2d(1, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        _BasicBlock(16, 16),
        _BasicBlock(16, 16),
        _BasicBlock(16, 32, 2),
        _BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    for m in body.modules():  # torchvision's init
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return body


class _Classifier(_Traced):
    """Cross-entropy (or NLL of a log-softmax) classification of digits, validated per epoch."""

    def __init__(self, net: nn.Module, *, log_softmax_output: bool) -> None:
        super().__init__()
        self.net = net
        self.nll = log_softmax_output

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return F.nll_loss(out, y) if self.nll else F.cross_entropy(out, y)

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: list[torch.Tensor], i: int) -> None:
        self.log("val_loss", self._loss(batch))


class ResNet(_Classifier):
    """The ``imagenet`` example's recipe on digits: SGD lr 0.1, momentum 0.9, wd 1e-4."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(_resnet_body(), nn.Linear(64, 10)), log_softmax_output=False)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 30, 0.1)}


def _build_resnet(seed: int, steps: int) -> Built:
    mean, std = 0.1307, 0.3081  # the examples' MNIST normalisation
    xt, yt, xv, yv = _digits(seed)
    xt, xv = (xt - mean) / std, (xv - mean) / std
    return Built(
        ResNet(),
        _loader(xt, yt, batch=64),
        _loader(xv, yv, batch=256, shuffle=False),
        trainer=_epochs(steps, len(xt), 64),
    )


# -- MNIST CNN ----------------------------------------------------------------------------


class _MnistNet(nn.Module):
    """``mnist/main.py``'s ``Net``: conv 32, conv 64, max-pool, dropout .25, fc 128, dropout .5."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)  # 9216 on 28x28; 64 x 2 x 2 on 8x8
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


class MnistCNN(_Classifier):
    """Adadelta lr 1.0, StepLR(step_size=1, gamma=0.7) per epoch, NLL of log-softmax."""

    def __init__(self) -> None:
        super().__init__(_MnistNet(), log_softmax_output=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adadelta(self.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def _build_mnist(precision: str) -> Callable[[int, int], Built]:
    def build(seed: int, steps: int) -> Built:
        mean, std = 0.1307, 0.3081
        xt, yt, xv, yv = _digits(seed)
        xt, xv = (xt - mean) / std, (xv - mean) / std
        return Built(
            MnistCNN(),
            _loader(xt, yt, batch=64),
            _loader(xv, yv, batch=1000, shuffle=False),  # test_batch_size 1000
            trainer={**_epochs(steps, len(xt), 64), "precision": precision},
        )

    return build


# -- siamese network ----------------------------------------------------------------------


class Siamese(_Traced):
    """``siamese_network``: one backbone on both images, their features concatenated, a
    256-unit head, sigmoid, BCE; Adadelta lr 1.0 with StepLR 0.7 per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _resnet_body()
        self.fc = nn.Sequential(nn.Linear(64 * 2, 256), nn.ReLU(inplace=True), nn.Linear(256, 1))
        for m in self.fc:
            if isinstance(m, nn.Linear):  # the example's init_weights
                nn.init.xavier_uniform_(m.weight)
                m.bias.data.fill_(0.01)
        self.sigmoid = nn.Sigmoid()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.sigmoid(self.fc(torch.cat((self.backbone(a), self.backbone(b)), 1)))

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        a, b, target = batch
        return F.binary_cross_entropy(self(a, b).squeeze(1), target)

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.record(loss.detach())
        return loss

    def validation_step(self, batch: list[torch.Tensor], i: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adadelta(self.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def _pairs(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Each image with one of the same class (half the time) or of another: target 1 or 0."""
    rng = np.random.default_rng(seed)
    yn = y.numpy()
    by_class = [np.flatnonzero(yn == c) for c in range(10)]
    same = rng.random(len(yn)) < 0.5
    other = np.array(
        [
            rng.choice(by_class[c]) if s else rng.choice(np.flatnonzero(yn != c))
            for c, s in zip(yn, same, strict=True)
        ]
    )
    return x, x[other], torch.from_numpy(same.astype(np.float32))


def _build_siamese(seed: int, steps: int) -> Built:
    mean, std = 0.1307, 0.3081
    xt, yt, xv, yv = _digits(seed)
    xt, xv = (xt - mean) / std, (xv - mean) / std
    return Built(
        Siamese(),
        _loader(*_pairs(xt, yt, seed), batch=64),
        _loader(*_pairs(xv, yv, seed + 1), batch=256, shuffle=False),
        trainer=_epochs(steps, len(xt), 64),
    )


# -- reinforcement learning on CartPole ---------------------------------------------------


class _CartPole:
    """CartPole-v1's physics (Euler, tau 0.02): reward 1 a step, done past 2.4 m or 12 deg,
    or at 500 steps."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.state = np.zeros(4)
        self.t = 0

    def reset(self) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        self.t = 0
        return self.state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        total_mass, pole_mass_length, length = 1.1, 0.05, 0.5
        temp = (force + pole_mass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (9.8 * sin - cos * temp) / (length * (4.0 / 3.0 - 0.1 * cos**2 / total_mass))
        x_acc = temp - pole_mass_length * theta_acc * cos / total_mass
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * x_acc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.t += 1
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360 or self.t >= 500
        return self.state.astype(np.float32), 1.0, done


GAMMA = 0.99
EPS = float(np.finfo(np.float32).eps)


def _returns(rewards: list[float]) -> torch.Tensor:
    """Discounted returns, standardised as the examples do."""
    out, r = [], 0.0
    for reward in reversed(rewards):
        r = reward + GAMMA * r
        out.insert(0, r)
    t = torch.tensor(out)
    return (t - t.mean()) / (t.std() + EPS) if len(t) > 1 else t - t.mean()


class _Policy(nn.Module):
    """``reinforce.py``'s policy: 4-128, dropout 0.6, ReLU, 128-2, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


class Reinforce(_Traced):
    """One episode per training step, played inside ``training_step`` with the graph kept;
    loss ``sum(-log_prob * R)``; manual optimization, Adam lr 1e-2."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = _Policy()
        self.env = _CartPole(seed)

    def training_step(self, batch: torch.Tensor, i: int) -> None:
        opt = self.optimizers()
        state, log_probs, rewards, done = self.env.reset(), [], [], False
        while not done:
            probs = self.policy(torch.from_numpy(state).unsqueeze(0))
            m = torch.distributions.Categorical(probs)
            action = m.sample()
            log_probs.append(m.log_prob(action))
            state, reward, done = self.env.step(int(action.item()))
            rewards.append(reward)
        loss = torch.cat(
            [-lp * r for lp, r in zip(log_probs, _returns(rewards), strict=True)]
        ).sum()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        self.record(sum(rewards))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _ActorCriticNet(nn.Module):
    """``actor_critic.py``'s ``Policy``: shared 4-128 ReLU, an action head and a value head."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.action_head = nn.Linear(128, 2)
        self.value_head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


class _Episodes(IterableDataset):
    """Episodes played by the current policy, without a graph: (states, actions, returns, reward).

    The loader runs in the training process (no workers), so it plays with the live
    weights; Lightning fetches one batch ahead, so an episode is one update old.
    """

    def __init__(self, net: _ActorCriticNet, episodes: int, seed: int) -> None:
        self.net, self.episodes, self.env = net, episodes, _CartPole(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for _ in range(self.episodes):
            state, states, actions, rewards, done = self.env.reset(), [], [], [], False
            with torch.no_grad():
                while not done:
                    states.append(state)
                    probs, _ = self.net(torch.from_numpy(state).unsqueeze(0))
                    action = int(torch.distributions.Categorical(probs).sample().item())
                    actions.append(action)
                    state, reward, done = self.env.step(action)
                    rewards.append(reward)
            yield (
                torch.from_numpy(np.stack(states)),
                torch.tensor(actions),
                _returns(rewards),
                torch.tensor(float(sum(rewards))),
            )


class ActorCritic(_Traced):
    """Actor-critic with automatic optimization: the episode arrives as a batch, its log
    probabilities and values are recomputed, loss = policy + smooth-L1 value; Adam 3e-2."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _ActorCriticNet()

    def training_step(self, batch: tuple[torch.Tensor, ...], i: int) -> torch.Tensor:
        states, actions, returns, reward = batch
        probs, values = self.net(states)
        log_probs = torch.log(probs.gather(1, actions[:, None]).squeeze(1))
        advantage = returns - values.squeeze(1).detach()
        loss = (-log_probs * advantage).sum() + F.smooth_l1_loss(
            values.squeeze(1), returns, reduction="sum"
        )
        self.log("train_loss", loss)
        self.record(reward)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-2)


def _build_reinforce(seed: int, steps: int) -> Built:
    return Built(Reinforce(seed), DataLoader(range(steps)), trainer={"max_epochs": 1})


def _build_actor_critic(seed: int, steps: int) -> Built:
    module = ActorCritic()
    episodes = _Episodes(module.net, steps, seed)
    return Built(module, DataLoader(episodes, batch_size=None), trainer={"max_epochs": 1})


# -- forward-forward --------------------------------------------------------------------


def _overlay(x: torch.Tensor, y: torch.Tensor | int) -> torch.Tensor:
    """The label one-hot in the first 10 pixels, at the data's maximum."""
    x_ = x.clone()
    x_[:, :10] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class _FFLayer(nn.Linear):
    """A forward-forward layer: normalise the input's direction, Linear, ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return F.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))


class ForwardForward(_Traced):
    """Layer 0 trained for ``per_layer`` steps with its own Adam (lr 0.03), then layer 1 on
    layer 0's outputs: goodness ``mean(h^2)`` above 2 for positive data, below for negative."""

    def __init__(self, per_layer: int, seed: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layers = nn.ModuleList([_FFLayer(64, 500), _FFLayer(500, 500)])
        self.per_layer, self.threshold, self.seed = per_layer, 2.0, seed
        self.it = 0
        self._inputs: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _layer_inputs(self, x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """Positive and negative data through the trained layers below ``k`` (fixed, detached)."""
        if self._inputs is None or self._inputs[0] != k:
            g = torch.Generator().manual_seed(self.seed)
            h_pos, h_neg = _overlay(x, y), _overlay(x, y[torch.randperm(len(y), generator=g)])
            with torch.no_grad():
                for layer in self.layers[:k]:
                    h_pos, h_neg = layer(h_pos), layer(h_neg)
            self._inputs = (k, h_pos, h_neg)
        return self._inputs[1:]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        goodness = []
        for label in range(10):
            h, g = _overlay(x, label), 0.0
            for layer in self.layers:
                h = layer(h)
                g = g + h.pow(2).mean(1)
            goodness.append(g.unsqueeze(1))
        return torch.cat(goodness, 1).argmax(1)

    def training_step(self, batch: list[torch.Tensor], i: int) -> None:
        x, y = batch
        k = min(self.it // self.per_layer, len(self.layers) - 1)
        h_pos, h_neg = self._layer_inputs(x, y, k)
        layer, opt = self.layers[k], self.optimizers()[k]
        g_pos = layer(h_pos).pow(2).mean(1)
        g_neg = layer(h_neg).pow(2).mean(1)
        z = torch.cat([-g_pos + self.threshold, g_neg - self.threshold])
        loss = torch.log(1 + torch.exp(z)).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.it += 1
        self.log("train_loss", loss)
        if self.it % 25 == 1 or self.it == 2 * self.per_layer:
            with torch.no_grad():
                self.record(1.0 - (self.predict(x) == y).float().mean())

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(layer.parameters(), lr=0.03) for layer in self.layers]


def _build_forward_forward(seed: int, steps: int) -> Built:
    mean, std = 0.1307, 0.3081
    xt, yt, _, _ = _digits(seed)
    x = ((xt - mean) / std).flatten(1)
    return Built(
        ForwardForward(steps // 2, seed),
        DataLoader(_Repeat((x, yt), steps), batch_size=None),
        trainer={"max_epochs": 1},
    )


# -- polynomial regression ----------------------------------------------------------------


class _PolyBatches(IterableDataset):
    """``get_batch(32)``: x ~ N(0, 1) as (x, x^2, x^3, x^4), y from the hidden polynomial."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, batches: int, seed: int) -> None:
        self.w, self.b, self.batches, self.seed = w, b, batches, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.batches):
            r = torch.randn(32, generator=g).unsqueeze(1)
            x = torch.cat([r**i for i in range(1, 5)], 1)
            yield x, x.mm(self.w) + self.b.item()


class PolyRegression(_Traced):
    """One Linear(4, 1), smooth L1, SGD lr 0.1 (the example's ``p.add_(-0.1 * grad)``); stops
    when the loss falls under 1e-3, as the example does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = F.smooth_l1_loss(self.fc(x), y)
        self.log("train_loss", loss)
        self.record(loss.detach())
        if self.trace[-1] < 1e-3:
            self.trainer.should_stop = True
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _build_regression(seed: int, steps: int) -> Built:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(4, 1, generator=g) * 5, torch.randn(1, generator=g) * 5
    return Built(
        PolyRegression(),
        DataLoader(_PolyBatches(w, b, steps, seed), batch_size=None),
        trainer={"max_epochs": 1},
    )


# -- the registry -------------------------------------------------------------------------


def _w(
    name: str, example: str, metric: str, steps: int, test: int, build: Any, up: bool = False
) -> Workload:
    return Workload(name, example, metric, up, steps, test, build)


_LIST = [
    _w("dcgan", "dcgan", "fake-real pixel-moment gap", 120, 30, _build_dcgan),
    _w("vae", "vae", "loss per sample (BCE+KLD)", 240, 40, _build_vae),
    _w("gcn", "gcn", "train NLL", 200, 40, _build_gcn),
    _w("gat", "gat", "train NLL", 80, 15, _build_gat),
    _w("word_lm", "word_language_model", "train NLL/token", 100, 20, _build_word_lm),
    _w("time_series", "time_sequence_prediction", "MSE", 4, 2, _build_time_series),
    _w("siamese", "siamese_network", "BCE", 100, 25, _build_siamese),
    _w("reinforce", "reinforcement_learning", "episode reward", 120, 30, _build_reinforce, True),
    _w(
        "actor_critic",
        "reinforcement_learning",
        "episode reward",
        150,
        30,
        _build_actor_critic,
        True,
    ),
    _w("forward_forward", "mnist_forward_forward", "train error", 300, 40, _build_forward_forward),
    _w("regression", "regression", "smooth L1", 1000, 60, _build_regression),
    _w("resnet", "imagenet", "train CE", 150, 30, _build_resnet),
    _w("mnist_cnn", "mnist", "train NLL", 180, 30, _build_mnist("32-true")),
    _w("mnist_cnn_bf16", "mnist", "train NLL", 180, 30, _build_mnist("bf16-mixed")),
]

#: Every workload by name, in the table's order.
WORKLOADS: dict[str, Workload] = {w.name: w for w in _LIST}
