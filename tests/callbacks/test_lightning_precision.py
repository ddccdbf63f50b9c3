"""Precision health under Lightning: each fault of low-precision training caught and named
with its dtype, its twin (float32, or the remedy applied) silent, and the statistics
behind them measured exactly, on real fits.

Each situation is built explicitly (a loss weighted down, an Inf put in a gradient, a
weight cast by the precision plugin), so nothing depends on how a CPU's kernels round.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from _models import TinyMLP, fit, loader
from _observed import PRECISION, Observed, named
from lightning.pytorch.plugins import MixedPrecision

from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning.precision import (
    fp8_counts,
    gradient_counts,
    rounded_counts,
)
from stethoscope.callbacks._lightning.predictions import probability_rows
from stethoscope.detectors import default_detectors
from stethoscope.record import RunRecord


class Weighted(TinyMLP):
    """TinyMLP whose loss is computed in float32 and multiplied by ``weight``; with
    ``inf_from`` set, ``net.2.weight``'s gradient holds an Inf at every step from it on
    (an op that overflows float16 in each backward pass)."""

    def __init__(self, *, weight: float = 1.0, inf_at: tuple[int, ...] = (), **kw: Any):
        super().__init__(**kw)
        self.weight, self.inf_at = weight, set(inf_at)
        self.scales: list[float] = []

    def on_fit_start(self) -> None:
        def poison(grad: torch.Tensor) -> torch.Tensor:
            if self.global_step not in self.inf_at:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
            return grad

        self.net[2].weight.register_hook(poison)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.weight * torch.nn.functional.cross_entropy(self(x).float(), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())


def scaled(init_scale: float = 2.0**16) -> dict[str, Any]:
    """16-mixed on the CPU: autocast to float16 and a GradScaler of our own (the Trainer
    would make a CPU's 16-mixed bf16-mixed)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


def run(model: L.LightningModule, statistic: str = "precision", *, steps: int = 60, **kw: Any):
    sink = Observed(statistic)
    callback = LightningStethoscope(sinks=[sink], stop_on=None, **kw.pop("callback_kw", {}))
    trainer, _ = fit(model, steps=steps, callback=callback, **kw)
    return trainer, sink


# -- the statistics' kernels ---------------------------------------------------------------------


def test_gradient_counts_are_subnormals_zeros_elements_and_the_peak_in_the_dtype():
    tiny16 = torch.finfo(torch.float16).tiny
    g = torch.tensor(
        [0.0, 0.0, tiny16 / 4, -tiny16 / 2, tiny16, -3.0, 1e-3, 2.0], dtype=torch.float16
    )
    same_in_fp32 = g.float()  # in float32 those are normal numbers: not judged, not measured
    counts = gradient_counts([g, same_in_fp32], scale=torch.tensor(2.0)).numpy()
    assert counts[0] == pytest.approx([2, 2, 8, 1.5])  # 2 subnormal, 2 zero, of 8; 3/2
    assert np.isnan(counts[1]).all()
    bf16 = torch.tensor([0.0, 1e-39, -2e-39, 1e-30, -4.0, math.nan], dtype=torch.bfloat16)
    bf16_counts = gradient_counts([bf16]).numpy()[0]
    assert bf16_counts[:3] == pytest.approx([2, 1, 6]) and np.isnan(bf16_counts[3])
    empty = gradient_counts([g[:0]]).numpy()[0]  # a shard another rank counts
    assert empty.tolist() == [0, 0, 0, 0]


def test_float32_gradients_computed_in_float16_are_counted_on_float16s_grid():
    """An autocast backward pass's float32 gradient holds float16 values: counted as
    float16's. A float32 value below float16's normal range that is none of float16's
    (computed in float32) is neither subnormal nor zero there; the peak is as held."""
    tiny16 = torch.finfo(torch.float16).tiny
    g = torch.tensor([0.0, 0.0, tiny16 / 4, -tiny16 / 2, tiny16, -3.0, 1e-3, 2.0])
    cast_up = g.half().float()
    counts = gradient_counts([cast_up], computed_in=torch.float16).numpy()[0]
    assert counts == pytest.approx([2, 2, 8, 3.0])
    own = torch.tensor([tiny16 / 3, -tiny16 / 7, 1e-7 / 3, 0.0, 1.5])  # float32's values
    assert gradient_counts([own], computed_in=torch.float16).numpy()[0] == pytest.approx(
        [0, 1, 5, 1.5]
    )
    assert np.isnan(gradient_counts([own]).numpy()).all()  # not computed in 16 bits


def test_fp8_counts_are_against_the_peak_the_ranks_agree_on():
    t = torch.tensor([0.0, 448.0, 1e-3, 1e-9, -2.0])
    counts = fp8_counts([t], scale=torch.tensor(2.0)).numpy()[0]
    # of 4 non-zero, scaled so that 448 meets each format's largest value: 1e-9 flushes
    # in both (e4m3 keeps down to ~9.8e-4 here, e5m2 to ~6e-8); 1e-3 just stays in e4m3
    assert counts.tolist() == pytest.approx([1, 1, 4, 224.0])
    # a shard whose own peak is 2, when another rank holds 448: counted against 448
    shard = torch.tensor([2.0, 1e-4, 0.0])
    alone = fp8_counts([shard]).numpy()[0]
    agreed = fp8_counts([shard], agree=lambda peaks: peaks.fill_(448.0)).numpy()[0]
    assert alone.tolist() == pytest.approx([0, 0, 2, 2.0])
    assert agreed.tolist() == pytest.approx([1, 0, 2, 448.0])
    assert fp8_counts([shard[:0]]).tolist() == [[0.0, 0.0, 0.0, 0.0]]  # an empty shard


def test_rounded_counts_are_the_pushed_elements_left_as_they_were_and_the_pushed():
    before = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.bfloat16)
    after = before.clone()
    after[0] += 1.0  # moved
    grad = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.bfloat16)
    # pushed: 0, 1, 2; of those 1 and 2 stayed. 3 and 4 had no gradient: not counted
    assert rounded_counts([before], [after], [grad]).tolist() == [[2.0, 3.0]]
    assert rounded_counts([before], [after], [grad * 0]).tolist() == [[0.0, 0.0]]
    wide = [t.float() for t in (before, after, grad)]  # float32: not judged, not measured
    assert np.isnan(rounded_counts(*[[t] for t in wide]).numpy()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_nan_weight_or_gradient_is_no_update_that_rounded_away(dtype):
    nan, inf = math.nan, math.inf
    before = torch.tensor([nan, 2.0, 3.0, 4.0, -inf], dtype=dtype)
    after = torch.tensor([nan, 2.0, 3.0, 4.0, -inf], dtype=dtype)  # nothing moved
    grad = torch.tensor([1.0, nan, -inf, 1.0, 1.0], dtype=dtype)
    # 0: a NaN weight; 1, 2: a gradient that is no number; 4: an infinite weight. Only 3
    # was pushed, and stayed
    assert rounded_counts([before], [after], [grad]).tolist() == [[1.0, 1.0]]


# -- bf16-true: updates that round away ------------------------------------------------------------


def test_bf16_true_updates_that_round_away_are_named_with_their_dtype():
    """Adam 3e-4 on bfloat16 weights: most updates are under half an ulp. Before the
    precision detectors, this run was told its weights were frozen (an LR of 0)."""
    _, sink = run(TinyMLP(lr=3e-4), precision="bf16-true")
    found = [f for f in sink.at_least("warning") if f.detector == "rounded_updates"]
    assert found, named(sink)
    assert "bfloat16" in found[0].message and "bf16-mixed" in found[0].message
    assert found[0].where.endswith("weight") and found[0].value >= 0.5
    assert "frozen_weights" not in named(sink)
    shares = np.array([o.update_lost for o in sink.observations if o.update_lost is not None])
    assert np.nanmedian(shares) > 0.5
    assert set(sink.observations[-1].dtypes) == {"bfloat16"}


def test_the_same_fit_with_float32_master_weights_is_silent():
    _, sink = run(TinyMLP(lr=3e-4), precision="bf16-mixed")
    assert not named(sink) & PRECISION
    assert all(set(o.dtypes) == {"float32"} for o in sink.observations)
    # float32 master weights: nothing of theirs is measured (a float32 update rounds away
    # only where it is ~1e-7 of its weight)
    measured = [o for o in sink.observations if o.update_lost is not None]
    assert measured and all(np.isnan(o.update_lost).all() for o in measured)
    assert all(np.isnan(o.grad_subnormal).all() for o in sink.observations)


def test_in_float32_nothing_of_precision_is_measured_or_judged():
    _, sink = run(TinyMLP(lr=3e-4))
    assert sink.observations == []  # the statistic was never planned
    assert not named(sink) & PRECISION


# -- 16-true: gradients that underflow -------------------------------------------------------------


def test_fp16_gradients_that_underflow_are_named():
    """float16 weights and gradients, no loss scaling, the loss weighted by 1e-3: the
    gradients are subnormal or zero in float16."""
    _, sink = run(Weighted(weight=1e-3, lr=10.0, optimizer="sgd"), precision="16-true")
    found = [f for f in sink.at_least("warning") if f.detector == "gradient_underflow"]
    assert found, named(sink)
    assert "float16" in found[0].message and "16-mixed" in found[0].message
    assert found[0].step <= 3


def test_the_same_loss_under_a_loss_scaler_is_silent():
    _, sink = run(Weighted(weight=1e-3, lr=10.0, optimizer="sgd"), **scaled())
    assert not named(sink) & PRECISION
    # float32 master weights: their gradients (unscaled) are float32, never subnormal
    assert all(set(o.dtypes) == {"float32"} for o in sink.observations)


class Autocast(Weighted):
    """Weighted, its forward pass and loss under ``torch.autocast`` of ``dtype`` written in
    the training step, in a float32 run with no loss scaler."""

    def __init__(self, *, dtype: torch.dtype, **kw: Any) -> None:
        super().__init__(**kw)
        self.compute_dtype = dtype

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.compute_dtype):
            return super().training_step(batch, batch_idx)


