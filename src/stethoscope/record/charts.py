"""The report's charts: their names, headings and legends, in the order the report
draws them (``report`` draws them; ``watch`` and the tests name them)."""

from __future__ import annotations

__all__ = ["CHARTS"]

#: The report's charts, in order: name (the figure's key and its PNG's name), heading,
#: and what it shows (the report's legend).
CHARTS: tuple[tuple[str, str, str], ...] = (
    (
        "loss",
        "Training loss",
        "The loss of every step (a line), validation losses (green diamonds), findings at "
        "the step they happened (orange triangles: warnings, red crosses: errors, grey "
        "circles: info), non-finite losses as red crosses along the top, and shaded "
        "where the sampler escalated (every detector ran every step).",
    ),
    (
        "gradient_flow",
        "Gradient flow",
        "The gradient norm of each parameter (input side at the top) over the sampled "
        "steps, coloured by log10; the bars give the latest sample on a log axis. A "
        "layer far darker or brighter than its neighbours is vanishing or exploding.",
    ),
    (
        "update_ratio",
        "Update ratio",
        "How far each step moves each parameter, relative to its size (‖Δw‖ / ‖w‖). "
        "About 1e-3 is healthy (the shaded band, 1e-4 … 1e-2); far below, the parameter "
        "barely learns; far above, the learning rate is too high for it.",
    ),
    (
        "distributions",
        "Weight and gradient distributions",
        "Quantiles of |weight| and |gradient| of one parameter over the sampled steps "
        "(choose it in the dropdown): the median, and bands holding the middle 50% and "
        "90% of the values; exact zeros sit at the bottom, non-finite values are red "
        "crosses at the top.",
    ),
    (
        "dead_saturated",
        "Dead and saturated units",
        "The fraction of each layer's units that got no gradient (dead ReLUs), and of "
        "each tanh/sigmoid's inputs in its flat tails (saturated), over time.",
    ),
    (
        "precision",
        "Precision",
        "For the parameters held in 16 bits: the share of each weight's elements that the "
        "optimizer step left as they were although their gradient was not zero (updates "
        "rounded away), and the share of each gradient that is subnormal (underflowing); "
        "and a loss scaler's scale and the share of the steps it skipped, over time.",
    ),
    (
        "fp8",
        "fp8 readiness",
        "How each parameter would fit fp8 with each tensor scaled to its largest "
        "magnitude: the share of its non-zero weights that would round to zero in e4m3, "
        "and of its gradient in e5m2 (the formats fp8 training holds them in). A layer "
        "far above 0% loses values in fp8: keep it in bfloat16.",
    ),
)
