"""What is measured of a validation besides its loss: its first samples' prints
(``val_prints``), the calls of its first batch that behaved as in training
(``val_modes``), what that batch divided its spectrally normalized weights by
(``val_spectral``) and how far the batch norms' running statistics are from their
batches' (``val_norms``), each when a detector reads it, in a single process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from stethoscope.callbacks._lightning.batch import ValidationPrints, split_batch
from stethoscope.callbacks._lightning.running_statistics import RunningStatisticsWatch
from stethoscope.callbacks._lightning.spectral_norms import FirstSpectralNorms
from stethoscope.callbacks._lightning.validation_modes import FirstValidation, compiled
from stethoscope.engine import Decision, Monitor

__all__ = ["ValidationMeasures"]


class ValidationMeasures:
    """The validation's statistics of a fit, by the validation hooks' order.

    Args:
        reads: ``statistic -> whether a detector still reads it``.
        inputs_of: ``batch -> inputs`` (default: ``split_batch``'s).
        held: What a ``trainer.validate()`` before this fit found of the spectral norms,
            judged as this fit's training starts unless its own sanity check finds them
            (see :meth:`for_fit`).
    """

    def __init__(
        self,
        reads: Callable[[str], bool],
        inputs_of: Callable[[Any], Any] | None = None,
        *,
        held: dict[str, Any] | None = None,
    ) -> None:
        inputs_of = inputs_of if inputs_of is not None else (lambda batch: split_batch(batch)[0])
        self.reads = reads
        self._prints = ValidationPrints(inputs_of)
        self._printing = False
        self._modes = FirstValidation()
        #: The sanity check's validation counts: it divides by what training has not yet
        #: iterated.
        self._spectral = FirstSpectralNorms()
        self._norms = RunningStatisticsWatch()
        self._norms_wanted = False
        self._held = held

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, *, single: bool) -> None:
        """A validation begins (``single``: in a single process; the ranks of a
        distributed run pool their losses alone). The spectral norms are read in a
        ``trainer.validate()`` too, to be judged when a fit starts."""
        judged = trainer.state.fn == "fit" and single
        self._printing = judged and self.reads("val_prints")
        wanted = judged and not trainer.sanity_checking and self.reads("val_modes")
        self._modes.validation_start(module, wanted=wanted)
        self._norms_wanted = (
            judged and self._norms.watching and not trainer.sanity_checking
        ) and self.reads("val_norms")
        alone = trainer.state.fn in ("fit", "validate") and trainer.world_size == 1
        spectral = alone and self.reads("val_spectral") and not compiled(module)
        when = "validate" if trainer.state.fn == "validate" else "validation"
        when = "sanity check" if trainer.sanity_checking else when
        self._spectral.validation_start(module, wanted=spectral, when=when)

    def batch_start(self, trainer: pl.Trainer, batch: Any, dataloader_idx: int) -> None:
        if self._printing and not trainer.sanity_checking and dataloader_idx == 0:
            self._prints.add(batch)
        self._modes.batch_start(dataloader_idx)
        self._spectral.batch_start(dataloader_idx)

    def batch_end(self) -> None:
        self._modes.batch_end()
        self._spectral.batch_end()

    def take(self) -> dict[str, Any]:
        """The validation's measured fields by name (None: not measured), and start over."""
        prints = self._prints.take() if self._printing else None
        norms, self._norms_wanted = self._norms_wanted, False
        return {
            "val_running_statistics": self._norms.measure() if norms else None,
            "val_prints": prints,
            "val_training_calls": self._modes.take(),
            "val_spectral": self._spectral.take(),
            "val_spectral_when": self._spectral.when,
        }

    def for_fit(self, inputs_of: Callable[[Any], Any]) -> ValidationMeasures:
        """The measures of a fit that starts now, holding what these found of the spectral
        norms in a ``trainer.validate()`` before it, to judge as its training starts."""
        return ValidationMeasures(self.reads, inputs_of, held=self._before_training())

    def training_starts(
        self, trainer: pl.Trainer, module: pl.LightningModule, monitor: Monitor
    ) -> Decision:
        """Training starts, and the monitor with it: copy the running statistics it will
        move, and judge what the sanity check (or a ``trainer.validate()`` before the
        fit) found of the spectral norms."""
        self._norms.start(module)
        measured = self._before_training()
        if measured is None:
            return Decision()  # nothing to do
        step = max(trainer.global_step - 1, 0)
        return monitor.observe_validation(step, trainer.current_epoch, None, **measured)

    def _before_training(self) -> dict[str, Any] | None:
        """What was found of the spectral norms before training (None: nothing to judge
        then; a model without them waits for the first validation's other fields): a
        ``trainer.validate()``'s before the fit, whose numbers the user saw, over the
        fit's own sanity check, whose numbers Lightning discards."""
        spectral = self._spectral.take(found_only=True)
        held, self._held = self._held, None
        if spectral is None or held is not None:
            return held
        return {"val_spectral": spectral, "val_spectral_when": self._spectral.when}

    def close(self) -> None:
        """Leave nothing on the model (a validation batch that raised)."""
        self._modes.close()
        self._spectral.close()