def test_an_autocast_in_the_training_step_without_a_scaler_is_an_underflow():
    """float32 weights, their gradients computed in float16 by an autocast the precision
    setting does not show, the loss weighted by 1e-3: named as float16's underflow,
    where before the precision detectors sat out the run as float32's."""
    _, sink = run(Autocast(dtype=torch.float16, weight=1e-3, lr=10.0, optimizer="sgd"))
    found = [f for f in sink.at_least("warning") if f.detector == "gradient_underflow"]
    assert found, named(sink)
    assert "computed under autocast, held in float32" in found[0].message
    assert found[0].step <= 8
    assert all(set(o.dtypes) == {"float32"} for o in sink.observations)


def test_the_same_autocast_in_bfloat16_is_silent():
    _, sink = run(Autocast(dtype=torch.bfloat16, weight=1e-3, lr=10.0, optimizer="sgd"))
    assert not named(sink) & PRECISION
    assert sink.observations == []  # bfloat16 has float32's range: nothing was measured


# -- 16-true: an Adam epsilon float16 cannot hold ------------------------------------------------


class HalfAdam(TinyMLP):
    """TinyMLP under Adam with epsilon ``eps``, its first input feature always zero:
    net.0.weight's first column gets no gradient, so Adam's moments there are exactly
    zero and its step there is 0 / (0 + eps), whatever the CPU's kernels."""

    def __init__(self, eps: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.eps = eps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = torch.cat([torch.zeros_like(x[:, :1]), x[:, 1:]], dim=1)
        return torch.nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)


