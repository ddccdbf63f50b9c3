"""LightningStethoscope on an accelerator, played on the CPU (``_accelerator.py``): every
branch a GPU takes runs here. A NaN is reported without a crash; healthy steps make no
host sync in any mode we offer (every direct read of a device tensor by stethoscope's
code is counted); the overhead budget measures the device's time; snapshots land
without a wait."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from _accelerator import SimulatedAccelerator, SimulatedSteps
from _models import TinyMLP, loader
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from test_lightning_recovery import Net, batches, train

from stethoscope import LightningStethoscope, Recovery
from stethoscope.callbacks._lightning.parameters import _FOLD, _fold_on, magnitude_histograms
from stethoscope.findings import RECOVERY
from stethoscope.testing import CapturingSink, RecordingDetector


def fit_on(
    sim: SimulatedAccelerator,
    model: L.LightningModule,
    data: list,
    callback: LightningStethoscope,
    *,
    device_ms: Any = None,
    **trainer_kw: Any,
) -> L.Trainer:
    """A fit whose stethoscope sees the CPU as ``sim``'s device (moved on a step at each
    batch start, before stethoscope's hooks run)."""
    return train(model, data, [SimulatedSteps(sim, device_ms), callback], **trainer_kw)


# -- a NaN ----------------------------------------------------------------------------------
@pytest.mark.parametrize("recover", [False, True], ids=["watch", "recover"])
def test_a_nan_loss_is_reported_and_its_parameter_named_without_a_crash(recover):
    """The crash a GPU showed: the readings of a step whose loss is NaN, landed in the
    same step (a device as fast as the host), have its gradients read at once; that read
    took ``.numpy()`` of device memory. Now it crosses like every reading."""
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=recover)
    torch.manual_seed(0)
    with SimulatedAccelerator(lag=0) as sim:
        trainer = fit_on(sim, Net("adamw-fused"), batches(60, poison={41: "nan"}), callback)
    at41 = {f.detector: f for f in sink.findings if f.step == 41}
    assert "nonfinite_loss" in at41
    assert at41["nonfinite_gradients"].where.startswith("net.")  # read at once, and named
    assert trainer.global_step == (60 if recover else 42)
    assert sim.train_syncs() == []


def test_a_device_behind_the_host_reports_the_nan_when_its_reading_lands():
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink])
    torch.manual_seed(0)
    with SimulatedAccelerator(lag=2) as sim:
        trainer = fit_on(sim, Net("adamw-fused"), batches(60, poison={41: "nan"}), callback)
    first = sink.at_least("error")[0]
    assert (first.detector, first.step) == ("nonfinite_loss", 41)
    assert trainer.global_step == 44  # read two steps late (max_lag), then stopped
    assert sim.train_syncs() == []


# -- no host sync on a healthy step ---------------------------------------------------------
def _scaler_plugin() -> dict[str, Any]:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


