"""The recovery table of the fault suite (Lightning): does ``recover=True`` keep a run
alive through a transient fault, and end a persistent one in a stop?

Each scenario trains the suite's MLP (Adam, lr 1e-2, 300 steps on the Gaussian task, a
validation after every epoch) three ways for each seed:

* the **healthy twin**: the same data, model and seed, without the fault;
* **without recovery**: the default callback (``stop_on="error"``);
* **with recovery**: ``LightningStethoscope(recover=True)``.

and reports, per way, the steps trained, whether the run was stopped, and the final
validation loss (the last validation), against the twin's. The transient faults start
at step 150:
* in the data: one NaN input batch, one poison batch (inputs x30 and every label
  wrong), a stretch of 8 batches with wrong labels;
* in the update, where the gate sees nothing wrong before it is applied: the learning
  rate x30, x300 and x3000 for 1, 4 and 16 steps, and (with SGD, momentum 0.9, and its
  twin likewise) the momentum buffer multiplied by 1000, as one huge gradient that
  entered it unseen would leave it.
The persistent ones: the learning rate 100x too high from the start (900 steps: room for
the whole ladder), and random labels.
The healthy control must take no action.

Run:
    python -m benchmarks.faults.recovery                 # 3 seeds, about 1 minute
    python -m benchmarks.faults.recovery --seeds 1 --only nan_batch
    python -m benchmarks.faults.recovery --longer 10     # 3000 steps, about 10 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import lightning as L
import torch

from benchmarks._machine import machine
from benchmarks.faults.data import DataSpec, make_data
from benchmarks.faults.lightning_suite import SuiteModule, configure, make_loader, quiet
from benchmarks.faults.scenarios import Scenario, TrainSpec
from stethoscope import LightningStethoscope
from stethoscope.findings import RECOVERY
from stethoscope.testing import CapturingSink

ONSET = 150
#: What the poisoned momentum buffer is multiplied by.
POISON = 1000.0
TRAIN = TrainSpec(optimizer="adam", lr=1e-2, max_steps=300, validate=True)
#: The training of the momentum case (and its twin's): SGD, whose buffer carries a past
#: gradient into every later update.
SGD = replace(TRAIN, optimizer="sgd", lr=0.05, momentum=0.9)
DATA = DataSpec(n_train=2048, n_val=512)


@dataclass(frozen=True)
class Case:
    """A recovery scenario: the fault, how long it lasts, and which kind it is."""

    name: str
    kind: str  # "transient", "persistent" or "control"
    what: str
    #: "nan_input", "poison", "corrupt_labels", "lr_spike" or "poisoned_momentum"
    fault: str | None = None
    steps: int = 1  # how many steps a batch or learning-rate fault lasts
    factor: float = 1.0  # the learning rate's, for "lr_spike"
    train: TrainSpec = TRAIN
    data: DataSpec = DATA
    healthy: TrainSpec = TRAIN  # the twin's training
    onset: int = ONSET  # the first step of the fault

    def twin(self) -> Case:
        """The same case without its fault: the healthy twin."""
        return replace(
            self, fault=None, train=self.healthy, data=replace(DATA, n_train=self.data.n_train)
        )

    def longer(self, k: int) -> Case:
        """The case ``k`` times as long: ``k`` times the steps and the training samples
        (the same epochs), the fault ``k`` times as late; the ladder's defaults (a
        snapshot every 100 steps, cool-downs of 200) are then a ``k``-th of the run."""
        return replace(
            self,
            train=replace(self.train, max_steps=self.train.max_steps * k),
            healthy=replace(self.healthy, max_steps=self.healthy.max_steps * k),
            data=replace(self.data, n_train=self.data.n_train * k),
            onset=self.onset * k,
        )


CASES: tuple[Case, ...] = (
    Case("nan_batch", "transient", "one NaN in the inputs at step 150", "nan_input"),
    Case(
        "poison_batch",
        "transient",
        "the batch of step 150: inputs x30 and every label wrong",
        "poison",
    ),
    Case(
        "corrupt_stretch",
        "transient",
        "8 batches from step 150 with every label wrong",
        "corrupt_labels",
        steps=8,
    ),
    *(
        Case(
            f"lr_x{factor}_for_{steps}",
            "transient",
            f"the learning rate x{factor} for {steps} step{'s' if steps > 1 else ''} from step 150",
            "lr_spike",
            steps=steps,
            factor=float(factor),
        )
        for factor in (30, 300, 3000)
        for steps in (1, 4, 16)
    ),
    Case(
        "poisoned_momentum",
        "transient",
        "SGD (lr 0.05, momentum 0.9): at step 150 the momentum buffer x1000, as one huge "
        "gradient the gate never saw would leave it",
        "poisoned_momentum",
        train=SGD,
        healthy=SGD,
    ),
    Case(
        "lr_too_high",
        "persistent",
        "Adam at lr 1.0 from the start (100x the twin's), 900 steps",
        # long enough for the default ladder's three roll backs and 200-step cool-downs
        train=replace(TRAIN, lr=1.0, max_steps=900),
    ),
    Case(
        "random_labels",
        "persistent",
        "every training label drawn at random: nothing to learn",
        data=replace(DATA, random_labels=True),
    ),
    Case("healthy", "control", "nothing wrong"),
)


class RecoveryModule(SuiteModule):
    """The suite's module with faults that last ``steps`` steps from ``onset``."""

    def __init__(self, case: Case, arrays: Any) -> None:
        # the suite builds the model and the optimizer from a scenario; the faults are ours
        scenario = Scenario(case.name, "healthy", case.what, train=case.train)
        super().__init__(scenario, arrays)
        self.case = case
        self.base_lr = case.train.lr

    def _faulty(self) -> bool:
        onset = self.case.onset
        return self.case.fault is not None and onset <= self.global_step < onset + self.case.steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.case.fault == "poisoned_momentum" and self.global_step == self.case.onset:
            for opt in self.trainer.optimizers:
                for state in opt.state.values():
                    state["momentum_buffer"].mul_(POISON)
        if self.case.fault == "lr_spike":
            lr = self.base_lr * (self.case.factor if self._faulty() else 1.0)
            for opt in self.trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr  # set every step: a roll back restores the old one

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self._faulty():
            kind = self.case.fault
            if kind == "nan_input":
                x = x.clone()
                x.view(-1)[0] = math.nan
            if kind == "poison":
                x = x * 30.0
            if kind in ("poison", "corrupt_labels"):
                y = (y + 1) % self.classes
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return loss


