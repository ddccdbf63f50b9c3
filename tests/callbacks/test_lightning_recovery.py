"""LightningStethoscope(recover=...) on real training: a skipped step leaves the weights
and the optimizer exactly as a run that never saw the batch, a cool-down scales the
learning rate for the optimizer alone, a roll back restores the last healthy snapshot,
and a fault that persists ends in a stop with the ladder's history."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from stethoscope import LightningStethoscope, Recovery
from stethoscope.detectors import default_detectors
from stethoscope.findings import RECOVERY
from stethoscope.testing import CapturingSink, RecordingDetector

FEATURES, CLASSES = 12, 3


def batches(n: int, *, poison: dict[int, str] | None = None, seed: int = 0) -> list:
    """``n`` fixed batches; ``poison`` maps a batch index to ``"nan"`` (a NaN input) or
    ``"spike"`` (inputs 100x too large and every label wrong)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    out = []
    for i in range(n):
        x = torch.randn(16, FEATURES, generator=g)
        y = (x @ teacher).argmax(1)
        if (poison or {}).get(i) == "nan":
            x = x.clone()
            x[0, 0] = math.nan
        if (poison or {}).get(i) == "spike":
            x, y = x * 100.0, (y + 1) % CLASSES  # confidently wrong: a loss spike
        out.append((x, y))
    return out


class Net(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))
        self.optimizer, self.lr = optimizer, lr
        self.seen_lr: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters()
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr / 20, weight_decay=0.01)
        if self.optimizer == "adamw-fused":
            return torch.optim.AdamW(params, lr=self.lr / 20, weight_decay=0.01, fused=True)
        if self.optimizer == "sgd-fused":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, fused=True)
        raise ValueError(self.optimizer)


def train(model: L.LightningModule, data: list, callbacks: list, **kw: Any) -> L.Trainer:
    """A fit of one epoch over ``data`` (unless ``kw`` says otherwise)."""
    defaults = dict(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = L.Trainer(**{**defaults, **kw}, callbacks=callbacks)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return trainer


def _same_state(a: Net, b: Net, trainer_a: L.Trainer, trainer_b: L.Trainer) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = trainer_a.optimizers[0].state_dict(), trainer_b.optimizers[0].state_dict()
    for key, state in sa["state"].items():
        for field, value in state.items():
            other = sb["state"][key][field]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (key, field)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-fused"])
def test_a_skipped_step_is_as_if_the_batch_was_never_seen(optimizer):
    poisoned = batches(60, poison={41: "nan"})
    torch.manual_seed(0)
    model = Net(optimizer)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    trainer = train(model, poisoned, [callback])
    assert trainer.global_step == 60 and not trainer.should_stop  # every step taken
    torch.manual_seed(0)
    twin = Net(optimizer)
    twin_trainer = train(twin, [b for i, b in enumerate(poisoned) if i != 41], [])
    _same_state(model, twin, trainer, twin_trainer)  # bit for bit, state step counts too
    [skip] = [f for f in sink.findings if f.detector == RECOVERY]
    assert skip.step == 41 and skip.where == "skip" and "the loss is nan" in skip.message
    assert any(f.detector == "nonfinite_loss" and f.step == 41 for f in sink.findings)
    assert callback.recoverer.ladder.counts == {"skip": 1, "cool": 0, "rollback": 0, "stop": 0}
    assert "step" not in trainer.optimizers[0].__dict__  # the optimizer's own step is back
    [row] = [r for r in callback.summaries[-1].rows if r.detector == RECOVERY]
    assert row.verdict == "skipped 1 step" and row.status == "info"


@pytest.mark.parametrize("lag", [None, 1], ids=["host", "device"])
def test_two_nan_batches_in_a_row_are_the_data_not_a_harmful_update(lag):
    # two steps judged bad right after an applied one would roll back (the weights that
    # update left are suspect), but a NaN in each batch's inputs explains both; on the
    # device the verdict lands a step late, and the batch is still at hand
    from _accelerator import SimulatedAccelerator, SimulatedSteps

    poisoned = batches(60, poison={41: "nan", 42: "nan"})
    torch.manual_seed(0)
    model = Net("adamw-fused")
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=Recovery(cool_after=5))
    if lag is None:
        trainer = train(model, poisoned, [callback])
    else:
        with SimulatedAccelerator(lag=lag) as sim:
            trainer = train(model, poisoned, [SimulatedSteps(sim), callback])
    skips = [f for f in sink.findings if f.detector == RECOVERY]
    assert [(f.step, f.where) for f in skips] == [(41, "skip"), (42, "skip")]
    assert all("the batch's inputs hold NaN or Inf" in f.message for f in skips)
    torch.manual_seed(0)
    twin = Net("adamw-fused")
    twin_trainer = train(twin, [b for i, b in enumerate(poisoned) if i not in (41, 42)], [])
    _same_state(model, twin, trainer, twin_trainer)


