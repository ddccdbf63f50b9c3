"""What the CPU cannot run through DeepSpeed itself: its fp16 loss scale (DeepSpeed's CPU
accelerator has no fp16), driven through stand-ins of its optimizers. The rest of
DeepSpeed's ZeRO runs for real in ``test_lightning_deepspeed.py``."""

from __future__ import annotations

import torch

from stethoscope.callbacks._lightning.loss_scale import pending_scale
from stethoscope.callbacks._lightning.zero import client_optimizer, is_deepspeed_optimizer


def deepspeed_optimizer(**attributes):
    """A stand-in for one of DeepSpeed's optimizers: a class from its package."""
    cls = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    out = cls()
    for name, value in attributes.items():
        setattr(out, name, value)
    return out


def test_deepspeeds_fp16_gradients_carry_its_loss_scale_until_its_step():
    # DeepSpeed unscales inside its step: at on_before_optimizer_step the gradients are
    # multiplied by its dynamic scale, which its loss scaler keeps as a host number
    scale = pending_scale(None, deepspeed_optimizer(loss_scale=1024.0))
    assert scale is not None and scale.device.type == "cpu" and float(scale) == 1024.0
    assert scale.dim() == 0  # divides a device tensor without a copy to the device
    # bf16 and float32 keep a static scale of 1: nothing to divide; bf16's optimizer none
    assert pending_scale(None, deepspeed_optimizer(loss_scale=1.0)) is None
    assert pending_scale(None, deepspeed_optimizer()) is None


def test_a_torch_optimizer_is_not_deepspeeds():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert not is_deepspeed_optimizer(sgd) and client_optimizer(sgd) is sgd
    wrapped = deepspeed_optimizer(optimizer=sgd)
    assert is_deepspeed_optimizer(wrapped) and client_optimizer(wrapped) is sgd
    assert pending_scale(None, sgd) is None
