"""KerasStethoscope on inputs of every layout (TensorFlow backend): float64, token ids,
dicts of inputs with a bool mask, complex values, token sequences of a length each batch
sets (a row of unknown width in the graph) and sparse inputs. Each fit completes with no
crash and no warning; and a sample prints alike in Keras and in Lightning whatever its
dtype and however its inputs nest."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.callbacks._keras.ops import inputs_finite, label_histogram  # noqa: E402
from stethoscope.callbacks._keras.ops import sample_prints as keras_prints  # noqa: E402
from stethoscope.callbacks._lightning.batch import sample_prints as torch_prints  # noqa: E402
from stethoscope.prints import MAX_PRINTS  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="these tests drive the TensorFlow backend"
)

N, FEATURES, CLASSES, VOCAB, BATCH = 96, 6, 3, 50, 16


def _labels(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return np.argmax(x[:, :CLASSES], axis=1).astype("int64")


def _dense_model(inputs, h) -> keras.Model:
    h = keras.layers.Dense(16, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(h))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _case(kind: str):
    """``(model, x, y)`` of layout ``kind`` (``y`` None: ``x`` is a dataset)."""
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    x = rng.normal(size=(N, FEATURES))
    y = _labels(rng, x)
    if kind == "float64":
        inputs = keras.Input((FEATURES,), dtype="float64")
        return _dense_model(inputs, keras.layers.Dense(8, dtype="float64")(inputs)), x, y
    if kind == "tokens":
        ids = rng.integers(0, VOCAB, (N, 8)).astype("int32")
        inputs = keras.Input((8,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(inputs))
        return _dense_model(inputs, h), ids, (ids[:, 0] % CLASSES).astype("int64")
    if kind == "dict":
        a = keras.Input((FEATURES,), name="a")
        b = keras.Input((FEATURES,), name="b", dtype="bool")
        h = keras.layers.Concatenate()([a, keras.ops.cast(b, "float32")])
        data = {"a": x.astype("float32"), "b": rng.normal(size=(N, FEATURES)) > 0}
        return _dense_model({"a": a, "b": b}, h), data, y
    if kind == "complex":
        inputs = keras.Input((FEATURES,), dtype="complex64")
        h = keras.layers.Lambda(lambda t: keras.ops.real(t))(inputs)
        return _dense_model(inputs, h), (x + 1j * rng.normal(size=x.shape)).astype("complex64"), y
    if kind == "variable_length":  # padded per batch: the graph's rows have no width

        def sequences():
            for i in range(N):
                length = 3 + i % 7
                yield rng.integers(1, VOCAB, length).astype("int32"), np.int64(i % CLASSES)

        spec = (tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int64))
        data = tf.data.Dataset.from_generator(sequences, output_signature=spec)
        # of known length: a generator's unknown one ends its first epoch on a step
        # that reads no batch, which the probe takes for a NaN loss (another matter)
        data = data.apply(tf.data.experimental.assert_cardinality(N))
        inputs = keras.Input((None,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(inputs))
        return _dense_model(inputs, h), data.padded_batch(BATCH), None
    if kind == "sparse":
        inputs = keras.Input((FEATURES,), sparse=True)
        dense = np.where(rng.random((N, FEATURES)) > 0.5, x, 0.0).astype("float32")
        data = tf.data.Dataset.from_tensor_slices(
            (tf.sparse.from_dense(dense), _labels(rng, dense))
        )
        return _dense_model(inputs, keras.layers.Dense(8)(inputs)), data.batch(BATCH), None
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind", ["float64", "tokens", "dict", "complex", "variable_length", "sparse"]
)
def test_every_input_layout_trains_to_the_end_without_a_warning(kind):
    """Before: a row of unknown width (math.prod of a None) and sparse inputs (a mean
    square of a SparseTensor) crashed the first step."""
    model, x, y = _case(kind)
    sink = CapturingSink()
    kw = {} if y is None else {"batch_size": BATCH}
    history = model.fit(
        x, y, epochs=2, verbose=0, shuffle=False, callbacks=[KerasStethoscope(sinks=[sink])], **kw
    )
    assert len(history.history["loss"]) == 2
    assert sink.at_least("warning") == []


def _both(x_np) -> int:
    """The prints of ``x_np`` (a nested structure of arrays) in both frameworks, equal;
    the samples printed."""
    in_keras = keras_prints(tf.nest.map_structure(tf.constant, x_np), MAX_PRINTS).numpy()
    in_keras = in_keras[~np.isnan(in_keras)]
    in_torch = torch_prints(torch.utils._pytree.tree_map(torch.from_numpy, x_np))
    np.testing.assert_array_equal(in_keras, in_torch.numpy().reshape(-1))
    return len(in_keras) // 2


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "complex64", "complex128"])
def test_a_sample_prints_alike_in_both_frameworks_in_more_dtypes(dtype):
    """Before, an int8's negative values were read as 16 bits in Keras and 8 in torch;
    complex inputs were not printed."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 3, 4)) * 100
    x = (x + 1j * x[::-1]).astype(dtype) if "complex" in dtype else x.astype(dtype)
    assert _both(x) == 5


def test_nested_inputs_and_wide_samples_print_alike_in_both_frameworks():
    rng = np.random.default_rng(4)
    nested = {
        "mask": rng.normal(size=(7, 3)) > 0,
        "x": rng.normal(size=(7, 5)).astype("float32"),
        "more": [rng.integers(0, 9, (7,)), rng.normal(size=(2, 2))],  # 2 samples: left out
    }
    assert _both(nested) == 7
    # samples wider than PRINT_WIDTH, in a batch past the budget: its first ones, alike
    assert _both(rng.normal(size=(300, 5000)).astype("float32")) == 104


def test_rows_of_unknown_width_and_sparse_inputs_are_skipped_and_still_checked():
    @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32)])
    def printed(ids):
        return keras_prints(ids, MAX_PRINTS) is None

    assert printed(tf.zeros((4, 5), tf.int32))
    sparse = tf.sparse.from_dense(tf.constant([[0.0, np.nan], [1.0, 0.0]]))
    assert keras_prints(sparse, MAX_PRINTS) is None
    assert not bool(inputs_finite({"s": sparse}))
    assert label_histogram(sparse) is None
    assert label_histogram(tf.fill((4, 2000), 1 / 2000)) is None  # too many classes to judge
