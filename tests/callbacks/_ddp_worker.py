"""One rank of the DDP tests, run as a script; ``test_lightning_ddp.py`` starts two.

    python _ddp_worker.py OUTDIR SCENARIO [SCENARIO ...]

The environment names the rank as a launcher would (``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so Lightning joins the two processes instead of launching its own, and
both run every scenario in turn in one process group (importing torch and Lightning once
is most of the cost). Each scenario is a fresh model, callback and ``Trainer`` on 2 CPU
ranks with gloo, writing rank zero's findings to ``OUTDIR/SCENARIO.jsonl`` through a
``JSONLSink``, and ``OUTDIR/SCENARIO-rank{r}.json``: this rank's last step, whether it
was told to stop or raised, and the finding that stopped it. The scenarios in
:data:`RECORDED` also keep a run record.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _models import TinyMLP, dataset
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Subset

from stethoscope import LightningStethoscope, Recovery
from stethoscope.detectors import Detector, default_detectors
from stethoscope.findings import Finding, TrainingProblem
from stethoscope.observation import Observation
from stethoscope.sinks import JSONLSink

#: The rank every fault is injected on: rank zero must learn of it from rank one.
FAULTY = 1


class RankFault(TinyMLP):
    """TinyMLP whose ``rank_fault`` happens on rank :data:`FAULTY` only: ``nan`` (its loss
    is NaN at step ``onset``), ``flaky`` (the same, on the step's first computation
    only: a replay computes it clean), ``perturb`` (its ``net.2.weight`` moves after the optimizer
    step at ``onset``), ``grad_edit`` (its ``net.2.weight`` gradient halved after the
    all-reduce, from ``onset``: clipping or scaling on one rank) or ``sleep`` (50 ms more
    per step in its forward pass)."""

    def __init__(self, *, rank_fault: str = "none", **kw: Any) -> None:
        super().__init__(**kw)
        self.rank_fault = rank_fault
        self.flaked = False

    def _mine(self) -> bool:
        return self.trainer.global_rank == FAULTY

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.rank_fault == "nan" and self._mine() and self.global_step == self.onset:
            loss = loss * math.nan
        flaky = self.rank_fault == "flaky" and self._mine() and self.global_step == self.onset
        if flaky and not self.flaked:
            self.flaked = True
            loss = loss * math.nan
        if self.rank_fault == "sleep" and self._mine():
            time.sleep(0.05)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        if self.rank_fault == "grad_edit" and self._mine() and self.global_step >= self.onset:
            with torch.no_grad():
                self.net[2].weight.grad.mul_(0.5)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.rank_fault == "perturb" and self._mine() and self.global_step == self.onset:
            weight = self.net[2].weight  # a DTensor's own part, on this rank alone
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            with torch.no_grad():  # its first element (FSDP1: of this rank's 1-D slice)
                local.view(-1)[0] += 1e-3


class RankOneDamage(Detector):
    """Stands in for ``large_updates`` (a detector the recovery ladder answers with a roll
    back): an error at step ``at``, from rank :data:`FAULTY`'s observation only, which only
    that rank's monitor sees until the ranks meet."""

    name = "large_updates"
    needs = frozenset({"loss"})

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def _update(self, obs: Observation) -> list[Finding]:
        if obs.step != self.at or obs.rank != FAULTY:
            return []
        return [self.finding(obs, "error", f"rank {obs.rank}'s updates went wrong", value=1.0)]


def _damage_detectors() -> list[Detector]:
    others = [d for d in default_detectors() if d.name != "large_updates"]
    return [*others, RankOneDamage(at=30)]


