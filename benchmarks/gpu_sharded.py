"""The ``sharded`` section of ``benchmarks.gpu``: what the detectors are handed under
Lightning's sharding strategies on one CUDA device, against the same fit unsharded.

Lightning runs ``FSDPStrategy`` (FSDP1: flat parameters, here with
``use_orig_params=True``) only on CUDA, so the CPU suite cannot. On one device nothing is
split across ranks, but the parameters the callback finds are the strategy's: FSDP1's
are views into its flat parameter, FSDP2's (``ModelParallelStrategy``) DTensors. Each
layout fits the tiny GPT of ``benchmarks.gpu`` in float32 for 40 steps, every sampled
detector every other step, and records the per-parameter gradient and weight norms the
detectors were handed; each is compared with the unsharded fit's, step by step (a rel.
1e-5 agreement is the bar). In the ``--cpu`` dry run FSDP1 is skipped (it needs CUDA).
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np

#: Steps each layout fits.
STEPS = 40


def _spy() -> Any:
    """A sink that keeps the per-parameter norms the detectors were handed, by step."""
    from stethoscope.sinks import Sink

    class Spy(Sink):
        def __init__(self) -> None:
            self.steps: dict[int, dict[str, Any]] = {}

        def observe(self, obs: Any, interval: Any = None) -> None:
            if obs.grad_norm is not None:
                row = self.steps.setdefault(obs.step, {"names": tuple(obs.names or ())})
                row["grad_norm"] = np.asarray(obs.grad_norm, dtype=float)
                if obs.weight_norm is not None:
                    row["weight_norm"] = np.asarray(obs.weight_norm, dtype=float)

    return Spy()


def _sharded(module: Any, layout: str) -> Any:
    """``module`` whose class shards it in ``configure_model`` (FSDP2: each block, then the
    network); FSDP1 wraps it in its strategy instead."""
    if layout != "FSDP2":
        return module
    from torch.distributed.fsdp import fully_shard

    def configure_model(self: Any) -> None:
        for block in self.net.blocks:
            fully_shard(block)
        fully_shard(self.net)

    module.__class__ = type(
        "Sharded" + type(module).__name__, (type(module),), {"configure_model": configure_model}
    )
    return module


def norms_fit(run: Any, layout: str) -> dict[int, dict[str, Any]]:
    """The per-parameter norms handed to the detectors in a fit under ``layout``
    (``"plain"``, ``"FSDP2"`` or ``"FSDP1"``)."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from benchmarks.gpu import SIZES, lightning_module, loader, token_batches, trainer_for
    from stethoscope import LightningStethoscope
    from stethoscope.detectors import default_detectors

    often = {d.name: 2 for d in default_detectors() if d.base_interval > 1}
    spy = _spy()
    callback = LightningStethoscope(sinks=[spy], intervals=often, escalate=False)
    strategy: Any = "auto"
    if layout == "FSDP2":
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    elif layout == "FSDP1":
        strategy = FSDPStrategy(use_orig_params=True)
    size = SIZES["tiny"]
    torch.manual_seed(0)
    module = _sharded(lightning_module(size, optimizer="foreach", device=run.device), layout)
    data = token_batches(STEPS, 8, size["context"], size["vocab"])
    trainer = trainer_for(
        run,
        [callback],
        max_steps=STEPS,
        precision="32-true",
        strategy=strategy,
        use_distributed_sampler=False,  # the batches in order, as the plain fit takes them
    )
    trainer.fit(module, loader(data))
    return spy.steps


def compare(got: dict[int, dict], want: dict[int, dict]) -> dict[str, Any]:
    """How ``got`` agrees with ``want``: the steps both measured, whether the parameters
    were named alike, and the largest relative difference of each norm."""
    steps = sorted(set(got) & set(want))
    worst: dict[str, float] = {}
    for step in steps:
        for field in ("grad_norm", "weight_norm"):
            if field in got[step] and field in want[step]:
                a, b = got[step][field], want[step][field]
                if a.shape != b.shape:
                    worst[field] = float("inf")
                    continue
                rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-30)
                worst[field] = max(worst.get(field, 0.0), float(np.nanmax(rel, initial=0.0)))
    return dict(
        steps_compared=len(steps),
        steps_measured=[len(got), len(want)],
        names_match=all(got[s]["names"] == want[s]["names"] for s in steps),
        largest_relative_difference=worst,
    )


def section_sharded(run: Any) -> None:
    """Each sharded layout against the plain fit (see the module's docstring)."""
    want = norms_fit(run, "plain")
    for layout in ("FSDP2", "FSDP1"):
        if layout == "FSDP1" and run.cpu:
            run.emit(dict(section="sharded", layout=layout, not_run="FSDPStrategy needs CUDA"))
            continue
        try:
            result = compare(norms_fit(run, layout), want)
            run.emit(dict(section="sharded", layout=layout, error=None, **result))
        except Exception as exc:  # the report says so, and the script goes on
            traceback.print_exc()
            run.emit(dict(section="sharded", layout=layout, error=f"{type(exc).__name__}: {exc}"))


def render(results: list[dict[str, Any]]) -> list[str]:
    """The section's table, for ``docs/gpu.md``."""
    rows = [r for r in results if r["section"] == "sharded"]
    if not rows:
        return []
    lines = [
        "",
        f"**Sharded strategies on one device** (the tiny GPT, float32, {STEPS} steps; the "
        "gradient and weight norms handed to the detectors against an unsharded fit's):",
        "",
        "| layout | steps compared | parameters named alike | largest rel. difference |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r.get("not_run") or r.get("error"):
            lines.append(f"| {r['layout']} | {r.get('not_run') or r['error']} | | |")
            continue
        worst = (
            ", ".join(f"{k}: {v:.2g}" for k, v in r["largest_relative_difference"].items()) or "—"
        )
        lines.append(
            f"| {r['layout']} | {r['steps_compared']} of {r['steps_measured'][1]} "
            f"| {r['names_match']} | {worst} |"
        )
    return lines
