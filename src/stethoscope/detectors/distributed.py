"""Distributed runs: replicas that drift apart, and ranks that hold the others back.

Both detectors judge facts gathered from every rank by the one collective of a sampled
step (:mod:`stethoscope.distributed`), so every rank sees the same numbers and reaches
the same verdict. In a single process they never run (their probes do not exist there).
"""

from __future__ import annotations

import numpy as np

from stethoscope.detectors._stats import push
from stethoscope.detectors.base import Detector, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["ReplicaDivergence", "Straggler"]


class ReplicaDivergence(Detector):
    """The replicas of a data-parallel run no longer hold the same weights.

    Rule: on a sampled step every rank checksums each parameter, and each buffer that
    DDP does not re-broadcast at every forward pass (BatchNorm running statistics under
    ``broadcast_buffers=False``); a tensor whose checksum is not the same on every rank
    has diverged. A parameter that differs is an error: the ranks now train different
    models, and the checkpoint rank zero writes is not the model the others evaluate. A
    buffer alone is a warning: the weights are still in step, but the ranks normalise
    differently. The finding names the first tensor that differs, in registration
    order, and the rank(s) that differ from the majority (from rank zero when there is
    no majority, as with two ranks).

    Sources: NeMo's ``DdpParityChecker`` (Megatron's
    ``check_param_hashes_across_dp_replicas``) compares a hash of every parameter across
    data-parallel replicas. The checksum here is the integer sum of each tensor's bit
    patterns: exact and independent of the summation order, so any change to any
    element shows, and identical replicas never differ (there is no rounding to allow for).
    """

    name = "replica_divergence"
    needs = frozenset({"replicas"})
    wants = frozenset({"replica_grads"})
    base_interval = 32  # it reads every weight, like the update snapshot; drift persists
    advice = "find the rank-local change to the weights; restart from a checkpoint"

    def _initial_state(self) -> dict:
        return {"agreed": None}  # the last step at which every replica was the same

    def _update(self, obs: Observation) -> list[Finding]:
        sums = np.asarray(obs.replica_sums)
        if sums.ndim != 2 or sums.shape[0] < 2 or sums.shape[1] == 0:
            return []
        differs = (sums != sums[0]).any(axis=0)
        if not differs.any():
            self.state["agreed"] = obs.step
            return []
        n = len(differs)
        buffers = (
            np.asarray(obs.replica_buffer, dtype=bool)
            if obs.replica_buffer is not None
            else np.zeros(n, dtype=bool)
        )
        params = differs & ~buffers
        first = int(np.argmax(params if params.any() else differs))
        name = obs.replica_names[first]
        odd, reference = _odd_ranks(sums[:, first])
        ranks = ", ".join(str(r) for r in odd)
        agreed = self.state["agreed"]
        since = f"; they still agreed at step {agreed}" if agreed is not None else ""
        count = int(differs.sum())
        where = f"{name} differs on rank {ranks} from {reference} at step {obs.step}"
        if params.any():
            return [
                self.finding(
                    obs,
                    "error",
                    f"The replicas diverged: {where} ({count} of {n} tensors differ{since}), "
                    f"so the ranks now train different models; {_cause(obs, params, agreed)}, and "
                    "restart from a checkpoint saved before.",
                    value=float(count),
                    where=name,
                    rank=odd[0],
                )
            ]
        return [
            self.finding(
                obs,
                "warning",
                f"The replicas' buffers diverged: {where} ({count} of {n} tensors differ"
                f"{since}) while the weights agree, so each rank normalises with its own "
                "running statistics; use SyncBatchNorm (Lightning: sync_batchnorm=True) or "
                "keep DDP's broadcast_buffers=True.",
                value=float(count),
                where=name,
                rank=odd[0],
            )
        ]


def _cause(obs: Observation, params: np.ndarray, agreed: int | None) -> str:
    """Where to look, from whether the ranks' gradients agreed as the step used them
    (``replica_grad_sums``, under DDP): gradients that differ were never all-reduced
    alike; gradients that agree leave the weights' own update on one rank, or a step
    between the last comparison (``agreed``) and this one that was not compared."""
    grads = obs.replica_grad_sums
    rank_local = (
        "look for code that changes the weights on one rank only (an in-place edit under a "
        "rank check, a parameter updated outside the optimizer, a non-deterministic kernel "
        "or faulty hardware)"
    )
    if grads is None:
        return rank_local
    grads = np.asarray(grads)
    if grads.ndim != 2 or grads.shape[0] < 2:
        return rank_local
    differ = (grads != grads[0]).any(axis=0)
    if not differ.any():
        said = "the ranks' gradients agreed as the step used them, so " + rank_local
        if agreed is not None and agreed >= obs.step - 1:
            return said  # the weights parted on this very step
        since = f"after step {agreed}" if agreed is not None else "none was compared before"
        return (
            f"{said}; or they parted on a step not compared ({since}) whose gradients "
            "skipped the all-reduce or changed on one rank: a backward or an optimizer "
            "step outside the DDP-wrapped training step on some steps (loss.backward() in "
            "place of manual_backward, a step taken in a hook), a lossy all-reduce, or "
            "clipping on one rank"
        )
    names = [obs.replica_names[i] for i in np.flatnonzero(differ)]
    first = names[0]
    return (
        f"the ranks' gradients already differed as the step used them ({len(names)} of "
        f"{len(differ)} parameters, first {first}): they were not all-reduced alike; look "
        "for a forward or backward that bypassed the DDP wrapper (a call of its .module, "
        "of a submodule or of a second model outside it), a step taken inside no_sync, a "
        "gradient changed on some ranks after the all-reduce (clipping or scaling under a "
        "rank check, an edit of .grad), or a communication hook that loses precision"
    )


