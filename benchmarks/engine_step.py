"""The engine's host time per step, with no framework: what a quiet step and a sampled
step cost the Monitor itself, on a healthy run of the default detectors.

A healthy loss curve (falling, with batch noise) is fed to ``Monitor.observe_loss`` the
way an adapter feeds it on an unsampled step, and every sampled step of the schedule
gets an ``Observation`` with a loss and each parameter's gradient and weight norm, for
a 12-parameter model (the detectors that need more are passed over), through
``Monitor.observe``. The steps after the sampler's calibration window are timed, in
rounds, each over a fresh monitor; the table gives the median round's mean per step.
The quiet steps that wait are judged together at the next step that cannot (a sampled
one, mostly), so the mean over every step is the engine's cost per step.

It uses the public ``Monitor`` only, so the same script times any version of the
package on ``PYTHONPATH``: ``PYTHONPATH=<tree>/src python -m benchmarks.engine_step``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from stethoscope import Monitor, Observation
from stethoscope.detectors import default_detectors

PARAMS = 12


def _curve(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (2.3 * np.exp(-t / 400) + 0.2) * rng.lognormal(0.0, 0.05, n)


def _sampled(step: int, loss: float, rng: np.random.Generator) -> Observation:
    grads = rng.lognormal(0.0, 0.1, PARAMS)
    weights = 10 + rng.lognormal(0.0, 0.01, PARAMS)
    return Observation(
        step=step,
        epoch=0,
        loss=loss,
        lr=1e-3,
        names=tuple(f"layer{i}.weight" for i in range(PARAMS)),
        numel=np.full(PARAMS, 4096.0),
        is_matrix=np.ones(PARAMS),
        fan_in=np.full(PARAMS, 64.0),
        grad_norm=grads,
        weight_norm=weights,
    )


def one_round(
    steps: int, seed: int, without: Sequence[str] = ()
) -> tuple[float, float, float, int]:
    """Mean host µs of a quiet step, of a sampled step and of any step after the
    calibration window, and how many sampled steps there were (``without``: detectors
    left out, to compare with a version that has not got them)."""
    monitor = Monitor(sinks=[], detectors=default_detectors(**dict.fromkeys(without)))
    losses = _curve(steps, seed).tolist()
    rng = np.random.default_rng(seed)
    quiet_s = sampled_s = 0.0
    quiet_n = sampled_n = 0
    clock = time.perf_counter
    warm = 400  # the sampler's calibration window is hot: every step sampled
    for step, loss in enumerate(losses):
        plan = monitor.plan(step)
        if plan <= {"loss"}:
            t0 = clock()
            monitor.observe_loss(step, 0, loss, 1e-3)
            dt = clock() - t0
            if step >= warm:
                quiet_s, quiet_n = quiet_s + dt, quiet_n + 1
        else:
            obs = _sampled(step, loss, rng)
            t0 = clock()
            monitor.observe(obs)
            dt = clock() - t0
            if step >= warm:
                sampled_s, sampled_n = sampled_s + dt, sampled_n + 1
    monitor.close()
    every = 1e6 * (quiet_s + sampled_s) / max(quiet_n + sampled_n, 1)
    return 1e6 * quiet_s / max(quiet_n, 1), 1e6 * sampled_s / max(sampled_n, 1), every, sampled_n


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_step", description=__doc__)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--without", default="", help="comma-separated detectors to leave out")
    args = p.parse_args(argv)
    without = [n for n in args.without.split(",") if n]
    rounds = [one_round(args.steps, seed, without) for seed in range(args.rounds)]
    quiet, sampled, every = (statistics.median(r[k] for r in rounds) for k in range(3))
    spread = (min(r[2] for r in rounds), max(r[2] for r in rounds))
    print("| host µs per step (median of rounds) | quiet step | sampled step | every step |")
    print("|---|---|---|---|")
    print(
        f"| {args.rounds} rounds of {args.steps} steps, {rounds[0][3]} sampled each | "
        f"{quiet:.2f} | {sampled:.1f} | {every:.2f} (rounds {spread[0]:.2f}–{spread[1]:.2f}) |"
    )


if __name__ == "__main__":
    main()
