"""repeated_data end to end in Lightning: the batches' prints measured at each epoch's
first step and on sampled steps, a loader stuck on one batch, the same order every epoch,
a mid-epoch resume whose loader starts the epoch again, against shuffled and sequential
loaders, token batches and batches with no input tensor."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from _models import TinyMLP, dataset, fit, problems
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from stethoscope import LightningStethoscope
from stethoscope.testing import CapturingSink

# 480 samples in batches of 32: epochs begin off the sampled detectors' 16-step schedule
SAMPLES, STEPS_PER_EPOCH = 480, 15


class FixedShuffle(Sampler):
    """A random order drawn from the same seed every epoch: a DistributedSampler without
    set_epoch, or a streaming dataset shuffled with a fixed seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(0)).tolist())


class StuckDataset(Dataset):
    """A dataset whose index never advances past the first batch's samples."""

    def __init__(self) -> None:
        self.data = dataset(SAMPLES)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i % 32]


def repeated(sink: CapturingSink) -> list:
    return [f for f in sink.findings if f.detector == "repeated_data"]


def test_a_loader_stuck_on_one_batch_is_named():
    data = DataLoader(StuckDataset(), batch_size=32)
    _, sink = fit(TinyMLP(), steps=40, data=data)
    (found,) = repeated(sink)
    assert found.severity == "warning" and found.epoch == 0
    assert "same batch again and again" in found.message


def test_the_same_order_every_epoch_is_named_at_the_second_epochs_second_step():
    data = DataLoader(dataset(SAMPLES), batch_size=32, sampler=FixedShuffle(SAMPLES))
    _, sink = fit(TinyMLP(), steps=3 * STEPS_PER_EPOCH, data=data)
    (found,) = repeated(sink)
    assert found.step == STEPS_PER_EPOCH + 1 and "same order every epoch" in found.message
    assert "and so did its batch 1" in found.message


class WholeBatches(Sampler):
    """The samples in blocks of 32, the blocks in a new order every epoch (a sampler over
    pre-built batches), each epoch beginning with block 0, as one epoch in 15 does by
    chance."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self):
        seed = torch.Generator().manual_seed(self.epoch)
        rest = torch.randperm(STEPS_PER_EPOCH - 1, generator=seed)
        self.epoch += 1
        return iter([i for b in [0, *(rest + 1).tolist()] for i in range(32 * b, 32 * (b + 1))])


def test_whole_batches_reshuffled_whose_first_comes_first_again_are_no_repeat():
    """Before, the second epoch's first batch alone was taken for the same order."""
    data = DataLoader(dataset(SAMPLES), batch_size=32, sampler=WholeBatches())
    _, sink = fit(TinyMLP(), steps=3 * STEPS_PER_EPOCH, data=data)
    assert repeated(sink) == []


def test_shuffled_and_sequential_loaders_are_left_alone():
    for shuffle in (True, False):
        data = DataLoader(dataset(SAMPLES), batch_size=32, shuffle=shuffle)
        _, sink = fit(TinyMLP(), steps=3 * STEPS_PER_EPOCH, data=data)
        assert repeated(sink) == [], shuffle


def test_a_mid_epoch_resume_that_restarts_the_loader_is_named(tmp_path):
    """Lightning resumes 5 batches into epoch 1 with batch_idx 5, while a loader that keeps
    no position serves the epoch from its first batch again."""
    data = DataLoader(dataset(SAMPLES), batch_size=32)  # sequential: its order is the same
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=STEPS_PER_EPOCH + 5, save_top_k=-1
    )
    steps = 2 * STEPS_PER_EPOCH
    _, first = fit(
        TinyMLP(), steps=steps, data=data, enable_checkpointing=True, callbacks=[checkpoint]
    )
    assert repeated(first) == []
    (path,) = tmp_path.glob(f"*step={STEPS_PER_EPOCH + 5}*")
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink])
    fit(TinyMLP(), steps=steps + 8, data=data, callback=callback, ckpt_path=path)
    (found,) = repeated(sink)
    assert found.step == STEPS_PER_EPOCH + 5 and found.value == 5.0
    assert "started the epoch again" in found.message and "last 5 never" in found.message


