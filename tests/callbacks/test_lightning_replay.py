"""LightningStethoscope(recover=Recovery(replay=True)) on real training: a step judged bad
is computed once more from the same state with the same batch, which tells a transient
fault (fine the second time: applied) from a bad batch (bad again: skipped and named);
and the batches a run skipped last, in its checkpoint and its record, so that a run
resumed from an earlier checkpoint skips them again."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from test_lightning_recovery import Net, Spy, batches, train

from stethoscope import LightningStethoscope, Recovery
from stethoscope.callbacks._lightning.batch import fingerprint
from stethoscope.findings import RECOVERY
from stethoscope.record.reader import RunRecord
from stethoscope.testing import CapturingSink


class FlakyNet(Net):
    """A NaN in the inputs of the first computation of step ``at`` alone: a fault of the
    machine, which a second computation does not meet."""

    def __init__(self, at: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.at, self.computed = at, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step == self.at:
            self.computed += 1
            if self.computed == 1:
                x = x.clone()
                x[0, 0] = math.nan
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def _acts(sink: CapturingSink) -> list[tuple[int, str]]:
    return [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_fault_met_once_is_replayed_applied_and_called_transient(optimizer):
    torch.manual_seed(0)
    model = FlakyNet(at=20, optimizer=optimizer)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=Recovery(replay=True))
    trainer = train(model, batches(40), [callback])
    assert model.computed == 2  # the first computation, and its replay
    assert _acts(sink) == [(20, "replay")]
    [replay] = [f for f in sink.findings if f.where == "replay"]
    assert replay.severity == "warning" and "batch 20 of epoch 0" in replay.message
    assert "fine: a transient fault of the machine" in replay.message
    # the replay's update was applied: bit for bit the run that never met the fault
    torch.manual_seed(0)
    twin = FlakyNet(at=None, optimizer=optimizer)
    train(twin, batches(40), [])
    _same_weights(model, twin)
    assert trainer.global_step == 40
    [row] = [r for r in callback.summaries[-1].rows if r.detector == RECOVERY]
    assert row.verdict == "met a transient fault"


def test_without_replay_the_same_fault_is_skipped():
    torch.manual_seed(0)
    model = FlakyNet(at=20)
    sink = CapturingSink()
    train(model, batches(40), [LightningStethoscope(sinks=[sink], recover=True)])
    assert model.computed == 1 and _acts(sink) == [(20, "skip")]


def test_a_bad_batch_is_bad_again_skipped_and_named_with_its_fingerprint():
    data = batches(40, poison={20: "nan"})
    torch.manual_seed(0)
    model = Net("adamw")
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=Recovery(replay=True))
    train(model, data, [callback])
    assert _acts(sink) == [(20, "skip")]
    [skip] = [f for f in sink.findings if f.where == "skip"]
    printed = fingerprint(data[20])
    assert f"(batch 20 of epoch 0, fingerprint {printed})" in skip.message
    assert "judged bad again: the batch (or the numerics), not the machine" in skip.message
    [kept] = callback.recoverer.skipped_data.batches
    assert (kept.step, kept.batch.index, kept.batch.fingerprint) == (20, 20, printed)
    assert kept.replay == "reproduces"
    torch.manual_seed(0)
    twin = Net("adamw")
    train(twin, [b for i, b in enumerate(data) if i != 20], [])
    _same_weights(model, twin)


def test_replay_is_refused_where_a_step_cannot_be_computed_again():
    torch.manual_seed(0)
    model = FlakyNet(at=20)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=Recovery(replay=True))
    with pytest.warns(RuntimeWarning, match=r"accumulate_grad_batches=2, the step's closure"):
        train(model, batches(60), [callback], accumulate_grad_batches=2)
    # the two micro-batches of step 20, the first with the fault, and no replay
    assert model.computed == 2 and _acts(sink) == [(20, "skip")]


class FaultAt(Net):
    """A NaN in the inputs of step ``at`` (inside the training step: the batch itself, and
    so its fingerprint, stays as the loader gave it)."""

    def __init__(self, at: int | None) -> None:
        super().__init__("sgd")
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step == self.at:
            x = x.clone()
            x[0, 0] = math.nan
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _fit(model: Net, tmp_path, record, ckpt_path=None, sink=None, seed=0) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = LightningStethoscope(sinks=[sink or CapturingSink()], recover=True, record=record)
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, every_epoch],
    )
    loader = torch.utils.data.DataLoader(batches(10, seed=seed), batch_size=None)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def test_a_run_resumed_before_a_skip_skips_the_batch_again_from_the_record(tmp_path):
    record = tmp_path / "record"
    torch.manual_seed(0)
    first = FaultAt(at=15)  # batch 5 of epoch 1
    _fit(first, tmp_path, record)
    checkpoints = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert [p.name for p in checkpoints] == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt"]
    # the last checkpoint holds the batch skipped, its record too
    state = torch.load(checkpoints[-1], weights_only=False)["callbacks"]
    [held] = next(iter(state.values()))["recovery"]["skipped_batches"]
    assert (held["step"], held["batch"]["epoch"], held["batch"]["index"]) == (15, 1, 5)
    # the run is taken up again from the end of epoch 0, before the skip, without the
    # fault: the record tells it which batch was skipped, and it skips it again
    torch.manual_seed(0)
    again = FaultAt(at=None)
    sink = CapturingSink()
    _fit(again, tmp_path, record, ckpt_path=checkpoints[0], sink=sink)
    [skip] = [f for f in sink.findings if f.detector == RECOVERY]
    assert skip.step == 15 and skip.where == "skip"
    assert "it was skipped at step 15 (the loss is nan), and is skipped again" in skip.message
    _same_weights(again, first)  # bit for bit: the batch skipped, as in the first run
    with RunRecord(record) as reader:
        rows = reader.skipped_batches()
    assert [(r.step, r.batch.epoch, r.batch.index) for r in rows] == [(15, 1, 5)]
    # ... and the report lists it
    from stethoscope.record.report import write_report

    write_report(record, output=tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "Skipped batches (1)" in page and rows[0].batch.fingerprint in page


def test_a_batch_that_comes_back_changed_is_not_skipped(tmp_path):
    record = tmp_path / "record"
    torch.manual_seed(0)
    _fit(FaultAt(at=15), tmp_path, record)
    first_ckpt = sorted((tmp_path / "ckpt").glob("*.ckpt"))[0]
    sink = CapturingSink()  # other data where the skipped batch was
    _fit(FaultAt(at=None), tmp_path, record, ckpt_path=first_ckpt, sink=sink, seed=1)
    acts = [f for f in sink.findings if f.detector == RECOVERY]
    assert [(f.step, f.where) for f in acts] == [(15, "resume")]
    assert "the loader's order changed, so it is not skipped" in acts[0].message


def test_skip_ahead_skips_the_batches_after_a_roll_back_and_keeps_them():
    data = batches(60, poison={25: "nan", 27: "nan"})
    settings = Recovery(
        cool_after=1, rollback_after=1, snapshot_every=10, cool_steps=10, skip_ahead=5
    )
    torch.manual_seed(0)
    sink, spy = CapturingSink(), Spy({27, 32, 33})
    callback = LightningStethoscope(sinks=[sink], recover=settings)
    trainer = train(Net("adamw"), data, [callback, spy])
    [rollback] = [f for f in sink.findings if f.where == "rollback"]
    assert rollback.step == 27 and "the next 5 batches are skipped (skip_ahead)" in rollback.message
    kept = callback.recoverer.skipped_data.batches
    assert [(b.step, b.batch.index) for b in kept] == [(s, s) for s in (25, 27, 28, 29, 30, 31, 32)]
    assert kept[-1].why == "one of the 5 batches after the roll back at step 27 (skip_ahead)"
    # nothing applied in those steps, and training goes on after them
    for name, value in spy.weights[27].items():
        assert torch.equal(spy.weights[32][name], value), name
    assert any(not torch.equal(spy.weights[33][k], v) for k, v in spy.weights[32].items())
    assert trainer.global_step == 60 and not trainer.should_stop


class NormNet(FlakyNet):
    """With a BatchNorm, whose running statistics a training forward pass moves."""

    def __init__(self, at: int | None = None) -> None:
        super().__init__(at=at, optimizer="sgd")
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 3),
        )


@pytest.mark.parametrize("fault", ["nan_batch", "transient"])
def test_a_skip_or_a_replay_leaves_batchnorm_as_if_the_fault_never_was(fault):
    data = batches(40, poison={20: "nan"} if fault == "nan_batch" else None)
    torch.manual_seed(0)
    model = NormNet(at=20 if fault == "transient" else None)
    recover = Recovery(replay=True) if fault == "transient" else True
    train(model, data, [LightningStethoscope(sinks=[], recover=recover)])
    torch.manual_seed(0)
    twin = NormNet()
    train(twin, [b for i, b in enumerate(data) if i != 20] if fault == "nan_batch" else data, [])
    norm = model.net[1]
    assert torch.isfinite(norm.running_mean).all() and torch.isfinite(norm.running_var).all()
    _same_weights(model, twin)  # the running statistics and their count too, bit for bit
