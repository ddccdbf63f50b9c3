"""A model whose own ``train()`` freezes stages that the framework never freezes."""

from __future__ import annotations

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["TrainOverride"]


class TrainOverride(Detector):
    """Stages meant to be frozen train: the model freezes them (``requires_grad=False``)
    or rests them (eval mode) in an override of ``train()``, which the framework's loop
    never calls.

    Rule: at the first measured training step (after every ``on_train_start`` hook), where
    calling the model's ``train(True)`` once, its flags saved and put back after, would
    set ``requires_grad=False`` on a parameter that requires grad or put a training
    module in eval mode: a warning, once. The model is left exactly as it was.

    Sources: backbones from mmpretrain, mmdetection and detectron2 freeze their first
    stages (``frozen_stages``, ``norm_eval``) in ``train()``, as their own runners call
    ``model.train()`` every epoch (mmpretrain issue 702: frozen stages that trained under
    another loop). Lightning 2 leaves the model in the mode it was given and restores
    each module's ``training`` flag by assignment after a validation. Keras layers have
    no such method (``fit`` passes ``training=True``).
    """

    name = "train_override"
    needs = frozenset({"train_mode"})
    base_interval = 16  # eval_mode's: the one reduction serves both
    escalates = False  # a fact of the set-up: the next steps tell nothing more
    advice = "call self.train() in on_train_start, or freeze in __init__"

    def _initial_state(self) -> dict:
        return {"judged": False}

    def applies(self) -> bool:
        return self.setup.framework != "keras"

    def finished(self, step: int) -> bool:
        return self.state["judged"] or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        what = obs.bypassed_train
        if what is None:
            return []
        self.state["judged"] = True
        if not what:
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The model's own train() is never called: {what}, but Lightning never "
                "calls train() when it fits (it sets each module's training flag "
                f"directly), so what it freezes trains from step {obs.step}; call "
                "self.train() in on_train_start, or freeze those parameters and modules "
                "in __init__.",
                value=1.0,
                threshold=0.0,
                where=what.split(" ", 1)[0],
            )
        ]