class TokenModel(L.LightningModule):
    """A tiny language model whose batches are dicts of token ids, as transformers' are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Tokens(Dataset):
    def __init__(self, stuck: bool) -> None:
        self.ids = torch.randint(0, 50, (256, 12), generator=torch.Generator().manual_seed(0))
        self.stuck = stuck

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        row = self.ids[0 if self.stuck else i]
        return {"input_ids": row, "labels": row.roll(-1)}


def test_token_batches_are_printed_by_their_input_ids():
    for stuck in (False, True):
        data = DataLoader(Tokens(stuck), batch_size=16, shuffle=True)
        _, sink = fit(TokenModel(), steps=40, data=data)
        assert len(repeated(sink)) == int(stuck), stuck


class NoTensorModel(L.LightningModule):
    """Batches that are a list of strings (a tokenizer in the training step)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        return (self.w * len(batch[0])).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_without_an_input_tensor_it_stays_silent_and_says_so():
    data = DataLoader([("a b c",)] * 64, batch_size=4, collate_fn=lambda b: [list(b)])
    _, sink = fit(NoTensorModel(), steps=40, data=data)
    assert repeated(sink) == []
    (summary,) = sink.summaries[-1:]
    rows = {r.detector: r.verdict for r in summary.rows}
    assert rows["repeated_data"] == "silent: no input tensor could be read from the batches"


class Validated(TinyMLP):
    """TinyMLP with a validation loop on ``val`` (its loss logged as val_loss)."""

    def __init__(self, val: DataLoader) -> None:
        super().__init__()
        self.val = val

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        return self.val


def test_a_validation_set_drawn_from_the_training_set_is_named():
    train = DataLoader(dataset(SAMPLES), batch_size=32, shuffle=True)
    leaked = DataLoader(dataset(SAMPLES), batch_size=64)  # the training set, validated on
    _, sink = fit(Validated(leaked), steps=4 * STEPS_PER_EPOCH, data=train)
    (found,) = repeated(sink)
    assert found.where == "validation data" and "overlaps the training data" in found.message
    assert found.value > 0.5


def test_a_held_out_validation_set_is_no_overlap():
    train = DataLoader(dataset(SAMPLES), batch_size=32, shuffle=True)
    held_out = DataLoader(dataset(SAMPLES, seed=9), batch_size=64)
    _, sink = fit(Validated(held_out), steps=4 * STEPS_PER_EPOCH, data=train)
    assert repeated(sink) == []


# -- node classification on one graph: train and validation masks ---------------------------------
class GraphNodes(Dataset):
    """One graph, one item: its node features, row-normalised adjacency, labels, and the
    mask of the nodes whose loss counts (Kipf and Welling's transductive split)."""

    def __init__(self, mask: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(0)
        n = len(mask)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + nn.functional.one_hot(self.y, 16).float()
        adj = (torch.rand(n, n, generator=g) < 0.02).float() + torch.eye(n)
        self.adj, self.mask = adj / adj.sum(1, keepdim=True), mask

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int):
        return self.x, self.adj, self.y, self.mask


class GCN(L.LightningModule):
    """Two graph convolutions, full batch: each epoch is the one graph."""

    def __init__(self, nodes: int = 256) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 4)
        split = torch.randperm(nodes, generator=torch.Generator().manual_seed(1))
        self.masks = [torch.zeros(nodes, dtype=torch.bool) for _ in range(2)]
        self.masks[0][split[:64]], self.masks[1][split[64:192]] = True, True

    def loss(self, batch):
        x, adj, y, mask = batch
        out = adj @ self.l2(torch.relu(adj @ self.l1(x)))
        return nn.functional.cross_entropy(out[mask], y[mask])

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss := self.loss(batch))
        return loss

    def train_dataloader(self):
        return DataLoader(GraphNodes(self.masks[0]), batch_size=None)

    def val_dataloader(self):
        return DataLoader(GraphNodes(self.masks[1]), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=5e-4)


def test_a_transductive_split_of_one_graph_is_said_as_what_it_is():
    """A new user's trial: "256 of 256 validation samples are training samples", and the
    advice to split the data once, on the standard set-up of node classification. The
    leak it still names: test_a_validation_set_drawn_from_the_training_set_is_named."""
    model = GCN()
    _, sink = fit(model, steps=10, data=model.train_dataloader(), check_val_every_n_epoch=5)
    assert problems(sink) == []
    (said,) = repeated(sink)
    assert said.severity == "info" and "transductive split" in said.message