MODES = {
    "defaults": ({}, "adamw", {}),
    "record": ({"record": "RECORD"}, "adamw", {}),
    "log_stats": ({"log_stats": True}, "adamw", {"logger": "CSV"}),
    "recover-fused-adamw": ({"recover": Recovery(snapshot_every=8)}, "adamw-fused", {}),
    "recover-fused-sgd": ({"recover": Recovery(snapshot_every=8)}, "sgd-fused", {}),
    "recover-16-mixed-scaler": ({"recover": Recovery(snapshot_every=8)}, "adamw-fused", "AMP"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_healthy_steps_never_wait_for_the_device(mode, tmp_path):
    """Each mode trains 64 steps, the first ones sampled (calibration), then every 16th;
    under recover= with snapshots every 8 steps. Not one read of a device tensor by
    stethoscope's code on a training step, nor a wait on an event."""
    kwargs, optimizer, trainer_kw = MODES[mode]
    kwargs = {k: (tmp_path / "run" if v == "RECORD" else v) for k, v in kwargs.items()}
    if trainer_kw == "AMP":
        trainer_kw = _scaler_plugin()
    elif trainer_kw.get("logger") == "CSV":
        trainer_kw = {"logger": CSVLogger(tmp_path)}
    grads = RecordingDetector({"grads", "weights", "updates"}, name="grads_seen")
    dists = RecordingDetector({"distributions"}, name="distributions_seen")
    detectors = [*_defaults(), grads, dists]
    callback = LightningStethoscope(sinks=[CapturingSink()], detectors=detectors, **kwargs)
    torch.manual_seed(0)
    with SimulatedAccelerator(lag=2) as sim:
        trainer = fit_on(sim, Net(optimizer), batches(64), callback, **trainer_kw)
    assert trainer.global_step == 64
    assert len(grads.seen) >= 8 and all(o.update_norm is not None for o in grads.seen)
    if mode == "record":
        assert dists.seen and all(o.grad_hist is not None for o in dists.seen)
    assert sim.train_syncs() == []
    if "recover" in mode:
        recovery = callback.recoverer.ladder
        assert recovery.counts["skip"] == 0  # healthy: nothing skipped


def _defaults() -> list:
    from stethoscope.detectors import default_detectors

    return list(default_detectors())


def test_a_non_fused_optimizer_under_recover_waits_twice_a_step_and_says_how_not_to():
    """torch's default AdamW (foreach) takes no ``found_inf``: the gate reads the loss and
    the gradient norm on the host, which waits; the warning names the remedy."""
    callback = LightningStethoscope(sinks=[], recover=True)
    torch.manual_seed(0)
    with SimulatedAccelerator(lag=2) as sim, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_on(sim, Net("adamw"), batches(20), callback)
    [warning] = [w for w in caught if "recover=" in str(w.message)]
    assert "AdamW" in str(warning.message) and "fused=True" in str(warning.message)
    train = sim.train_syncs()
    assert len(train) == 2 * 20
    assert {s.site.split(":")[0] for s in train} == {"callbacks/_lightning/recovery.py"}


# -- skips decided on the device --------------------------------------------------------------
def _same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_under_a_grad_scaler_a_fused_optimizer_skips_on_the_device():
    """16-mixed: the GradScaler hands the fused optimizer its ``found_inf``, the gate
    makes it the larger of its own and the scaler's. A NaN batch is the scaler's skip
    (not the ladder's, not counted), a spike the ladder's; neither waits, and the run
    is bit for bit one that never saw the spike."""
    poisoned = batches(60, poison={41: "nan", 50: "spike"})
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    torch.manual_seed(0)
    model = Net("adamw-fused")
    with SimulatedAccelerator(lag=1) as sim:
        trainer = fit_on(sim, model, poisoned, callback, **_scaler_plugin())
    assert trainer.global_step == 60 and not trainer.should_stop
    acts = [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]
    assert acts == [(50, "skip")]
    skip = next(f.message for f in sink.findings if f.detector == RECOVERY)
    assert "bar" in skip and "past the" in skip  # the loss's, or the gradient norm's
    assert sim.train_syncs() == []
    torch.manual_seed(0)
    twin = Net("adamw-fused")
    kept = [b for i, b in enumerate(poisoned) if i != 50]
    twin_trainer = train(twin, kept, [], **_scaler_plugin())
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _same_optimizer_state(trainer.optimizers[0], twin_trainer.optimizers[0])
    assert "found_inf" not in trainer.optimizers[0].__dict__


def test_under_a_grad_scaler_the_gradients_of_a_fused_optimizer_are_measured_unscaled():
    """Lightning unscales the gradients before ``on_before_optimizer_step``, except for an
    optimizer that unscales inside its step (a fused one): its gradients reach the hook
    multiplied by the loss scale, which the statistics and the gate divide out. The
    first step, same weights and batch: the norms and histograms of a fused AdamW equal
    those of torch's default one, which Lightning unscaled."""
    seen = {}
    for optimizer in ("adamw", "adamw-fused"):
        spy = RecordingDetector({"grads", "distributions"})
        callback = LightningStethoscope(sinks=[], detectors=[spy], recover=True)
        torch.manual_seed(0)
        train(Net(optimizer), batches(1), [callback], **_scaler_plugin())
        seen[optimizer] = spy.seen[0]
    plain, fused = seen["adamw"], seen["adamw-fused"]
    np.testing.assert_allclose(fused.grad_norm, plain.grad_norm, rtol=1e-5)
    np.testing.assert_array_equal(fused.grad_hist, plain.grad_hist)


@pytest.mark.parametrize("played", [False, True], ids=["host", "device"])
def test_under_a_grad_scaler_a_healthy_run_with_a_fused_optimizer_skips_nothing(played):
    """The gate judges a fused optimizer's gradients with the scale divided out, on the
    host (the CPU) and on the device alike: with them 2**16 too large, every step past
    the calibration was past the exploding_gradients bar, skipped, and the run stopped."""
    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=True)
    torch.manual_seed(0)
    scaler = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    with contextlib.ExitStack() as stack:
        callbacks = [callback]
        if played:
            sim = stack.enter_context(SimulatedAccelerator(lag=1))
            callbacks = [SimulatedSteps(sim), callback]
        trainer = train(Net("adamw-fused"), batches(60), callbacks, **scaler)
    assert trainer.global_step == 60 and not trainer.should_stop
    assert [f for f in sink.findings if f.detector == RECOVERY] == []


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused"])
def test_a_grad_scaler_finding_its_scale_is_no_error(optimizer):
    """A GradScaler that starts too high overflows and halves its scale, step after
    step, until it fits: its business, info findings, not an error that stops the run
    (it stopped at step 0)."""
    sink = CapturingSink()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    torch.manual_seed(0)
    trainer = train(
        Net(optimizer),
        batches(40),
        [LightningStethoscope(sinks=[sink])],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    assert trainer.global_step == 40 and not trainer.should_stop
    assert scaler.get_scale() < 2.0**24  # it did overflow, and halve
    assert sink.at_least("warning") == []
    overflows = [f for f in sink.findings if f.detector == "nonfinite_gradients"]
    assert overflows and all("GradScaler skips this step" in f.message for f in overflows)


# -- the budget on the device's timeline ------------------------------------------------------
@pytest.mark.parametrize(("sampled_ms", "stretched"), [(10.0, False), (40.0, True)])
def test_the_overhead_budget_measures_what_the_device_pays(sampled_ms, stretched):
    """The device spends 10 ms on a quiet step and ``sampled_ms`` on a sampled one,
    whatever the host does. At 10 the sampled steps cost the device nothing, and the
    budget stretches nothing (on this CPU they cost the host a good share, which a host
    clock would count); at 40 they cost it ~20% of training, and it stretches."""
    callback = LightningStethoscope(sinks=[])

    def device_ms(step: int) -> float:
        return sampled_ms if callback._measures.sampled else 10.0

    torch.manual_seed(0)
    data = list(loader())
    with SimulatedAccelerator(lag=2) as sim:  # two steps behind: the readings' max_lag
        fit_on(sim, TinyMLP(), data, callback, device_ms=device_ms, max_steps=900, max_epochs=-1)
    budget = callback.monitor.budget
    assert budget.measured is not None
    if stretched:
        assert callback.monitor.sampler.stretch > 1 and budget.measured > 0
    else:
        assert callback.monitor.sampler.stretch == 1 and budget.measured == 0.0
    assert sim.train_syncs() == []


# -- snapshots ----------------------------------------------------------------------------
class _Trainer:
    """What Snapshots reads of a Trainer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers = [optimizer]
        self.lr_scheduler_configs: list = []


class _Monitor:
    def __init__(self) -> None:
        self.state: dict = {"n": 0}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _trained(optimizer: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = (
        torch.optim.AdamW(module.parameters(), lr=0.1)
        if optimizer == "adamw"
        else torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    )
    _step(module, opt)
    return module, opt


def _step(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    module(torch.randn(16, 4)).square().mean().backward()
    opt.step()


def test_a_snapshot_lands_without_a_wait_and_its_buffers_are_reused():
    from stethoscope.callbacks._lightning.snapshots import Snapshots

    module, opt = _trained()
    with SimulatedAccelerator(lag=2) as sim:
        snapshots = Snapshots(Recovery(keep_snapshots=2, snapshot_in="memory"))
        allocated = []
        pinned = sim.pinned
        sim.pinned = lambda shape, dtype: allocated.append(shape) or pinned(shape, dtype)
        expected = {}
        for step in range(0, 60, 10):
            snapshots.take(step, _Trainer(opt), module, _Monitor())
            expected[step] = {k: v.clone() for k, v in module.state_dict().items()}
            assert [s.step for s in snapshots.kept][-1:] != [step]  # on its way
            for _ in range(2):
                _step(module, opt)
                sim.advance()
                snapshots.poll()
            assert snapshots.kept[-1].step == step  # landed, with no wait
        assert sim.waits == [] and sim.syncs == []
        assert [s.step for s in snapshots.kept] == [40, 50]
        tensors_per_state = len(module.state_dict()) + 3 * len(opt.state)  # step, 2 moments
        assert len(allocated) == 3 * tensors_per_state  # keep_snapshots + 1 sets, once
        for snap in snapshots.kept:
            for name, saved in snap.state["module"].items():
                assert torch.equal(saved, expected[snap.step][name]), (snap.step, name)
        snapshots.take(60, _Trainer(opt), module, _Monitor())
        snap, _ = snapshots.newest()  # a roll back now waits for the one on its way
        assert snap.step == 60 and len(sim.waits) == 1
        snapshots.close()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_roll_back_leaves_its_snapshot_as_it_was(optimizer):
    """An optimizer's ``load_state_dict`` keeps tensors already on the parameter's device
    (on the CPU, all of them; a ``step`` count always) and training would change the
    snapshot underneath: the next roll back to it would restore what training made."""
    from stethoscope.callbacks._lightning.snapshots import Snapshots

    module, opt = _trained(optimizer)
    snapshots = Snapshots(Recovery(snapshot_in="memory"))
    trainer, monitor = _Trainer(opt), _Monitor()
    snapshots.take(1, trainer, module, monitor)
    _, state = snapshots.newest()
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    snapshots.put_back(state, trainer, module, monitor)
    for _ in range(3):
        _step(module, opt)
    _, state = snapshots.newest()
    for i, saved in state["optimizers"][0]["state"].items():
        for key, value in saved.items():
            assert torch.equal(value, before[i][key]), (i, key)
    snapshots.close()


# -- the distributions' histograms -----------------------------------------------------------
def test_the_histogram_bins_are_folded_without_a_copy_from_the_host():
    assert _fold_on(torch.device("cpu")).tolist() == _FOLD
    with SimulatedAccelerator() as sim:
        magnitude_histograms([torch.randn(100), torch.zeros(3)])
    assert sim.syncs == []


# -- the reader ---------------------------------------------------------------------------
def test_the_reader_takes_readings_as_they_land_and_waits_only_past_max_lag():
    from stethoscope.callbacks._lightning.reader import HostReader

    with SimulatedAccelerator(lag=3) as sim:
        reader = HostReader(max_lag=2)
        reader.push("a", torch.tensor([1.0]))
        reader.push("b", torch.tensor([2.0]))
        assert reader.pop() == [] and sim.waits == []  # on their way, within the lag
        reader.push("c", torch.tensor([3.0]))
        assert [(m, v.tolist()) for m, v in reader.pop()] == [("a", [1.0])]  # the bound
        assert len(sim.waits) == 1
        reader.push("d", torch.tensor([4.0]))
        for _ in range(3):
            sim.advance()
        assert [m for m, _ in reader.pop()] == ["b", "c", "d"]  # landed: no wait
        assert len(sim.waits) == 1
        reader.push("e", torch.tensor([5.0]))
        assert [m for m, _ in reader.pop(wait=True)] == ["e"]  # an epoch's end: waited
        assert len(sim.waits) == 2


def test_a_replay_on_an_accelerator_judges_on_the_host_and_says_so():
    """Recovery(replay=True) needs each verdict right after its step, to compute a bad
    one again: on an accelerator even a fused optimizer's steps are judged on the host,
    which waits, and it warns. A fault met once is replayed and applied, a NaN batch is
    bad again, skipped and named with its fingerprint (read from device memory through
    the one path to the host), and nothing crashes."""
    from test_lightning_replay import FlakyNet

    sink = CapturingSink()
    callback = LightningStethoscope(sinks=[sink], recover=Recovery(replay=True))
    torch.manual_seed(0)
    model = FlakyNet(at=20, optimizer="adamw-fused")
    with (
        SimulatedAccelerator(lag=2) as sim,
        pytest.warns(RuntimeWarning, match="judges every step on the host"),
    ):
        trainer = fit_on(sim, model, batches(40, poison={30: "nan"}), callback)
    assert trainer.global_step == 40 and model.computed == 2
    acts = [(f.step, f.where) for f in sink.findings if f.detector == RECOVERY]
    assert acts == [(20, "replay"), (30, "skip")]
    skip = next(f.message for f in sink.findings if f.where == "skip")
    assert "batch 30 of epoch 0, fingerprint " in skip and "judged bad again" in skip
    # the host's verdict: the loss and the gradient norm, read each step; besides, only
    # the steps judged bad wait (for the replay's verdict, and the batch's fingerprint)
    syncs = sim.train_syncs()
    verdicts = [s for s in syncs if s.site.startswith("callbacks/_lightning/recovery.py")]
    assert len(verdicts) >= 2 * 40
    assert {s.step for s in syncs if s not in verdicts} <= {20, 30}
