"""What a module's own ``train()`` would do that Lightning never lets it do.

Libraries of backbones (mmpretrain, mmdetection, timm's frozen stages, detectron2's
``freeze_at``) freeze stages, or keep batch norms in eval mode, inside an override of
``nn.Module.train``: their own training loops call ``model.train()`` before each epoch.
Lightning does not: it leaves the model in the mode it was given and restores each
module's ``training`` flag by assignment after a validation. The freezing never runs,
and the "frozen" stages train. Calling ``train(True)`` once, on a model whose flags are
saved first and put back after, shows what the overrides meant.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["bypassed_train"]

#: Names shown in a sentence at most (the rest are counted).
_SHOWN = 2


def bypassed_train(model: nn.Module) -> str:
    """What the ``train()`` overrides in ``model`` would do when training begins and have
    not done: ``"backbone overrides train() to set requires_grad=False on
    backbone.stem.weight and 11 more and to put backbone.bn1 in eval mode"`` ("": none
    would change anything, or none overrides ``train``). The model is left exactly as it
    was."""
    modules = [(name or "the model", m) for name, m in model.named_modules()]
    owners = [name for name, m in modules if _overrides_train(m)]
    if not owners:
        return ""
    params = list(model.named_parameters())
    trained = [(n, p) for n, p in params if p.requires_grad]
    training = [(n, m) for n, m in modules if m.training]
    try:
        with torch.no_grad():
            model.train(True)
        frozen = [n for n, p in trained if not p.requires_grad]
        resting = [n for n, m in training if not m.training]
    except Exception:  # an override that needs what it was not given: no guess
        return ""
    finally:  # exactly as it was
        wanted = {id(p) for _, p in trained}
        for _, p in params:
            p.requires_grad_(id(p) in wanted)
        for _, m in modules:
            m.training = False
        for _, m in training:
            m.training = True
    if not frozen and not resting:
        return ""
    acts = []
    if frozen:
        acts.append(f"set requires_grad=False on {_names(frozen)}")
    if resting:
        acts.append(f"put {_names(resting)} in eval mode")
    verb = "override" if len(owners) > 1 else "overrides"
    return f"{_names(owners)} {verb} train() to {' and to '.join(acts)}"


def _overrides_train(module: nn.Module) -> bool:
    return type(module).train is not nn.Module.train


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
