"""repeated_data in Keras: the order fit was asked for, read from fit's own call, keeps
shuffle=False quiet, while a tf.data pipeline that never reshuffles is named, and so is
fit(shuffle=True) after keras.utils.set_random_seed, which serves every epoch in the first
one's order; prints of a batch are the same in both frameworks."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.callbacks._keras.ops import sample_prints as keras_prints  # noqa: E402
from stethoscope.callbacks._lightning.batch import sample_prints as torch_prints  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the prints read bits with tf.bitcast"
)

N, FEATURES, BATCH = 256, 6, 32  # 8 steps an epoch


@pytest.fixture(autouse=True)
def _no_global_seed():
    """Another test's keras.utils.set_random_seed makes fit serve arrays in one order every
    epoch (see below): each test here starts without a global seed."""
    tf.random.set_seed(None)
    yield
    tf.random.set_seed(None)


def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def model():
    m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2, activation="softmax")])
    m.compile("adam", "sparse_categorical_crossentropy")
    return m


class Order(keras.callbacks.Callback):
    """Keeps the order the stethoscope read from fit."""

    def __init__(self, watched: KerasStethoscope) -> None:
        super().__init__()
        self.watched, self.order = watched, None

    def on_train_end(self, logs=None):
        self.order = self.watched._data_order


def fit(data, **kwargs):
    sink = CapturingSink()
    cb = KerasStethoscope(sinks=[sink])
    order = Order(cb)
    m = model()
    if isinstance(data, tuple):
        m.fit(*data, batch_size=BATCH, epochs=3, verbose=0, callbacks=[cb, order], **kwargs)
    else:
        m.fit(data, epochs=3, verbose=0, callbacks=[cb, order], **kwargs)
    found = [f for f in sink.findings if f.detector == "repeated_data"]
    return found, order.order


@pytest.mark.parametrize(("shuffle", "order"), [(True, "shuffle"), (False, "sequential")])
def test_arrays_in_the_order_fit_was_asked_for_are_no_repeat(shuffle, order):
    found, read = fit(arrays(), shuffle=shuffle)
    assert read == order and found == []


class _FirstRows(keras.Sequential):
    """A model that keeps the first input row of every step it trains (run eagerly)."""

    def train_step(self, data):
        self.rows.append(np.asarray(data[0][0]))
        return super().train_step(data)


def _epochs_begin_alike() -> bool:
    """Whether a plain fit(shuffle=True) of the arrays, after keras.utils.set_random_seed,
    begins its second epoch with the sample its first began with: the ground truth, taken
    without stethoscope, for the Keras installed."""
    keras.utils.set_random_seed(0)
    spy = _FirstRows([keras.Input((FEATURES,)), keras.layers.Dense(2, activation="softmax")])
    spy.rows = []
    spy.compile("adam", "sparse_categorical_crossentropy", run_eagerly=True)
    spy.fit(*arrays(), batch_size=BATCH, epochs=2, verbose=0, shuffle=True)
    return bool(np.array_equal(spy.rows[0], spy.rows[N // BATCH]))


def test_a_global_seed_that_makes_fit_serve_one_order_every_epoch_is_named():
    """keras.utils.set_random_seed seeds the shuffle of fit's array adapter, and on Keras
    3.15 (TensorFlow backend) every epoch's new iterator replays it: fit(shuffle=True)
    trains on one order every epoch. The prints see it, although fit was asked to shuffle,
    and see nothing where the Keras installed reshuffles."""
    alike = _epochs_begin_alike()
    keras.utils.set_random_seed(0)
    found, read = fit(arrays(), shuffle=True)
    assert read == "shuffle"
    assert len(found) == int(alike)
    if alike:  # named at the second epoch's second step, which is its second batch too
        assert found[0].step == N // BATCH + 1 and "same order every epoch" in found[0].message


def test_a_tf_data_pipeline_that_never_reshuffles_is_named():
    x, y = arrays()
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(N, seed=1, reshuffle_each_iteration=False)
        .batch(BATCH)
    )
    (found,), read = fit(data)
    assert read == "" and found.step == N // BATCH + 1  # the second epoch's second step
    assert "same order every epoch" in found.message and "so did its batch 1" in found.message


def test_a_tf_data_pipeline_that_reshuffles_is_left_alone():
    x, y = arrays()
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=1).batch(BATCH)
    assert fit(data) == ([], "")


class WholeBatches(keras.utils.PyDataset):
    """The arrays' 8 batches, whole, in an order of their own each epoch (as fit shuffles
    a PyDataset): every epoch begins with the batch the one before began with, by chance
    (one time in 8), and goes on otherwise."""

    ORDERS = ([5, 2, 7, 0, 1, 3, 4, 6], [5, 6, 1, 3, 0, 7, 2, 4], [5, 0, 4, 6, 7, 2, 1, 3])

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = arrays()
        self.epoch, self.position, self.served = 0, 0, []

    def __len__(self) -> int:
        return N // BATCH

    def __getitem__(self, i: int):
        # its own order, whichever index fit's shuffle asks for
        b = self.ORDERS[self.epoch % len(self.ORDERS)][self.position % (N // BATCH)]
        self.position += 1
        self.served.append(b)
        return self.x[b * BATCH : (b + 1) * BATCH], self.y[b * BATCH : (b + 1) * BATCH]

    def on_epoch_end(self) -> None:
        self.epoch, self.position = self.epoch + 1, 0


def test_whole_batches_reshuffled_whose_first_comes_first_again_are_no_repeat():
    """Before, the second epoch's first batch alone was taken for the same order."""
    data = WholeBatches()
    found, read = fit(data, shuffle=True)
    assert read == "shuffle" and found == []
    # the batches served were each epoch's order (after any batch fit peeks at first)
    # fit peeks at the first batches, and ends an epoch after, so its epochs take the
    # orders from the second on: each begins with batch 5, and then another batch
    epochs = [data.served[-24:][e * 8 : (e + 1) * 8] for e in range(3)]
    assert [order[0] for order in epochs] == [5, 5, 5]
    assert len({order[1] for order in epochs}) == 3


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64", "int32", "bool"])
def test_a_sample_prints_alike_in_both_frameworks_wherever_it_sits_in_a_batch(dtype):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 3, 4)) * 100
    x = (x > 0) if dtype == "bool" else x.astype(dtype)
    in_keras = keras_prints(tf.constant(x), 8).numpy()
    assert np.isnan(in_keras[10:]).all()  # padded past the 5 samples
    in_torch = torch_prints(torch.from_numpy(x)).numpy().reshape(-1)
    np.testing.assert_array_equal(in_keras[:10], in_torch)
    moved = torch_prints(torch.from_numpy(x[[3, 0]])).numpy()
    np.testing.assert_array_equal(moved, in_torch.reshape(5, 2)[[3, 0]])
    assert len({tuple(p) for p in in_torch.reshape(5, 2)}) == 5  # different samples differ


def fit_validated(validation):
    sink = CapturingSink()
    m = model()
    x, y = arrays()
    m.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=4,
        verbose=0,
        validation_data=validation,
        callbacks=[KerasStethoscope(sinks=[sink])],
    )
    return [f for f in sink.findings if f.detector == "repeated_data"]


def test_a_validation_set_drawn_from_the_training_set_is_named():
    x, y = arrays()
    (found,) = fit_validated((x[:128], y[:128]))
    assert found.where == "validation data" and "overlaps the training data" in found.message


def test_a_held_out_validation_set_is_no_overlap():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(128, FEATURES)).astype("float32")
    assert fit_validated((x, (x[:, 0] > 0).astype("int64"))) == []
