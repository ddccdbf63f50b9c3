"""A validation that still behaves as training does: the mirror of ``eval_mode``."""

from __future__ import annotations

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["ValidationMode"]

#: Calls named in a finding at most (the rest are counted).
_SHOWN = 3


class ValidationMode(Detector):
    """A validation that behaves as training: a dropout that still drops, or a batch
    norm that normalises by the batch and moves its running statistics, although the
    framework put the model in eval mode. The validation loss is then random and worse
    than the model's, and a batch norm's statistics drift with the validation data.

    Rule: during the first batch of the run's first validation, a call dropped elements
    (a functional or ATen dropout with its training flag set, an attention's
    ``dropout_p`` above 0, ``rrelu``) or used a batch's statistics where running ones
    exist (``batch_norm``, ``instance_norm``): a warning, once, naming each call and the
    module that made it. The framework's mode is a flag each module reads, so the call's
    own argument is what decides; a normalisation without running statistics
    (``track_running_stats=False``) always uses the batch's, and a model that samples
    on purpose (a VAE's ``randn_like``) drops nothing, so neither is counted.

    Sources: ``F.dropout(x, p)`` in ``forward`` (its ``training`` defaults to True),
    ``dropout_p`` passed to attention whatever the mode, a ``.train()`` inside the
    validation step, an ``eval()`` override that misses a submodule.

    Keras passes ``training=False`` through ``evaluate``; a layer that hard-codes
    ``training=True`` is not watched there yet.
    """

    name = "validation_mode"
    needs = frozenset({"val_modes"})  # a validation's (never planned per step)
    runs_on = frozenset({"val_modes"})
    base_interval = 16
    advice = "pass training=self.training to dropout and batch norm calls"

    def _initial_state(self) -> dict:
        return {"judged": False}

    def applies(self) -> bool:
        return self.setup.framework != "keras"  # measured in Lightning only (see above)

    def finished(self, step: int) -> bool:
        return self.state["judged"] or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        calls = obs.val_training_calls
        if calls is None:
            return []
        self.state["judged"] = True
        if not calls:
            return []
        more = f" and {len(calls) - _SHOWN} more" if len(calls) > _SHOWN else ""
        drops = any("dropout" in c or "rrelu" in c for c in calls)
        norms = any("norm" in c for c in calls)
        effect = []
        if drops:
            effect.append("its outputs are random and its loss worse than the model's")
        if norms:
            effect.append("batch statistics replace the running ones, which it moves")
        where = calls[0].rsplit(" in ", 1)[-1]
        return [
            self.finding(
                obs,
                "warning",
                f"The validation at step {obs.step} behaved as training: "
                f"{', '.join(calls[:_SHOWN])}{more}, although the model was in eval "
                f"mode; {' and '.join(effect)}. A call's own argument decides its "
                "behaviour, not the model's mode: pass training=self.training to "
                "F.dropout or F.batch_norm, dropout_p=p if self.training else 0.0 to "
                "attention, and call no .train() inside the validation step.",
                value=float(len(calls)),
                threshold=0.0,
                where=where,
            )
        ]
