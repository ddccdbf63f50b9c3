"""Run records made without a framework: a Monitor fed synthetic observations that carry
every statistic the record keeps (the run holds its weights in bfloat16 under a loss
scaler, so the precision statistics are measured too), so that the readers can be
tested fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stethoscope import Monitor, Observation
from stethoscope.advice import TrainingSetup
from stethoscope.record import RunRecorder
from stethoscope.sinks.base import RunContext
from stethoscope.statistics import DISTRIBUTION_BINS

NAMES = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight")
LAYERS = ("net.0", "net.2", "net.4")


def synthetic_observation(step: int, plan: frozenset[str], *, loss: float) -> Observation:
    """The observation of ``step`` carrying what ``plan`` asks for; the gradient of the
    deepest layers shrinks with depth, so a gradient-flow chart has something to show."""
    rng = np.random.default_rng(step)
    n = len(NAMES)
    kw: dict = {}
    if "grads" in plan:
        kw["grad_norm"] = np.array([1e-1, 1e-2, 1e-3, 1e-4, 1e-5]) * (1 + 0.1 * rng.random(n))
    if "weights" in plan:
        kw["weight_norm"] = np.linspace(1.0, 3.0, n) + 0.001 * step
    if "updates" in plan:
        kw["update_norm"] = np.full(n, 1e-3) * (1 + rng.random(n))
        kw["prev_weight_norm"] = np.linspace(1.0, 3.0, n)
    if "units" in plan:
        kw["unit_zero"] = tuple(rng.random(8) < 0.25 * i for i in range(len(LAYERS)))
        kw["unit_names"] = LAYERS
        kw["unit_samples"] = 32
    if "outputs" in plan or "activations" in plan:
        kw["act_names"] = (*LAYERS, "net.1")
        kw["act_kinds"] = ("layer", "layer", "layer", "tanh")
        kw["act_rms"] = np.array([1.0, 0.5, 0.2, 0.7])
        kw["act_saturated"] = np.array([np.nan, np.nan, np.nan, 0.05 + 0.001 * step])
        kw["act_max"] = np.array([3.0, 2.0, 1.0, 6.0])
    if "precision" in plan:
        kw["grad_subnormal"] = np.zeros(n)
        kw["grad_zero"] = np.full(n, 0.01)
        kw["grad_peak"] = np.full(n, 0.5)
        kw["update_lost"] = np.linspace(0.0, 0.2, n) + 0.0001 * step
    if "loss_scale" in plan:
        kw["loss_scale"], kw["scale_steps"] = 2.0 ** (16 - step // 100), 4
        kw["scale_skipped"] = int(step % 100 == 0)  # the scale halves: one step in 4 skipped
    if "fp8" in plan:
        kw["fp8_underflow"] = np.tile([0.0, 0.0, 0.02, 0.001], (n, 1))
        kw["fp8_amax"] = np.tile([1.0, 0.1], (n, 1))
    if "distributions" in plan:
        hist = np.zeros((n, DISTRIBUTION_BINS))
        hist[:, 10 + step % 5] = 100.0
        kw["weight_hist"] = hist
        kw["grad_hist"] = hist[:, ::-1].copy()
    return Observation(
        step=step,
        epoch=step // 100,
        loss=loss,
        lr=0.01,
        names=NAMES,
        numel=np.array([64, 8, 64, 8, 8]),
        is_matrix=np.array([True, False, True, False, True]),
        fan_in=np.array([8.0, np.nan, 8.0, np.nan, 8.0]),
        dtypes=("bfloat16",) * n,
        **kw,
    )


def make_record(directory: Path, *, steps: int = 300, nan_at: int | None = 200, close=True):
    """Train nothing for ``steps`` steps with a record at ``directory``: a falling loss, a
    NaN at ``nan_at`` (a finding and an escalation), a validation every 100 steps.
    Returns the monitor (closed unless ``close`` is False)."""
    recorder = RunRecorder(directory, flush_seconds=0.01)
    monitor = Monitor(sinks=[recorder], stop_on=None)
    setup = TrainingSetup(low_precision=True, loss_scaler="GradScaler")
    context = RunContext(framework="synthetic", describe=lambda: {"model": "MLP"}, setup=setup)
    monitor.start(context)
    for step in range(steps):
        loss = 2.0 / (1 + 0.05 * step)
        if step == nan_at:
            loss = float("nan")
        monitor.observe(synthetic_observation(step, monitor.plan(step), loss=loss))
        if step % 100 == 99:
            monitor.observe_validation(step, step // 100, loss * 1.1)
            monitor.end_epoch(step // 100)
    if close:
        monitor.close()
    return monitor
