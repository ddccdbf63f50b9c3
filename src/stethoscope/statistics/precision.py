"""The statistics of low-precision training: how gradients and updates fare in the dtype
they are held in, and the loss scaler's health (see :mod:`stethoscope.number_formats`).

They are measured only in a run that holds something in a 16-bit format (the detectors
that read them are finished at once in float32), on the steps the sampler selects.
"""

from __future__ import annotations

from stethoscope.statistics.declaration import ARRAY, AcrossRanks, Field, Statistic

__all__ = ["FP8_COLUMNS", "PRECISION_STATISTICS"]

#: The columns of ``fp8_underflow``: each tensor, each fp8 format.
FP8_COLUMNS = ("weight e4m3", "weight e5m2", "gradient e4m3", "gradient e5m2")

PRECISION_STATISTICS: tuple[Statistic, ...] = (
    Statistic(
        "precision",
        "How each parameter's gradient and update fare in the dtype they are held in.",
        (
            Field(
                "grad_subnormal",
                ARRAY,
                "Share of each gradient's elements that are subnormal in its dtype (below "
                "its smallest normal magnitude, not zero): they keep fewer significant bits, "
                "and smaller ones flush to zero.",
            ),
            Field("grad_zero", ARRAY, "Share of each gradient's elements that are exactly zero."),
            Field(
                "grad_peak",
                ARRAY,
                "Largest magnitude in each gradient, as held (a loss scale it carries "
                "divided out).",
            ),
            Field(
                "update_lost",
                ARRAY,
                "Of each parameter's elements whose gradient was not zero, the share the "
                "optimizer step left exactly as they were: their update rounded away in the "
                "weight's dtype (NaN for a parameter not measured this step).",
            ),
        ),
        across_ranks=AcrossRanks.REPLICATED,
        requires=frozenset({"updates"}),  # the update is measured against a snapshot
    ),
    Statistic(
        "loss_scale",
        "The loss scaler's scale, and the steps it skipped since it was last measured.",
        (
            Field(
                "loss_scale",
                "float | None",
                "The loss scale after this step (a GradScaler's, a LossScaleOptimizer's).",
            ),
            Field(
                "scale_skipped",
                "int",
                "Steps the scaler skipped (an overflow in the scaled gradients, the scale "
                "lowered) since the scale was last measured.",
                default=0,
            ),
            Field(
                "scale_steps",
                "int",
                "Steps since the scale was last measured (this one included).",
                default=0,
            ),
        ),
        across_ranks=AcrossRanks.REPLICATED,
    ),
    Statistic(
        "fp8",
        "How each parameter's weights and gradients would fit fp8 (e4m3, e5m2) under "
        "per-tensor scaling: a readiness report for a run not in fp8 yet.",
        (
            Field(
                "fp8_underflow",
                ARRAY,
                "Per parameter, of its non-zero elements, the share that would round to "
                "zero in fp8 with the tensor scaled so that its largest magnitude meets the "
                "format's largest value, shape ``(parameters, 4)``: the columns of "
                "``FP8_COLUMNS`` (the weights after the step; the gradients before it).",
            ),
            Field(
                "fp8_amax",
                ARRAY,
                "Per parameter, the largest magnitude of its weights and of its gradient, "
                "shape ``(parameters, 2)``: what a per-tensor scale is set from (delayed "
                "scaling takes it from earlier steps, and a tensor that outgrows it "
                "saturates).",
            ),
        ),
        across_ranks=AcrossRanks.REPLICATED,
    ),
)