def _odd_ranks(column: np.ndarray) -> tuple[list[int], str]:
    """The ranks whose value differs from the majority's (rank zero's if none), and whose."""
    values, counts = np.unique(column, return_counts=True)
    if counts.max() * 2 > len(column):
        majority = values[int(np.argmax(counts))]
        return [int(r) for r in np.flatnonzero(column != majority)], "the majority"
    return [int(r) for r in np.flatnonzero(column != column[0])], "rank 0"


class Straggler(Detector):
    """One rank is persistently much slower than the others.

    Rule: each rank times the part of every step it does alone, from the end of the
    previous step to the start of the backward pass (data loading and the forward
    pass). The rest cannot tell: DDP's gradient all-reduce makes every rank wait for
    the slowest, so whole steps take as long everywhere. On each sample a rank's time
    is compared with the median of the other ranks' times. A rank is a straggler when,
    in more than half of its last ``window`` samples, it took at least ``ratio`` times
    that median and at least ``min_excess`` seconds more: a warning naming it, with the
    median ratio over the window as its value.

    Sources: NVIDIA's straggler detection (nvidia-resiliency-ext) times the same
    sections per rank and scores each rank against the best one; its examples flag a
    relative score below 0.7, a rank 1.43x slower. ``ratio=1.5`` is a little more
    conservative, and is measured against the median rather than the best rank, so one
    fast rank does not make the others stragglers (with two ranks, each is compared with
    the other). Needing most of the window keeps a few slow batches or descheduled steps,
    however slow, from counting; ``min_excess`` keeps scheduler jitter on millisecond
    steps (a Linux time slice is a few milliseconds) from counting, where a ratio alone
    would.

    Args:
        ratio: How many times the other ranks' median a rank must take (> 1).
        min_excess: Seconds per step a rank must also lose over that median.
        window: Samples per rank judged together; more than half must be slow.
    """

    name = "straggler"
    needs = frozenset({"ranks"})
    base_interval = 16
    advice = "check that rank's data loading, host load and hardware"

    def __init__(self, *, ratio: float = 1.5, min_excess: float = 0.01, window: int = 8) -> None:
        check_positive(self.name, "ratio", ratio)
        if ratio <= 1:
            raise ValueError(f"{self.name}: ratio={ratio!r} must be > 1")
        check_positive(self.name, "min_excess", min_excess)
        check_positive(self.name, "window", window, integer=True)
        self.ratio, self.min_excess, self.window = float(ratio), float(min_excess), window
        super().__init__()

    def _initial_state(self) -> dict:
        # per sample, per rank: time / the other ranks' median, and time - that median
        return {"ratios": [], "excess": []}

    def _update(self, obs: Observation) -> list[Finding]:
        busy = np.asarray(obs.rank_busy, dtype=np.float64)
        if busy.ndim != 1 or len(busy) < 2 or not np.all(np.isfinite(busy)) or np.any(busy < 0):
            return []  # a rank measured no step since the last sample: skip this one
        st = self.state
        if st["ratios"] and len(st["ratios"][-1]) != len(busy):
            st["ratios"], st["excess"] = [], []  # the world size changed (a resumed run)
        others = _median_of_others(busy)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(others > 0, busy / others, np.where(busy > 0, 1e6, 1.0))
        push(st["ratios"], np.minimum(ratios, 1e6).tolist(), self.window)  # strict JSON
        push(st["excess"], (busy - others).tolist(), self.window)
        if len(st["ratios"]) < self.window:
            return []
        window = np.array(st["ratios"])
        slow = ((window >= self.ratio) & (np.array(st["excess"]) >= self.min_excess)).sum(0)
        findings = []
        for r in np.flatnonzero(2 * slow > self.window):
            r = int(r)
            ratio = float(np.median(window[:, r]))
            own, typical = float(busy[r]), float(others[r])
            findings.append(
                self.finding(
                    obs,
                    "warning",
                    f"Rank {r} is a straggler: in {slow[r]} of the last {self.window} samples "
                    f"up to step {obs.step} it took at least {self.ratio:g}x the other ranks' "
                    f"median time per step for data loading and the forward pass (median "
                    f"{ratio:.1f}x; now {own * 1e3:.0f} ms against {typical * 1e3:.0f} ms), "
                    "and every rank waits for it at each gradient all-reduce; check that "
                    "rank's data loading (workers, disk, network), its host's load, and its "
                    "device's clocks or temperature.",
                    value=ratio,
                    threshold=self.ratio,
                    where=f"rank {r}",
                    rank=r,
                )
            )
        return findings


def _median_of_others(x: np.ndarray) -> np.ndarray:
    """For each element, the median of all the others (leave-one-out), in one sort."""
    s = np.sort(x)
    pos = np.empty(len(x), dtype=np.int64)
    pos[np.argsort(x, kind="stable")] = np.arange(len(x))  # each element's place in s
    m = len(x) - 1  # the others, without the element at ``pos``
    mids = np.array([(m - 1) // 2, m // 2])[:, None]
    picked = np.where(mids < pos, s[mids], s[np.minimum(mids + 1, len(x) - 1)])
    return picked.mean(axis=0)
