"""The TrainCheck bugs that need ranks: each rebuilt on DDP over 2 CPU processes (gloo).

    python -m benchmarks.faults.traincheck_ddp OUTDIR RUN [RUN ...]

is one rank: the environment names it as a launcher would (``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning joins the two processes instead of
launching its own, and both go through every run in turn in one process group (importing
torch and Lightning once is most of the cost). A run is ``<bug>:bug`` or ``<bug>:twin``.
Each writes rank zero's findings to ``OUTDIR/<bug>-<kind>.jsonl`` and, per rank,
``OUTDIR/<bug>-<kind>-rank<r>.json``: its last step and a checksum of its weights (the
ground truth: whether the replicas really drifted apart). :func:`launch` starts the two
ranks and waits for them.

Every bug here leaves the ranks training different models without a loud error:

* ``pytorch-104336``: the wrapped model's parameters moved to another device and back
  after DDP wrapped it (``ddp_model.cpu(); ddp_model.cuda(rank)``). Moving a parameter's
  data to another device or dtype resets its autograd accumulator, and with it the hook
  DDP registered there, so its gradient is never all-reduced again. One CPU has no second
  device: the round trip here is through float64 and back, the same reset. Twin: the
  report's second fix, the data offloaded and restored in place (``copy_``), which keeps
  each parameter's accumulator.
* ``x-jxmnop-ddp-out-of-sync``: steps that go around the DDP wrapper (the report's trainer
  held "sometimes nn.Module, sometimes DDP": every other step ran on the bare module, so
  nothing was all-reduced). In Lightning every ``training_step`` runs inside the wrapper,
  and DDP is told to expect a backward only by the strategy: with manual optimization,
  ``loss.backward()`` in place of ``self.manual_backward(loss)`` goes around it, here on
  every other step. Twin: ``manual_backward`` on every step.
* ``pytorch-84803``: an all-reduce that loses data (the report: GPU peer-to-peer
  transfers that drop data; its reproduction zeroes a tensor in 1% of communications).
  A DDP communication hook all-reduces each gradient bucket, and a rank whose received
  data is lost (5% of buckets, each rank drawing its own) is left with zeros there. Twin:
  the same hook without the loss. (Zeros sent by a rank before the all-reduce, as the
  reproduction's patch of ``dist.all_reduce`` does, reach every rank alike: the replicas
  stay the same, and nothing here can tell the lost gradient from a small one.)
* ``deepspeed-1801``: gradient clipping applied on one rank only. DeepSpeed's
  ``BF16_Optimizer.get_grads_for_norm(for_clipping=True)`` skipped the replicated
  (layer norm) gradients off tensor-parallel rank 0, a condition meant only for the norm's
  computation, so the other ranks never clipped them. Rebuilt as Lightning's
  ``configure_gradient_clipping`` with the same misplaced condition, the rank standing
  for the tensor-parallel rank. Twin: the condition where it belongs.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["BUGS", "launch", "run"]

STEPS = 64
#: The share of gradient buckets whose all-reduced data a rank loses (pytorch-84803).
LOSS_RATE = 0.05
#: The clipping bound of deepspeed-1801's rebuild: below the gradients' norm, so it clips.
MAX_NORM = 0.05
ROOT = Path(__file__).resolve().parents[2]


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


def _lightning() -> Any:
    import lightning as L

    return L


def _module_class() -> type:
    """The LightningModule every rebuild derives from (made here, so that importing this
    module to launch the ranks does not import Lightning)."""
    L = _lightning()

    class Classifier(L.LightningModule):
        """A 20-32-32-4 MLP with a layer norm, on Gaussian features labelled by a teacher."""

        def __init__(self, buggy: bool) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same initial weights on both ranks, as DDP expects
            self.buggy = buggy
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Classifier


def _moved_and_back(base: type) -> type:
    class MovedAndBack(base):
        def on_train_start(self) -> None:  # after DDP wrapped the model
            if self.buggy:  # the report's ddp_model.cpu(); ddp_model.cuda(rank), on one CPU
                self.double()
                self.float()
                return
            with torch.no_grad():  # its fix 2: offload, then restore into the same storage
                held = {n: p.detach().double() for n, p in self.named_parameters()}
                for n, p in self.named_parameters():
                    p.copy_(held[n].float())

    return MovedAndBack


def _bare_steps(base: type) -> type:
    class BareSteps(base):
        def __init__(self, buggy: bool) -> None:
            super().__init__(buggy)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            loss = self.loss(batch)
            if self.buggy and batch_idx % 2 == 0:  # around the wrapper, every other step
                loss.backward()
            else:
                self.manual_backward(loss)  # through the strategy, which prepares DDP
            opt.step()

    return BareSteps


def _lossy(base: type) -> type:
    class Lossy(base):
        def on_train_start(self) -> None:
            # the hook Lightning's DDPStrategy(ddp_comm_hook=...) registers on a GPU (it
            # skips a communication hook on CPU), before the first backward
            state = _LossyState(self.trainer.global_rank, self.buggy)
            self.trainer.strategy.model.register_comm_hook(state, _lossy_allreduce)

    return Lossy


def _clipped_on_rank_zero(base: type) -> type:
    class ClippedOnRankZero(base):
        def __init__(self, buggy: bool) -> None:
            super().__init__(buggy)
            for m in self.net:  # Megatron marks the weights it splits over tensor ranks
                if isinstance(m, nn.Linear):
                    for p in m.parameters():
                        p.tensor_model_parallel = True

        def _grads_for_norm(self, for_clipping: bool) -> list[torch.Tensor]:
            tp_rank = self.trainer.global_rank  # standing for the tensor-parallel rank
            grads = []
            for p in self.parameters():
                # a replicated gradient (a layer norm's), off tensor rank 0
                skip = not (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
                if not for_clipping and skip:  # counted once in the norm
                    continue
                if self.buggy and skip:  # the bug: the same test outside that condition
                    continue
                if p.grad is not None:
                    grads.append(p.grad)
            return grads

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ) -> None:
            # the global norm as DeepSpeed takes it: each gradient counted once, its
            # square summed over the tensor ranks (the same on every rank)
            square = torch.stack([g.square().sum() for g in self._grads_for_norm(False)]).sum()
            dist.all_reduce(square)
            scale = torch.clamp(MAX_NORM / (square.sqrt() + 1e-6), max=1.0)
            for g in self._grads_for_norm(for_clipping=True):
                g.mul_(scale)

    return ClippedOnRankZero


class _LossyState:
    """What a lossy all-reduce hook keeps: this rank's draws of which buckets it loses."""

    def __init__(self, rank: int, lossy: bool) -> None:
        self.random = random.Random(1000 + rank)
        self.lossy = lossy
        self.lost = 0


