"""The advice helpers: what a finding tells the user depends on what the training does."""

from __future__ import annotations

from stethoscope.advice import TrainingSetup, clipping_advice, float16_note, warmup_advice


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
