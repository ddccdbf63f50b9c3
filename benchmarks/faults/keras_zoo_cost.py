"""What stethoscope costs on the Keras zoo, split into a start-up and a rate (the Keras
twin of ``zoo_cost.py``, with the same bound and table).

For each workload it trains plain and watched fits (the watched one with stethoscope's
defaults) of ``k`` times the workload's epochs, in alternating pairs (ABBA), and clocks
every step in process CPU seconds (``keras_zoo.StepClock``: from one training batch's
start to the next, so a step holds stethoscope's hooks and its epoch's end). Both fits
train bit for bit the same, so step ``i`` is the same work in both; each step's time is
the least of the ``--repeats`` fits of its kind. The rate and the start-up are
``zoo_cost.Cost``'s: the rate over the run's second half, the start-up as the rest of
the extra time. A Keras fit traces its train functions on their first calls: a trace
late in the run counts in the rate.

Run (one thread, deterministic, as the zoo is)::

    python -m benchmarks.faults.keras_zoo_cost
    python -m benchmarks.faults.keras_zoo_cost --only lstm_lm --k 4
    KERAS_BACKEND=torch python -m benchmarks.faults.keras_zoo_cost
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import keras

from benchmarks.faults import keras_zoo, zoo
from benchmarks.faults.keras_zoo import WORKLOADS, KerasWorkload
from benchmarks.faults.zoo_cost import Cost, least_steps, render

__all__ = ["main", "measure"]


def _clocked(workload: KerasWorkload, epochs: int, watched: bool) -> list[float]:
    clock: list[float] = []
    f = keras_zoo.fit(workload, 0, watched=watched, epochs=epochs, clock=clock)
    if f.crash is not None:
        raise RuntimeError(f"{workload.name}: {f.crash}")
    return clock


def measure(workload: KerasWorkload, k: int, repeats: int) -> Cost:
    """``repeats`` ABBA pairs of ``k`` times the workload's epochs, clocked step by step."""
    epochs = workload.epochs * k
    clocks: dict[bool, list[list[float]]] = {False: [], True: []}
    for r in range(repeats):
        for is_watched in (True, False) if r % 2 else (False, True):
            clocks[is_watched].append(_clocked(workload, epochs, is_watched))
    plain, watched = least_steps(clocks[False]), least_steps(clocks[True])
    if len(plain) != len(watched):
        raise ValueError(
            f"{workload.name}: the plain fits ran {len(plain) - 1} steps, the watched "
            f"{len(watched) - 1}: not the same training"
        )
    return Cost(workload.name, plain, watched)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.keras_zoo_cost",
        description="stethoscope's start-up and rate on the Keras zoo's workloads",
    )
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--k", type=int, default=4, help="the fits' length, in workload lengths")
    p.add_argument("--repeats", type=int, default=3, help="fits of each kind, ABBA (default 3)")
    args = p.parse_args(argv)
    names = zoo.chosen(args.only, WORKLOADS)
    if names is None:
        return 2
    keras_zoo.configure(1)
    keras_zoo.quiet()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}", file=sys.stderr)
    costs = []
    for n in names:
        costs.append(measure(WORKLOADS[n], args.k, args.repeats))
        c = costs[-1]
        print(f"  {n}: start-up {c.start_up:.2f}s, rate {c.rate:.3f}", file=sys.stderr, flush=True)
    print(render(costs))
    print(
        json.dumps(
            {c.name: {"start_up_s": round(c.start_up, 3), "rate": round(c.rate, 4)} for c in costs}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
