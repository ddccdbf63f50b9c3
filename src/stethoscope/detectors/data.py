"""The data a model is fed: imbalanced labels, unnormalised inputs, unshuffled batches."""

from __future__ import annotations

import numpy as np

from stethoscope.advice import TrainingSetup
from stethoscope.detectors._stats import tally
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["ClassImbalance", "UnnormalizedInput", "UnshuffledData"]


def _language_model(setup: TrainingSetup) -> str:
    """Why a rule about a classifier's classes cannot judge a language model's labels, in
    a few words (see ``TrainingSetup.vocabulary``); empty: the model is none."""
    if not setup.vocabulary:
        return ""
    return (
        f"the model embeds and predicts the same {setup.vocabulary} tokens, as a language "
        "model does: its labels are the next tokens of a text, Zipfian and in the text's "
        "order by nature, not classes to balance or shuffle"
    )


class ClassImbalance(Detector):
    """One class far more frequent than another among the labels of the first batches.

    Rule: integer class labels are counted over the sampled batches until at
    least ``samples`` labels and ``20 x K`` labels (K: the number of classes seen,
    taken as the largest label + 1) were seen; then, once, the count of the
    most frequent class over that of the rarest (a class in 0..K-1 that never
    appears counts as 0) is compared with ``ratio``. Above it is a warning.

    A language model's labels are tokens, not classes (see
    ``TrainingSetup.vocabulary``): word frequencies are Zipfian, and weighting its loss
    by token would be wrong, so it does not judge one, and the monitor says so once.

    Sources: SageMaker Debugger ``class_imbalance`` (ratio 10 after 500
    samples); the 20-per-class floor keeps the ratio of a balanced dataset with
    many classes from being sampling noise.

    Args:
        ratio: Largest over smallest class count above which labels are imbalanced.
        samples: Labels to count before judging.
    """

    name = "class_imbalance"
    needs = frozenset({"labels"})
    base_interval = 16
    advice = "class weights or a balanced sampler; shuffle"

    def __init__(self, *, ratio: float = 10.0, samples: int = 500) -> None:
        check_positive(self.name, "ratio", ratio)
        if ratio <= 1:
            raise ValueError(f"{self.name}: ratio={ratio!r} must be > 1")
        check_positive(self.name, "samples", samples, integer=True)
        self.ratio, self.samples = float(ratio), samples
        super().__init__()

    def _initial_state(self) -> dict:
        return {"counts": [], "judged": False}

    def applies(self) -> bool:
        return not self.setup.vocabulary

    def not_applying_because(self) -> str:
        return _language_model(self.setup)

    def finished(self, step: int) -> bool:
        return self.state["judged"] or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        labels = np.asarray(obs.labels)
        if st["judged"] or labels.size == 0:
            return []
        total = tally(st["counts"], labels)
        st["counts"] = total.tolist()
        seen = int(total.sum())
        if seen < max(self.samples, 20 * len(total)) or len(total) < 2:
            return []
        st["judged"] = True
        big, small = int(np.argmax(total)), int(np.argmin(total))
        r = total[big] / total[small] if total[small] else float("inf")
        if r <= self.ratio:
            return []
        rare = (
            f"class {small} never appears"
            if total[small] == 0
            else f"class {small} has {total[small]}"
        )
        return [
            self.finding(
                obs,
                "warning",
                f"Labels are imbalanced: class {big} has {total[big]} of the first {seen} "
                f"labels and {rare} (ratio {r:.3g} > {self.ratio:g}); the model can score "
                "well by predicting the majority: weight the loss by class (e.g. "
                "CrossEntropyLoss(weight=...)), use a balanced sampler, or check that the "
                "data is shuffled and the labels are right.",
                value=float(r),
                threshold=self.ratio,
                where="labels",
            )
        ]


