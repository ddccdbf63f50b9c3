"""A machine that dies in the middle of a Keras fit, for the tests of a run resumed from
its backup (``test_keras_resume.py``, ``_multiworker_worker.py``). Imports Keras: a
worker that configures its devices first imports this after it has."""

from __future__ import annotations

import keras


class Crash(Exception):
    """The machine died."""


class CrashAt(keras.callbacks.Callback):
    """Raises :class:`Crash` at the start of batch ``batch`` of epoch ``epoch`` (on every
    worker alike: a machine that dies takes the job down with it)."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if (self.epoch, batch) == self.at:
            raise Crash
