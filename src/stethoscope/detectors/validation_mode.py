"""A validation that still behaves as training: the mirror of ``eval_mode``."""

from __future__ import annotations

import math

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["ValidationMode"]

#: Calls and weights named in a finding at most (the rest are counted).
_SHOWN = 3
#: A stored spectral-norm estimate is wrong when the eval-mode weight it makes is at
#: least this many times too large or too small (or of the opposite sign) ...
_SIGMA_OFF = 2.0
#: ... and its ``u`` is this far from ``W @ v``, where power iteration leaves it (an
#: estimate still converging, as training uses it too, is not the validation's fault).
_ALIGNED = 0.5


class ValidationMode(Detector):
    """A validation that behaves as training: a dropout that still drops, or a batch
    norm that normalises by the batch and moves its running statistics, although the
    framework put the model in eval mode. The validation loss is then random and worse
    than the model's, and a batch norm's statistics drift with the validation data. Or
    the reverse: a spectral norm that training never iterated, divided by at random.

    Rule: during the first batch of the run's first validation, a call dropped elements
    (a functional or ATen dropout with its training flag set, an attention's
    ``dropout_p`` above 0, ``rrelu``) or used a batch's statistics where running ones
    exist (``batch_norm``, ``instance_norm``): a warning, once, naming each call and the
    module that made it. The framework's mode is a flag each module reads, so the call's
    own argument is what decides; a normalisation without running statistics
    (``track_running_stats=False``) always uses the batch's, and a model that samples
    on purpose (a VAE's ``randn_like``) drops nothing, so neither is counted.

    And during the first batch of the first validation, the sanity check included: a
    spectrally normalized weight whose stored estimate ``u @ W @ v`` is off its true
    largest singular value by 2x or more (or of the wrong sign), with ``u`` not where
    power iteration leaves it (its cosine to ``W @ v`` under 0.5): a warning, once (an
    info when it was Lightning's sanity check, whose numbers Lightning discards),
    naming the weights, both sigmas and how many times too large the weight is.

    Sources: ``F.dropout(x, p)`` in ``forward`` (its ``training`` defaults to True),
    ``dropout_p`` passed to attention whatever the mode, a ``.train()`` inside the
    validation step, an ``eval()`` override that misses a submodule;
    ``torch.nn.utils.spectral_norm``, whose power iteration runs only in training-mode
    forwards, validated before any (Lightning's sanity check; pytorch issue 51800), or a
    weight set after either spectral norm was applied.

    Keras passes ``training=False`` through ``evaluate``; a layer that hard-codes
    ``training=True`` is not watched there yet.
    """

    name = "validation_mode"
    needs = frozenset({"val_modes"})  # a validation's (never planned per step)
    runs_on = frozenset({"val_modes", "val_spectral"})
    base_interval = 16
    advice = "pass training=self.training to dropout and batch norm calls"

    def _initial_state(self) -> dict:
        return {"judged": False, "spectral": False}

    def applies(self) -> bool:
        return self.setup.framework != "keras"  # measured in Lightning only (see above)

    def finished(self, step: int) -> bool:
        return (self.state["judged"] and self.state["spectral"]) or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        found = []
        if obs.val_spectral is not None and not self.state["spectral"]:
            self.state["spectral"] = True
            found += self._spectral(obs, obs.val_spectral)
        calls = obs.val_training_calls
        if calls is not None and not self.state["judged"]:
            self.state["judged"] = True
            found += self._training_calls(obs, calls) if calls else []
        return found

    def _training_calls(self, obs: Observation, calls: tuple[str, ...]) -> list[Finding]:
        more = f" and {len(calls) - _SHOWN} more" if len(calls) > _SHOWN else ""
        drops = any("dropout" in c or "rrelu" in c for c in calls)
        norms = any("norm" in c for c in calls)
        effect = []
        if drops:
            effect.append("its outputs are random and its loss worse than the model's")
        if norms:
            effect.append("batch statistics replace the running ones, which it moves")
        where = calls[0].rsplit(" in ", 1)[-1]
        return [
            self.finding(
                obs,
                "warning",
                f"The validation at step {obs.step} behaved as training: "
                f"{', '.join(calls[:_SHOWN])}{more}, although the model was in eval "
                f"mode; {' and '.join(effect)}. A call's own argument decides its "
                "behaviour, not the model's mode: pass training=self.training to "
                "F.dropout or F.batch_norm, dropout_p=p if self.training else 0.0 to "
                "attention, and call no .train() inside the validation step.",
                value=float(len(calls)),
                threshold=0.0,
                where=where,
            )
        ]

    def _spectral(self, obs: Observation, weights: tuple) -> list[Finding]:
        wrong = [(n, used, true) for n, used, true, cos in weights if _stale(used, true, cos)]
        if not wrong:
            return []
        wrong.sort(key=lambda w: -_off(w[1], w[2]))
        shown = "; ".join(
            f"{n} divided by sigma {used:.3g} where its largest singular value is "
            f"{true:.3g}, {_words(used, true)}"
            for n, used, true in wrong[:_SHOWN]
        )
        more = f"; and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
        causes, fixes = [], []
        if any(not _parametrized(w[0]) for w in wrong):
            causes.append(
                "torch.nn.utils.spectral_norm draws u, v at random and iterates only in "
                "a training-mode forward, and this validation came before any (Lightning's "
                "sanity check, trainer.validate() before fit)"
            )
            fixes.append(
                "run one training-mode forward before validating (or "
                "num_sanity_val_steps=0), or use torch.nn.utils.parametrizations."
                "spectral_norm, which iterates when it is registered"
            )
        if any(_parametrized(w[0]) for w in wrong):
            causes.append(
                "parametrizations.spectral_norm iterated when it was registered, on a "
                "weight set again since (initialized or loaded after it), and no "
                "training-mode forward iterated on the new one"
            )
            fixes.append(
                "initialize or load the weight before registering spectral norm, or run "
                "one training-mode forward after setting it"
            )
        # Lightning discards what its sanity check computes: the same validation run by
        # trainer.validate() before fit, or by the user's own loop, is what misleads
        sanity = obs.val_spectral_when == "sanity check"
        which = "Lightning's sanity check" if sanity else f"The first validation (step {obs.step})"
        discarded = (
            " Lightning discards the sanity check's numbers, so nothing was lost here; a "
            "trainer.validate() before fit, or an evaluation of your own before training, "
            "reports them."
            if sanity
            else ""
        )
        return [
            self.finding(
                obs,
                "info" if sanity else "warning",
                f"{which} divided spectrally normalized "
                f"weights by stale estimates of their largest singular value: {shown}{more}. "
                f"Power iteration did not run on them: {'; and '.join(causes)}. "
                f"{_sentence('; or '.join(fixes))}.{discarded}",
                value=_off(wrong[0][1], wrong[0][2]),
                threshold=_SIGMA_OFF,
                where=wrong[0][0],
            )
        ]


def _off(used: float, true: float) -> float:
    """How many times too large (or small) the eval-mode weight is (inf: divided by 0)."""
    if not used or not math.isfinite(used) or not math.isfinite(true) or true <= 0:
        return math.inf
    ratio = true / abs(used)
    return max(ratio, 1.0 / ratio) if ratio > 0 else math.inf


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _parametrized(name: str) -> bool:
    """Whether the weight is ``parametrizations.spectral_norm``'s (named as its state dict
    names it), not the hook's."""
    return name.startswith("parametrizations.") or ".parametrizations." in name


def _stale(used: float, true: float, cosine: float) -> bool:
    if not math.isfinite(true) or true <= 0:
        return False  # a zero (or unreadable) weight: nothing is divided by anything
    if not math.isfinite(cosine) or cosine >= _ALIGNED:
        return False
    return used <= 0 or _off(used, true) >= _SIGMA_OFF


def _words(used: float, true: float) -> str:
    off = _off(used, true)
    size = "infinitely large" if math.isinf(off) else f"{off:.3g}x too large"
    if used > 0 and true < used:
        size = f"{off:.3g}x too small"
    return f"so the eval weight is {size}{' and of the wrong sign' if used < 0 else ''}"
