"""Per-step overhead of LightningStethoscope on the CPU, measured inside one process.

Four ways to train the same model are compared, step for step:

* ``plain``: Lightning with no callback;
* ``stethoscope``: ``LightningStethoscope(sinks=[])``: default detectors, sampler
  and policy; ``sinks=[]`` only silences the console (the default ConsoleSink
  prints nothing on a healthy run but the epoch summary, outside the timed steps);
* ``detect_anomaly``: ``Trainer(detect_anomaly=True)``;
* ``naive``: a callback that reads ``p.grad.norm().item()`` for every parameter in
  ``on_before_optimizer_step`` and checks ``math.isfinite``;

plus ``stethoscope (calibration)``: a fresh ``LightningStethoscope(sinks=[])``
timed over its first 128 sampled-hot steps, where the sampler runs the gradient
detectors on every step at first and backs off to every 16th step.

Shared machines are noisy (the same plain run varies by a quarter between runs),
so ratios from separate runs mean little. Here the variants take turns training
one model (and its one Adam optimizer) in short blocks: a fresh ``Trainer`` per
block, variants in a shuffled order each round, many rounds. A
step is timed from one ``on_train_batch_start`` to the next, so it includes the
forward and backward passes, the optimizer step, every hook and fetching the
next (pre-built, in-memory) batch. The first steps of each block (Trainer
start-up) and the whole first round (warm-up) are dropped. Ratios to ``plain``
are taken within each round and summarised by their median and interquartile
range over rounds.

The global step continues from block to block (the Trainer's step counter is
preset before ``fit``), so the blocks form one training run whose steps the
variants share. The steady-state ``stethoscope`` instance is reused across its
blocks (``setup`` rebuilds only the per-fit probe and host reader; detector
baselines and the sampler schedule live in its ``Monitor`` and persist) and runs
past its calibration window in an untimed pre-roll, so its timed steps are the
steady state. Its sampling follows the global step, so each 48-step block holds
exactly three gradient samples. The synthetic task is learnable, so the run
stays healthy: the report counts the findings to show it.

Run:
    python -m benchmarks.overhead                      # both models, ~8 min on 2 cores
    python -m benchmarks.overhead --quick              # smoke run, ~1 min
    python -m benchmarks.overhead --model mlp --rounds 30 --json out.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stethoscope import LightningStethoscope

THREADS = 2
SEED = 0
POOL_BATCHES = 64  # distinct synthetic batches per model, cycled

PLAIN = "plain"
STETHOSCOPE = "stethoscope"
ANOMALY = "detect_anomaly"
NAIVE = "naive"
CALIBRATION = "stethoscope (calibration)"
VARIANTS = (PLAIN, STETHOSCOPE, ANOMALY, NAIVE, CALIBRATION)

DESCRIPTIONS = {
    PLAIN: "Lightning, no callback",
    STETHOSCOPE: "LightningStethoscope(sinks=[]): the defaults (every detector, the adaptive "
    "sampler, stop_on='error') past calibration; sinks=[] only keeps this output clean: the "
    "default ConsoleSink prints nothing on a healthy run but the epoch summary, which falls "
    "outside the timed steps",
    ANOMALY: "Trainer(detect_anomaly=True)",
    NAIVE: "callback: p.grad.norm().item() + math.isfinite for every parameter, every step",
    CALIBRATION: "fresh LightningStethoscope(sinks=[]), its first {n} steps (sampler hot)",
}


# -- models and data -----------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_size: int
    signal: float  # strength of the class pattern in the synthetic inputs
    title: str


MODELS = {
    "mlp": ModelSpec("mlp", mlp, (784,), 128, 0.1, "MLP 784-512-512-10, batch 128"),
    "cnn": ModelSpec(
        "cnn", cnn, (3, 32, 32), 64, 0.5, "CNN conv32-pool-conv64-pool-linear on 3x32x32, batch 64"
    ),
}


def synthetic_batches(spec: ModelSpec, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` learnable batches: Gaussian noise plus a faint pattern of the batch's class."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, *spec.input_shape, generator=g)
    batches = []
    for _ in range(n):
        y = torch.randint(0, 10, (spec.batch_size,), generator=g)
        x = torch.randn(spec.batch_size, *spec.input_shape, generator=g) + spec.signal * patterns[y]
        batches.append((x.contiguous(), y))
    return batches


class _Cycle(Dataset):
    """Pre-built batches, cycled from ``start``: a loader with no collation cost."""

    def __init__(self, pool: Sequence[tuple[torch.Tensor, ...]], start: int, length: int) -> None:
        self.pool, self.start, self.length = pool, start, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.pool[(self.start + i) % len(self.pool)]


class Task(L.LightningModule):
    """Cross-entropy classification; keeps its Adam optimizer (and its state) across fits."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self._optimizer: torch.optim.Optimizer | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        return self._optimizer