class SpySGD(torch.optim.SGD):
    """Keeps the learning rate each step is applied with."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.applied: list[float] = []

    def step(self, closure=None):  # type: ignore[override]
        self.applied.append(self.param_groups[0]["lr"])
        return super().step(closure)


class SpyNet(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = SpySGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_cool_down_scales_the_learning_rate_on_top_of_the_schedule_then_restores_it():
    data = batches(60, poison={40: "nan", 42: "nan"})
    torch.manual_seed(0)
    model = SpyNet()
    settings = Recovery(cool_after=2, window=10, cool_steps=5, cool_factor=0.5)
    sink = CapturingSink()
    spy = RecordingDetector({"grads"})  # the learning rate each step is observed at
    detectors = [*default_detectors(), spy]
    cb = LightningStethoscope(
        sinks=[sink], recover=settings, detectors=detectors, intervals={"recorder": 1}
    )
    trainer = train(model, data, [cb])
    applied = trainer.optimizers[0].applied
    assert len(applied) == 58  # two skipped
    schedule = [0.1 * 0.99**s for s in range(60) if s not in (40, 42)]
    cooled = [i for i, s in enumerate(s for s in range(60) if s not in (40, 42)) if 43 <= s <= 47]
    for i, (lr, planned) in enumerate(zip(applied, schedule, strict=True)):
        assert lr == pytest.approx(planned * (0.5 if i in cooled else 1.0)), i
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.99**60)
    # findings and the record give each step the rate its update was taken at, cooled
    taken = dict(zip((s for s in range(60) if s not in (40, 42)), applied, strict=True))
    seen = {o.step: o.lr for o in spy.seen if o.step in taken}
    assert len(seen) > 50 and seen == pytest.approx({s: taken[s] for s in seen})
    acts = [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]
    assert acts == [(40, "skip"), (42, "skip"), (42, "cool"), (48, "restore_lr")]


class SpikedNet(Net):
    """Plain SGD at lr 0.1, whose learning rate something sets x1000 for steps 30..45
    before each batch (a scheduler gone wrong)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SpySGD(self.parameters(), lr=0.1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        spiking = 30 <= self.global_step <= 45
        self.trainer.optimizers[0].param_groups[0]["lr"] = 100.0 if spiking else 0.1


@pytest.mark.parametrize("seen_by", ["large_updates", "the next two steps"])
def test_a_spike_the_gate_cannot_see_is_rolled_back_and_its_rest_cooled_from_before_it(
    seen_by,
):
    torch.manual_seed(0)
    model = SpikedNet()
    settings = Recovery(snapshot_every=10, cool_steps=30, trust_after=5)
    sink = CapturingSink()
    # without large_updates, only the steps after the damage can tell
    detectors = default_detectors(large_updates=None) if seen_by != "large_updates" else None
    callback = LightningStethoscope(sinks=[sink], recover=settings, detectors=detectors)
    trainer = train(model, batches(80), [callback])
    acts = [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]
    applied = trainer.optimizers[0].applied
    # step 30 is applied at lr 100: its loss and gradients were fine
    assert applied[30] == 100.0
    if seen_by == "large_updates":  # the update itself, 29x the weights' norm
        assert acts[:2] == [(30, "rollback"), (30, "cool")]
        first = 31
    else:  # the next two steps are judged bad: the weights are, not a batch
        assert acts[:4] == [(31, "skip"), (32, "skip"), (32, "rollback"), (32, "cool")]
        [rollback] = [f for f in sink.findings if f.where == "rollback"]
        assert "because steps 31 and 32, the two after step 30's update, were both " in (
            rollback.message
        )
        first = 33
    # back to a snapshot from before the spike (20; 30 is the spike's own step)
    rollback = next(f for f in sink.findings if f.where == "rollback")
    assert "snapshot of step 20" in rollback.message
    # the spike goes on to step 45: the learning rate had risen 1000x since the snapshot,
    # so it goes no higher than the snapshot's (0.1) for the cool-down's 30 steps
    skipped = first - 31
    assert len(applied) == 80 - skipped
    assert applied[first - skipped : 46 - skipped] == pytest.approx([0.1] * (46 - first))
    [cool] = [f for f in sink.findings if f.where == "cool"]
    assert "the learning rate had risen 1e+03x above the snapshot's" in cool.message
    assert trainer.global_step == 80 and not trainer.should_stop


class Spy(L.Callback):
    """After stethoscope's batch end: the module's weights at chosen steps."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.weights = steps, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step - 1 in self.steps:
            self.weights[trainer.global_step - 1] = {
                k: v.clone() for k, v in pl_module.state_dict().items()
            }


class SnapshotFiles(L.Callback):
    """The snapshot files on disk at each batch end, and whether any is left at the end."""

    def __init__(self, directory) -> None:
        self.directory, self.most = directory, 0

    def on_train_batch_end(self, *args) -> None:
        self.most = max(self.most, len(list(self.directory.glob("snapshot-*.pt"))))


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_skips_during_a_cool_down_roll_back_to_the_last_healthy_snapshot(where, tmp_path):
    data = batches(60, poison={25: "nan", 27: "nan"})
    settings = Recovery(
        cool_after=1,
        rollback_after=1,
        snapshot_every=10,
        cool_steps=10,
        snapshot_in=where,
        snapshot_dir=tmp_path / "snaps",
    )
    torch.manual_seed(0)
    model = Net("adamw")
    sink = CapturingSink()
    spy = Spy({27})
    files = SnapshotFiles(tmp_path / "snaps")
    callback = LightningStethoscope(sinks=[sink], recover=settings)
    trainer = train(model, data, [callback, spy, files])
    if where == "disk":  # two kept at most, and none left behind once training is over
        assert files.most == 2 and not list((tmp_path / "snaps").glob("*.pt"))
    else:
        assert files.most == 0
    assert trainer.global_step == 60 and not trainer.should_stop
    torch.manual_seed(0)
    twin = Net("adamw")
    train(twin, data[:21], [])  # the snapshot of step 20 holds the weights after 21 steps
    for name, value in twin.state_dict().items():
        assert torch.equal(spy.weights[27][name], value), name
    acts = [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]
    assert acts[:5] == [(25, "skip"), (25, "cool"), (27, "skip"), (27, "rollback"), (27, "cool")]
    rollback = next(f for f in sink.findings if f.where == "rollback")
    assert "snapshot of step 20" in rollback.message and "steps 21…27" in rollback.message
    assert callback.recoverer.ladder.counts["rollback"] == 1
    [row] = [r for r in callback.summaries[-1].rows if r.detector == RECOVERY]
    assert row.status == "warning"
    assert row.verdict == "skipped 2 steps, cooled the LR 2x, restored the LR, rolled back once"


def test_a_fault_that_persists_climbs_the_ladder_and_stops():
    data = batches(200, poison={i: "nan" for i in range(30, 200)})
    settings = Recovery(snapshot_every=10, max_rollbacks=2)
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=settings)
    trainer = train(Net("sgd"), data, [callback])
    # steps 30 and 31, right after an applied step, blame its update: a roll back; the
    # restored weights fare no better, so it is the data, skipped until a whole window
    # of steps was skipped (another roll back would not mend data)
    assert trainer.should_stop and trainer.global_step == 130
    stop = callback.stopped_by
    assert stop.detector == RECOVERY and stop.severity == "error"
    assert "gave up: every one of the last 100 steps was skipped" in stop.message
    counts = callback.recoverer.ladder.counts
    assert counts["rollback"] == 1 and counts["stop"] == 1 and counts["skip"] == 100


def test_a_healthy_run_takes_no_action():
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    train(Net("adamw"), batches(250), [callback])
    assert [f for f in sink.findings if f.detector == RECOVERY] == []
    assert callback.recoverer.ladder.counts == {"skip": 0, "cool": 0, "rollback": 0, "stop": 0}


def test_bad_recover_values_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"recover='always' is not valid; use False"):
        LightningStethoscope(recover="always")


def test_an_optimizer_whose_step_cannot_be_skipped_is_refused():
    class LBFGSNet(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="recover= cannot skip the steps of LBFGS"):
        train(LBFGSNet(), batches(4), [LightningStethoscope(sinks=[], recover=True)])


def test_with_gradient_clipping_a_spike_is_judged_before_the_clipping():
    data = batches(80, poison={60: "spike"})
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    trainer = train(Net("sgd"), data, [callback], gradient_clip_val=1.0)
    assert trainer.global_step == 80
    [skip] = [f for f in sink.findings if f.detector == RECOVERY]
    assert skip.step == 60 and "past the" in skip.message


def test_an_accumulated_step_with_one_bad_micro_batch_is_skipped_whole():
    data = batches(80, poison={41: "nan"})  # micro-batch 1 of step 10 (4 per step)
    torch.manual_seed(0)
    model = Net("adamw")
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    trainer = train(model, data, [callback], accumulate_grad_batches=4)
    assert trainer.global_step == 20
    torch.manual_seed(0)
    twin = Net("adamw")
    twin_trainer = train(twin, data[:40] + data[44:], [], accumulate_grad_batches=4)
    _same_state(model, twin, trainer, twin_trainer)
    assert [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY] == [(10, "skip")]


class TwoOptimizers(Net):
    """Manual optimization, an optimizer per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, second = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.net[0].parameters(), lr=0.05, momentum=0.9),
            torch.optim.Adam(self.net[2].parameters(), lr=1e-3),
        )


