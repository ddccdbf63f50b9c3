"""stethoscope on a GPU: host syncs by mode, faults and recovery on CUDA, and what it costs.

One prepared script for any CUDA machine with torch and Lightning (no other package, no
download: the models are GPT-2-shaped transformers built here with random weights, the
data is synthetic). Every section appends its result to ``OUT/results.jsonl`` as soon as
it ends; the tables of ``docs/gpu.md`` are rendered from that file.

Sections (``--only``):

* ``census``: every host sync during a fit, per mode (plain Lightning, the defaults,
  ``record=``, ``log_stats=``, ``recover=True`` with a fused AdamW, with torch's default
  AdamW (foreach), and under ``16-mixed`` with a GradScaler and a fused AdamW). Syncs are
  what ``torch.cuda.set_sync_debug_mode("warn")`` reports, plus the waits on CUDA events
  (which it does not see), each traced to the code that made it by the Python stack:
  stethoscope's when the first frame above torch's own is stethoscope's (a sync inside
  the optimizer's or the GradScaler's step is theirs, even when stethoscope's gate called
  that step), and counted by phase (training step, validation, epoch end).
* ``faults``: a NaN loss, a learning rate x1000, and ``recover=True`` skipping a NaN
  batch and a spiking one, the run compared bit for bit with a twin that never saw
  those batches.
* ``small`` and ``medium``: the overhead, with the callback switched on and off in blocks
  of 32 steps inside one fit (as ``benchmarks/overhead.py`` does on the CPU): plain,
  stethoscope's defaults, a hand-written ``isfinite(loss).item()`` every step, and on the
  small model ``detect_anomaly``. Steps are timed on the GPU's timeline (a CUDA event at
  each step start, read after the fit) and on the host's clock; each block's ratio is
  against the plain blocks around it. ``small`` is a host-bound GPT (4 layers, 256 wide,
  batch 32x128); ``medium`` is GPT-2 medium (24 layers, 1024 wide, 355M parameters,
  bf16-mixed, batch 8x512). The overhead budget's own view (the cost it measured on the
  device's timeline, its stretch) is reported with them.
* ``snapshot``: what a recovery snapshot and a roll back cost on GPT-2 medium with a
  fused AdamW: the host's time to start the copies, the time until they land, and a
  roll back; beside the per-tensor blocking copy of before.
* ``sharded``: the norms handed to the detectors under FSDP2 and FSDP1 on one device,
  against an unsharded fit (see ``benchmarks.gpu_sharded``).

Run, from the project root:

    python -m benchmarks.gpu --out OUT            # on a CUDA machine: about 5 minutes
    python -m benchmarks.gpu --cpu --out OUT      # a dry run on the CPU, tiny sizes
    python -m benchmarks.gpu --render OUT/results.jsonl --docs docs/gpu.md

The last one writes the tables between the markers of ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import gpu_sharded
from benchmarks.gpu_sharded import section_sharded

BEGIN, END = "<!-- gpu tables: begin -->", "<!-- gpu tables: end -->"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for results.jsonl and gpu.md")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU, tiny sizes")
    ap.add_argument(
        "--only",
        default="census,faults,sharded,host,small,medium,snapshot",
        help="sections, comma-separated",
    )
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for every section")
    ap.add_argument("--render", type=Path, help="a results.jsonl to render as tables")
    ap.add_argument("--docs", type=Path, help="with --render: the page whose tables to replace")
    return ap.parse_args(argv)


# -- the run's context -------------------------------------------------------------------
class Run:
    """Where the results go, the device, and the time left."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.cpu = args.cpu or not torch.cuda.is_available()
        self.device = "cpu" if self.cpu else "cuda"
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = self.out / "results.jsonl"
        self.budget = args.budget
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def emit(self, record: dict[str, Any]) -> None:
        record["t"] = round(time.perf_counter() - self.t0, 1)
        line = json.dumps(record, default=str)
        with open(self.results, "a") as f:
            f.write(line + "\n")
        print(line[:600], flush=True)


# -- the model and its data ----------------------------------------------------------------
def gpt(vocab: int, context: int, layers: int, width: int, heads: int) -> Any:
    """A GPT-2-shaped decoder (pre-norm blocks, causal attention, tied embeddings)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, -1).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tokens.weight
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tokens(idx) + self.positions(pos)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT()


def token_batches(n: int, batch: int, context: int, vocab: int, seed: int = 0) -> list:
    """``n`` batches of a learnable sequence task (each token mostly follows from the
    last by a fixed rule), with a poison code per batch (0: none; see :class:`LM`)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    # the tokens a sequence uses: a vocabulary of GPT-2's size would leave each rule seen
    # a few times in a run, and the loss, slow to fall, would escalate the sampler (a
    # benchmark of the steady state must not measure an escalation)
    used = min(vocab, 2048)
    follow = torch.randint(0, used, (used,), generator=g)
    out = []
    for _ in range(n):
        x = torch.empty(batch, context + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, used, (batch,), generator=g)
        for t in range(1, context + 1):
            noise = torch.randint(0, used, (batch,), generator=g)
            keep = torch.rand(batch, generator=g) < 0.9
            x[:, t] = torch.where(keep, follow[x[:, t - 1]], noise)
        out.append((x, torch.zeros((), dtype=torch.long)))
    return out


