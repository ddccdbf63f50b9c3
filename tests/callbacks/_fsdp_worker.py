"""One rank of the sharded-training tests, run as a script; ``test_lightning_fsdp.py``
starts two.

    python _fsdp_worker.py OUTDIR SCENARIO [SCENARIO ...]

As ``_ddp_worker.py`` does, both ranks run every scenario in turn in one process group
(gloo, 2 CPU ranks). A ``fsdp_*`` scenario trains under Lightning's
``ModelParallelStrategy`` (FSDP2: ``fully_shard`` on each linear layer and on the model,
every parameter a DTensor holding half of its rows per rank); a ``ddp_*`` one is its
twin under DDP, from the same initial weights and batches. Each writes
``OUTDIR/SCENARIO.jsonl`` (rank zero's findings), ``OUTDIR/SCENARIO-rank{r}.json`` (this
rank's last step, whether it stopped and why, its recovery ladder) and, from rank zero,
``OUTDIR/SCENARIO-observed.json``: every per-parameter statistic handed to the
detectors, by step.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import numpy as np
import torch
from _ddp_worker import QUIET, RankFault, _damage_detectors, run_all
from _models import dataset
from benchmarks.cpu_deepspeed import cpu_deepspeed_strategy
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Subset

from stethoscope import LightningStethoscope, Recovery
from stethoscope.callbacks._lightning import recovery as gate_module
from stethoscope.callbacks._lightning.shards import ShardCombiner
from stethoscope.detectors import default_detectors
from stethoscope.observation import Observation
from stethoscope.sinks import JSONLSink, Sink


class ShardedRankFault(RankFault):
    """RankFault, sharded by FSDP2 in ``configure_model``: each linear layer, then the
    whole model (Lightning calls it once the process group is up)."""

    def configure_model(self) -> None:
        for module in self.net:
            if isinstance(module, torch.nn.Linear):
                fully_shard(module)
        fully_shard(self)


class HybridShardedRankFault(RankFault):
    """RankFault under HSDP: FSDP2 on a 2-D mesh of 2 replicas of 1 shard each, so every
    parameter is a DTensor placed ``(Replicate(), Shard(0))``: each rank holds all of it,
    as under DDP."""

    def configure_model(self) -> None:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for module in self.net:
            if isinstance(module, torch.nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)


class TensorParallelRankFault(RankFault):
    """RankFault under tensor parallelism over both ranks: its linear layers split by
    columns and by rows in turn (weights ``Shard(0)`` and ``Shard(1)``; the biases of the
    row-split layers ``Replicate()``, held whole by both ranks)."""

    def configure_model(self) -> None:
        linear = [i for i, m in enumerate(self.net) if isinstance(m, torch.nn.Linear)]
        plan = {
            f"net.{i}": ColwiseParallel() if k % 2 == 0 else RowwiseParallel()
            for k, i in enumerate(linear)
        }
        parallelize_module(self, self.device_mesh["tensor_parallel"], plan)


class FlatShardedRankFault(RankFault):
    """RankFault under FSDP1: each linear layer wrapped in ``FullyShardedDataParallel``
    with ``use_orig_params=True`` (``FULL_SHARD``), so each parameter the model shows is a
    1-D slice of its elements, empty on some rank. Wrapped here, on the CPU, since
    Lightning wraps only on CUDA (``device_id``); its strategy is :class:`CPUFSDPStrategy`."""

    def configure_model(self) -> None:
        for i, module in enumerate(self.net):
            if isinstance(module, torch.nn.Linear):
                self.net[i] = FSDP(module, use_orig_params=True, device_id=torch.device("cpu"))


class HybridFlatShardedRankFault(RankFault):
    """RankFault under FSDP1's ``HYBRID_SHARD`` on 4 ranks: each linear layer sharded over
    2 ranks and replicated over 2 such groups (a 2x2 mesh: ranks 0 and 1 one replica,
    2 and 3 the other), so each parameter is a 1-D slice on each rank, held twice."""

    def configure_model(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for i, module in enumerate(self.net):
            if isinstance(module, torch.nn.Linear):
                self.net[i] = FSDP(
                    module,
                    use_orig_params=True,
                    device_id=torch.device("cpu"),
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                    device_mesh=mesh,
                )


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, which refuses any accelerator but CUDA by its exact
    type: a subclass runs on the CPU, with the model wrapped by hand (above)."""