def test_manual_optimization_with_two_optimizers_skips_both_and_counts_one_step():
    data = batches(60, poison={30: "nan"})
    torch.manual_seed(0)
    model = TwoOptimizers()
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    trainer = train(model, data, [callback])
    torch.manual_seed(0)
    twin = TwoOptimizers()
    train(twin, data[:30] + data[31:], [])
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    skips = [f for f in sink.findings if f.detector == RECOVERY]
    assert [f.where for f in skips] == ["skip"] and not trainer.should_stop


def test_the_report_marks_the_skips_the_cool_downs_and_the_roll_back(tmp_path):
    pytest.importorskip("plotly")
    from stethoscope.record.report import cool_downs, figures

    data = batches(60, poison={25: "nan", 27: "nan"})
    settings = Recovery(cool_after=1, rollback_after=1, snapshot_every=10, cool_steps=10)
    torch.manual_seed(0)
    callback = LightningStethoscope(sinks=[], recover=settings, record=tmp_path / "run")
    train(Net("adamw"), data, [callback])
    from stethoscope.record import RunRecord

    with RunRecord(tmp_path / "run") as record:
        spans = cool_downs(record.findings(), 59)
        loss = figures(record)["loss"]
    assert [(a, b) for a, b, _ in spans] == [(25, 27), (27, 38)]  # cooled, cooled again
    traces = {t.name: t for t in loss.data}
    assert list(traces["skipped step (2)"].x) == [25, 27]
    assert [x for x in traces["rolled back"].x if x is not None] == [27, 27]
    assert "learning rate cooled (recovery)" in traces


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused"])
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_step_skipped_on_the_device_is_as_if_the_batch_was_never_seen(optimizer, lag):
    """As on a GPU (the CPU played as one, the device ``lag`` steps behind): the verdict a
    tensor, handed to the fused optimizer's ``found_inf``, read back when it lands."""
    from _accelerator import SimulatedAccelerator, SimulatedSteps

    poisoned = batches(60, poison={41: "nan", 50: "spike"})
    torch.manual_seed(0)
    model = Net(optimizer)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    with SimulatedAccelerator(lag=lag) as sim:
        trainer = train(model, poisoned, [SimulatedSteps(sim), callback])
    # healthy steps never wait; the inputs of a step skipped for its NaN loss are read
    # once (whether they hold NaN or Inf), when its verdict lands, up to ``lag`` steps on
    waits = sim.train_syncs()
    assert len(waits) <= 1 and all(s.kind == "wait" and 41 <= s.step <= 41 + lag for s in waits)
    assert trainer.global_step == 60 and not trainer.should_stop
    torch.manual_seed(0)
    twin = Net(optimizer)
    twin_trainer = train(twin, [b for i, b in enumerate(poisoned) if i not in (41, 50)], [])
    _same_state(model, twin, trainer, twin_trainer)
    skips = [f for f in sink.findings if f.detector == RECOVERY]
    assert [(f.step, f.where) for f in skips] == [(41, "skip"), (50, "skip")]
    assert "the loss was nan" in skips[0].message
    assert "past the" in skips[1].message
    assert "found_inf" not in trainer.optimizers[0].__dict__  # nothing left on it


