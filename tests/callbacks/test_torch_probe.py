"""The torch probe: fused norms, the host reader, and a cold hot path."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from _models import TinyMLP, fit
from torch import nn

from stethoscope import LightningStethoscope
from stethoscope.callbacks._lightning import batch_reductions, parameters
from stethoscope.callbacks._lightning.forward import ForwardProbe
from stethoscope.callbacks._lightning.parameters import (
    ParameterProbe,
    _stack_norms,
    magnitude_histograms,
)
from stethoscope.callbacks._lightning.reader import HostReader
from stethoscope.statistics import DISTRIBUTION_BINS, DISTRIBUTION_EDGES
from stethoscope.testing import CapturingSink


def test_norms_match_per_tensor_norms_across_dtypes():
    tensors = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64), torch.randn(4).half()]
    got = _stack_norms(tensors)
    want = torch.tensor([float(t.double().norm()) for t in tensors])
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want.double(), rtol=1e-3)


def test_half_precision_norm_does_not_overflow_to_inf():
    big = torch.full((100_000,), 300.0, dtype=torch.float16)  # finite values, norm ~ 9.5e4
    assert torch.isinf(torch._foreach_norm([big])[0])  # what a naive fp16 norm reports
    norm = _stack_norms([big])[0]
    assert torch.isfinite(norm) and norm == pytest.approx(300.0 * 100_000**0.5, rel=1e-3)


def test_the_recovery_gate_judges_half_precision_gradients_by_the_same_norm():
    from stethoscope.callbacks._lightning.parameters import total_norm

    big = torch.full((100_000,), 300.0, dtype=torch.float16)
    other = torch.ones(10, dtype=torch.float16)
    norm = total_norm([big, other])
    assert torch.isfinite(norm) and norm == pytest.approx((9e4 * 100_000 + 10) ** 0.5, rel=1e-3)


def test_nan_and_inf_propagate_into_the_norm():
    norms = _stack_norms([torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])])
    assert torch.isnan(norms[0]) and torch.isinf(norms[1])


def test_host_reader_returns_cpu_results_in_order_at_once():
    reader = HostReader(max_lag=2)
    for i in range(3):
        reader.push(("step", i), torch.tensor([float(i), 2.0 * i]))
    out = reader.pop()
    assert [m for m, _ in out] == [("step", 0), ("step", 1), ("step", 2)]
    assert out[2][1].tolist() == [2.0, 4.0]
    assert len(reader) == 0 and reader.pop(wait=True) == []


def test_parameter_probe_update_norms_equal_the_optimizer_step():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model[2].bias.requires_grad_(False)  # frozen: never watched
    probe = ParameterProbe(list(model.named_parameters()))
    assert probe.names == ("0.weight", "0.bias", "2.weight")
    assert probe.is_matrix.tolist() == [True, False, True]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    idx = probe.with_grad(probe.indices_of(opt))
    assert idx == [0, 1, 2]
    grads = probe.grad_norms(idx)
    before = probe.snapshot(idx)
    expected_updates = [0.1 * p.grad.norm() for p in probe.params]
    opt.step()
    previous = torch.stack([b.norm() for b in before])
    weights = probe.weight_norms(idx)
    updates, prev = probe.update_norms(before, idx)
    assert torch.allclose(prev, previous)
    assert torch.allclose(grads, torch.stack([p.grad.norm() for p in probe.params]))
    assert torch.allclose(weights, torch.stack([p.detach().norm() for p in probe.params]))
    assert torch.allclose(updates, torch.stack(expected_updates), rtol=1e-4)


def test_unsampled_steps_never_touch_parameters(monkeypatch):
    """The hot path stays cold: per-parameter work happens on sampled steps only."""
    calls: dict[str, list[int]] = {
        "grad_norms": [],
        "snapshot": [],
        "weights": [],
        "attach": [],
        "row_norms": [],
        "input_moments": [],
        "class_labels": [],
        "sample_prints": [],
        "probability_rows": [],
        "broadcast_in_loss": [],
    }
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink])
    steps_seen: list[int] = []

    def spy(name, original):
        def wrapper(self, *args, **kwargs):
            calls[name].append(cb._measures.step)
            return original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(ParameterProbe, "grad_norms", spy("grad_norms", ParameterProbe.grad_norms))
    monkeypatch.setattr(ParameterProbe, "snapshot", spy("snapshot", ParameterProbe.snapshot))
    monkeypatch.setattr(ParameterProbe, "weight_norms", spy("weights", ParameterProbe.weight_norms))
    monkeypatch.setattr(ForwardProbe, "attach", spy("attach", ForwardProbe.attach))
    monkeypatch.setattr(ParameterProbe, "unit_rows", spy("row_norms", ParameterProbe.unit_rows))
    bare = [
        (batch_reductions, fn)
        for fn in (
            "input_moments",
            "class_labels",
            "sample_prints",
            "probability_rows",
            "broadcast_in_loss",
        )
    ]
    for module, fn in bare:
        original = getattr(module, fn)
        monkeypatch.setattr(
            module,
            fn,
            lambda *a, _fn=fn, _orig=original: calls[_fn].append(cb._measures.step) or _orig(*a),
        )
    original_stack = parameters._stack_norms
    monkeypatch.setattr(
        parameters,
        "_stack_norms",
        lambda tensors: steps_seen.append(cb._measures.step) or original_stack(tensors),
    )
    planned: list[int] = []
    planned_updates: list[int] = []
    sampled: list[int] = []  # steps that measure more than the loss
    plan = cb.monitor.plan

    def recording_plan(step):
        probes = plan(step)
        if probes != {"loss"}:
            sampled.append(step)
        if "grads" in probes:
            planned.append(step)
        if "updates" in probes:
            planned_updates.append(step)
        return probes

    cb.monitor.plan = recording_plan
    torch.manual_seed(0)
    fit(TinyMLP(), steps=1000, callback=cb)
    assert sink.at_least("warning") == []
    assert calls["grad_norms"] == planned
    assert calls["weights"] == planned
    assert calls["snapshot"] == planned_updates  # small/large_updates, frozen_weights
    assert set(planned_updates) < set(planned)
    for probe in ("attach", "row_norms"):
        assert calls[probe] == planned, probe  # hooks and unit stats: sampled steps only
    for probe in ("input_moments", "class_labels"):  # on sampled steps only
        assert calls[probe] and set(calls[probe]) <= set(planned), probe
    # the prints also at each epoch's first step; the output and the loss graph before
    # the backward pass of a sampled step: never on a quiet one
    for probe in ("sample_prints", "probability_rows", "broadcast_in_loss"):
        assert calls[probe] and set(calls[probe]) <= set(sampled), probe
    assert len(calls["sample_prints"]) < 0.3 * 1000
    # the inputs' scale is judged once, early; the labels' order (unshuffled_data) all run
    assert max(calls["input_moments"]) < 32, max(calls["input_moments"])
    assert set(steps_seen) == set(planned)
    # calibration samples the first ~60 steps; after it, a step off the 1-in-16 grid is
    # sampled only inside a hot window that the sampler reported opening and closing
    reports = sink.by_detector("sampler")
    opened = [f.step for f in reports if "running all" in f.message]
    closed = [f.step for f in reports if "back to their base" in f.message] + [10**9]
    windows = [(a, min(b for b in closed if b > a)) for a in opened]
    for step in planned:
        if step >= 128 and step % 16:
            assert any(a <= step <= b for a, b in windows), (step, windows)
    assert len(planned) < 0.25 * 1000, len(planned)


def test_snapshots_stay_within_the_budget_and_take_turns():
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    probe = ParameterProbe(list(model.named_parameters()), snapshot_budget=700)
    everything = list(range(len(probe.params)))
    seen: set[int] = set()
    for _ in range(6):
        chosen = probe.choose(everything)
        assert chosen == sorted(chosen) and chosen
        size = sum(int(probe.numel[i]) for i in chosen)
        assert size <= 700 or len(chosen) == 1  # one tensor larger than the budget goes alone
        seen |= set(chosen)
    assert seen == set(everything)
    assert ParameterProbe(list(model.named_parameters())).choose(everything) == everything


def test_frozen_weights_found_when_snapshots_take_turns():
    """With a budget smaller than the model, an LR-0 group is still found, a few samples later."""

    class SmallBudget(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb._probe.snapshot_budget = 700

    torch.manual_seed(0)
    sink = CapturingSink()
    cb = LightningStethoscope(sinks=[sink])
    fit(TinyMLP(zero_lr="net.2"), steps=120, callback=cb, callbacks=[SmallBudget()])
    found = sink.by_detector("frozen_weights")
    assert {f.where for f in found} == {"net.2.weight", "net.2.bias"}, [
        (f.where, f.step) for f in found
    ]
    assert sink.at_least("warning") == found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_magnitude_histograms_count_every_element_in_its_bin(dtype, monkeypatch):
    edges = np.array(DISTRIBUTION_EDGES)
    values = torch.tensor(
        [0.0, -0.0, 1e-13, 1e-12, 3e-4, -3e-4, 0.5, 2.0, -7.0, 1e5, float("nan"), float("inf")]
    )
    monkeypatch.setattr(parameters, "_HISTOGRAM_CHUNK", 5)  # chunks add up to the whole
    (hist,) = magnitude_histograms([values.to(dtype)]).numpy()
    assert len(hist) == DISTRIBUTION_BINS
    assert hist.sum() == values.numel() and hist[0] == 2 and hist[-1] == 2
    finite = values[torch.isfinite(values) & (values != 0)].to(dtype).double().abs().numpy()
    for x in finite:  # (0, e0] is bin 1 ... (e_last, inf) is bin len(edges) + 1
        assert hist[1 + np.searchsorted(edges, x, side="left")] > 0, x
    expected = np.bincount(1 + np.searchsorted(edges, finite, side="left"), minlength=len(hist))
    assert hist[1:-1].tolist() == expected[1:-1].tolist()


def test_every_planned_statistic_has_a_lightning_reduction():
    from stethoscope.callbacks._lightning.batch import BatchParts
    from stethoscope.callbacks._lightning.parameters import unit_layers
    from stethoscope.callbacks._lightning.reductions import make_reductions
    from stethoscope.statistics import PLANNED

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    probe = ParameterProbe(list(model.named_parameters()))
    layers = unit_layers(model, probe)
    reductions = make_reductions(
        model, probe, layers, ForwardProbe(model, layers), BatchParts(None, None)
    )
    assert {s for r in reductions.all for s in r.statistics} == PLANNED
