"""What stethoscope costs on the zoo, split into a start-up and a rate.

The zoo's runs are a few seconds long, so their time ratio (``zoo.py``'s time column)
mixes two costs that scale differently: a fixed start-up (building the probes, the first
steps, where the sampler runs every detector every step to calibrate) and what each step
costs once the run is under way. A user's run is longer than the zoo's: what decides
whether they notice stethoscope is the second. The bound this checks (issue 51): past a
fixed start-up of at most a second, no run slower than 1.05x its plain twin.

For each workload it times plain and watched fits (the watched one with stethoscope's
defaults) at the workload's length ``L`` and at ``k * L``, in alternating pairs
(ABBA), as process CPU seconds on one thread, the medians of ``--repeats`` pairs. With
``extra(n)`` the watched fit's time less the plain one's at length ``n``:

* rate: ``1 + (extra(kL) - extra(L)) / (plain(kL) - plain(L))``, the watched run's
  slope over the plain one's: what each step past the first ``L`` costs;
* start-up: ``extra(L) - (rate - 1) * plain(L)``, the time the line's intercept holds.

Both are flagged ``!`` past the bound (rate > 1.05, start-up > 1 s).

Run (one core, as the workloads were sized for)::

    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo_cost
    OMP_NUM_THREADS=1 python -m benchmarks.faults.zoo_cost --only word_lm,gcn --k 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from benchmarks.faults import zoo
from benchmarks.faults.lightning_suite import quiet
from benchmarks.faults.zoo_models import WORKLOADS, Workload

__all__ = ["Cost", "main", "measure"]

#: The bound: the rate past start-up, and the start-up in seconds.
RATE, START_UP = 1.05, 1.0


@dataclass
class Cost:
    """One workload's times at two lengths (medians of CPU seconds)."""

    name: str
    k: int
    steps: tuple[int, int]
    plain: tuple[float, float]
    watched: tuple[float, float]

    @property
    def extra(self) -> tuple[float, float]:
        return self.watched[0] - self.plain[0], self.watched[1] - self.plain[1]

    @property
    def rate(self) -> float | None:
        """The watched run's time per plain second, past the first length (None: the run
        did not grow, as one that stops at a target loss)."""
        grew = self.plain[1] - self.plain[0]
        if self.steps[1] < 1.5 * self.steps[0] or grew <= 0:
            return None
        return 1 + (self.extra[1] - self.extra[0]) / grew

    @property
    def start_up(self) -> float:
        """Seconds the watched run costs once, whatever its length (a run that did not
        grow: all it costs, at either length)."""
        if self.rate is None:
            return max(self.extra)
        return self.extra[0] - (self.rate - 1) * self.plain[0]

    def within(self) -> bool:
        return (self.rate is None or self.rate <= RATE) and self.start_up <= START_UP


def _timed(workload: Workload, watched: bool) -> tuple[float, int]:
    f = zoo.fit(workload, 0, watched=watched)
    if f.crash is not None:
        raise RuntimeError(f"{workload.name}: {f.crash}")
    return f.cpu, f.steps


def measure(workload: Workload, k: int, repeats: int) -> Cost:
    """``repeats`` ABBA pairs at the workload's length and at ``k`` times it."""
    plain, watched, steps = [], [], []
    for length in (workload.steps, workload.steps * k):
        w = dataclasses.replace(workload, steps=length)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for is_watched in (True, False) if r % 2 else (False, True):
                cpu, n = _timed(w, is_watched)
                times[is_watched].append(cpu)
        plain.append(statistics.median(times[False]))
        watched.append(statistics.median(times[True]))
        steps.append(n)
    return Cost(
        workload.name, k, (steps[0], steps[1]), (plain[0], plain[1]), (watched[0], watched[1])
    )


def render(costs: Sequence[Cost]) -> str:
    head = (
        f"{'workload':<16} {'steps':>11} {'plain s':>13} {'extra s':>13} "
        f"{'start-up s':>10} {'rate':>7}"
    )
    lines = [head, "-" * len(head)]
    for c in costs:
        flag_s = "!" if c.start_up > START_UP else " "
        flag_r = "!" if c.rate is not None and c.rate > RATE else " "
        rate = "-" if c.rate is None else f"{c.rate:.3f}"
        lines.append(
            f"{c.name:<16} {c.steps[0]:>5},{c.steps[1]:>5} "
            f"{c.plain[0]:>6.2f},{c.plain[1]:>6.2f} {c.extra[0]:>+6.2f},{c.extra[1]:>+6.2f} "
            f"{c.start_up:>9.2f}{flag_s} {rate:>6}{flag_r}"
        )
    within = sum(c.within() for c in costs)
    lines.append(
        f"within the bound (rate <= {RATE}, start-up <= {START_UP:g} s): {within}/{len(costs)}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.faults.zoo_cost",
        description="stethoscope's start-up and rate on the zoo's workloads",
    )
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--k", type=int, default=4, help="the longer length, in workload lengths")
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs per length (default 2)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"unknown workload(s) {unknown!r}; use some of {list(WORKLOADS)!r}", file=sys.stderr)
        return 2
    quiet()
    torch.set_num_threads(1)
    costs = []
    for n in names:
        costs.append(measure(WORKLOADS[n], args.k, args.repeats))
        c = costs[-1]
        print(f"  {n}: start-up {c.start_up:.2f}s, rate {c.rate}", file=sys.stderr, flush=True)
    print(render(costs))
    print(
        json.dumps(
            {
                c.name: {"start_up_s": round(c.start_up, 3), "rate": c.rate and round(c.rate, 4)}
                for c in costs
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
