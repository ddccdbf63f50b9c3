"""The run's context for the sinks, from a Lightning Trainer.

A user with ``MLFlowLogger`` and ``MLflowSink()`` expects one run, not two; with
``TensorBoardLogger`` and ``TensorBoardSink()``, one log dir; with a progress bar, lines
that do not tear it. The context offers each sink the Trainer's destinations, looked up
only when a sink asks for them (reading ``MLFlowLogger.run_id`` starts the logger's
run). Only public API is used: ``MLFlowLogger.run_id``, ``MLFlowLogger.experiment`` (an
``MlflowClient``, whose ``tracking_uri`` is public), ``TensorBoardLogger.log_dir`` and
``ProgressBar.print``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

from stethoscope.advice import (
    RunningStatistics,
    SmallEpsilon,
    TrainingSetup,
    adaptive_optimizers,
    small_epsilon,
)
from stethoscope.callbacks._lightning.loss_scale import loss_scaler_name
from stethoscope.callbacks._lightning.parameters import ParameterProbe
from stethoscope.callbacks._lightning.zero import (
    client_optimizer,
    is_deepspeed_optimizer,
    zero_stage,
)
from stethoscope.number_formats import HALF
from stethoscope.sinks.base import RunContext

__all__ = ["run_context", "training_setup"]


def run_context(
    trainer: Any,
    *,
    record: Path | None,
    report: Callable[[Path], None] | None,
    describe: Callable[[], dict[str, Any]],
) -> RunContext:
    """The context of ``trainer``'s run, for the sinks."""
    return RunContext(
        framework="lightning",
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        printer=progress_printer(trainer),
        tensorboard_log_dir=lambda: _ask(trainer, "TensorBoardLogger", _log_dir),
        mlflow_run=lambda: _ask(trainer, "MLFlowLogger", _mlflow_run),
        first_step=trainer.global_step,
        first_epoch=trainer.current_epoch,
        describe=describe,
        record=record,
        report=report,
        setup=training_setup(trainer),
    )


def training_setup(trainer: Any) -> TrainingSetup:
    """What ``trainer`` already does that the findings' advice depends on: its gradient
    clipping, its precision and whether a scheduler drives the learning rate."""
    clip = trainer.gradient_clip_val
    clipping = None
    if clip:
        algorithm = trainer.gradient_clip_algorithm
        clipping = f"gradient_clip_val={clip}"
        if algorithm and str(algorithm) not in ("norm", "GradClipAlgorithmType.NORM"):
            clipping += f", gradient_clip_algorithm={str(algorithm).split('.')[-1].lower()!r}"
    precision = str(trainer.precision)
    module = trainer.lightning_module
    return TrainingSetup(
        framework="lightning",
        clipping=clipping,
        precision=None if precision in _FULL_PRECISION else precision,
        scheduler=bool(trainer.lr_scheduler_configs),
        # a game shows as the run goes, not in its settings (see GameWatch)
        adversarial=False,
        adaptive=adaptive_optimizers([client_optimizer(o) for o in trainer.optimizers]),
        loss_scaler=loss_scaler_name(trainer),
        low_precision=precision not in _FULL_PRECISION or _holds_half(module),
        master_weights=any(is_deepspeed_optimizer(o) for o in trainer.optimizers),
        divided_again=_divided_again(trainer),
        small_epsilon=_small_epsilon(trainer.optimizers),
        line_search=_line_search(trainer.optimizers),
        vocabulary=_vocabulary(module),
        loader_workers=_loader_workers(trainer),
        whole_batches=_whole_batches(trainer),
        running_statistics=_running_statistics(module),
    )


def _running_statistics(module: Any) -> RunningStatistics | None:
    """The batch norm whose running statistics follow the batches slowest: each step they
    keep ``1 - momentum`` of themselves (``momentum=None``: a cumulative average, whose
    initial values are gone after the first batch; none kept: nothing to lag)."""
    import torch

    norms = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and m.momentum is not None
    ]
    if not norms:
        return None
    name, slowest = min(norms, key=lambda nm: float(nm[1].momentum))
    m = float(slowest.momentum)
    return RunningStatistics(name, f"momentum={m:g}", 1.0 - m)


def _loader_workers(trainer: Any) -> int:
    """The worker processes of the training loader (0: the main process, or a loader
    that is no ``DataLoader``, or several)."""
    workers = getattr(getattr(trainer, "train_dataloader", None), "num_workers", 0)
    return workers if isinstance(workers, int) else 0


def _whole_batches(trainer: Any) -> bool:
    """Whether the training loader is a ``DataLoader`` that collates nothing: no
    ``batch_size`` nor ``batch_sampler``, so each item its dataset gives is a batch as it
    is (torch's ``DataLoader._auto_collation`` is private: its two public attributes say
    the same)."""
    from torch.utils.data import DataLoader

    loader = getattr(trainer, "train_dataloader", None)
    if not isinstance(loader, DataLoader):
        return False
    return loader.batch_size is None and loader.batch_sampler is None


def _vocabulary(module: Any) -> int:
    """The tokens ``module`` both embeds and predicts: the rows of one of its
    ``nn.Embedding`` tables, where its last ``nn.Linear`` has as many outputs (a language
    model's encoder and decoder, tied or not); 0: none."""
    from torch import nn

    if module is None:
        return 0
    tables = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
    heads = [m.out_features for m in module.modules() if isinstance(m, nn.Linear)]
    return heads[-1] if tables and heads and heads[-1] in tables else 0