def poisoned(batches: list, codes: dict[int, int]) -> list:
    """The batches with poison ``codes[i]`` on batch ``i`` (1: a NaN loss, 2: a loss
    spike x30, as a corrupted batch would give)."""
    import torch

    return [(x, torch.tensor(codes.get(i, 0))) for i, (x, _) in enumerate(batches)]


SIZES = {
    "small": dict(vocab=2048, context=128, layers=4, width=256, heads=4),
    "medium": dict(vocab=50257, context=512, layers=24, width=1024, heads=16),
    "tiny": dict(vocab=256, context=16, layers=2, width=32, heads=2),
}


def lightning_module(
    size: dict,
    *,
    lr: float = 3e-4,
    optimizer: str = "fused",
    lr_fault_at: int | None = None,
    check_loss: bool = False,
    device: str = "cuda",
) -> Any:
    import lightning as L
    import torch

    class LM(L.LightningModule):
        """Next-token cross entropy, AdamW with a short warm-up. A batch's poison code,
        a tensor, changes the loss on the device (no host read): 1 makes it NaN, 2
        multiplies it by 30."""

        def __init__(self) -> None:
            super().__init__()
            with torch.device(device):  # built where it trains
                self.net = gpt(**size)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, code = batch
            logits = self.net(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            loss = loss * torch.where(code == 1, math.nan, torch.where(code == 2, 30.0, 1.0))
            if check_loss and not bool(torch.isfinite(loss).item()):  # what users write
                raise FloatingPointError("the loss is not finite")
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            logits = self.net(x[:, :-1])
            return torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )

        def configure_optimizers(self) -> Any:
            kw = {"fused": True} if optimizer == "fused" else {}  # else torch's default: foreach
            opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01, **kw)

            def factor(step: int) -> float:
                warm = min(1.0, (step + 1) / 20)
                return warm * (1000.0 if lr_fault_at is not None and step >= lr_fault_at else 1.0)

            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
            return [opt], [{"scheduler": scheduler, "interval": "step"}]

    return LM()


def trainer_for(run: Run, callbacks: list, **kw: Any) -> Any:
    import lightning as L

    base: dict[str, Any] = dict(
        accelerator="cpu" if run.cpu else "gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        precision="32-true" if run.cpu else "bf16-mixed",
        max_epochs=-1,
    )
    base.update(kw)
    if run.cpu and base["precision"] == "16-mixed":  # Lightning takes it on the CPU so
        import torch
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu")
        base["plugins"] = [MixedPrecision(base.pop("precision"), "cpu", scaler=scaler)]
    elif run.cpu:
        base["precision"] = "32-true"
    return L.Trainer(callbacks=callbacks, **base)


def loader(batches: list) -> Any:
    import torch

    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


# -- where the fit is, and the census ----------------------------------------------------------
def _tracker() -> Any:
    import lightning as L

    class Tracker(L.Callback):
        """Where the fit is (its step and phase), first among the callbacks."""

        def __init__(self) -> None:
            self.step, self.phase = -1, "setup"
            self.stethoscope: Any = None

        def sampled(self) -> bool | None:
            record = getattr(self.stethoscope, "_record", None)
            return None if record is None else bool(record.sampled)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.step, self.phase = trainer.global_step, "train"

        def on_validation_start(self, trainer, pl_module) -> None:
            self.phase = "validation"

        def on_validation_end(self, trainer, pl_module) -> None:
            self.phase = "train"

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.phase = "epoch_end"

        def on_train_end(self, trainer, pl_module) -> None:
            self.phase = "end"

    return Tracker()


def attribute(frames: list[traceback.FrameSummary]) -> str:
    """Whose a sync is, from the stack (innermost last): ``stethoscope``, ``stepper`` (the
    optimizer's or GradScaler's own step, which stethoscope's gate may call), or
    ``other`` (Lightning, torch, the user's model)."""
    import torch

    import stethoscope

    ours = os.path.dirname(stethoscope.__file__) + os.sep
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    steppers = (torch_dir + "optim" + os.sep, torch_dir + "amp" + os.sep)
    for frame in reversed(frames):
        name = frame.filename
        if name == warnings.__file__:  # the warning's way to our showwarning
            continue
        if name.startswith(steppers):
            return "stepper"
        if name.startswith(torch_dir):
            continue
        return "stethoscope" if name.startswith(ours) else "other"
    return "other"


def _site(frames: list[traceback.FrameSummary]) -> str:
    import stethoscope

    ours = os.path.dirname(stethoscope.__file__) + os.sep
    for frame in reversed(frames):
        if frame.filename.startswith(ours):
            return f"{frame.filename[len(ours) :]}:{frame.lineno}"
    inner = frames[-1]
    return f"{os.path.basename(inner.filename)}:{inner.lineno}"


