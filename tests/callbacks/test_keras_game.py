"""A Keras game (a GAN: a train step of its own, an optimizer per player): the detectors
that assume the loss should fall sit it out, the second player's optimizer is seen as one,
and the other detectors judge it as usual."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() != "tensorflow", reason="the train step uses tf.GradientTape"
    ),
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
]

NOISE = 8


class GAN(keras.Model):
    """A GAN on a mixture of four 2-D Gaussians, as Keras' GAN examples write it: the
    discriminator's optimizer is an attribute set in ``compile``, the generator's is
    ``model.optimizer``, and the generator's loss goes through ``compute_loss`` (so the
    callback sees it). ``nan_at``: a NaN in the real batch of that step. ``seed``: the
    players' initialisation (else the process's random state, which the tests run
    before this one would decide)."""

    def __init__(self, nan_at: int = -1, seed: int = 0) -> None:
        super().__init__()
        keras.utils.set_random_seed(seed)
        self.generator = keras.Sequential(
            [
                keras.Input((NOISE,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        self.discriminator = keras.Sequential(
            [
                keras.Input((2,)),
                keras.layers.Dense(32),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Dense(1),
            ]
        )
        self.noise = keras.random.SeedGenerator(0)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.nan_at = nan_at

    def compile(self) -> None:  # type: ignore[override]
        super().compile(
            optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
        self.d_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)

    def call(self, x):
        return self.discriminator(x)

    def train_step(self, data):
        x = data
        if self.nan_at >= 0:
            poisoned = tf.tensor_scatter_nd_update(x, [[0, 0]], [float("nan")])
            x = tf.where(tf.equal(self.optimizer.iterations, self.nan_at), poisoned, x)
        n = tf.shape(x)[0]
        real, fake = tf.ones((n, 1)), tf.zeros((n, 1))
        noise = keras.random.normal((n, NOISE), seed=self.noise)
        d_vars = self.discriminator.trainable_variables
        with tf.GradientTape() as tape:
            made = self.generator(noise, training=True)
            d_loss = self.bce(real, self.discriminator(x, training=True)) + self.bce(
                fake, self.discriminator(made, training=True)
            )
        self.d_optimizer.apply(tape.gradient(d_loss, d_vars), d_vars)
        g_vars = self.generator.trainable_variables
        with tf.GradientTape() as tape:
            judged = self.discriminator(self.generator(noise, training=True), training=True)
            g_loss = self.compute_loss(x=noise, y=real, y_pred=judged, training=True)
        self.optimizer.apply(tape.gradient(g_loss, g_vars), g_vars)
        return {"loss": g_loss, "d_loss": d_loss}


def _train(model: GAN, sink: CapturingSink, epochs: int = 4) -> KerasStethoscope:
    rng = np.random.default_rng(0)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]], "float32")
    x = centers[rng.integers(0, 4, 4096)] + 0.2 * rng.standard_normal((4096, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    model.compile()
    callback = KerasStethoscope(sinks=[sink], stop_on=None)
    model.fit(x, batch_size=64, epochs=epochs, verbose=0, callbacks=[callback])
    return callback


@pytest.mark.parametrize("seed", [0, 35])
def test_a_healthy_keras_gan_is_quiet(seed):
    """Before: frozen_weights warned at step 0 that the discriminator's variables were in
    no optimizer (they are in the model's second one), and the rules that assume the
    loss should fall judged the generator's. Seed 35: the discriminator's one output on
    the generator's first samples lies within [0, 1] on every row, on and off for 60
    steps, which logits_mismatch took for a sigmoid's at step 1."""
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        callback = _train(GAN(seed=seed), sink)
    assert callback.monitor.detectors[0].setup.adversarial
    assert [(f.step, f.detector) for f in sink.findings if f.severity != "info"] == []


def test_a_nan_in_a_keras_gan_is_still_caught():
    sink = CapturingSink()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        _train(GAN(nan_at=20), sink, epochs=1)
    assert sink.by_detector("nonfinite_loss") or sink.by_detector("nonfinite_gradients")


def test_a_layer_left_out_of_every_optimizer_is_still_named_in_keras_words():
    """The second player's optimizer excuses only the variables it holds."""

    class Lazy(GAN):
        def train_step(self, data):
            n = tf.shape(data)[0]
            noise = keras.random.normal((n, NOISE), seed=self.noise)
            g_vars = self.generator.trainable_variables[:2]  # the last layer never trains
            with tf.GradientTape() as tape:
                judged = self.discriminator(self.generator(noise, training=True))
                g_loss = self.compute_loss(x=noise, y=tf.ones((n, 1)), y_pred=judged)
            self.optimizer.apply(tape.gradient(g_loss, g_vars), g_vars)
            d_vars = self.discriminator.trainable_variables
            self.d_optimizer.apply([tf.zeros_like(v) for v in d_vars], d_vars)
            return {"loss": g_loss}

    sink, model = CapturingSink(), Lazy()
    with pytest.warns(RuntimeWarning, match="several optimizers by hand"):
        _train(model, sink, epochs=1)
    (f,) = sink.by_detector("frozen_weights")
    last = model.generator.layers[-1]
    assert (f.where, f.value) == (last.kernel.path, 2.0)  # its kernel and bias, no more
    assert "optimizer.apply in the train step" in f.message and "requires_grad" not in f.message
