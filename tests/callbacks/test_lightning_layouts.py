"""LightningStethoscope on batches of every layout a user's loader yields: float64 training
(``precision="64-true"``), sparse features (COO, CSR), a sparse adjacency in the labels'
place, token ids, bool features, nested dicts, complex values, nested tensors, a batch
that is an object of the user's, a scalar batch and an empty batch. Each fit completes
its steps with no crash and no warning; the statistics read what they can and skip the
rest. Then the cost of the prints of a batch: bounded, whatever its size."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from _accelerator import SimulatedAccelerator, SimulatedSteps
from _models import problems
from torch import nn

from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning import batch as batch_stats
from stethoscope.callbacks._lightning.predictions import probability_rows
from stethoscope.detectors import default_detectors
from stethoscope.prints import MAX_PRINTS, PRINT_BUDGET, PRINT_WIDTH, print_plan
from stethoscope.testing import CapturingSink, RecordingDetector

N, FEATURES, CLASSES, VOCAB, LENGTH = 16, 8, 3, 50, 6
STEPS, VAL_BATCHES = 8, 2


class Sample:
    """A batch that is an object of the user's own (no tuple, no mapping)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


def _batch(kind: str, g: torch.Generator, index: int) -> Any:
    """Batch ``index`` of layout ``kind``: its features carry the class (a linear teacher
    on the first ``CLASSES`` columns), so the model learns as a healthy one does."""
    x = torch.randn(N, FEATURES, generator=g)
    y = x[:, :CLASSES].argmax(1)
    if kind == "float64":
        return x.double(), y
    if kind == "sparse_coo":
        return x.to_sparse(), y
    if kind == "sparse_csr":
        return x.to_sparse_csr(), y
    if kind in ("adjacency", "adjacency_pair"):
        # a graph's row-normalised adjacency with self loops, sparse: batch[1]
        adj = (torch.rand(N, N, generator=g) < 0.2).float() + torch.eye(N)
        adj = (adj / adj.sum(1, keepdim=True)).to_sparse()
        return (x, adj, y) if kind == "adjacency" else (x, adj)
    if kind == "tokens":
        ids = torch.randint(0, VOCAB, (N, LENGTH), generator=g)
        return ids, ids[:, 0] % CLASSES
    if kind == "bool":  # 32 of them: 16 random samples of 8 would repeat each other
        return torch.cat([x, torch.randn(N, 32 - FEATURES, generator=g)], 1) > 0, y
    if kind == "nested":
        return {"inputs": {"a": x, "b": x.abs() > 0.1}, "labels": y}
    if kind == "complex":
        return torch.complex(x, torch.randn(N, FEATURES, generator=g)), y
    if kind == "wide_transposed":  # samples wider than PRINT_WIDTH, not contiguous
        wide = torch.randn(PRINT_WIDTH + 904, N, generator=g).T
        wide[:, :FEATURES] = x
        return wide, y
    if kind == "nested_tensor":
        rows = [torch.randn(1 + i % 3, FEATURES, generator=g) for i in range(N)]
        t = torch.nested.nested_tensor(rows, layout=torch.jagged)
        return t, torch.stack([r.mean(0)[:CLASSES].argmax() for r in rows])
    if kind == "object":
        return Sample(x, y)
    if kind == "scalar":
        return torch.tensor(1.0 + index)
    if kind == "empty":
        return (x[:0], y[:0]) if index == 3 else (x, y)
    raise ValueError(kind)


