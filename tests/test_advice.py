"""The advice helpers: what a finding tells the user depends on what the training does."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stethoscope.advice import (
    TrainingSetup,
    adaptive_optimizers,
    clipping_advice,
    epsilon_advice,
    epsilon_cause,
    float16_note,
    small_epsilon,
    warmup_advice,
)


def test_clipping_advice_is_in_the_frameworks_words_unless_the_run_clips_already():
    assert "Trainer(gradient_clip_val=1.0)" in clipping_advice(TrainingSetup("lightning"))
    assert "clipnorm=1.0" in clipping_advice(TrainingSetup("keras"))
    assert "global norm" in clipping_advice(TrainingSetup())
    clipped = clipping_advice(TrainingSetup("keras", clipping="global_clipnorm=5.0"))
    assert clipped.startswith("gradients are clipped already (global_clipnorm=5.0)")


def test_float16_overflow_is_mentioned_only_under_float16():
    assert "65504" in float16_note(TrainingSetup("lightning", precision="16-mixed"))
    assert "65504" in float16_note(TrainingSetup("keras", precision="mixed_float16"))
    assert float16_note(TrainingSetup("lightning", precision="bf16-mixed")) == ""
    assert float16_note(TrainingSetup()) == ""


def test_warmup_advice_points_at_the_schedule_when_there_is_one():
    assert warmup_advice(TrainingSetup(scheduler=True)) == "check your schedule's warm-up"
    assert warmup_advice(TrainingSetup()) == "add warm-up"


@pytest.mark.parametrize(
    ("optimizer", "eps", "dtypes", "zero", "bound"),
    [
        ("AdamW", 1e-8, ["float32", "float16"], True, math.inf),  # 1e-8 rounds to 0
        ("Adam", 1e-7, ["float16"], False, 2441.41),  # sqrt(2**-24) / 1e-7
        ("RMSprop", 1e-5, ["float16"], False, 24.414),
        ("Adagrad", 1e-10, ["float16"], True, math.inf),
    ],
)
def test_an_epsilon_small_for_float16_is_named_with_how_far_a_step_may_go(
    optimizer, eps, dtypes, zero, bound
):
    risk = small_epsilon(optimizer, "eps", eps, dtypes)
    assert (
        risk is not None and risk.dtype == "float16" and str(risk) == f"{optimizer}'s eps={eps:g}"
    )
    assert risk.zero is zero and risk.bound == pytest.approx(bound, rel=1e-3)
    # the rounding it predicts is float16's own
    assert bool(np.float16(eps) == 0) is zero


@pytest.mark.parametrize(
    ("optimizer", "eps", "dtypes"),
    [
        ("AdamW", 1e-8, ["bfloat16", "float32"]),  # float32's range
        ("AdamW", 1e-4, ["float16"]),  # bounds a step at 2.4x
        ("AdamW", 3e-5, ["float16"]),
        ("SGD", 1e-8, ["float16"]),  # no root of a second moment
        ("Adamax", 1e-8, ["float16"]),  # keeps no square
        ("Adam", (1e-8, 1e-3), ["float16"]),  # no number
        ("Adam", None, ["float16"]),
    ],
)
def test_an_epsilon_the_dtype_bounds_a_step_with_is_not_small(optimizer, eps, dtypes):
    assert small_epsilon(optimizer, "eps", eps, dtypes) is None


def test_an_optimizer_is_judged_by_its_class_and_bases_as_adaptive_optimizers_judges_it():
    class Mine(torch.optim.Adam):  # a user's subclass: an Adam all the same
        pass

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    mine = Mine([p], eps=1e-8)
    risk = small_epsilon(mine, "eps", 1e-8, [p.dtype])
    assert risk is not None and str(risk) == "Mine's eps=1e-08" and risk.zero
    assert adaptive_optimizers([mine])
    assert small_epsilon(torch.optim.SGD([p], lr=0.1), "eps", 1e-8, [p.dtype]) is None


def test_the_epsilons_cause_and_remedy_are_in_the_frameworks_words():
    zero = small_epsilon("AdamW", "eps", 1e-8, ["float16"])
    small = small_epsilon("Adam", "epsilon", 1e-7, ["float16"])
    assert epsilon_cause(zero).endswith("AdamW's eps=1e-08 is 0 in float16")
    assert epsilon_cause(small).endswith(
        "Adam's epsilon=1e-07 lets such a step be up to 2441x the usual one"
    )
    assert 'precision="16-mixed"' in epsilon_advice(TrainingSetup("lightning"))
    assert '"mixed_float16"' in epsilon_advice(TrainingSetup("keras"))
    assert "1e-4" in epsilon_advice(TrainingSetup())