class Observed(Sink):
    """Keeps what the detectors were handed of each parameter, by step (rank zero)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def observe(self, obs: Observation, interval: Any = None) -> None:
        if obs.loss_scale is not None:
            row = self.steps.setdefault(obs.step, {"names": list(obs.names or ())})
            row["loss_scale"] = [obs.loss_scale, obs.scale_skipped, obs.scale_steps]
        if obs.grad_norm is None and obs.weight_norm is None:
            return
        row = self.steps.setdefault(obs.step, {"names": list(obs.names or ())})
        for field in ("grad_norm", "weight_norm", "update_norm", "prev_weight_norm"):
            value = getattr(obs, field)
            if value is not None:
                row[field] = [None if np.isnan(v) else float(v) for v in value]
        if obs.unit_zero is not None:
            row["unit_zero"] = [z.astype(int).tolist() for z in obs.unit_zero]
        if obs.grad_hist is not None:
            row["grad_hist"] = obs.grad_hist.tolist()
        if obs.stale_grads is not None:
            row["stale_grads"] = obs.stale_grads
        for field in ("grad_subnormal", "grad_zero", "grad_peak", "update_lost"):
            value = getattr(obs, field)
            if value is not None:
                row[field] = [None if np.isnan(v) else float(v) for v in value]
        for field in ("fp8_underflow", "fp8_amax"):  # a row per parameter
            value = getattr(obs, field)
            if value is not None:
                row[field] = np.nan_to_num(value, nan=-1.0).tolist()


#: Every sampled detector every other step: most steps compared.
OFTEN = {d.name: 2 for d in default_detectors() if d.base_interval > 1}

#: A bf16 run judged at base intervals.
BF16 = {"escalate": False, "precision": "bf16-true"}

#: name: (model kwargs, callback kwargs, steps)
SCENARIOS: dict[str, tuple[dict, dict, int]] = {
    # the same training under both strategies: the statistics must agree (the record
    # asks for the histograms too)
    "fsdp_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    "ddp_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    # rank 1's loss is NaN at step 37: agreed at the next meeting, step 48
    "fsdp_nan": ({"rank_fault": "nan", "onset": 37}, {"escalate": False}, 80),
    # the recovery ladder: rank 1's NaN batch at step 5 is skipped by both ranks...
    "fsdp_skip": ({"rank_fault": "nan", "onset": 5}, {"recover": True}, 20),
    # ...which leaves every shard as this twin, whose data never held that batch, does
    "fsdp_twin": ({}, {"recover": True}, 19),
    # an error on an applied step that rank 1 alone sees: every rank rolls its own shards
    # back to the same step's snapshot
    "fsdp_rollback": ({}, {"recover": Recovery(snapshot_every=8), "detectors": "damage"}, 48),
    # the ranks' shards left uncombined (a broken combine): the self-check says so
    "fsdp_uncombined": ({}, {}, 4),
    # the same, the snapshots on disk in one directory both ranks share
    "fsdp_rollback_disk": ({}, {"recover": "disk", "detectors": "damage"}, 48),
    # bf16 weights and a learning rate too small for them: most updates round away
    # (with fp8_readiness, opt-in, whose counts are against each whole tensor's peak)
    "fsdp_bf16": ({"depth": 3, "lr": 1e-5}, {**BF16, "detectors": "fp8"}, 40),
    "ddp_bf16": ({"depth": 3, "lr": 1e-5}, {**BF16, "detectors": "fp8"}, 40),
    # HSDP: each parameter replicated over the ranks, as DDP's are
    "hsdp_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    # ...whose replicas are compared: rank 1's net.2.weight moves after step 20
    "hsdp_perturb": ({"rank_fault": "perturb", "onset": 20}, {}, 64),
    # tensor parallelism: both ranks train on the same batches, so the reference is
    # FSDP2 on the same batches on both ranks (the gradient of one rank's batch)
    "tp_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    # FSDP1's flat parameters, each rank a slice of each
    "fsdp1_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    # FSDP1's HYBRID_SHARD on 4 ranks (against ddp_norms on 4): replicas of the slices,
    # each counted once, and compared
    "hsdp1_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    "hsdp1_perturb": ({"rank_fault": "perturb", "onset": 20}, {}, 64),
    # the recovery gate's norm of the whole model, each step: the replicas counted once
    "hsdp1_gate": ({"depth": 3}, {"recover": True}, 12),
    "ddp_gate": ({"depth": 3}, {"recover": True}, 12),
    # a NaN batch on rank 1 at step 5, skipped by every rank, against a twin without it
    "hsdp1_skip": ({"rank_fault": "nan", "onset": 5}, {"recover": True}, 20),
    "hsdp1_twin": ({}, {"recover": True}, 19),
    "fsdp1_skip": ({"rank_fault": "nan", "onset": 5}, {"recover": True}, 20),
    "fsdp1_twin": ({}, {"recover": True}, 19),
    "fsdp1_rollback": ({}, {"recover": Recovery(snapshot_every=8), "detectors": "damage"}, 48),
    "fsdp1_rollback_disk": ({}, {"recover": "disk", "detectors": "damage"}, 48),
    "ddp_rollback": ({}, {"recover": Recovery(snapshot_every=8), "detectors": "damage"}, 48),
    "fsdp_same_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    # DeepSpeed's ZeRO: stage 2 (whole weights, gradients in each rank's partition) and
    # stage 3 (the weights partitioned too)
    "zero2_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    "zero3_norms": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "record": True}, 24),
    "zero2_nan": ({"rank_fault": "nan", "onset": 37}, {"escalate": False}, 80),
    "zero3_nan": ({"rank_fault": "nan", "onset": 37}, {"escalate": False}, 80),
    # rank 1's copy of net.2.weight moves after step 20: ZeRO-2's replicas differ
    "zero2_perturb": ({"rank_fault": "perturb", "onset": 20}, {}, 64),
    # recover= is refused under DeepSpeed, before any step
    "zero2_recover": ({}, {"recover": True}, 4),
    # two batches a step: DeepSpeed holds the step's gradients on the second alone
    "ddp_accumulate": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "accumulate": 2}, 12),
    "zero2_accumulate": (
        {"depth": 3},
        {"intervals": OFTEN, "escalate": False, "accumulate": 2},
        12,
    ),
    "zero3_accumulate": (
        {"depth": 3},
        {"intervals": OFTEN, "escalate": False, "accumulate": 2},
        12,
    ),
    # fp8_readiness (opt-in): counts against each whole tensor's peak, agreed first
    "ddp_fp8": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "detectors": "fp8"}, 8),
    "zero2_fp8": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "detectors": "fp8"}, 8),
    "zero3_fp8": ({"depth": 3}, {"intervals": OFTEN, "escalate": False, "detectors": "fp8"}, 8),
    # bf16 weights under DeepSpeed, which keeps their fp32 master copies
    "zero2_bf16": ({"depth": 3, "lr": 1e-5}, {**BF16, "precision": "bf16-mixed"}, 40),
    "zero1_bf16": ({"depth": 3, "lr": 1e-5}, {**BF16, "precision": "bf16-mixed"}, 40),
    "zero1_uncombined": ({}, {"precision": "bf16-mixed"}, 4),
    # the ranks' slices left uncombined: checked against DeepSpeed's own gathered gradients
    "zero2_uncombined": ({}, {}, 4),
    "zero3_uncombined": ({}, {}, 4),
    # fp16 with DeepSpeed's dynamic loss scaler, from a scale (2**24) that overflows at
    # first: the engine skips those steps and lowers its scale, as it is meant to
    "zero2_fp16": (
        {"depth": 3},
        {
            "intervals": OFTEN,
            "escalate": False,
            "precision": "16-mixed",
            "deepspeed": {"initial_scale_power": 24},
        },
        40,
    ),
}

#: How each layout shards the model, and the strategy's arguments.
LAYOUTS: dict[str, tuple[type, dict]] = {
    "ddp": (RankFault, {}),
    "fsdp": (ShardedRankFault, {"data_parallel_size": 2, "tensor_parallel_size": 1}),
    "hsdp": (HybridShardedRankFault, {"data_parallel_size": 2, "tensor_parallel_size": 1}),
    "tp": (TensorParallelRankFault, {"data_parallel_size": 1, "tensor_parallel_size": 2}),
    "fsdp1": (FlatShardedRankFault, {"flat": True}),
    "hsdp1": (HybridFlatShardedRankFault, {"flat": True}),  # on 4 ranks
    "zero2": (RankFault, {"zero": 2}),  # DeepSpeed
    # stage 1 with bf16 weights and fp32 gradients: DeepSpeed's BF16_Optimizer, which
    # keeps each parameter's whole gradient on every rank
    "zero1": (RankFault, {"zero": 1, "config": {"data_types": {"grad_accum_dtype": "fp32"}}}),
    "zero3": (RankFault, {"zero": 3}),
}

#: Each rank trains on its own half of the samples (every other one), in order: the
#: twin's rank leaves out its batch of step 5 (32 samples from 160).
TWIN_SKIPS = range(5 * 32, 6 * 32)


def run(out: Path, name: str) -> None:
    model_kw, cb_kw, steps = SCENARIOS[name]
    cb_kw = dict(cb_kw)  # a scenario's own: its entries are taken out below
    if cb_kw.get("detectors") == "damage":  # made afresh: a detector keeps its state
        cb_kw = {**cb_kw, "detectors": _damage_detectors()}
    if cb_kw.get("detectors") == "fp8":
        cb_kw = {**cb_kw, "detectors": default_detectors(fp8_readiness={})}
    if cb_kw.get("recover") == "disk":
        shared = out / f"{name}-snapshots"  # shared by every node
        recovery = Recovery(snapshot_every=8, snapshot_in="disk", snapshot_dir=shared)
        cb_kw = {**cb_kw, "recover": recovery}
    layout = name.split("_")[0]
    model_class, parallel = LAYOUTS[layout]
    # in a two-node run each node writes where its own disk would be
    nodes = int(os.environ.get("STETHOSCOPE_TEST_NODES", "1"))  # see _launch.run_ranks
    world = int(os.environ.get("STETHOSCOPE_TEST_WORLD", "2"))
    here = out / f"node{os.environ['NODE_RANK']}" if nodes > 1 else out
    here.mkdir(exist_ok=True)
    if cb_kw.pop("record", False):
        cb_kw = {**cb_kw, "record": here / f"{name}-record"}
    torch.manual_seed(0)  # the same initial weights on both ranks and under both strategies
    model = model_class(**{"lr": 1e-2, **model_kw})
    precision = cb_kw.pop("precision", "32-true")
    accumulate = cb_kw.pop("accumulate", 1)  # batches per optimizer step
    deepspeed_kw = cb_kw.pop("deepspeed", {})  # DeepSpeedStrategy's own arguments
    observed = Observed()
    callback = LightningStethoscope(sinks=[JSONLSink(here / f"{name}.jsonl"), observed], **cb_kw)
    timeout = timedelta(seconds=60)
    if parallel.get("flat"):
        strategy = CPUFSDPStrategy(timeout=timeout)
    elif parallel.get("zero"):
        config = parallel.get("config")
        if config is not None:  # a whole configuration: Lightning reads no argument then
            stage = {"stage": parallel["zero"]}
            config = {**config, "zero_optimization": stage, "zero_allow_untested_optimizer": True}
        strategy = cpu_deepspeed_strategy(parallel["zero"], timeout, config=config, **deepspeed_kw)
    elif parallel:
        strategy = ModelParallelStrategy(**parallel, timeout=timeout)
    else:
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timeout)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world // nodes,
        num_nodes=nodes,
        strategy=strategy,
        precision=precision,
        accumulate_grad_batches=accumulate,
        max_steps=steps,
        limit_val_batches=0,
        use_distributed_sampler=False,  # each rank's batches are given: see TWIN_SKIPS
        callbacks=[callback],
        **QUIET,
    )
    full = dataset(2048)
    mine = list(range(trainer.global_rank, len(full), world))
    if layout == "tp" or name.startswith("fsdp_same"):  # the same batches on both ranks
        mine = list(range(0, len(full), 2))
    if name.endswith("_twin"):
        mine = [i for k, i in enumerate(mine) if k not in TWIN_SKIPS]
    data = DataLoader(Subset(full, mine), batch_size=32, shuffle=False)
    refused = None  # what a setting the callback refuses at the start says
    gate_norms: list[float] = []  # the recovery gate's gradient norm, each step (*_gate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if name.endswith("_uncombined"):
            with mock.patch.object(ShardCombiner, "of_process_group", _uncombined):
                trainer.fit(model, data)
        elif name.endswith("_gate"):
            with mock.patch.object(gate_module, "total_norm", _recorded(gate_norms)):
                trainer.fit(model, data)
        elif name.endswith("_recover"):
            try:
                trainer.fit(model, data)
            except ValueError as e:
                refused = str(e)
        else:
            trainer.fit(model, data)
    stopped = callback.stopped_by
    recoverer = callback.recoverer
    result = {
        "rank": trainer.global_rank,
        "refused": refused,
        "gate_norms": gate_norms,
        "global_step": trainer.global_step,
        "should_stop": trainer.should_stop,
        "stopped_by": stopped.to_dict(json_safe=True) if stopped else None,
        "ladder": [[r.step, r.act, r.why] for r in recoverer.ladder.history] if recoverer else None,
        "warnings": [str(w.message) for w in caught if "stethoscope" in str(w.message)],
        "local_rank": trainer.local_rank,
        # DeepSpeed's own count of the steps its loss scaler skipped, and its scale
        "skipped_steps": getattr(trainer.strategy.model, "skipped_steps", None),
        "loss_scale": getattr(trainer.optimizers[0], "loss_scale", None),
        "node_rank": trainer.node_rank,
        # what this rank holds of each parameter, bit for bit
        "shards": {n: _digest(p) for n, p in model.named_parameters()},
    }
    (out / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if trainer.global_rank == 0:
        (out / f"{name}-observed.json").write_text(json.dumps(observed.steps))


def _recorded(norms: list[float]) -> Any:
    """``total_norm``, each of whose results is appended to ``norms``."""
    real = gate_module.total_norm

    def total_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        norms.append(float(out))
        return out

    return total_norm


def _uncombined() -> ShardCombiner:
    """A combiner that leaves each rank's numbers as they are: every norm is a shard's."""
    return ShardCombiner(lambda tensor, op: None)


def _digest(parameter: torch.Tensor) -> str:
    """A digest of the bytes this rank holds of ``parameter``."""
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    raw = local.detach().contiguous().view(torch.uint8)  # any dtype's bytes (bf16 too)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    run_all(run)