def test_a_resumed_run_continues_the_ladder_from_its_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = batches(60, poison={10: "nan", 12: "nan", 14: "nan"})

    def fit(max_steps: int, ckpt_path=None) -> LightningStethoscope:
        callback = LightningStethoscope(sinks=[], recover=True)
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                callback,
                ModelCheckpoint(dirpath=tmp_path / f"to{max_steps}", save_last=True),
            ],
        )
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        trainer.fit(Net("sgd"), loader, ckpt_path=ckpt_path)
        return callback

    torch.manual_seed(0)
    first = fit(30)
    assert first.recoverer.ladder.counts["skip"] == 3 and first.recoverer.ladder.cooling(29)
    torch.manual_seed(0)
    resumed = fit(60, ckpt_path=tmp_path / "to30" / "last.ckpt")
    ladder = resumed.recoverer.ladder
    # the history came back with the checkpoint; the epoch's loader starts over on resume,
    # so the three NaN batches come again, after step 30, and are skipped again
    skips = [r.step for r in ladder.history if r.act == "skip"]
    assert skips[:3] == [10, 12, 14] and len(skips) == 6 and min(skips[3:]) >= 30
    # still in the cool-down of step 14, those skips roll back, to the snapshot the
    # resumed fit took when it started (snapshots are not kept in checkpoints)
    [rollback] = [r for r in ladder.history if r.act == "rollback"]
    assert rollback.step == 44 and "snapshot taken before step 30" in rollback.why
    assert ladder.lr_scale(59) == 0.1


