"""What a validation measures besides its loss, in a single process: its first samples'
prints, the calls of its first batch that behaved as in training, and what that batch
divided its spectrally normalized weights by, and how far the batch norms' running
statistics are from the batches training normalised by. Each is measured with the event (a
validation), never planned per step; the ranks of a distributed run pool their losses
alone (``val``, declared with the per-step statistics).
"""

from __future__ import annotations

from stethoscope.statistics.declaration import ARRAY, AcrossReplicas, Cadence, Field, Statistic

__all__ = ["VALIDATION_STATISTICS"]

VALIDATION_STATISTICS: tuple[Statistic, ...] = (
    Statistic(
        "val_prints",
        "A fingerprint of each sample of a validation's first batches.",
        (
            Field(
                "val_prints",
                ARRAY,
                "The prints (as ``sample_prints``) of the samples of a validation's "
                "first batches, up to ``MAX_VAL_PRINTS`` (set only on a validation).",
            ),
        ),
        cadence=Cadence.EVENT,
        across_replicas=AcrossReplicas.NONE,
    ),
    Statistic(
        "val_modes",
        "The calls that behaved as in training during a validation's first batch.",
        (
            Field(
                "val_training_calls",
                "tuple[str, ...] | None",
                "Each call that dropped elements or used (and updated) a batch's "
                "statistics during the first batch of the run's first validation, "
                'with the module that made it: ``"F.dropout(training=True) in '
                'net.3"`` (empty: none; set only on that validation).',
            ),
        ),
        cadence=Cadence.EVENT,
        across_replicas=AcrossReplicas.NONE,
    ),
    Statistic(
        "val_spectral",
        "What the spectrally normalized weights of a validation's first batch were "
        "divided by, beside their largest singular values.",
        (
            Field(
                "val_spectral",
                "tuple[tuple[str, float, float, float], ...] | None",
                "For each spectrally normalized weight the first batch of the run's "
                "first validation (the sanity check included) used: its name, the "
                "sigma its stored ``u``, ``v`` give (``u @ W @ v``), the weight's "
                "largest singular value, and the cosine between ``u`` and ``W @ v`` "
                "(1 where power iteration left them; empty: none used).",
            ),
            Field(
                "val_spectral_when",
                "str",
                'Which validation that was: ``"sanity check"`` (Lightning\'s, before '
                'training, whose numbers it discards), ``"validate"`` (a '
                '``trainer.validate()`` before the fit) or ``"validation"``.',
                default="",
            ),
        ),
        cadence=Cadence.EVENT,
        across_replicas=AcrossReplicas.NONE,
    ),
    Statistic(
        "val_norms",
        "How far the batch norms' running statistics, which a validation normalises by, "
        "are from the batches' own, which training normalises by.",
        (
            Field(
                "val_running_statistics",
                "StatisticsLag | None",
                "The batch norm whose running statistics put the largest error into its "
                "normalised outputs at a validation, read from its buffers at the fit's "
                "start and now (see ``stethoscope.running_statistics``); None: the model "
                "has none that moves, or nothing has moved them yet.",
            ),
        ),
        cadence=Cadence.EVENT,
        across_replicas=AcrossReplicas.NONE,
    ),
)