def _lossy_allreduce(state, bucket):  # DDP checks the annotations: none, or its own types
    """DDP's all-reduce of one gradient bucket (averaged over the ranks), whose result
    this rank loses, as zeros, in :data:`LOSS_RATE` of the buckets."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def received(fut: torch.futures.Future) -> torch.Tensor:
        out = fut.value()[0]
        if state.lossy and state.random.random() < LOSS_RATE:
            state.lost += 1
            out.zero_()  # the transfer into this rank dropped its data
        return out

    return future.then(received)


#: bug -> the LightningModule that rebuilds it, made from the base class (whose argument
#: says whether it is the bug or its twin)
BUGS: dict[str, Callable[[type], type]] = {
    "pytorch-104336": _moved_and_back,
    "x-jxmnop-ddp-out-of-sync": _bare_steps,
    "pytorch-84803": _lossy,
    "deepspeed-1801": _clipped_on_rank_zero,
}


def _data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(1)
    # shuffled by Lightning's DistributedSampler: each rank its own half
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def run(out: Path, run_id: str) -> None:
    """One rank's run of ``run_id`` (``<bug>:bug`` or ``<bug>:twin``)."""
    from lightning.pytorch.strategies import DDPStrategy

    from stethoscope import LightningStethoscope
    from stethoscope.sinks import JSONLSink

    name, kind = run_id.split(":")
    buggy = kind == "bug"
    model = BUGS[name](_module_class())(buggy)
    stem = f"{name}-{kind}"
    callback = LightningStethoscope(sinks=[JSONLSink(out / f"{stem}.jsonl")])
    trainer = _lightning().Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        max_steps=STEPS,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(model, _data())
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    (out / f"{stem}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_ids: Sequence[str], out: Path, *, timeout: float = 300.0) -> None:
    """Run this module as ranks 0 and 1 of one process group, through every run of
    ``run_ids``, their output in ``out/rank<r>.log``; wait for both. Raises RuntimeError
    with their logs' tails if one fails or is still running after ``timeout`` seconds
    (both are then killed: never a hang)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": path,
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
        }
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "benchmarks.faults.traincheck_ddp", str(out), *run_ids]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()  # only the processes started here
                proc.wait()
            log.close()
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join(
            f"--- rank {r}:\n{(out / f'rank{r}.log').read_text()[-3000:]}" for r in failed
        )
        raise RuntimeError(f"ranks {failed} failed or timed out after {timeout} s\n{logs}")


def _main(argv: Sequence[str]) -> None:
    out = Path(argv[0])
    for run_id in argv[1:]:
        run(out, run_id)
    # Lightning leaves the gloo process group up after fit: take it down before exiting
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