class UnnormalizedInput(Detector):
    """Input features on a scale far from standardised (pixels in 0..255, raw units).

    Rule: the per-feature root mean square ``sqrt(mean(x^2))`` (channels for
    images) is accumulated over the sampled batches until ``samples`` samples
    were seen; then, once, it is a warning when the typical feature's RMS is above
    ``scale``, when any feature's RMS is above ``10 x scale``, or when every
    feature's RMS is below ``1 / (100 x scale)``. The typical feature is the 90th
    percentile of the features' RMS, and the median where there are fewer than
    ``TYPICAL_FEATURES`` features: below ten, one feature is more than a tenth of
    them, so the 90th percentile lies between the two largest and reads the largest
    feature alone (of x, x^2, x^3, x^4 of a normal x, RMS 1, 1.7, 3.9 and 10: 8.3),
    which the ``10 x scale`` bar judges. The RMS of a standardised feature is
    exactly 1 however heavy its tails, so values beyond ±1 (which standardised data
    has all the time) never count; images in 0..1 have an RMS of ~0.5.

    Sources: UMLAUT flags inputs outside [-1, 1] and so warns on standardised
    data; SageMaker Debugger ``check_input_images`` flags |mean| > 0.2 after 500
    samples, which fires on every image set scaled to 0..1.

    Args:
        scale: Largest healthy RMS of the typical (90th percentile, or median) feature.
        samples: Samples to see before judging.
    """

    name = "unnormalized_input"
    needs = frozenset({"inputs"})
    base_interval = 16
    advice = "standardise inputs (mean 0, std 1)"
    #: Features from which the typical one is the 90th percentile (fewer: the median).
    TYPICAL_FEATURES = 10

    def __init__(self, *, scale: float = 5.0, samples: int = 256) -> None:
        check_positive(self.name, "scale", scale)
        check_positive(self.name, "samples", samples, integer=True)
        self.scale, self.samples = float(scale), samples
        super().__init__()

    def _initial_state(self) -> dict:
        # sums over samples of each feature's x^2, and the sample count
        return {"sq": [], "count": 0, "judged": False}

    def finished(self, step: int) -> bool:
        return self.state["judged"]

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        n = int(obs.input_count)
        sq = np.asarray(obs.input_sq, np.float64)
        if st["judged"] or n <= 0 or sq.size == 0 or not np.all(np.isfinite(sq)):
            return []  # non-finite inputs: nonfinite_loss names the batch
        if len(st["sq"]) != sq.size:
            st["sq"], st["count"] = [0.0] * sq.size, 0  # a different input: start over
        st["sq"] = (np.asarray(st["sq"]) + sq * n).tolist()
        st["count"] += n
        if st["count"] < self.samples:
            return []
        st["judged"] = True
        rms = np.sqrt(np.asarray(st["sq"]) / st["count"])
        few = rms.size < self.TYPICAL_FEATURES
        typical, top = float(np.percentile(rms, 50 if few else 90)), int(np.argmax(rms))
        if typical > self.scale or rms[top] > 10 * self.scale:
            if rms.size == 1:
                detail = f"the input has an RMS of {rms[top]:.3g}"
            elif typical > self.scale:
                detail = (
                    f"the typical ({'median' if few else '90th percentile'}) input feature "
                    f"has an RMS of {typical:.3g} (the largest: feature {top}, {rms[top]:.3g})"
                )
            else:
                detail = f"input feature {top} has an RMS of {rms[top]:.3g}"
            value, threshold = (
                (typical, self.scale)
                if typical > self.scale
                else (float(rms[top]), 10 * self.scale)
            )
            return [
                self.finding(
                    obs,
                    "warning",
                    f"Inputs are not normalised: over the first {st['count']} samples {detail} "
                    f"(a standardised feature has 1; limit {threshold:g}), so the first layer's "
                    "weights get gradients on that scale, and features of unlike scales make "
                    "the problem ill-conditioned (one learning rate too large along the large "
                    "features, too small along the rest, in a linear model as in a deep one, "
                    "where a tanh or sigmoid fed by that layer saturates too); standardise each "
                    "feature (subtract the mean, divide by the std) or scale images to 0..1 "
                    "and normalise.",
                    value=value,
                    threshold=threshold,
                    where="input" if rms.size == 1 else f"input[{top}]",
                )
            ]
        if rms[top] < 1 / (100 * self.scale):
            return [
                self.finding(
                    obs,
                    "warning",
                    f"Inputs are vanishingly small: over the first {st['count']} samples "
                    + (
                        f"the input has an RMS of only {rms[top]:.3g}"
                        if rms.size == 1
                        else f"no input feature has an RMS above {rms[top]:.3g}"
                    )
                    + " (a standardised feature has 1); "
                    "check for double scaling (e.g. dividing by 255 twice) and standardise.",
                    value=float(rms[top]),
                    threshold=1 / (100 * self.scale),
                    where="input",
                )
            ]
        return []


def entropy(counts: np.ndarray) -> np.ndarray:
    """The entropy, in nats, of the distribution each row of ``counts`` (per class) was
    drawn from, as the plug-in estimate gives it (a 1-D ``counts``: one, as a 0-d
    array)."""
    p = counts / counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)


