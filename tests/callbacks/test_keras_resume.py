"""A Keras fit that dies and is resumed (``BackupAndRestore``, at the epoch it was in)
into the record of the run it continues: its steps are numbered on from the record
(the optimizer counts only the updates it applied, not the steps the ladder skipped),
the batches the first run skipped past the checkpoint are skipped again where they come
back, bit for bit as a run that never saw them, and where the data is shuffled it says
that they are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from _keras_crash import Crash, CrashAt  # noqa: E402
from test_keras_recovery import BATCH, data, fit, model, same_state, without  # noqa: E402

from stethoscope import KerasStethoscope  # noqa: E402
from stethoscope.findings import RECOVERY  # noqa: E402
from stethoscope.record import RunRecord  # noqa: E402
from stethoscope.testing import CapturingSink  # noqa: E402


def first_run(tmp_path: Path) -> tuple[Path, Path]:
    """30 batches an epoch, batch 5 NaN: skipped at step 5 and at step 35; the run
    backs up at the end of epoch 0 and dies in epoch 1 at its batch 12. Returns the
    record's and the backup's directories."""
    record, backup = tmp_path / "run", tmp_path / "backup"
    x, y = data(30, poison={5: "nan"})
    callbacks = [
        KerasStethoscope(sinks=[], record=record, recover=True),
        keras.callbacks.BackupAndRestore(backup),
        CrashAt(1, 12),
    ]
    with pytest.raises(Crash):
        fit(model("sgd"), x, y, callbacks, epochs=2)
    return record, backup


def resume(record: Path, backup: Path, sink: CapturingSink, *, shuffle: bool = False) -> Any:
    """The first run's fit again, in a fresh process (a new model and callbacks), on data
    where batch 5 is fine now, resumed by ``BackupAndRestore``; the stethoscope comes
    first in the list, before the callback that restores the weights."""
    x, y = data(30)
    resumed = model("sgd")
    callbacks = [
        KerasStethoscope(sinks=[sink], record=record, recover=True),
        keras.callbacks.BackupAndRestore(backup),
    ]
    resumed.fit(x, y, batch_size=BATCH, shuffle=shuffle, verbose=0, callbacks=callbacks, epochs=2)
    return resumed


def test_a_resumed_fit_skips_again_the_batch_it_skipped_past_its_checkpoint(tmp_path):
    sink = CapturingSink()
    resumed = resume(*first_run(tmp_path), sink)
    # skipped all the same, as the run it continues did (PaLM's rewind-and-skip)
    twin = model("sgd")
    fit(twin, *without(*data(30), [5]), [], epochs=2)  # never saw batch 5, in either epoch
    same_state(resumed, twin)
    assert int(resumed.optimizer.iterations.numpy()) == 58
    [again] = [f for f in sink.findings if f.detector == RECOVERY]
    assert (again.step, again.where, again.severity.value) == (35, "skip", "info")
    assert "(batch 5 of epoch 1): it was skipped at step 35" in again.message
    assert "the loss was nan" in again.message and "skipped again" in again.message
    with RunRecord(tmp_path / "run") as kept:
        steps = kept.losses().steps
        assert [b.step for b in kept.skipped_batches()] == [5, 35]
        assert [e["epoch"] for e in kept.epochs()] == [0, 1]
    # numbered on from the record: epoch 1 is steps 30 to 59, each once
    assert np.array_equal(np.sort(steps), np.arange(60))


def test_a_resumed_fit_on_shuffled_data_says_it_cannot_skip_them_again(tmp_path):
    sink = CapturingSink()
    resumed = resume(*first_run(tmp_path), sink, shuffle=True)
    assert int(resumed.optimizer.iterations.numpy()) == 59  # nothing skipped
    [said] = [f for f in sink.findings if f.detector == RECOVERY]
    assert (said.step, said.where, said.severity.value) == (30, "resume", "info")
    assert "skipped 1 batch past step 30 (batch 5 of epoch 1)" in said.message
    assert "not skipped again here: fit shuffles the data every epoch" in said.message