# -- callbacks -----------------------------------------------------------------------


class StepClock(Callback):
    """Records ``perf_counter`` and the global step at every ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter())
        self.steps.append(trainer.global_step)

    def step_ms(self) -> list[tuple[int, float]]:
        """(step, ms) for every step followed by another batch start."""
        t = self.times
        return [(self.steps[i], 1e3 * (t[i + 1] - t[i])) for i in range(len(t) - 1)]


class NaiveGradCheck(Callback):
    """What one writes by hand: a host read of every gradient norm, every step."""

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        for name, p in pl_module.named_parameters():
            if p.grad is not None and not math.isfinite(p.grad.norm().item()):
                raise FloatingPointError(f"non-finite gradient in {name}")


# -- one block -----------------------------------------------------------------------


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", module="lightning_utilities.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")


def fit_block(
    task: Task,
    pool: Sequence[tuple[torch.Tensor, ...]],
    start_step: int,
    n_steps: int,
    callbacks: list[Callback],
    **trainer_kwargs: Any,
) -> tuple[StepClock, int]:
    """Train ``n_steps`` optimizer steps from global step ``start_step`` with a fresh Trainer."""
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=start_step + n_steps,
        max_epochs=-1,
        callbacks=[clock, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    # Continue the step count where this variant's previous block ended, so that a
    # reused LightningStethoscope sees one run (its sampling schedule follows the step).
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    progress.optimizer.step.total.completed = start_step
    loader = DataLoader(_Cycle(pool, start_step, n_steps + 1), batch_size=None, shuffle=False)
    gc.collect()
    trainer.fit(task, loader)
    if clock.steps[0] != start_step or trainer.global_step != start_step + n_steps:
        raise RuntimeError(
            f"the step counter did not continue: first step {clock.steps[0]}, expected "
            f"{start_step}; ended at {trainer.global_step}, expected {start_step + n_steps} "
            "(this Lightning version keeps it elsewhere)"
        )
    return clock, trainer.global_step


# -- variants ------------------------------------------------------------------------


def calibration_steps(cb: LightningStethoscope) -> int:
    """Steps until the sampler, hot at the start of a run, reaches its base intervals."""
    sampler = cb.monitor.sampler
    return sampler.hot_steps * (max(sampler.base.values()) - 1).bit_length()


@dataclass
class Variant:
    key: str
    blocks: list[dict[str, Any]] = field(default_factory=list)
    callback: LightningStethoscope | None = None  # the reused steady-state instance


@dataclass
class Config:
    rounds: int
    block_steps: int
    warmup_steps: int
    models: tuple[str, ...]
    seed: int = SEED


def _findings(cb: LightningStethoscope) -> int:
    """Findings the callback recorded (all severities, sampler notices included)."""
    done = sum(r.count for s in cb.summaries for r in s.rows if r.status != "ok")
    live = cb.monitor.summary(-1)
    return done + sum(r.count for r in live.rows if r.status != "ok")


def run_model(spec: ModelSpec, cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    net = spec.build()
    pool = synthetic_batches(spec, POOL_BATCHES, cfg.seed + 1)
    # One model and optimizer for every variant: all of them train the same weights in
    # turn, so no variant gets a luckier copy (memory layout, training stage).
    task = Task(net)
    variants = {k: Variant(k) for k in VARIANTS}
    steady = variants[STETHOSCOPE]
    steady.callback = LightningStethoscope(sinks=[])
    calib_n = calibration_steps(steady.callback)

    # Untimed pre-roll: take the reused instance past its calibration window.
    pre = calib_n + 1  # the sampler leaves its hot state when it observes step calib_n
    t0 = time.perf_counter()
    _, step = fit_block(task, pool, 0, pre, [steady.callback])
    sampler = steady.callback.monitor.sampler
    if sampler.hot or sampler.calibrating:
        raise RuntimeError("the stethoscope's sampler is still hot after its calibration window")
    log(f"{spec.name}: {pre} untimed pre-roll steps: {time.perf_counter() - t0:.1f}s")

    calib_callbacks: list[LightningStethoscope] = []
    rng = random.Random(cfg.seed)
    for rnd in range(cfg.rounds + 1):  # round 0 is warm-up
        # The calibration row needs no warm-up round: a fresh instance is made per block.
        order = [k for k in VARIANTS if rnd > 0 or k != CALIBRATION]
        rng.shuffle(order)
        t_round = time.perf_counter()
        for key in order:
            v = variants[key]
            timed = calib_n if key == CALIBRATION else cfg.block_steps
            n = cfg.warmup_steps + timed + 1  # +1: the last timed step ends at a batch start
            first_timed = step + cfg.warmup_steps
            kwargs: dict[str, Any] = {}
            callbacks: list[Callback] = []
            if key == STETHOSCOPE:
                callbacks = [v.callback]
            elif key == ANOMALY:
                kwargs["detect_anomaly"] = True
            elif key == NAIVE:
                callbacks = [NaiveGradCheck()]
            elif key == CALIBRATION:
                fresh = LightningStethoscope(sinks=[])
                # The run "starts" at the first timed step: the warm-up steps before it
                # are sampled every step too, then the timed window is exactly the
                # calibration schedule (every step, then every 2, 4, 8 steps).
                fresh.monitor.sampler.load_state_dict({"hot_since": first_timed})
                callbacks = [fresh]
                calib_callbacks.append(fresh)
            clock, step = fit_block(task, pool, step, n, callbacks, **kwargs)
            kept = [(s, ms) for s, ms in clock.step_ms() if s >= first_timed]
            assert len(kept) == timed, (key, len(kept), timed)
            block: dict[str, Any] = {
                "round": rnd,
                "steps": [s for s, _ in kept],
                "ms": [ms for _, ms in kept],
            }
            if key == STETHOSCOPE:
                monitor = v.callback.monitor
                block["sampled"] = [bool(monitor.plan(s) - {"loss"}) for s in block["steps"]]
            v.blocks.append(block)
        log(
            f"{spec.name}: round {rnd}/{cfg.rounds}{' (warm-up)' if rnd == 0 else ''} "
            f"{time.perf_counter() - t_round:.1f}s"
        )

    result = summarise(variants, cfg)
    result["model"] = spec.name
    result["title"] = spec.title
    result["calibration_steps"] = calib_n
    result["stethoscope_health"] = {
        "findings_steady": _findings(steady.callback),
        "escalations_steady": steady.callback.monitor.sampler.escalations,
        "sampler_hot_at_end": steady.callback.monitor.sampler.hot,
        "findings_calibration_runs": sum(_findings(cb) for cb in calib_callbacks),
    }
    return result


# -- statistics ----------------------------------------------------------------------


def _quartiles(xs: Sequence[float]) -> dict[str, float]:
    """First quartile, median and third quartile."""
    if len(xs) == 1:
        return {"q1": xs[0], "median": xs[0], "q3": xs[0]}
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"q1": q1, "median": q2, "q3": q3}


def summarise(variants: dict[str, Variant], cfg: Config) -> dict[str, Any]:
    def measured(v: Variant) -> list[dict[str, Any]]:
        return [b for b in v.blocks if b["round"] >= 1]

    plain = {b["round"]: b for b in measured(variants[PLAIN])}
    out: dict[str, Any] = {"variants": {}}
    for key, v in variants.items():
        blocks = measured(v)
        all_ms = [ms for b in blocks for ms in b["ms"]]
        mean_ratios, median_ratios = [], []
        for b in blocks:
            p = plain[b["round"]]
            mean_ratios.append(statistics.fmean(b["ms"]) / statistics.fmean(p["ms"]))
            median_ratios.append(statistics.median(b["ms"]) / statistics.median(p["ms"]))
        entry: dict[str, Any] = {
            "median_ms": statistics.median(all_ms),
            "mean_ms": statistics.fmean(all_ms),
            "steps_timed": len(all_ms),
            "rounds": len(blocks),
            "ratio_of_means": _quartiles(mean_ratios),
            "ratio_of_medians": _quartiles(median_ratios),
            "per_round_ratio_of_means": mean_ratios,
            "blocks": blocks,
        }
        if key == STETHOSCOPE:
            # The sampled steps (gradient norms, 1 in 16) against the same round's plain median.
            split: dict[str, list[float]] = {"sampled": [], "unsampled": []}
            for b in blocks:
                ref = statistics.median(plain[b["round"]]["ms"])
                for ms, hit in zip(b["ms"], b["sampled"], strict=True):
                    split["sampled" if hit else "unsampled"].append(ms / ref)
            entry["step_ratio_by_kind"] = {
                k: {"n": len(xs), "median": statistics.median(xs) if xs else None}
                for k, xs in split.items()
            }
        out["variants"][key] = entry
    return out


# -- report --------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }


def _ratio(r: dict[str, float]) -> str:
    return f"{r['median']:.3f}x [{r['q1']:.3f}–{r['q3']:.3f}]"


def markdown(results: list[dict[str, Any]], env: dict[str, Any], cfg: Config, wall_s: float) -> str:
    lines = [
        "| model | variant | median ms/step | mean ms/step | ratio vs plain, block means: "
        "median [IQR] | ratio vs plain, step medians: median [IQR] |",
        "|---|---|---:|---:|---|---|",
    ]
    for res in results:
        for key in VARIANTS:
            e = res["variants"][key]
            ratio_mean = "1 (reference)" if key == PLAIN else _ratio(e["ratio_of_means"])
            ratio_median = "1 (reference)" if key == PLAIN else _ratio(e["ratio_of_medians"])
            lines.append(
                f"| {res['model']} | {key} | {e['median_ms']:.2f} | {e['mean_ms']:.2f} | "
                f"{ratio_mean} | {ratio_median} |"
            )
    calib_n = results[0]["calibration_steps"] if results else 128
    notes = [
        "",
        f"{env['date']}; torch {env['torch']}, lightning {env['lightning']}, "
        f"Python {env['python']}; {env['torch_threads']} torch threads on {env['cpu']} "
        f"({env['cpu_count']} CPUs). `{env['command']}`, {wall_s / 60:.1f} min.",
        f"{cfg.rounds} rounds after a warm-up round; per round and variant a fresh Trainer "
        f"trains {cfg.warmup_steps} untimed + {cfg.block_steps} timed steps "
        f"({calib_n} timed for the calibration row), variants in shuffled order. "
        "A step is timed from one on_train_batch_start to the next (forward, backward, "
        "optimizer, every hook, next in-memory batch). Ratios are taken within each round "
        "against that round's plain block, then summarised over rounds.",
        "Block means count every step, including the 1-in-16 steps on which the stethoscope "
        "reads gradient norms; per-step medians hide those steps.",
        "",
    ]
    for key in VARIANTS:
        notes.append(f"- {key}: {DESCRIPTIONS[key].format(n=calib_n)}")
    notes.append("")
    for res in results:
        split = res["variants"][STETHOSCOPE].get("step_ratio_by_kind", {})
        h = res["stethoscope_health"]
        parts = [
            f"{k} steps (n={v['n']}): {v['median']:.3f}x"
            for k, v in split.items()
            if v["median"] is not None
        ]
        notes.append(
            f"{res['model']}: stethoscope steps against the round's plain median: "
            + "; ".join(parts)
            + f". Findings in the steady-state run: {h['findings_steady']}, sampler "
            f"escalations: {h['escalations_steady']}."
        )
    return "\n".join(lines + notes)


# -- CLI -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Per-step overhead of LightningStethoscope vs plain Lightning, "
        "detect_anomaly and a naive gradient check (CPU, interleaved blocks).",
    )
    p.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    p.add_argument(
        "--rounds", type=int, default=None, help="measured rounds (default 16; 2 with --quick)"
    )
    p.add_argument(
        "--block-steps",
        type=int,
        default=None,
        help="timed steps per block (default 48; 16 with --quick); keep it a multiple of 16, "
        "the stethoscope's gradient interval, so every block holds as many sampled steps",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps opening each block (default 10; 3 with --quick)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every timing and summary as JSON")
    p.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    args = p.parse_args(argv)
    defaults = (2, 16, 3) if args.quick else (16, 48, 10)
    for name, d in zip(("rounds", "block_steps", "warmup_steps"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, d)
    if args.rounds < 1 or args.block_steps < 1 or args.warmup_steps < 1:
        p.error("--rounds, --block-steps and --warmup-steps must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    torch.set_num_threads(THREADS)
    cfg = Config(
        rounds=args.rounds,
        block_steps=args.block_steps,
        warmup_steps=args.warmup_steps,
        models=("mlp", "cnn") if args.model == "both" else (args.model,),
    )

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    env = environment()
    shown = sys.argv[1:] if argv is None else list(argv)
    env["command"] = " ".join(["python -m benchmarks.overhead", *shown])
    t0 = time.perf_counter()
    results = [run_model(MODELS[m], cfg, log) for m in cfg.models]
    wall = time.perf_counter() - t0
    log(f"total {wall:.0f}s")
    print(markdown(results, env, cfg, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "config": vars(cfg), "wall_s": wall, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
