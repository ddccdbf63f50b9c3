"""What is measured of a validation besides its loss: its first samples' prints
(``val_prints``) and the calls of its first batch that behaved as in training
(``val_modes``), each when a detector reads it, in a single process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from stethoscope.callbacks._lightning.batch import ValidationPrints, split_batch
from stethoscope.callbacks._lightning.validation_modes import FirstValidation

__all__ = ["ValidationMeasures"]


class ValidationMeasures:
    """The validation's statistics of a fit, by the validation hooks' order.

    Args:
        reads: ``statistic -> whether a detector still reads it``.
        inputs_of: ``batch -> inputs`` (default: ``split_batch``'s).
    """

    def __init__(
        self, reads: Callable[[str], bool], inputs_of: Callable[[Any], Any] | None = None
    ) -> None:
        inputs_of = inputs_of if inputs_of is not None else (lambda batch: split_batch(batch)[0])
        self.reads = reads
        self._prints = ValidationPrints(inputs_of)
        self._printing = False
        self._modes = FirstValidation()

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, *, single: bool) -> None:
        """A validation begins (``single``: in a single process; the ranks of a
        distributed run pool their losses alone)."""
        judged = trainer.state.fn == "fit" and single
        self._printing = judged and self.reads("val_prints")
        wanted = judged and not trainer.sanity_checking and self.reads("val_modes")
        self._modes.validation_start(module, wanted=wanted)

    def batch_start(self, trainer: pl.Trainer, batch: Any, dataloader_idx: int) -> None:
        if self._printing and not trainer.sanity_checking and dataloader_idx == 0:
            self._prints.add(batch)
        self._modes.batch_start(dataloader_idx)

    def batch_end(self) -> None:
        self._modes.batch_end()

    def take(self) -> dict[str, Any]:
        """The validation's measured fields by name (None: not measured), and start over."""
        prints = self._prints.take() if self._printing else None
        return {"val_prints": prints, "val_training_calls": self._modes.take()}

    def close(self) -> None:
        """Leave nothing on the model (a validation batch that raised)."""
        self._modes.close()
