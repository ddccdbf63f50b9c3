"""The validation loss against the training loss: a model that memorises."""

from __future__ import annotations

from stethoscope.detectors._stats import is_finite, push
from stethoscope.detectors.base import Detector, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["Overfitting"]


class Overfitting(Detector):
    """Validation loss rising while the training loss keeps falling.

    Rule: at each validation (never the sanity check), the validation loss is
    compared with the best (lowest) one so far. It is a warning when it has been
    more than ``min_rise`` above the best on ``patience`` validations in a row, or
    when it has risen on ``trend`` validations in a row by more than
    ``trend_rise`` of the best in all (a steady climb is no noise: on a plateau
    with 2% noise, 7 values in rising order are 1 in 5040), while the mean
    training loss since the previous validation is below the one at the best
    validation (training still improves: the model memorises).

    A rise above the best must also pass the largest one its noise made in the last
    ``NOISE_WINDOW`` validations: a rise above the best of its time that a new best then
    undid (relative to that best). A model that overfits does not come back down; a
    noisy validation loss does, and shows how far it swings. A small ResNet at SGD lr
    0.1 on digits, validated each epoch, went 0.14, 0.48, 0.12, 0.075, 0.10 while it
    learnt: its rise of 33% over its best is far less than the 240% it rose and undid.
    The steady climb needs no such bar: noise does not rise on every validation.

    Either rise must also pass ``floor`` of the scale of the task: the largest of the
    run's first training loss (where it started: ln K for a classifier at chance), the
    first validation loss and the mean training loss before it. A model that went from
    1.4 to 0.001 and then wobbles up by 0.0006 (a real run of the project's new-user
    trial) rose 60% against its own best, and by 0.04% of what it had to learn: not
    worth a warning, whatever early stopping would make of it.

    Sources: SageMaker Debugger ``overfit`` compares validation with training
    loss ((val - train) / train > 0.1, patience 1), which fires on any healthy
    model with a generalisation gap; the rise of validation against its own best
    (its ``overtraining`` rule) is what early stopping acts on.

    Args:
        min_rise: Relative rise above the best validation loss that counts.
        patience: Validations in a row above it that raise a warning.
        trend: Validations in a row, each above the one before, that make a climb.
        trend_rise: Relative rise over such a climb that raises a warning.
        floor: The least rise that counts, as a fraction of the scale of the task.
    """

    name = "overfitting"
    needs = frozenset({"val"})
    base_interval = 1
    advice = "early stopping, regularisation or more data"
    #: The last validations whose undone rises show the validation loss's noise.
    NOISE_WINDOW = 12

    def __init__(
        self,
        *,
        min_rise: float = 0.1,
        patience: int = 2,
        trend: int = 6,
        trend_rise: float = 0.05,
        floor: float = 0.01,
    ) -> None:
        check_positive(self.name, "min_rise", min_rise)
        check_positive(self.name, "floor", floor)
        self.floor = float(floor)
        check_positive(self.name, "patience", patience, integer=True)
        check_positive(self.name, "trend", trend, integer=True)
        check_positive(self.name, "trend_rise", trend_rise)
        self.min_rise, self.patience = float(min_rise), patience
        self.trend, self.trend_rise = trend, float(trend_rise)
        super().__init__()

    def _initial_state(self) -> dict:
        # best: [val loss, train loss, epoch, validation index]; n: validations seen;
        # climb: the validation losses since the last one that did not rise (oldest first)
        # first: the scale of the task (see the class docstring); peak: the highest
        # validation loss since the best; undone: [validation index, rise over the best
        # of its time, relative to it] of each rise a new best undid, the last ones
        return {
            "best": None,
            "n": 0,
            "streak": 0,
            "fired": False,
            "climb": [],
            "first": None,
            "peak": None,
            "undone": [],
        }

    def _new_best(self, val: float) -> None:
        """A new best: the rise since the last one (if any) was noise, now undone."""
        st = self.state
        best, peak = st["best"], st.get("peak")
        undone = st.setdefault("undone", [])
        if best is not None and peak is not None and peak > best[0] and best[0] != 0:
            undone.append([st["n"], (peak - best[0]) / abs(best[0])])
        st["undone"] = [u for u in undone if u[0] > st["n"] - self.NOISE_WINDOW]
        st["peak"] = None

    def _noise(self) -> float:
        """The largest rise over its best that the validation loss undid in the last
        ``NOISE_WINDOW`` validations, relative to that best (0: none)."""
        st = self.state
        recent = [r for n, r in st.get("undone", []) if n > st["n"] - self.NOISE_WINDOW]
        return max(recent, default=0.0)

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        val, train = obs.val_loss, obs.train_loss
        if not is_finite(val):
            return []
        st["n"] += 1
        if st.get("first") is None:
            st["first"] = max(
                abs(float(x)) for x in (val, train, obs.start_loss, 0.0) if is_finite(x)
            )
        least = self.floor * st["first"]  # a rise below it is not worth a word
        climb = st["climb"]
        if climb and val <= climb[-1]:
            climb.clear()
        push(climb, float(val), self.trend + 1)
        best = st["best"]
        if best is None or val < best[0]:
            self._new_best(val)
            st["best"], st["streak"], st["fired"] = [val, train, obs.epoch, st["n"]], 0, False
            return []
        st["peak"] = max(val, st.get("peak") or val)
        scale = abs(best[0])  # also right for a negative loss (NLL)
        bar = best[0] + max(self.min_rise * scale, least, self._noise() * scale)
        rose = val > bar if bar != 0 else val > 0
        climbed = len(climb) > self.trend and val - climb[0] > max(self.trend_rise * scale, least)
        train_falls = is_finite(train) and is_finite(best[1]) and train < best[1]
        if not ((rose or climbed) and train_falls):
            st["streak"] = 0
            return []
        st["streak"] = st["streak"] + 1 if rose else 0
        self.suspect = f"validation loss {val:.3g} above its best {best[0]:.3g}"
        if (st["streak"] < self.patience and not climbed) or st["fired"]:
            return []
        how = ""
        if st["streak"] < self.patience:  # the climb, not the level, says it
            bar = climb[0] + max(self.trend_rise * scale, least)
            how = f", rising on each of the last {self.trend} validations,"
        st["fired"] = True
        ago = obs.epoch - best[2]
        when = (
            f"{ago} epoch(s) ago, at epoch {best[2]}"
            if ago > 0
            else f"{st['n'] - best[3]} validation(s) ago"
        )
        return [
            self.finding(
                obs,
                "warning",
                f"The model is overfitting: validation loss rose to {val:.3g} from its best "
                f"{best[0]:.3g} ({when}){how} while the training loss fell from {best[1]:.3g} to "
                f"{train:.3g}; keep the checkpoint of the best epoch and stop early, or add "
                "regularisation (weight decay, dropout, augmentation) or more data.",
                value=val,
                threshold=bar,
                where="validation",
            )
        ]