def batches(kind: str, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [_batch(kind, g, i) for i in range(n)]


class Layouts(L.LightningModule):
    """An MLP (tanh and ReLU layers: forward statistics on both) fed batches of one
    layout, each turned into dense float features and integer labels."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, CLASSES)
        )
        g = torch.Generator().manual_seed(5)
        self.register_buffer("fixed_x", torch.randn(N, FEATURES, generator=g))

    def features(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.kind
        if k in ("sparse_coo", "sparse_csr"):
            x, y = batch
            return self.net[0](x), y  # a Linear takes the sparse features as they are
        if k == "adjacency":
            x, adj, y = batch
            return self.net[0](torch.sparse.mm(adj, x)), y
        if k == "adjacency_pair":
            x, adj = batch
            return self.net[0](torch.sparse.mm(adj, x)), x[:, :CLASSES].argmax(1)
        if k == "tokens":
            ids, y = batch
            return self.net[0](self.embed(ids).mean(1)), y
        if k == "nested":
            inputs = batch["inputs"]
            return self.net[0](inputs["a"] * inputs["b"]), batch["labels"]
        if k == "complex":
            x, y = batch
            return self.net[0](x.real), y
        if k == "nested_tensor":
            x, y = batch
            return self.net[0](torch.stack([r.mean(0) for r in x.unbind()])), y
        if k == "object":
            return self.net[0](batch.x), batch.y
        if k == "scalar":
            x = self.fixed_x * batch
            return self.net[0](x), x[:, :CLASSES].argmax(1)
        x, y = batch
        return self.net[0](x[:, :FEATURES].to(self.net[0].weight.dtype)), y

    def loss(self, batch: Any) -> torch.Tensor:
        h, y = self.features(batch)
        logits = self.net[1:](h)
        return nn.functional.cross_entropy(logits, y, reduction="sum") / max(len(y), 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, batch_size=N)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def layout_fit(
    kind: str, *before: L.Callback
) -> tuple[L.Trainer, CapturingSink, RecordingDetector]:
    """A fit of ``STEPS`` steps on batches of layout ``kind``, validated halfway and at
    the end; ``before``: callbacks to run before stethoscope's."""
    sink = CapturingSink()
    printed = RecordingDetector({"prints"}, name="prints_seen")
    callback = LightningStethoscope(sinks=[sink], detectors=[*default_detectors(), printed])
    loader = torch.utils.data.DataLoader
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=STEPS,
        max_epochs=2,
        accelerator="cpu",
        precision="64-true" if kind == "float64" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=STEPS // 2,
        callbacks=[*before, callback],
    )
    trainer.fit(
        Layouts(kind),
        loader(batches(kind, STEPS, seed=0), batch_size=None),
        loader(batches(kind, VAL_BATCHES, seed=1), batch_size=None),
    )
    return trainer, sink, printed


