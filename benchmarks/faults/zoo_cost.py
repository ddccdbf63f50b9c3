"""What stethoscope costs on the zoo, split into a start-up and a rate.

The zoo's runs are a few seconds long, so their time ratio (``zoo.py``'s time column)
mixes two costs that scale differently: a fixed start-up (building the probes, the first
steps, where the sampler runs every detector every step to calibrate) and what each step
costs once the run is under way. A user's run is longer than the zoo's: what decides
whether they notice stethoscope is the second. The bound this checks (issue 51): past a
fixed start-up of at most a second, no run slower than 1.05x its plain twin.

For each workload it trains plain and watched fits (the watched one with stethoscope's
defaults) of ``k * L`` steps, ``L`` the workload's length, in alternating pairs (ABBA),
and clocks every step in process CPU seconds on one thread (``zoo.StepClock``: from one
training batch's start to the next, so a step holds its validation and its epoch's end).
The two fits train bit for bit the same, so step ``i`` is the same work in both. Each
step's time is the least of the ``--repeats`` fits of its kind: the machine's noise only
ever adds time, and the minimum over a few runs strips most of it, where the total of a
whole fit carries all of its spikes.

* rate: the watched steps' time over the plain ones', over the run's second half, after
  the sampler's calibration and the detectors' warm-up: what a step costs once the run
  is under way;
* start-up: the watched fit's extra time, less what the rate accounts for:
  ``extra - (rate - 1) * plain steps``, over the whole fit, what comes before its first
  step included.

Both are flagged ``!`` past the bound (rate > 1.05, start-up > 1 s).

Run (one core, as the workloads were sized for)::

    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo_cost
    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo_cost --only word_lm,gcn --k 4
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.faults import zoo
from benchmarks.faults.lightning_suite import quiet
from benchmarks.faults.zoo_models import WORKLOADS, Workload

__all__ = ["Cost", "least_steps", "main", "measure", "paired", "parser", "report"]

#: The bound: the rate past start-up, and the start-up in seconds.
RATE, START_UP = 1.05, 1.0


@dataclass
class Cost:
    """One workload's clocked fits: per step, the least CPU seconds of its repeats.

    ``plain`` and ``watched`` each hold the time before the first step, then one entry per
    step (the last one runs to the fit's end, its teardown included).
    """

    name: str
    plain: list[float]
    watched: list[float]

    @property
    def steps(self) -> int:
        return len(self.plain) - 1

    @property
    def extra(self) -> float:
        """The watched fit's seconds over the plain one's, all of it."""
        return sum(self.watched) - sum(self.plain)

    @property
    def rate(self) -> float:
        """The watched steps' time per plain second over the run's second half (its last
        step, which holds the teardown, left out)."""
        half = slice(1 + self.steps // 2, len(self.plain) - 1)
        return sum(self.watched[half]) / sum(self.plain[half])

    @property
    def start_up(self) -> float:
        """Seconds the watched run costs once, whatever its length: its extra time less
        the rate's share of the plain steps."""
        return self.extra - (self.rate - 1) * sum(self.plain[1:])

    def within(self) -> bool:
        return self.rate <= RATE and self.start_up <= START_UP


def least_steps(clocks: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the least of several fits' times, from the clock each fit kept (its
    start, each step's start, its end).

    Raises:
        ValueError: If the fits ran different numbers of steps (they are then not the
            same training, and step ``i`` of one is not step ``i`` of another).
    """
    lengths = {len(c) for c in clocks}
    if len(lengths) != 1:
        raise ValueError(f"the fits ran different numbers of steps: {sorted(lengths)}")
    per_fit = [[b - a for a, b in itertools.pairwise(c)] for c in clocks]
    return [min(times) for times in zip(*per_fit, strict=True)]


def _clocked(workload: Workload, watched: bool) -> list[float]:
    clock: list[float] = []
    f = zoo.fit(workload, 0, watched=watched, clock=clock)
    if f.crash is not None:
        raise RuntimeError(f"{workload.name}: {f.crash}")
    return clock


def measure(workload: Workload, k: int, repeats: int) -> Cost:
    """``repeats`` ABBA pairs of ``k`` times the workload's length, clocked step by step."""
    w = dataclasses.replace(workload, steps=workload.steps * k)
    return paired(workload.name, repeats, lambda watched: _clocked(w, watched))


def paired(name: str, repeats: int, clocked: Callable[[bool], list[float]]) -> Cost:
    """``repeats`` ABBA pairs of fits, ``clocked(watched)`` each one's clock; per step the
    least time of each kind.

    Raises:
        ValueError: If the plain and the watched fits ran different numbers of steps.
    """
    clocks: dict[bool, list[list[float]]] = {False: [], True: []}
    for r in range(repeats):
        for is_watched in (True, False) if r % 2 else (False, True):
            clocks[is_watched].append(clocked(is_watched))
    plain, watched = least_steps(clocks[False]), least_steps(clocks[True])
    if len(plain) != len(watched):
        raise ValueError(
            f"{name}: the plain fits ran {len(plain) - 1} steps, the watched "
            f"{len(watched) - 1}: not the same training"
        )
    return Cost(name, plain, watched)


def render(costs: Sequence[Cost]) -> str:
    head = (
        f"{'workload':<16} {'steps':>6} {'plain s':>8} {'extra s':>8} "
        f"{'start-up s':>10} {'rate':>7}"
    )
    lines = [head, "-" * len(head)]
    for c in costs:
        flag_s = "!" if c.start_up > START_UP else " "
        flag_r = "!" if c.rate > RATE else " "
        lines.append(
            f"{c.name:<16} {c.steps:>6} {sum(c.plain):>8.2f} {c.extra:>+8.2f} "
            f"{c.start_up:>9.2f}{flag_s} {c.rate:>6.3f}{flag_r}"
        )
    within = sum(c.within() for c in costs)
    lines.append(
        f"within the bound (rate <= {RATE}, start-up <= {START_UP:g} s): {within}/{len(costs)}"
    )
    return "\n".join(lines)


def parser(prog: str, workloads: Sequence[str], what: str) -> argparse.ArgumentParser:
    """The command line both zoos' cost benchmarks take."""
    p = argparse.ArgumentParser(prog=prog, description=f"stethoscope's start-up and rate on {what}")
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(workloads)}")
    p.add_argument("--k", type=int, default=4, help="the fits' length, in workload lengths")
    p.add_argument("--repeats", type=int, default=3, help="fits of each kind, ABBA (default 3)")
    return p


def report(names: Sequence[str], measure_one: Callable[[str], Cost]) -> None:
    """Measure each workload in turn (its figures on stderr as it goes), then print the
    table and one JSON line."""
    costs = []
    for n in names:
        costs.append(measure_one(n))
        c = costs[-1]
        print(f"  {n}: start-up {c.start_up:.2f}s, rate {c.rate:.3f}", file=sys.stderr, flush=True)
    print(render(costs))
    print(
        json.dumps(
            {c.name: {"start_up_s": round(c.start_up, 3), "rate": round(c.rate, 4)} for c in costs}
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser("python -m benchmarks.faults.zoo_cost", list(WORKLOADS), "the zoo's workloads")
    args = args.parse_args(argv)
    names = zoo.chosen(args.only, WORKLOADS)
    if names is None:
        return 2
    quiet()
    torch.set_num_threads(1)
    report(names, lambda n: measure(WORKLOADS[n], args.k, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