class UnshuffledData(Detector):
    """The batches' labels run in blocks: the training data is not shuffled (or is
    sorted by label), so each batch holds a few classes where it should hold most.

    Rule: each sampled batch of at least ``min_batch`` integer class labels gives its
    label entropy; all of them pooled give the distribution a shuffled batch is drawn
    from. Every ``batches`` batches, once two classes have 20 labels each (sorted data
    shows one class for long), those batches' mean entropy is compared with that of
    ``WINDOWS`` windows of as many batches of the same sizes drawn at random from the
    pooled labels (simulated, with a fixed seed): below ``fraction`` of their mean and
    below all but 1% of them, on two windows in a row, is a warning, once (a run judges
    many windows, and skewed labels make a shuffled window's entropy vary). Skewed labels
    lower both alike, so they are no sign; a run whose labels are not classes (more than
    ``MAX_CLASSES`` of them: token ids) is left alone, and so is a language model (see
    ``TrainingSetup.vocabulary``), whose batches follow its text on purpose (a recurrent
    one carries its state from one batch to the next), which the monitor says once.

    Sources: the silent-bug reports this family answers (the same shuffle every epoch,
    a sampler that keeps the dataset's order); a model trained on label-sorted batches
    chases each class in turn and ends far worse than the loss suggests.

    Args:
        fraction: The share of a shuffled batch's entropy below which batches are blocks.
        batches: Sampled batches judged together.
        min_batch: Labels a batch must hold to count.
    """

    name = "unshuffled_data"
    needs = frozenset({"labels"})
    base_interval = 16
    advice = "shuffle the training data"
    blind_to = "no integer class labels could be read from the batches"
    #: More classes than this are a vocabulary, not classes: not judged.
    MAX_CLASSES = 1000
    #: Windows of shuffled batches simulated per judgement.
    WINDOWS = 256

    def __init__(self, *, fraction: float = 0.5, batches: int = 8, min_batch: int = 8) -> None:
        check_fraction(self.name, "fraction", fraction)
        check_positive(self.name, "batches", batches, integer=True)
        check_positive(self.name, "min_batch", min_batch, integer=True)
        self.fraction, self.batches, self.min_batch = float(fraction), batches, min_batch
        super().__init__()

    def _initial_state(self) -> dict:
        # counts: every counted label by class; seen: [labels, entropy] of each batch
        # since the last judgement; judged: it has warned
        return {"counts": [], "seen": [], "judged": False, "blocky": 0}

    def applies(self) -> bool:
        return not self.setup.vocabulary

    def not_applying_because(self) -> str:
        return _language_model(self.setup)

    def finished(self, step: int) -> bool:
        return self.state["judged"] or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        labels = np.asarray(obs.labels)
        if st["judged"] or labels.size < self.min_batch:
            return []
        batch = tally([], labels)
        if len(batch) > self.MAX_CLASSES:
            st["judged"] = True  # token ids, not classes
            return []
        st["counts"] = tally(st["counts"], labels).tolist()
        st["seen"].append([int(batch.sum()), float(entropy(batch))])
        total = np.asarray(st["counts"])
        # two classes with 20 labels each at least: sorted data shows one class for long,
        # and the labels pooled from its first batches are no dataset's distribution
        if len(st["seen"]) < self.batches or (total >= 20).sum() < 2:
            return []
        seen, st["seen"] = st["seen"], []  # the next batches are judged afresh
        level = float(np.mean([h for _, h in seen]))
        shuffled, rare = self._shuffled([n for n, _ in seen], total)
        blocky = level < self.fraction * shuffled and level < rare
        st["blocky"] = st["blocky"] + 1 if blocky else 0
        if st["blocky"] < 2:
            return []
        st["judged"] = True  # it has said it: once is enough
        classes = int((total > 0).sum())
        return [
            self.finding(
                obs,
                "warning",
                f"The training batches' labels run in blocks: their label entropy is "
                f"{level:.3g} nats on average over the last {len(seen)} batches (and as low "
                f"over the {len(seen)} before), where "
                f"shuffled batches of the same sizes would have {shuffled:.3g} "
                f"({classes} classes in all): the data is not shuffled, or sorted by "
                "label, so the model chases one class after another; shuffle it "
                "(DataLoader(shuffle=True), tf.data's shuffle() before batch(), or "
                "shuffle=True in fit).",
                value=level,
                threshold=self.fraction * shuffled,
                where="labels",
            )
        ]

    def _shuffled(self, sizes: list[int], counts: np.ndarray) -> tuple[float, float]:
        """The mean label entropy of windows of batches of ``sizes`` drawn at random from
        ``counts`` (``WINDOWS`` of them, vectorised per batch size), and the entropy
        all but 1% of those windows reach."""
        rng = np.random.default_rng(0)
        p = counts / counts.sum()
        means = np.zeros(self.WINDOWS)
        for n in sizes:
            means += entropy(rng.multinomial(n, p, size=self.WINDOWS))
        means /= len(sizes)
        return float(means.mean()), float(np.quantile(means, 0.01))