#: The layouts, and whether their inputs are printed (a dense tensor of samples).
LAYOUTS = {
    "float64": True,
    "sparse_coo": False,
    "sparse_csr": False,
    "adjacency": True,
    "adjacency_pair": True,
    "tokens": True,
    "bool": True,
    "nested": True,
    "complex": True,
    "nested_tensor": False,
    "object": False,
    "scalar": False,
    "empty": True,
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_every_layout_trains_to_the_end_without_a_warning(kind):
    """Before: float64 (a float32 norm of a float64 input, activation and gradient row),
    sparse features (a norm or a reshape of a sparse tensor), a sparse adjacency at
    batch[1] (added to a dense tensor as if it were labels), nested tensors (a reshape)
    and an empty batch (the peak of no activation) crashed; nested dicts and complex
    inputs went unprinted."""
    trainer, sink, printed = layout_fit(kind)
    assert trainer.global_step == STEPS
    assert problems(sink) == []
    prints = [o.sample_prints for o in printed.seen if o.sample_prints is not None]
    assert bool(prints) == LAYOUTS[kind]


@pytest.mark.parametrize("kind", ["float64", "nested", "adjacency_pair", "wide_transposed"])
def test_on_an_accelerator_no_layout_makes_a_healthy_step_wait(kind):
    """Played on the CPU (``_accelerator.py``): the batch statistics of every layout stay
    on the device, and reach the host without a sync."""
    with SimulatedAccelerator(lag=2) as sim:
        trainer, sink, _ = layout_fit(kind, SimulatedSteps(sim))
    assert trainer.global_step == STEPS and problems(sink) == []
    assert sim.train_syncs() == []


# -- each statistic, on each layout ----------------------------------------------------------
def _layouts() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    return {
        "float64": x.double(),
        "float16": x.half(),
        "bfloat16": x.bfloat16(),
        "float8": x.to(torch.float8_e4m3fn),
        "int64": torch.randint(0, 9, (6, 5), generator=g),
        "uint8": torch.randint(0, 255, (6, 5), generator=g, dtype=torch.uint8),
        "bool": x > 0,
        "complex": torch.complex(x, x),
        "coo": x.to_sparse(),
        "csr": x.to_sparse_csr(),
        "nested": torch.nested.nested_tensor([x[:2], x[:3]], layout=torch.jagged),
        "scalar": torch.tensor(2.0),
        "empty": x[:0],
        "zero_width": x[:, :0],
        "transposed": torch.randn(5, 6, generator=g).T,
        "dict": {"b": x > 0, "a": x, "c": [x.double(), (x.long(),)]},
        "object": Sample(x, x),
        "none": None,
        "strings": ["a", "b"],
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_every_batch_statistic_reads_a_layout_or_skips_it(name):
    x = _layouts()[name]
    prints = batch_stats.sample_prints(x)
    assert prints is None or (prints.dtype == torch.float32 and prints.shape[1] == 2)
    moments = batch_stats.input_moments(x)
    assert moments is None or moments[0].dtype == torch.float32
    labels = batch_stats.class_labels(x)
    assert labels is None or labels.dtype == torch.float32
    assert batch_stats.inputs_finite((x, None)) is True
    batch_stats.fingerprint((x, None))
    batch_stats.BatchParts(None, None).samples((x, None))
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        probability_rows(x, x)


def test_a_dense_tensor_of_samples_is_printed_whatever_its_dtype():
    for name in ("float64", "float16", "bfloat16", "float8", "int64", "uint8", "bool", "complex"):
        prints = batch_stats.sample_prints(_layouts()[name])
        assert prints is not None and prints.shape == (6, 2), name
    for name in ("coo", "csr", "nested", "scalar", "empty", "zero_width", "object", "strings"):
        assert batch_stats.sample_prints(_layouts()[name]) is None, name


def test_float64_inputs_have_their_scale_measured_in_float64():
    x = torch.full((4, 3), 1e30, dtype=torch.float64)  # its square overflows float32
    sq, n = batch_stats.input_moments(x)
    assert n == 4 and sq.dtype == torch.float32 and torch.isinf(sq).all()
    sq, _ = batch_stats.input_moments(torch.full((4, 3), 3.0, dtype=torch.float64))
    assert torch.equal(sq, torch.full((3,), 9.0))


def test_token_ids_and_masks_have_no_scale_but_a_nested_float_tensor_has():
    ids = torch.randint(0, 9, (4, 6))
    assert batch_stats.input_moments(ids) is None
    assert batch_stats.input_moments(ids > 3) is None
    sq, n = batch_stats.input_moments({"ids": ids, "x": torch.ones(4, 2)})
    assert n == 4 and torch.equal(sq, torch.ones(2))


def test_nested_inputs_print_each_sample_over_all_its_tensors():
    """A mask alone prints many samples alike: a sample's print covers every tensor of
    its inputs, so two samples of one mask but other features differ."""
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 4, generator=g), torch.ones(6, 3, dtype=torch.bool)
    prints = batch_stats.sample_prints({"attention_mask": mask, "x": x})
    assert len({tuple(p) for p in prints.tolist()}) == 6
    # the same sample prints alike in any batch of the same layout
    again = batch_stats.sample_prints({"attention_mask": mask[[4, 1]], "x": x[[4, 1]]})
    assert torch.equal(again, prints[[4, 1]])
    # a single tensor's print is its own, and a tensor of other samples is left out
    assert torch.equal(
        batch_stats.sample_prints([x, torch.ones(2, 2)]), batch_stats.sample_prints(x)
    )


def test_labels_are_read_from_their_shape_and_dtype_first():
    y = torch.tensor([0, 2, 1, 1])
    assert torch.equal(batch_stats.class_labels(y), torch.tensor([0.0, 2, 1, 1, 1]))
    one_hot = nn.functional.one_hot(y, 3).float()
    assert torch.equal(batch_stats.class_labels(one_hot), torch.tensor([0.0, 2, 1, 1, 1]))
    # a graph's adjacency, dense or sparse, square and rows that sum to 1: no labels
    adj = torch.eye(4) * 0.5 + 0.125
    assert torch.allclose(adj.sum(1), torch.ones(4))
    assert batch_stats.class_labels(adj) is None
    assert batch_stats.class_labels(adj.to_sparse()) is None
    assert batch_stats.class_labels(adj.to_sparse_csr()) is None
    # rows over more classes than are judged: not read at all
    wide = torch.full((4, 2000), 1 / 2000)
    assert batch_stats.class_labels(wide) is None
    assert batch_stats.class_labels(y > 0) is None  # bool targets
    assert batch_stats.class_labels(torch.complex(y.float(), y.float())) is None


def test_the_nonfinite_inputs_of_a_sparse_or_nested_tensor_are_found():
    x = torch.randn(4, 3)
    x[1, 2] = float("nan")
    for t in (x.to_sparse(), x.to_sparse_csr(), torch.nested.nested_tensor([x[:2], x[2:]])):
        assert batch_stats.inputs_finite((t, None)) is False
    assert batch_stats.inputs_finite(({"a": torch.ones(2), "b": [x]}, None)) is False
    assert batch_stats.inputs_finite((torch.complex(x, x), None)) is False


# -- the cost of the prints -----------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [(1024, 1433), (2708, 2708), (4096, 20), (64, 3, 224, 224), (2, 10_000_000), (1, 5)],
    ids=["cora-features", "cora-adjacency", "tabular", "images", "huge-samples", "one"],
)
def test_a_batch_prints_at_most_the_budget_of_elements(shape):
    width = int(np.prod(shape[1:]))
    (stride,), count = print_plan([width], shape[0])
    read = -(-width // stride)
    assert read <= PRINT_WIDTH and count * read <= PRINT_BUDGET
    assert 1 <= count <= min(shape[0], MAX_PRINTS)
    if width <= PRINT_WIDTH:
        assert stride == 1  # a sample of up to PRINT_WIDTH elements is read whole
    # the stride depends on the width alone: any batch of these samples reads them alike
    assert print_plan([width], 1)[0] == print_plan([width], 10**6)[0] == [stride]


def test_the_elements_a_batch_prints_are_bounded_whatever_the_batch_size(monkeypatch):
    """Counted where the chunks are summed: a Cora-sized full batch (2708 nodes x 1433
    features) read all of its first 1024 samples before, 1.5M elements; now at most the
    budget, and the same for an adjacency of 2708 x 2708."""
    read: list[int] = []
    sums = batch_stats._sums

    def counted(stacked, weights, host):
        read.append(stacked.numel())
        return sums(stacked, weights, host)

    monkeypatch.setattr(batch_stats, "_sums", counted)
    for shape in [(2708, 1433), (2708, 2708), (50_000, 3)]:
        read.clear()
        prints = batch_stats.sample_prints(torch.zeros(shape))
        # float32: two 16-bit chunks an element
        assert sum(read) <= 2 * PRINT_BUDGET and len(prints) >= 64, shape


def test_the_same_sample_prints_alike_in_a_batch_of_any_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 5000, generator=g)  # wider than PRINT_WIDTH: read evenly spaced
    small, large = batch_stats.sample_prints(x[:3]), batch_stats.sample_prints(x)
    assert torch.equal(small, large[:3])
    assert len({tuple(p) for p in large.tolist()}) == len(large)


