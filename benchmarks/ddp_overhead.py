"""What the one collective costs on a sampled step: 2 CPU ranks (gloo), one machine.

Both ranks train the MLP of ``benchmarks.overhead`` (784-512-512-10, batch 128 per rank,
synthetic in-memory batches) under ``LightningStethoscope`` with its default detectors
and ``escalate=False``, so the ranks meet on every sixteenth step (the base interval of
the gradient detectors). The meetings take turns: on every other one the ranks skip the
all-gather and each agrees with a copy of its own packet instead, doing all the rest of
the work (probes, checksums, packing, unpacking, judging). Both kinds of sampled step
therefore interleave in one ``trainer.fit``, which a noisy shared machine needs (see
``benchmarks.overhead``); skipping is safe here because without escalation the schedule
never changes, so the ranks still meet on the same steps.

A step is timed from ``on_train_batch_start`` (a callback before the stethoscope) to
``on_train_batch_end`` (one after it): forward, backward with DDP's gradient all-reduce,
optimizer step and every hook, but not the fetch of the next batch. The report gives
medians over the run (a warm-up is dropped), the median time inside the meeting and
inside its all-gather call on each rank. For context, plain DDP runs of the same length
without the callback come before and after, in the same processes.

``--strategy fsdp2`` trains the same MLP sharded by FSDP2 (``fully_shard`` on each
linear layer and on the model, Lightning's ``ModelParallelStrategy``): each rank reduces
its shards on a sampled step and the ranks combine them in one all-reduce more.

``--strategy zero2`` and ``zero3`` train it under DeepSpeed's ZeRO (Lightning's
``DeepSpeedStrategy``, on the CPU through ``benchmarks.cpu_deepspeed``): each rank reduces
the slices its partition holds, combined as FSDP2's shards are.

Run (it starts its two ranks itself; ~1 min on 2 cores):
    python -m benchmarks.ddp_overhead
    python -m benchmarks.ddp_overhead --strategy fsdp2
    python -m benchmarks.ddp_overhead --strategy zero3
    python -m benchmarks.ddp_overhead --steps 1600 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from statistics import median
from typing import Any

WARMUP = 64  # steps dropped from the start of each run


def _launch(args: argparse.Namespace) -> int:
    """Start both ranks as a launcher would; print rank zero's report."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",  # two ranks on two cores
            "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
        }
        cmd = [sys.executable, "-m", "benchmarks.ddp_overhead", *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    reports = [json.loads(o.split("REPORT", 1)[1]) for o in outs if "REPORT" in o]
    if len(reports) != 2:
        print("".join(outs))
        return 1
    report = {**reports[0], "rank1": {k: v for k, v in reports[1].items() if "meeting" in k}}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return max(p.returncode for p in procs)


def _rank(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, IterableDataset

    from stethoscope import LightningStethoscope
    from stethoscope.callbacks._lightning.ranks import LightningRanks

    torch.set_num_threads(1)

    class Batches(IterableDataset):
        """The same 8 pre-built batches, forever: one endless epoch, no loader cost."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(int(os.environ["LOCAL_RANK"]))
            self.x = torch.randn(8, 128, 784, generator=g)
            self.y = (self.x[..., :10] * 3).argmax(-1)

        def __iter__(self):
            while True:
                yield from zip(self.x, self.y, strict=True)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class ShardedMLP(MLP):
        def configure_model(self) -> None:
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(self)

    class Start(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.t0 = time.perf_counter()

    class End(Callback):
        def __init__(self, start: Start) -> None:
            self.start, self.times = start, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start.t0)

    class AlternatingRanks(LightningRanks):
        """Skips the all-gather on every other meeting at a step, agreeing with its own
        packet."""

        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.meetings: list[tuple[int, bool, float]] = []  # (step, gathered, seconds)
            self.gathers: list[float] = []  # seconds in the all-gather call itself
            self._skip = False
            self._at_step = False

        def batch_done(self, trainer, step):
            self._at_step = True
            try:
                super().batch_done(trainer, step)
            finally:
                self._at_step = False

        def meet(self, trainer, step, shared=None):
            if not self._at_step:  # a validation's or an epoch end's meeting: as it is
                return super().meet(trainer, step, shared)
            strategy = trainer.strategy
            real = strategy.all_gather

            def timed(t):
                t0 = time.perf_counter()
                out = real(t)
                self.gathers.append(time.perf_counter() - t0)
                return out

            def own(t):  # every rank's packet is taken to be this rank's: no collective
                return torch.stack([t] * trainer.world_size)

            strategy.all_gather = own if self._skip else timed
            t0 = time.perf_counter()
            try:
                super().meet(trainer, step, shared)
            finally:
                strategy.all_gather = real
            self.meetings.append((step, not self._skip, time.perf_counter() - t0))
            self._skip = not self._skip

    class Alternating(LightningStethoscope):
        """The callback, its ranks meeting as :class:`AlternatingRanks` do."""

        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            if self._ranks is not None:
                drain = functools.partial(self._drain, trainer, wait=True)
                self._ranks = AlternatingRanks(
                    trainer, self.monitor, self.recoverer, drain, self._act
                )

    def strategy() -> Any:
        timeout = timedelta(seconds=120)
        if args.strategy == "fsdp2":
            return ModelParallelStrategy(
                data_parallel_size=2, tensor_parallel_size=1, timeout=timeout
            )
        if args.strategy.startswith("zero"):
            from benchmarks.cpu_deepspeed import cpu_deepspeed_strategy

            # the batches come whole (batch_size=None): their size for DeepSpeed's logs
            return cpu_deepspeed_strategy(
                int(args.strategy[-1]), timeout, logging_batch_size_per_gpu=128
            )
        return DDPStrategy(process_group_backend="gloo", timeout=timeout)

    def run(callbacks: list) -> None:
        start = Start()
        end = End(start)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy(),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[start, *callbacks, end],
        )
        torch.manual_seed(0)
        model = ShardedMLP() if args.strategy == "fsdp2" else MLP()
        trainer.fit(model, DataLoader(Batches(), batch_size=None))
        return trainer, end.times

    trainer, plain = run([])
    steth = Alternating(sinks=[], escalate=False)
    trainer, times = run([steth])
    trainer, plain_after = run([])
    ranks = steth._ranks
    met = {step: gathered for step, gathered, _ in ranks.meetings}
    kept = [(t, s) for t, s in enumerate(times) if t >= WARMUP]
    ms = lambda xs: round(1e3 * median(xs), 3) if xs else None  # noqa: E731
    found = sum(s.count for summary in steth.summaries for s in summary.rows)
    inside = [(g, s) for step, g, s in ranks.meetings if step >= WARMUP]
    report = {
        "strategy": args.strategy,
        "steps": args.steps,
        "warmup_dropped": WARMUP,
        "rank": trainer.global_rank,
        "plain_ms_per_step_before_after": [ms(plain[WARMUP:]), ms(plain_after[WARMUP:])],
        "unsampled_ms_per_step": ms([s for t, s in kept if t not in met]),
        "sampled_with_collective_ms": ms([s for t, s in kept if met.get(t) is True]),
        "sampled_without_collective_ms": ms([s for t, s in kept if met.get(t) is False]),
        "meeting_with_collective_ms": ms([s for g, s in inside if g]),
        "meeting_without_collective_ms": ms([s for g, s in inside if not g]),
        "meeting_all_gather_call_ms": ms(ranks.gathers[len(ranks.gathers) // 8 :]),
        "sampled_steps_each": sum(1 for t, _ in kept if met.get(t) is True),
        "packet_bytes": max(p.nbytes for p in ranks.meeting._packets.values()),
        "findings": found,
        "torch": torch.__version__,
        "lightning": L.__version__,
    }
    report["collective_ms"] = round(
        report["sampled_with_collective_ms"] - report["sampled_without_collective_ms"], 3
    )
    print("REPORT" + json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2", "zero2", "zero3"), default="ddp")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        _rank(args)
    else:
        sys.exit(_launch(args))


if __name__ == "__main__":
    main()