#: Optimizers (and their subclasses) that search along a direction each step, calling
#: their closure many times: torch's LBFGS, with or without its line search.
_LINE_SEARCH = ("LBFGS",)


def _line_search(optimizers: list[Any]) -> str:
    """The first optimizer that takes each step as a search over calls of its closure, by
    its class name; empty: none."""
    for optimizer in map(client_optimizer, optimizers):
        if any(c.__name__ in _LINE_SEARCH for c in type(optimizer).__mro__):
            return type(optimizer).__name__
    return ""


def _small_epsilon(optimizers: list[Any]) -> SmallEpsilon | None:
    """The first epsilon too small for the 16-bit weights its parameter group updates
    (torch's optimizers keep their state in each weight's dtype); DeepSpeed's updates
    float32 master copies."""
    for optimizer in map(client_optimizer, optimizers):
        for group in optimizer.param_groups:
            dtypes = {p.dtype for p in group["params"]}
            risk = small_epsilon(optimizer, "eps", group.get("eps"), dtypes)
            if risk is not None:
                return risk
    return None


def _divided_again(trainer: Any) -> int:
    """What the loss is divided by a second time: Lightning's automatic optimization
    divides each batch's loss by ``accumulate_grad_batches`` (manual optimization may
    not set it), and a DeepSpeed engine's backward, which Lightning calls with its
    default ``scale_wrt_gas=True``, by its ``gradient_accumulation_steps``, set by
    Lightning to the same number (lightning 2.6, deepspeed 0.19). 1: none."""
    engine = trainer.strategy.model
    if trainer.accumulate_grad_batches <= 1 or zero_stage(engine) is None:
        return 1
    return int(engine.gradient_accumulation_steps())


#: The Trainer's precision settings that keep everything in float32 or float64.
_FULL_PRECISION = frozenset({"32-true", "32", "64-true", "64"})


def _holds_half(module: Any) -> bool:
    """Whether any parameter of ``module`` is held in a 16-bit format (a model cast by
    hand under a float32 Trainer)."""
    if module is None:
        return False
    return any(str(p.dtype).rsplit(".", 1)[-1] in HALF for p in module.parameters())


def describe_run(trainer: Any, module: Any, probe: ParameterProbe) -> dict[str, Any]:
    """The model, its optimizers and the Trainer's settings, as plain data: each
    parameter whole, as ``probe`` knows it (a sharded one's whole shape)."""
    parameters = [
        {"name": n, "shape": list(shape), "numel": shape.numel(), "trainable": p.requires_grad}
        for n, shape, p in probe.as_whole(list(module.named_parameters()))
    ]
    return {
        "framework": "lightning",
        "model": {
            "class": type(module).__name__,
            "parameters": parameters,
            "total": sum(p["numel"] for p in parameters),
        },
        "optimizers": [
            {
                "class": type(opt).__name__,
                "groups": [
                    {k: v for k, v in g.items() if k != "params" and _plain(v)}
                    for g in opt.param_groups
                ],
            }
            for opt in trainer.optimizers
        ],
        "trainer": {
            "max_epochs": trainer.max_epochs,
            "max_steps": trainer.max_steps,
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
        },
    }


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (a tensor learning rate is not written)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def progress_printer(trainer: Any) -> Callable[[str], None] | None:
    """Print through the progress bar so that its line is not torn: ``tqdm.write`` for
    TQDM. A RichProgressBar draws on rich's global console, which places output above
    the live bar itself (its stdout proxy would wrap already-wrapped lines a second time):
    then, and without a bar, print as usual (``None``)."""
    bar = trainer.progress_bar_callback
    enabled = bar is not None and bar.is_enabled
    return bar.print if enabled and not isinstance(bar, RichProgressBar) else None


def _ask(trainer: Any, kind: str, lookup: Callable[[Any], Any]) -> Any:
    """``lookup`` of the first logger of class ``kind``; None without one. Never raises:
    a logger that cannot say where it writes leaves the sink on its own default."""
    from lightning.pytorch import loggers

    cls = getattr(loggers, kind)
    for logger in trainer.loggers:
        if isinstance(logger, cls):
            try:
                return lookup(logger)
            except Exception as exc:  # a sink must never cost the run, nor must lending to one
                warnings.warn(
                    f"stethoscope: could not send findings to {type(logger).__name__}'s run "
                    f"({exc!r}); the sinks keep their own destination",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
    return None


def _log_dir(logger: Any) -> str | None:
    return logger.log_dir


def _mlflow_run(logger: Any) -> tuple[str, str | None] | None:
    run_id = logger.run_id  # creates the logger's run if it has none yet
    return (run_id, _tracking_uri(logger)) if run_id else None


def _tracking_uri(logger: Any) -> str | None:
    """The logger's tracking URI through public API: its client's ``tracking_uri``."""
    uri = getattr(logger.experiment, "tracking_uri", None)
    if isinstance(uri, str) and uri:
        return uri
    # MlflowClient before it had the property: the logger sets MLflow's global URI to
    # its own when it makes its client, which ``logger.run_id`` above has done.
    import mlflow

    return mlflow.get_tracking_uri()
