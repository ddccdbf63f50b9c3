"""The suite's data sets, as numpy arrays: no framework, no download.

Every scenario trains on one of three small classification tasks, drawn from a
seed so that each (scenario, seed) pair sees the same data in every framework:

* ``gaussian``: standardised Gaussian features (20 of them, values past ±1
  everywhere, as standardised data always has) labelled by a random linear
  teacher into 4 classes. Learnable to a loss near 0 by a small MLP.
* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10
  classes; no download), split 80/20 into train and validation with the seed,
  standardised per pixel with the training split's statistics (pixels that are
  always 0 stay 0) unless ``raw`` keeps the pixel values 0..16.
* ``separable``: 4 well-separated classes: 20 Gaussian features of standard
  deviation 0.5, the one numbered after the class raised by 3. A small MLP fits it
  to a loss of a few thousandths, on held-out data too.
* ``sequences``: 4 classes of sequences (20 steps x 4 channels): each class has
  a random template; a sample is its class's template times 0.7 plus unit
  Gaussian noise. A GRU learns it in a few hundred steps.

Label faults are applied here, because they are properties of the data rather
than of the framework: ``label_noise`` (a fraction of labels redrawn uniformly),
``random_labels`` (every label redrawn: no signal left) and ``majority`` (the
training set resampled so that one class makes up that fraction of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ORDERS", "Arrays", "DataSpec", "make_data"]


#: The orders a training set can be served in (see ``DataSpec.order``).
ORDERS = ("shuffled", "sorted", "fixed", "sequential")


@dataclass(frozen=True)
class DataSpec:
    """Which data a scenario trains on, and what is wrong with it.

    Args:
        source: ``"gaussian"``, ``"separable"``, ``"digits"``, ``"sequences"`` or
            ``"regression"`` (Gaussian inputs, a float target: one output, no classes).
        n_train: Training samples (``digits``: at most the 80% split, 1437).
        n_val: Validation samples; 0 for none (no validation loop).
        label_noise: Fraction of training labels redrawn uniformly at random.
        random_labels: Redraw every training label: the inputs carry no signal.
        majority: If set, resample the training set so that class 0 is this
            fraction of it (the other classes share the rest equally).
        scale: Multiply every input feature by this (1.0: standardised).
        raw: ``digits`` only: keep pixel values 0..16 instead of standardising.
        images: ``digits`` only: shape inputs as 1x8x8 images (for a CNN).
        order: ``"shuffled"`` (reshuffled every epoch); ``"sorted"``: the training set
            sorted by label and served in that order every epoch (a pipeline bug);
            ``"fixed"``: shuffled once, and served in that order every epoch (a
            ``DistributedSampler`` without ``set_epoch``, a pipeline bug);
            ``"sequential"``: the stored order every epoch, shuffling turned off on
            purpose.
        val_from_train: The share of the validation samples replaced by training samples
            (a split that leaked; a pipeline bug).
    """

    source: str = "gaussian"
    n_train: int = 1024
    n_val: int = 0
    label_noise: float = 0.0
    random_labels: bool = False
    majority: float | None = None
    scale: float = 1.0
    raw: bool = False
    images: bool = False
    order: str = "shuffled"
    val_from_train: float = 0.0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}; use one of {ORDERS!r}")

    @property
    def shuffled(self) -> bool:
        """Whether the training set is reshuffled every epoch."""
        return self.order == "shuffled"

    @property
    def loader_order(self) -> str:
        """How a loader serves it: ``"shuffled"`` (a new order every epoch), ``"fixed"``
        (one random order, every epoch) or ``"sequential"`` (the stored order, by a
        sampler that says so)."""
        return self.order if self.order in ("shuffled", "fixed") else "sequential"


@dataclass(frozen=True)
class Arrays:
    """Training (and optional validation) arrays: float32 inputs, int64 labels (a float32
    target for a regression, whose ``classes`` is 1)."""

    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray | None
    y_val: np.ndarray | None
    classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


GAUSSIAN_FEATURES, GAUSSIAN_CLASSES = 20, 4
SEQ_LEN, SEQ_FEATURES, SEQ_CLASSES = 20, 4, 4


def _split(x: np.ndarray, y: np.ndarray, n_train: int) -> tuple[np.ndarray, ...]:
    """The first ``n_train`` samples for training, the rest for validation."""
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_data(spec: DataSpec, seed: int) -> Arrays:
    """The arrays of ``spec`` for ``seed``."""
    rng = np.random.default_rng(10_000 + seed)
    n_total = spec.n_train + spec.n_val
    if spec.source == "gaussian":
        x = rng.standard_normal((n_total, GAUSSIAN_FEATURES))
        teacher = rng.standard_normal((GAUSSIAN_FEATURES, GAUSSIAN_CLASSES))
        y = (x @ teacher).argmax(1)
        classes = GAUSSIAN_CLASSES
        x_tr, y_tr, x_va, y_va = _split(x, y, spec.n_train)
    elif spec.source == "separable":
        y = rng.integers(0, GAUSSIAN_CLASSES, n_total)
        x = 0.5 * rng.standard_normal((n_total, GAUSSIAN_FEATURES))
        x[np.arange(n_total), y] += 3.0
        classes = GAUSSIAN_CLASSES
        x_tr, y_tr, x_va, y_va = _split(x, y, spec.n_train)
    elif spec.source == "regression":
        x = rng.standard_normal((n_total, GAUSSIAN_FEATURES))
        y = x @ rng.standard_normal(GAUSSIAN_FEATURES) + 0.1 * rng.standard_normal(n_total)
        classes = 1
        x_tr, y_tr, x_va, y_va = _split(x, y, spec.n_train)
    elif spec.source == "sequences":
        templates = rng.standard_normal((SEQ_CLASSES, SEQ_LEN, SEQ_FEATURES))
        y = rng.integers(0, SEQ_CLASSES, n_total)
        x = 0.7 * templates[y] + rng.standard_normal((n_total, SEQ_LEN, SEQ_FEATURES))
        classes = SEQ_CLASSES
        x_tr, y_tr, x_va, y_va = _split(x, y, spec.n_train)
    elif spec.source == "digits":
        from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

        x, y = load_digits(return_X_y=True)
        order = rng.permutation(len(x))
        split = int(0.8 * len(x))
        tr, va = order[:split], order[split:]
        if spec.n_train > len(tr) or spec.n_val > len(va):
            raise ValueError(f"digits has {len(tr)} training and {len(va)} validation samples")
        tr, va = tr[: spec.n_train], va[: spec.n_val]
        x_tr, y_tr, x_va, y_va = x[tr], y[tr], x[va], y[va]
        if not spec.raw:
            mean, std = x_tr.mean(0), x_tr.std(0)
            std[std == 0] = 1.0  # pixels that are always 0 stay 0
            x_tr, x_va = (x_tr - mean) / std, (x_va - mean) / std
        classes = 10
    else:
        raise ValueError(
            f"source={spec.source!r}; use 'gaussian', 'separable', 'digits', 'sequences' "
            "or 'regression'"
        )

    y_tr = y_tr.copy()
    if spec.random_labels:
        y_tr = rng.integers(0, classes, len(y_tr))
    elif spec.label_noise:
        flip = rng.random(len(y_tr)) < spec.label_noise
        y_tr[flip] = rng.integers(0, classes, int(flip.sum()))
    if spec.majority is not None:
        x_tr, y_tr = _resample_majority(x_tr, y_tr, spec.majority, classes, rng)
    if spec.order == "sorted":
        by_label = np.argsort(y_tr, kind="stable")
        x_tr, y_tr = x_tr[by_label], y_tr[by_label]
    if spec.val_from_train:
        leaked = round(spec.val_from_train * len(y_va))
        rows = rng.choice(len(y_tr), size=leaked, replace=False)
        x_va, y_va = x_va.copy(), y_va.copy()
        x_va[:leaked], y_va[:leaked] = x_tr[rows], y_tr[rows]
    x_tr = x_tr * spec.scale
    x_va = x_va * spec.scale
    if spec.images:
        x_tr, x_va = x_tr.reshape(-1, 1, 8, 8), x_va.reshape(-1, 1, 8, 8)
    val = spec.n_val > 0
    return Arrays(
        x=x_tr.astype(np.float32),
        y=y_tr.astype(np.float32 if classes == 1 else np.int64),
        x_val=x_va.astype(np.float32) if val else None,
        y_val=y_va.astype(np.float32 if classes == 1 else np.int64) if val else None,
        classes=classes,
    )


def _resample_majority(
    x: np.ndarray, y: np.ndarray, fraction: float, classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``len(y)`` samples with replacement: class 0 ``fraction`` of them, others equal."""
    n = len(y)
    n_major = round(fraction * n)
    per_minor = (n - n_major) // (classes - 1)
    parts = [rng.choice(np.flatnonzero(y == 0), n_major)]
    parts += [rng.choice(np.flatnonzero(y == c), per_minor) for c in range(1, classes)]
    idx = rng.permutation(np.concatenate(parts))
    return x[idx], y[idx]