def test_an_adam_epsilon_that_is_zero_in_float16_is_named_and_the_nan_blamed_on_it():
    _, sink = run(HalfAdam(1e-8), precision="16-true", steps=3)
    (said,) = sink.by_detector("epsilon_underflow")
    assert (said.step, said.severity, said.where) == (0, "warning", "Adam")
    assert "Adam's eps=1e-08 is 0 in float16" in said.message
    nan = sink.by_detector("nonfinite_weights")[0]  # 0 / 0 in the zero column
    assert (nan.step, nan.where) == (0, "net.0.weight")
    assert "Adam's eps=1e-08 is 0 in float16" in nan.message and "learning rate" not in nan.message


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_an_epsilon_the_weights_dtype_bounds_a_step_with_is_silent(precision):
    eps = 1e-4 if precision == "16-true" else 1e-8  # bfloat16 keeps float32's range
    _, sink = run(HalfAdam(eps), precision=precision, steps=20)
    assert not named(sink) & {"epsilon_underflow", "nonfinite_weights", "large_updates"}


# -- a GradScaler: its scale and the steps it skipped ----------------------------------------------


def test_the_steps_a_gradscaler_skipped_are_counted_exactly_and_their_updates_dropped():
    """Inf in a gradient at steps 5, 6, 7 and 20: the scaler skips exactly those steps.
    Measured every step, the skips and the scale agree with the scaler's own."""
    bad = (5, 6, 7, 20)
    model = Weighted(inf_at=bad, lr=1e-3)
    every = {"callback_kw": {"intervals": {"loss_scale_collapse": 1, "rounded_updates": 1}}}
    _, sink = run(model, "loss_scale", steps=30, **every, **scaled())
    by_step = {o.step: o for o in sink.observations}
    assert sorted(s for s, o in by_step.items() if o.scale_skipped) == list(bad)
    assert sum(o.scale_steps for o in by_step.values()) == 30
    assert [by_step[s].loss_scale for s in range(30)] == model.scales
    for step in bad:  # a skipped step moved nothing: its update statistics say nothing
        assert by_step[step].update_norm is None
    assert by_step[8].update_norm is not None