#: name: (model kwargs, callback kwargs, steps, DDP kwargs, validate)
SCENARIOS: dict[str, tuple[dict, dict, int, dict, bool]] = {
    # BatchNorm buffers (re-broadcast by DDP each step), dropout, validation: all quiet
    "healthy": ({"norm": True}, {}, 64, {}, True),
    # base intervals: rank 1's NaN at step 37 is agreed at the next meeting, step 48
    "nan": ({"rank_fault": "nan", "onset": 37}, {"escalate": False}, 80, {}, False),
    "nan_raise": (
        {"rank_fault": "nan", "onset": 37},
        {"escalate": False, "raise_on": "error"},
        80,
        {},
        False,
    ),
    "perturb": ({"rank_fault": "perturb", "onset": 20}, {}, 64, {}, False),
    "grad_edit": ({"rank_fault": "grad_edit", "onset": 20}, {}, 64, {}, False),
    "sleep": ({"rank_fault": "sleep"}, {}, 24, {}, False),
    # BatchNorm buffers DDP does not re-broadcast: each rank's running statistics drift
    "buffers": ({"norm": True}, {}, 24, {"broadcast_buffers": False}, False),
    # the recovery ladder: rank 1's NaN at step 37 is skipped by both ranks, at once
    "recover": ({"rank_fault": "nan", "onset": 37}, {"recover": True}, 64, {}, False),
    # rank 1's NaN at step 37 on the first computation alone: both ranks replay the step,
    # which is fine, and apply it
    "recover_replay": (
        {"rank_fault": "flaky", "onset": 37},
        {"recover": Recovery(replay=True)},
        64,
        {},
        False,
    ),
    # an error on an applied step that rank 1 alone sees: held until the ranks meet, then
    # every rank rolls back to the same snapshot
    "recover_rollback": (
        {},
        {"recover": Recovery(snapshot_every=8), "detectors": "damage"},
        64,
        {},
        False,
    ),
}


#: The Trainer's arguments of every scenario: no logger, checkpoint, progress bar or
#: summary, no sanity validation, no epoch limit.
QUIET: dict[str, Any] = dict(
    max_epochs=-1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)

#: Scenarios whose run also keeps a record, in ``OUTDIR/SCENARIO-record`` (rank zero's).
RECORDED = ("healthy", "nan")


def run(out: Path, name: str) -> None:
    model_kw, cb_kw, steps, ddp_kw, validate = SCENARIOS[name]
    if cb_kw.get("detectors") == "damage":  # made afresh: a detector keeps its state
        cb_kw = {**cb_kw, "detectors": _damage_detectors()}
    if name in RECORDED:
        cb_kw = {**cb_kw, "record": out / f"{name}-record"}
    torch.manual_seed(0)  # the same initial weights on both ranks, as DDP expects
    model = RankFault(**model_kw)
    callback = LightningStethoscope(sinks=[JSONLSink(out / f"{name}.jsonl")], **cb_kw)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60), **ddp_kw),
        max_steps=steps,
        limit_val_batches=2 if validate else 0,
        callbacks=[callback],
        **QUIET,
    )
    # 32 steps per epoch on each rank; one teacher: the last 128 samples are held out
    full = dataset(2048 + 128)
    data = DataLoader(Subset(full, range(2048)), batch_size=32, shuffle=True)
    val = DataLoader(Subset(full, range(2048, 2176)), batch_size=32) if validate else None
    raised = None
    try:
        trainer.fit(model, data, val)
    except TrainingProblem as exc:
        raised = exc.finding.to_dict(json_safe=True)
    stopped = callback.stopped_by
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "should_stop": trainer.should_stop,
        "stopped_by": stopped.to_dict(json_safe=True) if stopped else None,
        "raised": raised,
        # the replicas' weights, to compare across ranks
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "skips": callback.recoverer.ladder.counts["skip"] if callback.recoverer else None,
        "ladder": (
            [[r.step, r.act, r.why] for r in callback.recoverer.ladder.history]
            if callback.recoverer
            else None
        ),
    }
    (out / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_all(run: Callable[[Path, str], None]) -> None:
    """Run every scenario the command line names (``OUTDIR SCENARIO ...``) with ``run``,
    then take the process group down."""
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        run(out, name)
    # Lightning leaves the gloo process group up after fit; left to the interpreter's exit,
    # its threads were once torn down unjoined ("terminate called without an active
    # exception", SIGABRT) after every scenario had written its result
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_all(run)