def test_the_host_and_the_device_sum_a_print_alike():
    """The host sums the chunks as one float64 product, a device in int64: both exact,
    over chunks and weights at their largest."""
    chunks = torch.full((3, 4 * PRINT_WIDTH), 0xFFFF, dtype=torch.int32)
    chunks[1] = torch.randint(0, 1 << 16, (4 * PRINT_WIDTH,))
    drawn = batch_stats.print_weights(4 * PRINT_WIDTH)
    drawn[0] = (1 << 20) - 1
    host = batch_stats._sums(chunks, torch.from_numpy(drawn.T.astype(np.float64)), True)
    device = batch_stats._sums(chunks, torch.from_numpy(drawn), False)
    assert torch.equal(host, device)


def test_a_non_contiguous_batch_prints_as_its_contiguous_copy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 40, 40, generator=g).permute(0, 2, 3, 1)  # channels last
    assert not x.is_contiguous()
    assert torch.equal(batch_stats.sample_prints(x), batch_stats.sample_prints(x.contiguous()))


class ComplexWeights(L.LightningModule):
    """A complex weight matrix (a unitary layer, a spectral filter) under a real loss."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) * 0.3)
        self.out = nn.Linear(8, 1)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        z = (x.to(torch.cfloat) @ self.w).abs()
        return nn.functional.mse_loss(self.out(z).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_complex_parameters_are_measured_without_a_crash():
    """Before: the weight and gradient norms accumulated in float32 inside the kernel,
    which a complex tensor refuses (its norm is real)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1)), batch_size=32)
    sink, grads = CapturingSink(), RecordingDetector({"grads", "weights"}, name="grads_seen")
    callback = LightningStethoscope(sinks=[sink], detectors=[*default_detectors(), grads])
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    model = ComplexWeights()
    before = float(model.w.detach().abs().norm())
    trainer.fit(model, data)
    assert trainer.global_step == 48
    assert problems(sink) == []
    assert grads.seen, "the hot start measures the gradients"
    obs = grads.seen[0]
    w = obs.names.index("w")
    assert obs.grad_norm[w] > 0 and np.isfinite(obs.grad_norm[w])
    # after the first of Adam's steps of at most lr=1e-2 per element: within 0.16 of it
    assert obs.weight_norm[w] == pytest.approx(before, abs=0.16)