class Census:
    """Counts the host syncs of a fit and the waits on CUDA events, by whose they are,
    the phase of the fit, and whether stethoscope sampled the step."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.syncs: list[dict[str, Any]] = []

    def _note(self, kind: str, extra: dict | None = None) -> None:
        frames = traceback.extract_stack()[:-2]
        self.syncs.append(
            dict(
                kind=kind,
                whose=attribute(frames),
                site=_site(frames),
                phase=self.tracker.phase,
                step=self.tracker.step,
                sampled=self.tracker.sampled(),
                **(extra or {}),
            )
        )

    def __enter__(self) -> Census:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=".*ynchroniz.*")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                self._note("sync")
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._event_sync = torch.cuda.Event.synchronize
        census = self

        def synchronize(event, *args, **kwargs):
            done = event.query()
            if not done:
                census._note("event wait")
            return census._event_sync(event, *args, **kwargs)

        torch.cuda.Event.synchronize = synchronize
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = self._event_sync
        self._catch.__exit__(*exc)

    def _count(self, whose: str, phase: str) -> int:
        return sum(1 for s in self.syncs if s["whose"] == whose and s["phase"] == phase)

    def summary(self) -> dict[str, Any]:
        ours = [s for s in self.syncs if s["whose"] == "stethoscope"]
        train = [s for s in ours if s["phase"] == "train" and s["kind"] == "sync"]
        # a wait on a reading's event: the device more than max_lag steps behind, and still
        # busy with the steps queued since (it does not idle for it)
        waits = [s for s in ours if s["phase"] == "train" and s["kind"] == "event wait"]
        return dict(
            stethoscope_train=len(train),
            stethoscope_train_waits=len(waits),
            stethoscope_wait_sites=Counter(s["site"] for s in waits).most_common(4),
            stethoscope_train_unsampled=sum(1 for s in train if s["sampled"] is False),
            stethoscope_train_steps=len({s["step"] for s in train}),
            stethoscope_other_phases=Counter(s["phase"] for s in ours if s["phase"] != "train"),
            stethoscope_sites=Counter(f"{s['kind']} {s['site']}" for s in train).most_common(6),
            stepper_train=self._count("stepper", "train"),
            others_train=self._count("other", "train"),
            other_sites=Counter(s["site"] for s in self.syncs if s["whose"] == "other").most_common(
                4
            ),
        )


CENSUS_MODES: dict[str, tuple[dict | None, str, dict]] = {
    # mode: (LightningStethoscope's arguments or None for none, optimizer, Trainer's)
    "plain": (None, "fused", {}),
    "defaults": ({}, "fused", {}),
    "record=": ({"record": "RECORD"}, "fused", {}),
    "log_stats=True": ({"log_stats": True}, "fused", {"logger": "CSV"}),
    "recover=True, fused AdamW": ({"recover": "RECOVER"}, "fused", {}),
    "recover=True, AdamW (foreach)": ({"recover": "RECOVER"}, "foreach", {}),
    "recover=True, 16-mixed, GradScaler, fused AdamW": (
        {"recover": "RECOVER"},
        "fused",
        {"precision": "16-mixed"},
    ),
    # the precision statistics on 16-bit weights, and a GradScaler's skips counted on the
    # device at every step
    "defaults, bf16-true": ({}, "fused", {"precision": "bf16-true"}),
    "defaults, 16-mixed, GradScaler": ({}, "fused", {"precision": "16-mixed"}),
}


def census_fit(run: Run, mode: str, steps: int) -> dict[str, Any]:
    import torch

    from stethoscope import LightningStethoscope, Recovery

    kwargs, optimizer, trainer_kw = CENSUS_MODES[mode]
    tracker = _tracker()
    callbacks: list = [tracker]
    if kwargs is not None:
        resolved = {}
        for key, value in kwargs.items():
            if value == "RECORD":
                value = run.out / "census_record"
            elif value == "RECOVER":
                value = Recovery(snapshot_every=50)  # snapshots on training steps, measured
            resolved[key] = value
        tracker.stethoscope = LightningStethoscope(sinks=[], **resolved)
        callbacks.append(tracker.stethoscope)
    if trainer_kw.get("logger") == "CSV":
        from lightning.pytorch.loggers import CSVLogger

        trainer_kw = {**trainer_kw, "logger": CSVLogger(run.out / "census_logs")}
    size = SIZES["tiny" if run.cpu else "small"]
    torch.manual_seed(0)
    module = lightning_module(size, optimizer=optimizer, device=run.device)
    data = token_batches(64, 4 if run.cpu else 32, size["context"], size["vocab"])
    trainer = trainer_for(
        run,
        callbacks,
        max_steps=steps,
        val_check_interval=steps // 4,
        limit_val_batches=4,
        check_val_every_n_epoch=None,
        **trainer_kw,
    )
    error = None
    with Census(tracker) as census:
        try:
            trainer.fit(module, loader(data), loader(data[:4]))
        except Exception as exc:  # the report says so, and the script goes on
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    return dict(mode=mode, steps=trainer.global_step, error=error, **census.summary())


def section_census(run: Run) -> None:
    import torch

    if not run.cpu:  # the census must see a plain .item()
        tracker = _tracker()
        tracker.phase = "train"
        with Census(tracker) as census:
            torch.ones(1, device="cuda").sum().item()
        run.emit(dict(section="census", mode="control: one .item()", seen=len(census.syncs)))
    steps = 40 if run.cpu else 300
    for mode in CENSUS_MODES:
        if run.left() < 20:
            run.emit(dict(section="census", mode=mode, skipped="out of time"))
            continue
        run.emit(dict(section="census", **census_fit(run, mode, steps)))


# -- faults --------------------------------------------------------------------------------
def _capturing() -> Any:
    from stethoscope.testing import CapturingSink

    return CapturingSink()


def fault_fit(run: Run, name: str, steps: int, codes: dict[int, int], **kw: Any) -> dict:
    import torch

    from stethoscope import LightningStethoscope

    sink = _capturing()
    recover = kw.pop("recover", False)
    callback = LightningStethoscope(sinks=[sink], recover=recover)
    size = SIZES["tiny" if run.cpu else "small"]
    torch.manual_seed(0)
    module = lightning_module(size, device=run.device, **kw)
    clean = token_batches(steps, 4 if run.cpu else 32, size["context"], size["vocab"])
    data = poisoned(clean, codes)
    trainer = trainer_for(run, [callback], max_steps=steps, limit_val_batches=0)
    error = None
    try:
        trainer.fit(module, loader(data))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    found = [
        dict(step=f.step, detector=f.detector, severity=str(f.severity), where=f.where)
        for f in sink.findings
        if str(f.severity) != "info" or f.detector == "recovery"
    ]
    return dict(
        section="faults",
        name=name,
        error=error,
        steps=trainer.global_step,
        stopped_by=(callback.stopped_by.detector, callback.stopped_by.step)
        if callback.stopped_by is not None
        else None,
        findings=found[:12],
        module=module,
        trainer=trainer,
    )


def section_faults(run: Run) -> None:
    import torch

    steps, at = (60, 30) if run.cpu else (400, 150)
    for name, codes, kw in (
        ("NaN loss", {at: 1}, {}),
        ("learning rate x1000", {}, {"lr_fault_at": at + 50 if not run.cpu else at}),
    ):
        if run.left() < 25:
            run.emit(dict(section="faults", name=name, skipped="out of time"))
            continue
        result = fault_fit(run, name, steps, codes, **kw)
        result.pop("module"), result.pop("trainer")
        run.emit(result)
    if run.left() < 40:
        run.emit(dict(section="faults", name="recover", skipped="out of time"))
        return
    replay_fit(run, steps, at)
    # the skip, bit for bit: the math attention kernel (its backward is deterministic)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    steps = 60 if run.cpu else 200
    bad = {steps // 2: 1, steps // 2 + 20: 2}
    with sdpa_kernel(SDPBackend.MATH):
        watched = fault_fit(run, "recover=True", steps, bad, recover=True)
        size = SIZES["tiny" if run.cpu else "small"]
        torch.manual_seed(0)
        twin = lightning_module(size, device=run.device)
        clean = token_batches(steps, 4 if run.cpu else 32, size["context"], size["vocab"])
        kept = [b for i, b in enumerate(clean) if i not in bad]
        twin_trainer = trainer_for(run, [], max_steps=len(kept), limit_val_batches=0)
        twin_trainer.fit(twin, loader(kept))
    module, trainer = watched.pop("module"), watched.pop("trainer")
    diffs = [
        float((a.float() - b.float()).abs().max())
        for a, b in zip(module.state_dict().values(), twin.state_dict().values(), strict=True)
    ]
    opt_a, opt_b = trainer.optimizers[0], twin_trainer.optimizers[0]
    state_same = all(
        torch.equal(sa[k], sb[k])
        for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True)
        for k in sa
    )
    watched.update(
        poisoned_batches=sorted(bad),
        weights_bit_for_bit=max(diffs) == 0.0,
        largest_weight_difference=max(diffs),
        optimizer_state_bit_for_bit=state_same,
    )
    run.emit(watched)


def replay_fit(run: Run, steps: int, at: int) -> None:
    """``Recovery(replay=True)`` on CUDA: a NaN batch and a spiking one, each computed
    again and judged bad again (the batch, not the machine), skipped and named; the
    verdicts are read on the host (it warns), and the run goes on."""
    from stethoscope import Recovery

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fault_fit(
            run,
            "recover=Recovery(replay=True)",
            steps,
            {at: 1, at + 20: 2},
            recover=Recovery(replay=True),
        )
    result.pop("module"), result.pop("trainer")
    result["warned"] = [str(w.message)[:160] for w in caught if "replay" in str(w.message)]
    run.emit(result)


# -- overhead, in blocks inside one fit -----------------------------------------------------------
PLAIN, STETHOSCOPE, ANOMALY = "plain", "stethoscope", "detect_anomaly"
ITEM = "isfinite(loss).item()"
_RUN_HOOKS = ("setup", "on_train_start", "on_train_epoch_end", "on_train_end", "teardown")


def _gate(owner: Callable[[int], str], steady: Any, run: Run) -> Any:
    import lightning as L
    import torch

    from benchmarks._dispatch import STEP_HOOKS, call_hook

    class ItemCheck(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if not bool(torch.isfinite(loss).item()):
                raise FloatingPointError("the loss is not finite")

    class Gate(L.Callback):
        """Times every step (a CUDA event and the host clock at its start) and hands its
        hooks to the variant that owns it."""

        def __init__(self) -> None:
            self.item = ItemCheck()
            self.active: list = []
            self.anomaly = False
            self.marks: list[tuple[int, Any, float]] = []
            self.sampled: dict[int, bool] = {}
            #: the host's milliseconds inside stethoscope's step hooks, per step
            self.hook_ms: dict[int, float] = {}
            self.last = PLAIN

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.global_step
            event = None
            if not run.cpu:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self.marks.append((step, event, time.perf_counter()))
            key = owner(step)
            if self.last == STETHOSCOPE and key != STETHOSCOPE:
                steady.on_train_epoch_start(trainer, pl_module)  # its clock: not its step
            self.last = key
            self.active = {STETHOSCOPE: [steady], ITEM: [self.item]}.get(key, [])
            if self.anomaly != (key == ANOMALY):
                self.anomaly = key == ANOMALY
                torch.set_anomaly_enabled(self.anomaly, True)
            began = time.perf_counter()
            for cb in self.active:
                call_hook(cb, "on_train_batch_start", trainer, batch, batch_idx)
            if key == STETHOSCOPE:
                self.sampled[step] = steady._measures.sampled
                self.hook_ms[step] = 1e3 * (time.perf_counter() - began)

        def step_times(self) -> tuple[dict[int, float], dict[int, float]]:
            """Each step's milliseconds on the device's timeline and the host's."""
            if not run.cpu:
                torch.cuda.synchronize()
            device, host = {}, {}
            for (s, e0, t0), (_, e1, t1) in zip(self.marks, self.marks[1:], strict=False):
                host[s] = 1e3 * (t1 - t0)
                device[s] = e0.elapsed_time(e1) if e0 is not None else host[s]
            return device, host

    def step_hook(name: str) -> Callable:
        def hook(self, trainer, pl_module, *args, **kwargs) -> None:
            began = time.perf_counter()
            for cb in self.active:
                call_hook(cb, name, trainer, *args, **kwargs)
            if self.last == STETHOSCOPE and self.marks:
                step = self.marks[-1][0]  # the step begun last (global_step moves mid-step)
                self.hook_ms[step] = self.hook_ms.get(step, 0.0) + 1e3 * (
                    time.perf_counter() - began
                )

        return hook

    def run_hook(name: str) -> Callable:
        def hook(self, *args, **kwargs) -> None:
            if name == "on_train_end":
                torch.set_anomaly_enabled(False, True)
            getattr(steady, name)(*args, **kwargs)

        return hook

    for name in STEP_HOOKS:
        setattr(Gate, name, step_hook(name))
    for name in _RUN_HOOKS:
        setattr(Gate, name, run_hook(name))
    return Gate()


