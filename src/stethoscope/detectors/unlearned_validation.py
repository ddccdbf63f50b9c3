"""A validation loss that stays where training began while the training loss falls."""

from __future__ import annotations

import math

from stethoscope.detectors._stats import is_finite
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["UnlearnedValidation"]


class UnlearnedValidation(Detector):
    """Nothing the model learns shows in its validation: the validation loss stays at
    the level the training started from, while the training loss falls far below it.

    Two mechanisms give it, and the finding names the one the run's setup points to:

    * **The model that validates is not the one that trains.** Inference normalises by
      a batch norm's running statistics, which each step keep ``momentum`` of themselves
      (Keras; ``1 - momentum`` in torch). Where that is close to 1 and the steps are few,
      they are still mostly their initial values (mean 0, variance 1): measured,
      ``keras.applications.MobileNetV3Small`` (momentum 0.999) on the digits trains to
      98% and validates at chance (loss ln 10) every epoch; a small Conv+BN CNN on
      23 steps an epoch validates at 2.30 -> 2.23 with Keras' default 0.99, at 2.28 -> 1.39
      with 0.9, its training loss 2.27 -> 1.44 either way.
    * **The validation data is not the training data's kind**: labels misaligned with
      their inputs, another preprocessing, another task.

    Rule: at ``patience`` validations in a row, and at every validation before them
    (never the sanity check), the validation loss is at least ``no_better`` of the run's
    first training loss while the mean training loss since the last validation is below
    ``learned`` of it: a warning, once. A loss that can fall below zero (a negative
    log-likelihood with a density) has no such floor and is left alone, as is a run
    whose first loss is not positive. A model that learns and then overfits had a
    better validation first, and is ``overfitting``'s.

    Args:
        no_better: The share of the first training loss the validation loss stays above.
        learned: The share of it the training loss must have fallen below.
        patience: Validations in a row that raise the warning.
    """

    name = "unlearned_validation"
    needs = frozenset({"val"})
    base_interval = 1
    #: Its evidence is the validations', and the steps after it show nothing of them: an
    #: escalation would run every detector every step for nothing.
    escalates = False
    advice = "validate the model that trains: check its inference-mode layers and the data"

    def __init__(self, *, no_better: float = 0.9, learned: float = 0.5, patience: int = 2) -> None:
        check_fraction(self.name, "no_better", no_better)
        check_fraction(self.name, "learned", learned)
        check_positive(self.name, "patience", patience, integer=True)
        self.no_better, self.learned, self.patience = float(no_better), float(learned), patience
        super().__init__()

    def _initial_state(self) -> dict:
        # in_a_row: validations in a row at the start's level with training below it;
        # validated_better: some validation was below that level (the rule is done)
        return {"in_a_row": 0, "validated_better": False, "fired": False}

    def finished(self, step: int) -> bool:
        st = self.state
        return st["fired"] or st["validated_better"]

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"] or st["validated_better"]:
            return []
        val, train, start = obs.val_loss, obs.train_loss, obs.start_loss
        if not (is_finite(val) and is_finite(start)) or start <= 0 or val < 0:
            return []
        if val < self.no_better * start:
            st["validated_better"] = True  # it learned something that carries over
            return []
        if not is_finite(train) or train < 0 or train >= self.learned * start:
            st["in_a_row"] = 0
            return []
        st["in_a_row"] += 1
        if st["in_a_row"] < self.patience:
            return []
        st["fired"] = True
        return [
            self.finding(
                obs,
                "warning",
                f"The validation loss is {val:.3g} after {st['in_a_row']} validations in a "
                f"row, no better than the first training loss {start:.3g}, while the "
                f"training loss fell to {train:.3g}: nothing the model learns shows when it "
                f"validates. {self._cause(obs.step + 1)}",
                value=float(val),
                threshold=self.no_better * float(start),
                where=self._where(),
            )
        ]

    def _where(self) -> str | None:
        norm = self.setup.running_statistics
        return norm.layer if norm is not None else None

    def _cause(self, steps: int) -> str:
        norm = self.setup.running_statistics
        if norm is None:
            return (
                "The model has no batch norm to validate differently, so look at the "
                "validation data: its labels against its inputs, and its preprocessing "
                "against the training data's."
            )
        share = norm.initial_share(steps)
        half = math.log(0.5) / math.log(norm.keep) if 0 < norm.keep < 1 else math.inf
        return (
            f"Inference normalises by the batch norms' running statistics, and those of "
            f"{norm.layer} ({norm.setting}) still hold {share:.0%} of their initial values "
            f"after {steps} steps (half of them after {half:.0f}), so the model that "
            f"validates is closer to the untrained one. Lower the momentum "
            f"({_faster(self.setup.framework)}), or check the validation data: its labels "
            f"against its inputs, and its preprocessing against the training data's."
        )


def _faster(framework: str) -> str:
    """A momentum that follows the batches within tens of steps, in the framework's terms."""
    return "momentum=0.1, torch's default" if framework == "lightning" else "momentum=0.9"
