"""Plain facts of a Keras fit, as the workers of the distributed Keras tests write them
(``_mirrored_worker.py``, ``_multiworker_worker.py``). No TensorFlow is imported here:
each worker configures its devices before it imports anything that does."""

from __future__ import annotations

from typing import Any


def clean(model: Any) -> bool:
    """No wrapper of stethoscope left on the model, its optimizer or its layers."""
    return (
        not {"compute_loss", "train_step"} & set(vars(model))
        and not {"apply", "_all_reduce_sum_gradients"} & set(vars(model.optimizer))
        and all("call" not in vars(layer) for layer in model.layers)
        and all(not {"update_state", "result"} & set(vars(m)) for m in model.metrics)
        and model.train_function is None
    )


def finding(f: Any) -> dict:
    """A finding as plain data: where, when, by which detector and rank, how serious."""
    return {
        "step": f.step,
        "detector": f.detector,
        "severity": str(f.severity),
        "where": f.where,
        "rank": f.rank,
    }
