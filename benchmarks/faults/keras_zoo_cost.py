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

import sys
from collections.abc import Sequence

import keras

from benchmarks.faults import keras_zoo, zoo
from benchmarks.faults.keras_zoo import WORKLOADS, KerasWorkload
from benchmarks.faults.zoo_cost import Cost, paired, parser, report

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
    return paired(workload.name, repeats, lambda watched: _clocked(workload, epochs, watched))


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m benchmarks.faults.keras_zoo_cost"
    args = parser(prog, list(WORKLOADS), "the Keras zoo's workloads").parse_args(argv)
    names = zoo.chosen(args.only, WORKLOADS)
    if names is None:
        return 2
    keras_zoo.configure(1)
    keras_zoo.quiet()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}", file=sys.stderr)
    report(names, lambda n: measure(WORKLOADS[n], args.k, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
