"""How big a run record gets: a long run of a 100-layer model, recorded for real.

No framework trains here: a ``Monitor`` with the default detectors and a
``RunRecorder`` is fed one synthetic observation per step, carrying what the monitor
plans for that step, shaped like a 100-layer model (a weight and a bias per layer, 256
units each, a tanh after every layer), so the record sees the same schedule, the same
arrays and the same thinning as it would under a real run of that size. The loss falls
and is healthy, so the sampler stays at its base intervals after calibration (a run
with escalations samples more, for a while).

Run:
    python -m benchmarks.record_size                 # 1,000,000 steps, a few minutes
    python -m benchmarks.record_size --steps 100000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks._machine import machine
from stethoscope import Monitor, Observation
from stethoscope.record import RunRecord, RunRecorder
from stethoscope.sinks.base import RunContext
from stethoscope.statistics import DISTRIBUTION_BINS

LAYERS, UNITS = 100, 256
CHECKPOINTS = (1_000, 10_000, 100_000, 1_000_000)


class Model:
    """The arrays of a 100-layer model's observations, made once and reused."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.names = tuple(f"layers.{i}.{p}" for i in range(LAYERS) for p in ("weight", "bias"))
        n = len(self.names)
        self.numel = np.array([UNITS * UNITS if i % 2 == 0 else UNITS for i in range(n)], float)
        self.is_matrix = np.arange(n) % 2 == 0
        self.fan_in = np.where(self.is_matrix, float(UNITS), np.nan)
        self.norms = rng.uniform(0.5, 2.0, n)
        self.units = tuple(f"layers.{i}" for i in range(LAYERS))
        self.zero = tuple(rng.random(UNITS) < 0.05 for _ in range(LAYERS))
        self.acts = (*self.units, *(f"act.{i}" for i in range(LAYERS)))
        hist = np.zeros((n, DISTRIBUTION_BINS))
        hist[:, 18:24] = self.numel[:, None] / 6
        self.hist = hist

    def observation(self, step: int, plan: frozenset[str], loss: float) -> Observation:
        kw: dict = {}
        wobble = 1 + 0.01 * np.sin(step / 100)
        if "grads" in plan:
            kw["grad_norm"] = self.norms * 0.01 * wobble
        if "weights" in plan:
            kw["weight_norm"] = self.norms * 10
        if "updates" in plan:
            kw["update_norm"] = self.norms * 0.01
            kw["prev_weight_norm"] = self.norms * 10
        if "units" in plan:
            kw.update(unit_zero=self.zero, unit_names=self.units, unit_samples=256)
        if "outputs" in plan or "activations" in plan:
            n = len(self.acts)
            kw.update(
                act_names=self.acts,
                act_kinds=("layer",) * LAYERS + ("tanh",) * LAYERS,
                act_rms=np.full(n, 0.8 * wobble),
                act_saturated=np.r_[np.full(LAYERS, np.nan), np.full(LAYERS, 0.01)],
                act_max=np.full(n, 3.0),
            )
        if "distributions" in plan:
            kw.update(weight_hist=self.hist, grad_hist=self.hist)
        return Observation(
            step=step,
            epoch=step // 10_000,
            loss=loss,
            lr=1e-3,
            names=self.names,
            numel=self.numel,
            is_matrix=self.is_matrix,
            fan_in=self.fan_in,
            **kw,
        )


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def run(steps: int, log) -> list[dict]:
    directory = Path(tempfile.mkdtemp(prefix="stethoscope-size-"))
    try:
        recorder = RunRecorder(directory / "run")
        monitor = Monitor(sinks=[recorder], stop_on=None)
        monitor.start(RunContext(framework="synthetic"))
        model = Model(np.random.default_rng(0))
        rows, t0 = [], time.perf_counter()
        for step in range(steps):
            loss = 2.0 / (1 + step / 1000) + 0.01 * np.sin(step)
            monitor.observe(model.observation(step, monitor.plan(step), loss))
            if step + 1 in CHECKPOINTS or step + 1 == steps:
                recorder.flush()
                with RunRecord(recorder.path) as record:
                    kept = len(record.layers("grad_norm").steps)
                    hists = len(record.layers("weight_hist").steps)
                rows.append(
                    {
                        "steps": step + 1,
                        "mb": _size(recorder.path) / 1e6,
                        "layer_steps_kept": kept,
                        "distribution_steps_kept": hists,
                        "seconds": time.perf_counter() - t0,
                    }
                )
                log(f"{step + 1} steps: {rows[-1]['mb']:.1f} MB")
        monitor.close()
        rows[-1]["mb_closed"] = _size(recorder.path) / 1e6
        return rows
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        "| steps | record size | sampled steps kept (per-layer) | distribution steps kept | "
        "wall time |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['steps']:,} | {r['mb']:.1f} MB | {r['layer_steps_kept']:,} | "
            f"{r['distribution_steps_kept']:,} | {r['seconds']:.0f} s |"
        )
    lines += [
        "",
        f"{env['date']}; Python {env['python']} on {env['cpu']}. A model of {LAYERS} layers "
        f"({2 * LAYERS} parameters, {UNITS} units each, a tanh after each), default "
        "detectors and RunRecorder defaults; size of the database with its WAL file; after "
        f"closing (checkpointed): {rows[-1]['mb_closed']:.1f} MB.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.record_size", description=__doc__)
    p.add_argument("--steps", type=int, default=1_000_000)
    args = p.parse_args(argv)
    rows = run(args.steps, lambda msg: print(msg, file=sys.stderr, flush=True))
    print(markdown(rows, machine()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