# -- loader workers -------------------------------------------------------------------------------
class Drawn(Dataset):
    """Synthetic samples drawn from the dataset's own generator, made before the loader's
    workers start (torch seeds each worker's global NumPy and torch generators, not one
    the dataset holds): each worker draws the same samples."""

    def __init__(self, n: int = 128) -> None:
        self.n, self.rng = n, np.random.default_rng(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.from_numpy(self.rng.standard_normal(20).astype(np.float32))
        return x, int(x[:4].argmax())


def seed_worker(worker: int) -> None:
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
def test_loader_workers_that_share_a_random_state_are_named(seeded):
    init = seed_worker if seeded else None
    data = DataLoader(Drawn(), batch_size=32, num_workers=2, worker_init_fn=init)
    _, sink = fit(TinyMLP(), steps=4, data=data)
    if seeded:
        assert problems(sink) == []
        return
    (found,) = repeated(sink)  # was "the same batch again and again", sent to __getitem__
    assert found.step == 2 and found.where == "loader workers"
    assert "2 workers serve the same batches" in found.message
    assert "worker_init_fn" in found.message


def test_a_loader_stuck_on_one_batch_is_stuck_under_workers_too():
    data = DataLoader(StuckDataset(), batch_size=32, num_workers=2)
    _, sink = fit(TinyMLP(), steps=6, data=data)
    (found,) = repeated(sink)
    assert "same batch again and again" in found.message and "its 2 workers" in found.message


# -- full-batch training, served as an epoch of many steps ---------------------------------------
class Copies(Dataset):
    """The whole training set as each of ``n`` items: full-batch training for ``n`` steps
    an epoch (pytorch/examples' LBFGS and forward-forward loops, in a loader)."""

    def __init__(self, n: int) -> None:
        self.batch, self.n = dataset(SAMPLES)[:], n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.batch


class Yielded(torch.utils.data.IterableDataset):
    """The whole training set, yielded ``n`` times."""

    def __init__(self, n: int) -> None:
        self.batch, self.n = dataset(SAMPLES)[:], n

    def __iter__(self):
        return iter([self.batch] * self.n)


@pytest.mark.parametrize("data", [Copies, Yielded], ids=["a-dataset-of-copies", "an-iterable"])
def test_the_whole_training_set_at_every_step_is_full_batch_training(data):
    """DataLoader(batch_size=None) over the whole training set as each item: the same
    batch from the first step on is the data, said once (was a stuck loader's warning)."""
    _, sink = fit(TinyMLP(), steps=40, data=DataLoader(data(40), batch_size=None))
    (found,) = repeated(sink)
    assert found.severity == "info" and "full-batch training" in found.message
    assert problems(sink) == []


def test_the_whole_training_set_stuck_on_a_collating_loader_is_stuck():
    """The twin: the same samples drawn one by one (batch_size=32 over a dataset whose
    index never advances) are a stuck loader, whatever the loader's batch holds."""
    (found,) = repeated(fit(TinyMLP(), steps=40, data=DataLoader(StuckDataset(), batch_size=32))[1])
    assert found.severity == "warning" and "same batch again and again" in found.message


class ReadyBatches(Dataset):
    """Batches of 32 made whole by the dataset, and from step ``stuck`` on its first again
    (a batch cache that stops advancing)."""

    def __init__(self, stuck: int) -> None:
        self.data, self.stuck = dataset(SAMPLES), stuck

    def __len__(self) -> int:
        return STEPS_PER_EPOCH

    def __getitem__(self, i: int):
        return self.data[32 * (0 if i >= self.stuck else i) : 32 * (i + 1 if i < self.stuck else 1)]


def test_ready_batches_that_stop_advancing_are_stuck():
    data = DataLoader(ReadyBatches(stuck=4), batch_size=None)
    (found,) = repeated(fit(TinyMLP(), steps=12, data=data)[1])
    assert found.severity == "warning" and "same batch again and again" in found.message