def test_a_half_precision_gradient_with_a_large_norm_is_not_skipped_as_non_finite():
    from stethoscope import Monitor
    from stethoscope.callbacks._lightning.recovery import StepGate
    from stethoscope.recovery import Recoverer

    skipped: list[str] = []
    gate = StepGate(
        Recoverer(Monitor(sinks=[]), Recovery()),
        None,
        None,
        lambda step, why: skipped.append(why),
        lambda step: None,
    )
    weight = nn.Parameter(torch.zeros(100_000, dtype=torch.float16))
    weight.grad = torch.full_like(weight, 300.0)  # norm ~9.5e4, past fp16's largest
    optimizer = torch.optim.SGD([weight], lr=0.1)
    gate.new_step(0)
    gate.saw_loss(torch.tensor(1.0), 1.0)
    gate.judge(optimizer, [weight.grad])
    assert gate._verdicts[id(optimizer)] is None


def test_under_a_grad_scaler_its_own_skips_are_not_counted_twice_nor_rolled_back():
    """AMP with float16 and a GradScaler (on the CPU, as Lightning's precision plugin
    takes one): a NaN batch is the scaler's to skip, which the ladder neither counts nor
    answers with a roll back; a spike is still the ladder's, judged on the unscaled loss."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    data = batches(60, poison={41: "nan", 50: "spike"})
    torch.manual_seed(0)
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = train(Net("sgd"), data, [callback], plugins=[plugin])
    assert trainer.global_step == 60 and not trainer.should_stop
    assert scaler.get_scale() == 2.0**7  # the scaler skipped step 41 (and halved its scale)
    acts = [f for f in sink.findings if f.detector == RECOVERY]
    assert [(f.step, f.where) for f in acts] == [(50, "skip")]
    # the loss of the skip is the loss's own, not multiplied by the scale (x128 here)
    loss = float(acts[0].message.split("the loss ")[1].split(" ")[0])
    assert "past the loss_spike bar" in acts[0].message and 1 < loss < 100, acts[0].message
    assert any(f.detector == "nonfinite_loss" and f.step == 41 for f in sink.findings)
