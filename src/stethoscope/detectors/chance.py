"""A classifier whose loss sits at chance level: it has learned nothing from its inputs."""

from __future__ import annotations

import math

import numpy as np

from stethoscope.detectors._stats import (
    MAD_TO_SIGMA,
    is_finite,
    median,
    restarts_clock,
    robust_sigma,
    tally,
)
from stethoscope.detectors.base import (
    Detector,
    Losses,
    Rates,
    Steps,
    check_fraction,
    check_positive,
)
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["LossAtChance"]


class LossAtChance(Detector):
    """The training loss sits at chance level: the cross-entropy of predicting each
    class at its frequency among the labels (``ln K`` for ``K`` balanced classes).

    A model at that loss uses nothing of its inputs: the labels carry no signal about
    them (shuffled apart from the inputs, a broken pipeline) or the inputs never reach
    the model. ``loss_not_decreasing`` measures progress from the initial loss, and a
    classifier that starts above chance (a confident initialisation) and falls to it
    has made "progress" that is no learning at all.

    Rule: integer labels are counted at the start, every ``stride`` steps (where
    ``class_imbalance`` reads them), until at least ``samples`` and ``20 x K`` were seen
    (K: the largest label + 1); then they are no longer read. Their entropy ``H`` (in
    nats, corrected for the sample's size) is chance. A run whose labels are not integer
    classes, or that has not shown enough of them in its first ``MAX_READS`` label
    batches (a language model's vocabulary), is left alone. Every loss of the last
    ``patience`` steps is kept; once they span that long, every ``stride`` steps, their
    median within ``tolerance`` of ``H``, or within two standard errors of either
    estimate (the median's from the batch noise, the entropy's from the labels counted),
    is a warning, once. A doubled learning rate starts the span again (a warm-up from 0 gets
    its patience at a real learning rate).

    Sources: Karpathy's "A Recipe for Training Neural Networks" (2019) makes checking
    the loss at initialisation against -log(1/n_classes) one of the first steps: that is
    where a softmax classifier starts, and a run that stays there has not left its
    start. No tool we know of reports it: SageMaker Debugger's ``loss_not_decreasing``,
    like ours, compares the loss with its own earlier values.

    Args:
        tolerance: How close to chance, as a fraction of it, the loss must sit.
        patience: Steps whose losses' median is compared with chance.
        samples: Labels to count before chance is known.
    """

    name = "loss_at_chance"
    needs = frozenset({"loss"})
    wants = frozenset({"labels"})
    base_interval = 1  # every loss: the median of 300 is four times surer than of 20
    #: Steps between two judgements (and between two label reads while counting).
    stride = 16
    #: Label batches asked for at most while counting: a vocabulary of tens of thousands
    #: of tokens is never counted 20 times over, and a run whose batches hold no labels
    #: never shows any; neither is asked for ever.
    MAX_READS = 64
    assumes_falling_loss = True
    advice = "check that labels match inputs; check the data pipeline"

    def __init__(
        self,
        *,
        tolerance: float = 0.02,
        patience: int = 300,
        samples: int = 500,
    ) -> None:
        check_fraction(self.name, "tolerance", tolerance)
        check_positive(self.name, "patience", patience, integer=True)
        check_positive(self.name, "samples", samples, integer=True)
        self.tolerance, self.patience, self.samples = float(tolerance), patience, samples
        super().__init__()

    def _initial_state(self) -> dict:
        # counts: the labels seen (reads: in how many batches); chance and its standard
        # error once known; steps and losses: every finite loss of the span, in order
        return {
            "counts": [],
            "reads": 0,
            "chance": None,
            "chance_se": 0.0,
            "steps": [],
            "losses": [],
            "clock_lr": None,
            "fired": False,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "recent" in state and "steps" not in state:  # a checkpoint of [step, loss] pairs
            self.state["steps"] = [int(step) for step, _ in state["recent"]]
            self.state["losses"] = [float(loss) for _, loss in state["recent"]]

    def finished(self, step: int) -> bool:
        st = self.state
        return st["fired"] or (st["chance"] is None and st["reads"] >= self.MAX_READS)

    def wanting(self, step: int) -> frozenset[str]:
        counting = self.state["chance"] is None and step % self.stride == 0
        return self.wants if counting else frozenset()

    def waits_below(self, steps: int) -> float | None:
        return math.inf  # a warning after hundreds of steps, and no suspicion: it can wait

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        st = self.state
        for i in range(start, len(losses)):
            step = steps[i]
            if step % self.stride == 0:
                return i  # a label read or a judgement
            if restarts_clock(lrs[i], st["clock_lr"]):
                return i  # the span starts again there
            self._keep(step, losses[i])
        return len(losses)

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"]:
            return []
        loss = obs.loss
        if obs.labels is None and is_finite(loss) and self.quiet(obs.step, loss, obs.lr):
            return []
        if st["chance"] is None:
            if obs.step % self.stride == 0:  # asked for: a run whose batches hold no labels
                st["reads"] += 1  # gives up too
            if obs.labels is not None:  # counted whenever read (every step while hot)
                self._count(obs.labels)
        steps, losses = st["steps"], st["losses"]
        lr = obs.lr
        if restarts_clock(lr, st["clock_lr"]):
            st["clock_lr"] = float(lr)
            steps.clear()  # a warm-up: the span starts again
            losses.clear()
        if not is_finite(obs.loss):
            return []
        self._keep(obs.step, obs.loss)
        if obs.step % self.stride:
            return []
        chance = st["chance"]
        if chance is None or obs.step - steps[0] < self.patience or len(losses) < 5:
            return []
        # the standard error of a median is sqrt(pi / 2n) sigma
        scale = (math.pi / (2 * len(losses))) ** 0.5
        # the noise below is at most what the losses' range allows (two losses differ by
        # no more than the range, two such differences by no more than twice it): a level
        # further from chance than that is not at it, whatever the MAD of the differences
        low, high = min(losses), max(losses)
        widest = MAD_TO_SIGMA * 2 * (high - low) / math.sqrt(2)
        bar = max(self.tolerance * chance, 2 * math.hypot(widest * scale, st["chance_se"]))
        # the median lies between the extremes: a span wholly that far off needs no sorting
        if low - chance > bar or chance - high > bar:
            return []
        level = median(losses)
        gap = abs(level - chance)
        if gap > bar:
            return []
        # the batch noise comes from successive differences, which a falling loss does
        # not widen
        spread = robust_sigma(np.diff(losses).tolist()) / math.sqrt(2)
        noise = 2 * math.hypot(spread * scale, st["chance_se"])
        if gap > max(self.tolerance * chance, noise):
            return []
        st["fired"] = True
        k = len(st["counts"])
        return [
            self.finding(
                obs,
                "warning",
                f"The training loss has sat at chance level for the {self.patience} steps to "
                f"{obs.step}: median {level:.4g} against {chance:.4g}, the loss of "
                f"predicting each of the {k} classes at its frequency (ln {k} = "
                f"{math.log(k):.4g} if balanced): the model has learned nothing from its "
                "inputs so far; check that the labels still match the inputs (shuffled "
                "apart, a broken pipeline), that the inputs reach the model, then the "
                "learning rate.",
                value=level,
                threshold=chance,
                where="loss",
            )
        ]

    def _keep(self, step: int, loss: float) -> None:
        """Add a finite loss to the span; the oldest kept is the last one at least
        ``patience`` steps back."""
        steps, losses = self.state["steps"], self.state["losses"]
        steps.append(step)
        losses.append(float(loss))
        old = 0
        while len(steps) - old > 1 and steps[old + 1] <= step - self.patience:
            old += 1
        if old:
            del steps[:old], losses[:old]

    def _count(self, labels: object) -> None:
        """Add a batch's labels to the counts; once enough were, chance is known."""
        labels = np.asarray(labels)
        st = self.state
        if labels.size == 0:
            return
        if not np.issubdtype(labels.dtype, np.integer):
            st["reads"] = self.MAX_READS  # a regression's targets: no classes to count
            return
        total = tally(st["counts"], labels)
        st["counts"] = total.tolist()
        seen = float(total.sum())
        if len(total) < 2 or seen < max(self.samples, 20 * len(total)):
            return
        p = total[total > 0] / seen
        surprise = -np.log(p)
        entropy = float((p * surprise).sum())
        # the plug-in entropy of a sample falls short by about (K - 1) / 2N (Miller-Madow);
        # its standard error is that of the mean surprise over N labels
        st["chance"] = entropy + (len(p) - 1) / (2 * seen)
        st["chance_se"] = float(np.sqrt(max((p * surprise**2).sum() - entropy**2, 0.0) / seen))