def test_a_collapsing_loss_scale_is_named_with_its_path():
    model = Weighted(inf_at=tuple(range(20, 60)), lr=1e-3)
    _, sink = run(model, "loss_scale", steps=60, **scaled())
    found = [f for f in sink.at_least("warning") if f.detector == "loss_scale_collapse"]
    assert found, named(sink)
    assert found[0].step <= 20 + 32  # halved past the floor or skipping half its window
    assert "65536" in found[0].message and "skipped" in found[0].message


def test_a_gradscaler_finding_its_scale_at_the_start_is_silent():
    """A scale far too high at first overflows a few steps, as it is meant to."""
    model = Weighted(inf_at=(0, 1, 2, 3), lr=1e-3)
    _, sink = run(model, "loss_scale", steps=80, **scaled())
    assert "loss_scale_collapse" not in named(sink)


# -- headroom ---------------------------------------------------------------------------------


def test_float16_activations_nearing_the_maximum_are_warned_of():
    _, sink = run(TinyMLP(lr=1e-3), **scaled(), data=loader(scale=2000.0))
    found = [f for f in sink.at_least("warning") if f.detector == "overflow_risk"]
    assert found, named(sink)
    assert "float16" in found[0].message and "65504" in found[0].message
    assert found[0].where == "net.0"


def test_the_same_inputs_in_bfloat16_have_float32s_range():
    _, sink = run(TinyMLP(lr=1e-3), precision="bf16-mixed", data=loader(scale=2000.0))
    assert "overflow_risk" not in named(sink)


# -- fp8 readiness, and the record ------------------------------------------------------------


class WideRange(TinyMLP):
    """TinyMLP whose first layer holds weights of about 1e-7 beside a column of 1: spread
    wider than e4m3 can hold under one scale per tensor (trained at an LR too small to
    move them past e4m3's 2.2e-6 of the largest)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        with torch.no_grad():
            self.net[0].weight.mul_(1e-6)
            self.net[0].weight[:, 0] = 1.0


def test_fp8_readiness_is_judged_only_when_asked_for_and_names_the_layer():
    asked = {"callback_kw": {"detectors": default_detectors(fp8_readiness={})}}
    _, sink = run(WideRange(lr=1e-7, optimizer="sgd"), "fp8", steps=40, **asked)
    found = [f for f in sink.at_least("warning") if f.detector == "fp8_readiness"]
    assert found, named(sink)
    assert found[0].where == "net.0.weight" and "e4m3" in found[0].message
    lost = sink.observations[-1].fp8_underflow
    assert lost[0, 0] > 0.9  # net.0.weight: its 1e-6 weights round to zero in e4m3
    assert lost[2, 0] < 0.01  # net.2.weight: the default initialisation fits

    _, quiet = run(WideRange(lr=1e-7, optimizer="sgd"), "fp8", steps=40)
    assert "fp8_readiness" not in named(quiet)


def test_the_record_keeps_the_precision_statistics_per_layer(tmp_path):
    run(TinyMLP(lr=3e-4), precision="bf16-true", callback_kw={"record": tmp_path / "r"})
    with RunRecord(tmp_path / "r") as record:
        assert {"update_lost", "grad_subnormal", "fp8_weight_e4m3"} <= set(record.kinds())
        lost = record.layers("update_lost")
        assert "net.0.weight" in lost.names and np.nanmedian(lost.values) > 0.5
        assert "loss_scale" not in record.kinds()  # no loss scaler under bf16-true


def test_a_bfloat16_softmax_is_probabilities_within_its_own_rounding():
    """A softmax computed in bfloat16 (bf16-mixed) sums to 1 within a few 1e-3 only; read
    against float32's 1e-3, it was taken for logits and named logits_mismatch."""
    logits = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits.to(torch.bfloat16), dim=1)
    assert (probs.float().sum(1) - 1).abs().max() > 1e-3  # the situation, built
    assert probability_rows(probs)[0][0].item() == 1.0
    assert probability_rows(logits.to(torch.bfloat16))[0][0].item() == 0.0
    off = probs.float() * 1.01  # float32 rows off by 1%: not probabilities
    assert probability_rows(off)[0][0].item() == 0.0