@dataclass
class Outcome:
    """One way of one seed: how far it got and where it ended."""

    steps: int
    stopped: bool
    val_loss: float
    actions: dict[str, int] = field(default_factory=dict)
    stopped_by: str | None = None


def _train(case: Case, seed: int, *, faulty: bool, recover: bool | None) -> Outcome:
    """One fit: ``recover`` None means no stethoscope at all (the twin)."""
    the_case = case if faulty else case.twin()
    torch.manual_seed(seed)
    arrays = make_data(the_case.data, seed)
    model = RecoveryModule(the_case, arrays)
    train = make_loader(arrays.x, arrays.y, the_case.train.batch_size, seed)
    val = make_loader(arrays.x_val, arrays.y_val, 256, seed, order="sequential")
    callbacks = []
    sink = CapturingSink()
    if recover is not None:
        callbacks.append(LightningStethoscope(sinks=[sink], recover=recover))
    trainer = L.Trainer(
        max_steps=the_case.train.max_steps,
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the callback's stop line: not the table's
        trainer.fit(model, train, val)
    val_losses = [v for _, v in model.val_losses]
    last = val_losses[-1] if val_losses else math.nan
    outcome = Outcome(trainer.global_step, bool(trainer.should_stop), last)
    if callbacks:
        cb = callbacks[0]
        outcome.stopped_by = cb.stopped_by.detector if cb.stopped_by else None
        outcome.actions = recovery_acts(sink)
    return outcome


def recovery_acts(sink: CapturingSink) -> dict[str, int]:
    """How often the ladder did each thing (skip, cool, restore_lr, rollback, stop)."""
    acts: dict[str, int] = {}
    for f in sink.findings:
        if f.detector == RECOVERY:
            acts[f.where] = acts.get(f.where, 0) + 1
    return acts


#: One fit of a case and seed: ``(case, seed, faulty=, recover=)``; ``recover`` None: the
#: twin, with no stethoscope at all.
Train = Callable[..., Outcome]


def run_case(case: Case, seeds: Sequence[int], train: Train = _train) -> list[dict[str, Any]]:
    """The three ways of ``case`` for each seed, as rows of :func:`markdown`."""
    rows = []
    for seed in seeds:
        twin = train(case, seed, faulty=False, recover=None)
        without = train(case, seed, faulty=True, recover=False)
        with_ = train(case, seed, faulty=True, recover=True)
        rows.append({"seed": seed, "twin": twin, "without": without, "with": with_})
    return rows


def run_cases(
    names: set[str] | None,
    seeds: int,
    train: Train = _train,
    cases: Sequence[Case] = CASES,
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """Every case (of ``names``, or all), its progress on stderr; the rows and the wall time."""
    t0 = time.perf_counter()
    results = {}
    for case in cases:
        if names is None or case.name in names:
            results[case.name] = run_case(case, range(seeds), train)
            print(f"{case.name}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return results, time.perf_counter() - t0


def _way(o: Outcome, twin: Outcome, total: int) -> str:
    if o.stopped:
        end = f"stopped at {o.steps} by {o.stopped_by}"
    elif o.steps < total:
        end = f"ended at {o.steps}"
    else:
        end = f"all {total} steps"
    ratio = o.val_loss / twin.val_loss if math.isfinite(o.val_loss) else math.nan
    loss = "NaN" if not math.isfinite(o.val_loss) else f"{o.val_loss:.3f} ({ratio:.2f}x)"
    return f"{end}; val {loss}"


def markdown(
    results: dict[str, list[dict[str, Any]]], wall_s: float, cases: Sequence[Case] = CASES
) -> str:
    lines = [
        "| scenario | kind | seed | healthy twin val | without recovery | with recover=True "
        "| ladder's acts |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for case in cases:
        for row in results.get(case.name, []):
            twin, total = row["twin"], case.train.max_steps
            acts = ", ".join(f"{k} {v}" for k, v in row["with"].actions.items()) or "none"
            lines.append(
                f"| {case.name} | {case.kind} | {row['seed']} | {twin.val_loss:.3f} | "
                f"{_way(row['without'], twin, total)} | {_way(row['with'], twin, total)} | "
                f"{acts} |"
            )
    lines += ["", "Within 5% of the twin (transient faults, with recover=True):"]
    for case in cases:
        if case.kind != "transient" or case.name not in results:
            continue
        ok = [
            not r["with"].stopped
            and r["with"].steps == case.train.max_steps
            and r["with"].val_loss <= 1.05 * r["twin"].val_loss
            for r in results[case.name]
        ]
        ratios = [r["with"].val_loss / r["twin"].val_loss for r in results[case.name]]
        lines.append(
            f"- {case.name}: {sum(ok)}/{len(ok)} (val loss ratios "
            f"{', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f})"
        )
    m = machine()
    lines += ["", f"{m['date']}; {wall_s / 60:.1f} min; {m['cpu']} x{m['cpu_count']}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults.recovery", description=__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    p.add_argument(
        "--longer",
        type=int,
        default=1,
        help="runs this many times as long (steps, samples, the fault's onset); the "
        "persistent cases, already long, are left out",
    )
    args = p.parse_args(argv)
    configure(2)
    quiet()
    names = set(args.only.split(",")) if args.only else None
    cases = CASES
    if args.longer > 1:
        cases = tuple(c.longer(args.longer) for c in CASES if c.kind != "persistent")
    results, wall = run_cases(names, args.seeds, cases=cases)
    print(markdown(results, wall, cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
