"""What ``recover=`` asks for (:class:`Recovery`), which findings the recovery ladder
answers instead of the policy, and why a step is not applied (the codes a verdict
carries)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DAMAGE",
    "FORCED_SKIP",
    "GRADIENT_PAST_BAR",
    "LOSS_PAST_BAR",
    "NONFINITE_GRADIENT",
    "NONFINITE_LOSS",
    "REASONS",
    "RECOVERABLE",
    "Recovery",
    "parse_recover",
    "skip_reason",
]

#: Detectors whose errors the ladder answers (by a skip already made, or a roll back)
#: instead of stopping: what a bad batch or a learning-rate excursion produces. Any other
#: error stops as ``stop_on`` says.
RECOVERABLE = frozenset(
    {
        "nonfinite_loss",
        "nonfinite_gradients",
        "nonfinite_weights",
        "exploding_gradients",
        "loss_spike",
        "unstable_loss",
        "large_updates",
    }
)

#: Detectors whose warning already says the weights went wrong, not only a step: a
#: loss that has climbed back up and stayed there for a stretch, updates as large as
#: the weights for several samples. No skip can undo that; a roll back can. (A language
#: model starts at ln V, so ``unstable_loss``'s error, twice the initial loss, may
#: never come: its warning is the signal.)
DAMAGE = frozenset({"unstable_loss", "large_updates"})

#: Why a step is not applied, as the code a verdict carries (0: apply). The larger,
#: the worse: ranks that disagree take the largest. A forced skip (a batch skipped
#: before, one of ``skip_ahead``'s) is the host's decision, the same on every rank.
LOSS_PAST_BAR, GRADIENT_PAST_BAR, NONFINITE_GRADIENT, NONFINITE_LOSS = 1, 2, 3, 4
FORCED_SKIP = 5
#: Each code in words.
REASONS = {
    LOSS_PAST_BAR: "the loss is past the loss_spike bar",
    GRADIENT_PAST_BAR: "the gradient norm is past the exploding_gradients bar",
    NONFINITE_GRADIENT: "a gradient is non-finite",
    NONFINITE_LOSS: "the loss is non-finite",
    FORCED_SKIP: "the batch is skipped whatever it holds",
}
#: Each code with the values that made it.
_WHAT = {
    LOSS_PAST_BAR: "the loss {loss:.4g} was past the loss_spike bar {loss_bar:.4g}",
    GRADIENT_PAST_BAR: "the gradient norm {norm:.3g} was past the exploding_gradients bar "
    "{grad_bar:.3g}",
    NONFINITE_GRADIENT: "a gradient was non-finite",
    NONFINITE_LOSS: "the loss was {loss}",
    FORCED_SKIP: "the batch was skipped whatever it held",
}


def skip_reason(code: int, *, loss: float, norm: float, loss_bar: float, grad_bar: float) -> str:
    """Why a step whose verdict was ``code`` was skipped, with the values that made it."""
    return _WHAT[code].format(loss=loss, norm=norm, loss_bar=loss_bar, grad_bar=grad_bar)


_SNAPSHOT_PLACES = ("auto", "memory", "disk")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Recovery: {name}={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What ``recover=`` does: the rungs of the ladder and when each is climbed.

    Args:
        cool_after: Skipped steps within ``window`` steps that start a cool-down.
        window: Steps over which skips are counted.
        cool_factor: The learning rate is multiplied by this during a cool-down.
        cool_steps: Steps a cool-down lasts (the user's schedule goes on underneath).
        rollback_after: Skipped steps during a cool-down that roll back.
        max_rollbacks: Roll backs in a run; the next one needed stops training.
        snapshot_every: Steps between snapshots, taken only when the run was healthy
            (no warning on an applied step in those steps). One is taken at the start.
        keep_snapshots: Snapshots kept at most (the oldest go first).
        trust_after: A roll back goes to a snapshot only if the trouble it answers began
            at least this many steps after it (None: a fifth of ``snapshot_every``): the
            update that did the damage may be in a snapshot taken just before its harm
            showed. The snapshot taken when training starts is always trusted.
        snapshot_in: ``"memory"`` (host memory), ``"disk"`` (``snapshot_dir``, or a
            temporary directory), or ``"auto"``: memory for state under
            ``memory_limit_bytes``, else disk.
        snapshot_dir: Where ``"disk"`` snapshots go.
        memory_limit_bytes: The ``"auto"`` bound on a snapshot kept in memory.
        skip_ahead: Batches skipped after each roll back (PaLM skipped 200 to 500): the
            data right after the trouble may be what caused it. They are kept with the
            other skipped batches.
        replay: Compute a step judged bad once more, from the same state with the same
            batch, before skipping it: judged bad again, it is the batch (or the
            numerics), and it is skipped; fine, it was a transient fault of the machine,
            and the second computation is applied. Costs nothing on a step judged fine.

    Raises:
        ValueError: A bad value, named with the valid range.
    """

    cool_after: int = 3
    window: int = 100
    cool_factor: float = 0.1
    cool_steps: int = 200
    rollback_after: int = 3
    max_rollbacks: int = 3
    snapshot_every: int = 100
    keep_snapshots: int = 2
    trust_after: int | None = None
    snapshot_in: str = "auto"
    snapshot_dir: str | os.PathLike[str] | None = None
    memory_limit_bytes: int = 2 * 1024**3
    skip_ahead: int = 0
    replay: bool = False

    def __post_init__(self) -> None:
        for name in ("cool_after", "window", "cool_steps", "rollback_after", "snapshot_every"):
            _positive_int(name, getattr(self, name))
        _positive_int("keep_snapshots", self.keep_snapshots)
        _positive_int("max_rollbacks", self.max_rollbacks, minimum=0)
        _positive_int("skip_ahead", self.skip_ahead, minimum=0)
        if self.trust_after is None:
            object.__setattr__(self, "trust_after", self.snapshot_every // 5)
        _positive_int("trust_after", self.trust_after, minimum=0)
        _positive_int("memory_limit_bytes", self.memory_limit_bytes, minimum=0)
        if not isinstance(self.replay, bool):
            raise ValueError(f"Recovery: replay={self.replay!r} must be True or False")
        factor = self.cool_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(f"Recovery: cool_factor={factor!r} must be a number in (0, 1)")
        if self.snapshot_in not in _SNAPSHOT_PLACES:
            raise ValueError(
                f"Recovery: snapshot_in={self.snapshot_in!r} is not valid; use one of "
                f"{', '.join(map(repr, _SNAPSHOT_PLACES))}"
            )
        if self.snapshot_dir is not None:
            if not isinstance(self.snapshot_dir, (str, os.PathLike)):
                raise ValueError(f"Recovery: snapshot_dir={self.snapshot_dir!r} must be a path")
            object.__setattr__(self, "snapshot_dir", os.fspath(self.snapshot_dir))


def parse_recover(value: Any) -> Recovery | None:
    """``recover=``: ``False``/``None`` (off), ``True`` (the default ladder) or a
    :class:`Recovery`.

    Raises:
        ValueError: Anything else, named with the valid choices.
    """
    if value is None or value is False:
        return None
    if value is True:
        return Recovery()
    if isinstance(value, Recovery):
        return value
    if value is Recovery:
        raise ValueError("recover=Recovery is the class; use recover=Recovery() or True")
    raise ValueError(
        f"recover={value!r} is not valid; use False (off), True (the default ladder) or "
        "stethoscope.Recovery(...)"
    )