def overhead(
    run: Run, label: str, size: dict, batch: int, variants: list[str], rounds: int
) -> None:
    import random

    import numpy as np
    import torch

    from stethoscope import LightningStethoscope

    segment, preroll = 32, 192
    rng = random.Random(0)
    owners: list[str] = [STETHOSCOPE] * preroll
    blocks: list[tuple[str, int, int]] = []  # (variant, round, first step)
    for r in range(rounds):
        others = list(variants)
        rng.shuffle(others)
        for key in [PLAIN, *(k for other in others for k in (other, PLAIN))]:
            blocks.append((key, r, len(owners)))
            owners.extend([key] * segment)
    steps = len(owners)
    sink = _capturing()
    steady = LightningStethoscope(sinks=[sink])
    gate = _gate(lambda s: owners[s] if s < steps else PLAIN, steady, run)
    torch.manual_seed(0)
    module = lightning_module(size, device=run.device)
    data = token_batches(64, batch, size["context"], size["vocab"])
    cycled = [data[i % len(data)] for i in range(steps + 1)]
    trainer = trainer_for(run, [gate], max_steps=steps, limit_val_batches=0)
    began = time.perf_counter()
    trainer.fit(module, loader(cycled))
    wall = time.perf_counter() - began
    device, host = gate.step_times()

    def mean_of(times: dict[int, float], first: int) -> float:
        # the block's steps but its first (the switch), the last step being untimed
        return float(np.mean([times[s] for s in range(first + 1, first + segment) if s in times]))

    ratios: dict[str, dict[str, list[float]]] = {v: {"device": [], "host": []} for v in variants}
    plain_ms: dict[str, list[float]] = {"device": [], "host": []}
    for i, (key, _, first) in enumerate(blocks):
        if key == PLAIN:
            plain_ms["device"].append(mean_of(device, first))
            plain_ms["host"].append(mean_of(host, first))
            continue
        before, after = blocks[i - 1][2], blocks[i + 1][2]
        for clock, times in (("device", device), ("host", host)):
            around = (mean_of(times, before) + mean_of(times, after)) / 2
            ratios[key][clock].append(mean_of(times, first) / around)

    def spread(xs: list[float]) -> dict[str, float]:
        q1, median, q3 = np.percentile(xs, [25, 50, 75]) if xs else [math.nan] * 3
        return {k: round(float(v), 4) for k, v in (("median", median), ("q1", q1), ("q3", q3))}

    ours = [s for s in range(steps) if owners[s] == STETHOSCOPE and s >= preroll]
    sampled = [device[s] for s in ours if gate.sampled.get(s) and s in device]
    quiet = [device[s] for s in ours if gate.sampled.get(s) is False and s in device]
    hook_quiet = [gate.hook_ms[s] for s in ours if gate.sampled.get(s) is False]
    hook_sampled = [gate.hook_ms[s] for s in ours if gate.sampled.get(s)]
    budget = steady.monitor.budget
    run.emit(
        dict(
            section=label,
            model=size,
            batch=batch,
            parameters_m=round(sum(p.numel() for p in module.parameters()) / 1e6, 1),
            rounds=rounds,
            steps=steps,
            wall_s=round(wall, 1),
            plain_step_ms={k: round(float(np.median(v)), 3) for k, v in plain_ms.items()},
            ratio={v: {clock: spread(xs) for clock, xs in r.items()} for v, r in ratios.items()},
            stethoscope_sampled_ms=round(float(np.mean(sampled)), 3) if sampled else None,
            stethoscope_quiet_ms=round(float(np.median(quiet)), 3) if quiet else None,
            sampled_steps=len(sampled),
            budget_measured=budget.measured if budget is not None else None,
            budget_stretch=steady.monitor.sampler.stretch,
            gradient_interval=steady.monitor.interval("exploding_gradients"),
            hook_ms_quiet=round(float(np.median(hook_quiet)), 3) if hook_quiet else None,
            hook_ms_sampled=round(float(np.mean(hook_sampled)), 3) if hook_sampled else None,
            per_round={
                v: [round(x, 3) for x in r["device"]] for v, r in ratios.items() if r["device"]
            },
            findings=[(f.detector, f.step, f.message[:160]) for f in sink.findings][:10],
        )
    )
    del module, trainer
    if not run.cpu:
        torch.cuda.empty_cache()


