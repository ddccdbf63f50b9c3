"""What the model hands its loss: whether its output is probabilities or logits, what
the loss expects, and what the loss would be for each way of taking the output (the
``predictions`` statistic, which ``logits_mismatch`` reads)."""

from __future__ import annotations

from stethoscope.statistics.declaration import AcrossReplicas, Field, Statistic

__all__ = ["PREDICTIONS"]

PREDICTIONS = Statistic(
    "predictions",
    "Whether the model's output, which the loss is fed, is rows of probabilities, "
    "what the loss expects, and what the loss would be for each way of taking it.",
    (
        Field(
            "output_probs",
            "float | None",
            "1.0 when every row of the model's output is probabilities (several "
            "columns: non-negative and summing to 1; one column: within [0, 1]), "
            "0.0 when not (logits).",
        ),
        Field(
            "output_width",
            "int",
            "The output's columns (its last axis: the classes).",
            default=0,
        ),
        Field(
            "loss_as_logits",
            "float | None",
            "Cross-entropy of the batch's class labels with the output taken as "
            "logits (``cross_entropy(output, labels)``).",
        ),
        Field(
            "loss_as_log_probs",
            "float | None",
            "The same with the output taken as log-probabilities (``nll_loss(output, labels)``).",
        ),
        Field(
            "loss_as_probs",
            "float | None",
            "The same with the output taken as probabilities (``nll_loss(log(output), labels)``).",
        ),
        Field(
            "loss_as_softmax",
            "float | None",
            "The same with the output's softmax taken as logits "
            "(``cross_entropy(softmax(output), labels)``: a softmax before a loss "
            "that applies its own).",
        ),
        Field(
            "uniform_as_logits",
            "float | None",
            "Cross-entropy of the uniform distribution with the output taken as "
            "logits: what label smoothing mixes into ``loss_as_logits``.",
        ),
        Field(
            "uniform_as_probs",
            "float | None",
            "The same with the output taken as probabilities (into ``loss_as_probs``).",
        ),
        Field(
            "uniform_as_softmax",
            "float | None",
            "The same with the output's softmax taken as logits (into ``loss_as_softmax``).",
        ),
        Field(
            "output_in_unit",
            "float | None",
            "With targets of the output's shape (a binary or multi-label output's): "
            "1.0 when every element of the output is within [0, 1] (a sigmoid's), "
            "0.0 when not.",
        ),
        Field(
            "bce_as_logits",
            "float | None",
            "Binary cross-entropy of those targets with the output taken as logits "
            "(``binary_cross_entropy_with_logits(output, targets)``).",
        ),
        Field(
            "bce_as_probs",
            "float | None",
            "The same with the output taken as probabilities "
            "(``binary_cross_entropy(output, targets)``).",
        ),
        Field(
            "bce_as_sigmoid",
            "float | None",
            "The same with the output's sigmoid taken as logits "
            "(``binary_cross_entropy_with_logits(sigmoid(output), targets)``: a "
            "sigmoid before a loss that applies its own).",
        ),
        Field(
            "loss_terms",
            "float | None",
            "How many terms the means above are taken over: the class labels kept, or "
            "a binary output's target elements. A loss summed over them "
            "(``reduction='sum'``) is that many times their mean.",
        ),
        Field(
            "loss_expects",
            "str",
            'What the loss is configured to take: ``"logits"``, ``"probabilities"`` '
            '(Keras\' cross-entropies, by ``from_logits``) or ``""`` (unknown: a '
            "loss computed in the training step).",
            default="",
        ),
    ),
    across_replicas=AcrossReplicas.SAME,
)