def section_small(run: Run) -> None:
    if run.cpu:
        overhead(run, "small", SIZES["tiny"], 4, [STETHOSCOPE, ITEM, ANOMALY], 2)
    else:
        overhead(run, "small", SIZES["small"], 32, [STETHOSCOPE, ITEM, ANOMALY], 8)


def section_medium(run: Run) -> None:
    if run.cpu:
        overhead(run, "medium", SIZES["tiny"], 4, [STETHOSCOPE, ITEM], 2)
    else:
        overhead(run, "medium", SIZES["medium"], 8, [STETHOSCOPE, ITEM], 8)


# -- snapshots -------------------------------------------------------------------------------
def section_snapshot(run: Run) -> None:
    import torch

    from stethoscope import Recovery
    from stethoscope.callbacks._lightning.snapshots import Snapshots

    size = SIZES["tiny" if run.cpu else "medium"]
    torch.manual_seed(0)
    with torch.device(run.device):
        net = gpt(**size)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x = token_batches(1, 2, size["context"], size["vocab"])[0][0].to(run.device)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast(run.device, dtype=torch.bfloat16, enabled=not run.cpu):
            logits = net(x[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
        ).backward()
        opt.step()

    def wait() -> None:
        if not run.cpu:
            torch.cuda.synchronize()

    step()
    wait()

    class Holder:
        def __init__(self) -> None:
            self.optimizers, self.lr_scheduler_configs = [opt], []

    class Monitor:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    snapshots = Snapshots(Recovery(snapshot_in="memory", keep_snapshots=2))
    rows = []
    # the first three allocate their pinned buffers (two kept, one on its way); from the
    # fourth on, each reuses the buffers of the snapshot it replaces
    for i in range(7):
        step()
        began = time.perf_counter()
        snapshots.take(i, Holder(), net, Monitor())
        started = time.perf_counter() - began
        while snapshots.on_its_way:  # how long until it lands, polled as steps poll it
            snapshots.poll()
            time.sleep(0.0005)
        landed = time.perf_counter() - began
        rows.append((started, landed))
    nbytes = snapshots.kept[-1].nbytes
    wait()
    began = time.perf_counter()
    _, state = snapshots.newest()
    Snapshots.put_back(state, Holder(), net, Monitor())
    wait()
    rollback = time.perf_counter() - began
    # before: a blocking copy of each tensor
    wait()
    began = time.perf_counter()
    tensors = list(net.state_dict().values()) + [
        t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    for t in tensors:
        t.detach().to("cpu", copy=True)
    per_tensor = time.perf_counter() - began
    run.emit(
        dict(
            section="snapshot",
            parameters_m=round(sum(p.numel() for p in net.parameters()) / 1e6, 1),
            tensors=len(tensors),
            gigabytes=round(nbytes / 1e9, 3),
            allocating_start_ms=round(1e3 * statistics.median(r[0] for r in rows[:3]), 1),
            allocating_land_ms=round(1e3 * statistics.median(r[1] for r in rows[:3]), 1),
            start_ms=round(1e3 * statistics.median(r[0] for r in rows[3:]), 2),
            land_ms=round(1e3 * statistics.median(r[1] for r in rows[3:]), 1),
            gb_per_s=round(nbytes / 1e9 / statistics.median(r[1] for r in rows[3:]), 1),
            rollback_ms=round(1e3 * rollback, 1),
            blocking_per_tensor_ms=round(1e3 * per_tensor, 1),
            bus=_bus(run, nbytes),
        )
    )
    snapshots.close()


def _bus(run: Run, nbytes: int) -> dict[str, float]:
    """The machine's own device-to-host bandwidth, for scale: one copy of ``nbytes`` into
    pinned memory (timed with events) and one into pageable memory (a plain ``.cpu()``)."""
    import torch

    if run.cpu:
        return {}
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    pinned = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    pinned.copy_(source, non_blocking=True)  # touch the pages once
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pinned.copy_(source, non_blocking=True)
    end.record()
    end.synchronize()
    pinned_s = start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    source.cpu()
    pageable_s = time.perf_counter() - began
    del source, pinned
    torch.cuda.empty_cache()
    return {
        "pinned_gb_per_s": round(nbytes / 1e9 / pinned_s, 1),
        "pageable_gb_per_s": round(nbytes / 1e9 / pageable_s, 1),
    }


def section_host(run: Run) -> None:
    """What stethoscope's per-step crossings cost the host, per call: a reading's trip to
    the host (a pinned buffer, a copy, an event), an event's query, a timing event."""
    import torch

    from stethoscope.callbacks._lightning.device import to_host

    device = run.device
    loss = torch.ones((), device=device)
    calls = 2000

    def per_call_us(fn: Callable[[], Any]) -> float:
        for _ in range(50):
            fn()
        if not run.cpu:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        return round(1e6 * (time.perf_counter() - began) / calls, 2)

    crossing = to_host(loss)
    row = dict(
        section="host",
        to_host_us=per_call_us(lambda: to_host(loss)),
        landed_us=per_call_us(crossing.landed),
        pinned_empty_us=per_call_us(lambda: torch.empty(1, pin_memory=not run.cpu)),
    )
    if not run.cpu:
        row["timing_event_us"] = per_call_us(lambda: torch.cuda.Event(enable_timing=True).record())
        row["isfinite_item_us"] = per_call_us(lambda: torch.isfinite(loss).item())
    run.emit(row)


SECTIONS: dict[str, Callable[[Run], None]] = {
    "census": section_census,
    "faults": section_faults,
    "small": section_small,
    "medium": section_medium,
    "snapshot": section_snapshot,
    "sharded": section_sharded,
    "host": section_host,
}


def measure(args: argparse.Namespace) -> int:
    from benchmarks.overhead import _quiet

    _quiet()
    import lightning
    import torch

    run = Run(args)
    run.emit(
        dict(
            section="env",
            torch=torch.__version__,
            lightning=lightning.__version__,
            device=torch.cuda.get_device_name(0) if not run.cpu else "cpu",
            python=sys.version.split()[0],
        )
    )
    for name in args.only.split(","):
        if run.left() < 15:
            run.emit(dict(section=name, skipped="out of time"))
            continue
        try:
            SECTIONS[name](run)
        except Exception as exc:  # one section's failure must not lose the others
            crashed = f"{type(exc).__name__}: {exc}"
            run.emit(dict(section=name, crashed=crashed, tb=traceback.format_exc()[-3000:]))
    run.emit(dict(section="done", seconds=round(time.perf_counter() - run.t0, 1)))
    (run.out / "gpu.md").write_text(render(read(run.results)))
    return 0


# -- the tables -----------------------------------------------------------------------------
def read(path: Path) -> list[dict[str, Any]]:
    """A run's results; where a later run (appended) measured the same thing again, its
    record replaces the earlier one in place."""
    kept: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            key = (r["section"], r.get("mode"), r.get("name"), r.get("layout"))
            kept[key] = r
    return list(kept.values())


def _ratio(r: dict[str, Any] | None) -> str:
    if not r or r.get("median") is None or math.isnan(r["median"]):
        return "—"
    return f"{r['median']:.3f}x ({r['q1']:.3f}–{r['q3']:.3f})"


def render(results: list[dict[str, Any]]) -> str:
    """The tables of ``docs/gpu.md``, from a run's results."""
    env = next((r for r in results if r["section"] == "env"), {})
    lines = [
        f"Measured on {env.get('device', '?')}, torch {env.get('torch', '?')}, "
        f"Lightning {env.get('lightning', '?')} (`python -m benchmarks.gpu`).",
        "",
        "**Host syncs on training steps, by mode** (300 steps, small GPT, bf16-mixed unless "
        "said; validation every 75 steps; `recover=` snapshots every 50 steps):",
        "",
        "| mode | stethoscope's, on training steps | where | its waits on an event past "
        "`max_lag` | stethoscope's, elsewhere | the optimizer's or scaler's own "
        "| Lightning's and the model's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["section"] != "census" or "stethoscope_train" not in r:
            continue
        where = ", ".join(f"{site} ({n})" for site, n in r["stethoscope_sites"]) or "—"
        elsewhere = ", ".join(f"{k}: {v}" for k, v in r["stethoscope_other_phases"].items()) or "0"
        error = f" (error: {r['error']})" if r.get("error") else ""
        lines.append(
            f"| {r['mode']}{error} | **{r['stethoscope_train']}** | {where} "
            f"| {r.get('stethoscope_train_waits', '—')} | {elsewhere} | {r['stepper_train']} "
            f"| {r['others_train']} |"
        )
    control = next((r for r in results if r.get("mode") == "control: one .item()"), None)
    if control is not None:
        lines += ["", f"Control: the census saw {control['seen']} syncs for one `.item()`."]
    lines += ["", "**Faults on the GPU:**", "", "| fault | what stethoscope did |", "|---|---|"]
    for r in results:
        if r["section"] != "faults" or "findings" not in r:
            continue
        first = [f for f in r["findings"] if f["severity"] != "info"][:3]
        said = "; ".join(f"{f['detector']} at step {f['step']} ({f['where']})" for f in first)
        if r["name"] == "recover=Recovery(replay=True)":
            acts = [
                f"{f['where']} at {f['step']}" for f in r["findings"] if f["detector"] == "recovery"
            ]
            said = f"{', '.join(acts)}; ran {r['steps']} steps; warned: {len(r['warned'])}"
        elif r["name"] == "recover=True":
            acts = [
                f"{f['where']} at {f['step']}" for f in r["findings"] if f["detector"] == "recovery"
            ]
            said = (
                f"{', '.join(acts)}; ran {r['steps']} steps; weights bit for bit with a twin "
                f"that never saw batches {r['poisoned_batches']}: {r['weights_bit_for_bit']} "
                f"(largest difference {r['largest_weight_difference']:.3g}), optimizer state: "
                f"{r['optimizer_state_bit_for_bit']}"
            )
        elif r.get("stopped_by"):
            said += f"; stopped at step {r['stopped_by'][1]} ({r['stopped_by'][0]})"
        if r.get("error"):
            said = f"**crashed**: {r['error']}"
        lines.append(f"| {r['name']} | {said} |")
    lines += [
        "",
        "**Overhead, blocks of 32 steps switched on and off inside one fit** (median of the "
        "blocks' ratios to the plain blocks around them, interquartile range in brackets):",
        "",
        "| model | plain step (device / host) | variant | on the device's timeline "
        "| on the host's clock |",
        "|---|---|---|---|---|",
    ]
    overheads = [r for r in results if r["section"] in ("small", "medium") and "ratio" in r]
    for r in overheads:
        model = f"{r['section']}: {r['parameters_m']}M parameters, batch {r['batch']}"
        plain = f"{r['plain_step_ms']['device']:.2f} / {r['plain_step_ms']['host']:.2f} ms"
        for variant, clocks in r["ratio"].items():
            lines.append(
                f"| {model} | {plain} | {variant} | {_ratio(clocks['device'])} "
                f"| {_ratio(clocks['host'])} |"
            )
            model, plain = "", ""
    lines += [
        "",
        "**The overhead budget on the device's timeline** (the stethoscope blocks above):",
        "",
        "| model | sampled step | quiet step | sampled steps | cost the budget measured "
        "| stretch | gradients every |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in overheads:
        measured = r["budget_measured"]
        lines.append(
            f"| {r['section']} | {r['stethoscope_sampled_ms']} ms | {r['stethoscope_quiet_ms']} ms "
            f"| {r['sampled_steps']} | {'—' if measured is None else f'{measured:.2%}'} "
            f"| {r['budget_stretch']}x | {r['gradient_interval']} steps |"
        )
    lines += [
        "",
        "**stethoscope's host time per step** (inside its step hooks, the stethoscope blocks "
        "above):",
        "",
        "| model | quiet step | sampled step |",
        "|---|---|---|",
    ]
    for r in overheads:
        lines.append(
            f"| {r['section']} | {r.get('hook_ms_quiet', '—')} ms "
            f"| {r.get('hook_ms_sampled', '—')} ms |"
        )
    host = next((r for r in results if r["section"] == "host" and "to_host_us" in r), None)
    if host is not None:
        lines += [
            "",
            f"Per call, on the host: a reading's trip (pinned buffer, copy, event) "
            f"{host['to_host_us']} µs, asking whether it landed {host['landed_us']} µs, a "
            f"pinned allocation {host['pinned_empty_us']} µs, a timing event "
            f"{host.get('timing_event_us', '—')} µs; `isfinite(loss).item()` on an idle "
            f"device {host.get('isfinite_item_us', '—')} µs.",
        ]
    snap = next((r for r in results if r["section"] == "snapshot" and "gigabytes" in r), None)
    if snap is not None:
        bus = snap.get("bus") or {}
        lines += [
            "",
            f"**A recovery snapshot** of {snap['parameters_m']}M parameters with a fused AdamW "
            f"({snap['gigabytes']} GB in {snap['tensors']} tensors): with its pinned buffers "
            f"reused, the host starts the copies in {snap['start_ms']} ms and they land "
            f"{snap['land_ms']} ms later ({snap['gb_per_s']} GB/s), the training stream's "
            f"time. The first three (two kept, one on its way) allocate their buffers: "
            f"{snap['allocating_start_ms']} ms on the host each. A blocking copy per tensor, as "
            f"before, held the host {snap['blocking_per_tensor_ms']} ms. A roll back took "
            f"{snap['rollback_ms']} ms. The machine's own bus: "
            f"{bus.get('pinned_gb_per_s', '—')} GB/s into pinned memory, "
            f"{bus.get('pageable_gb_per_s', '—')} GB/s into pageable memory.",
        ]
    lines += gpu_sharded.render(results)
    for r in results:
        if "crashed" in r or "skipped" in r:
            lines.append(f"\nSection {r['section']}: {r.get('crashed') or r.get('skipped')}.")
    return "\n".join(lines) + "\n"


def splice(page: Path, tables: str) -> None:
    """Put ``tables`` between the markers of ``page``."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page} has no '{BEGIN}' ... '{END}' markers to write between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{tables}{END}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.render is not None:
        tables = render(read(args.render))
        if args.docs is not None:
            splice(args.docs, tables)
        else:
            print(tables)
        return 0
    if args.out is None:
        raise SystemExit("--out FOLDER is needed (or --render RESULTS)")
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
