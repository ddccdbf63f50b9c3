"""Layer 1: repeated_data on sequences of batch fingerprints: a loader stuck on one batch,
the same order every epoch, data that cycles within an epoch, and the batches a resumed
run sees twice or never, against shuffled, sequential and full-batch training."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from _helpers import assert_resumes, assert_sentence

from stethoscope.detectors import RepeatedData
from stethoscope.observation import Observation

SAMPLES = 64  # a dataset of 64 samples
BATCH = 8  # in batches of 8: 8 steps an epoch


def batch_prints(order: np.ndarray, index: int) -> np.ndarray:
    """The prints of batch ``index`` of an epoch whose samples come in ``order`` (sample i's
    print: a number fixed per sample)."""
    chosen = order[index * BATCH : (index + 1) * BATCH]
    return 1_000_003.0 * (chosen + 1)


def epochs(n: int, *, reshuffle: bool, seed: int = 0, steps: list[int] | None = None):
    """Observations of ``n`` epochs, on the steps in ``steps`` (default: every step) and on
    each epoch's first two (the detector asks for the second), each epoch in a new random
    order (``reshuffle``) or the first one's again."""
    rng = np.random.default_rng(seed)
    per = SAMPLES // BATCH
    out, order = [], rng.permutation(SAMPLES)
    for e in range(n):
        if reshuffle and e:
            order = rng.permutation(SAMPLES)
        for i in range(per):
            step = e * per + i
            if steps is None or step in steps or i <= 1:
                out.append(obs(step, e, batch_prints(order, i)))
    return out


def obs(step: int, epoch: int, prints: np.ndarray, order: str = "") -> Observation:
    return Observation(step=step, epoch=epoch, sample_prints=prints, data_order=order)


def judge(observations, detector: RepeatedData | None = None) -> list:
    d = detector or RepeatedData()
    found = []
    for o in observations:
        found += d.update(o)
    return found


def sampled(n_epochs: int) -> list[int]:
    return list(range(0, n_epochs * SAMPLES // BATCH, 3))


@pytest.mark.parametrize("steps", [None, sampled(6)], ids=["every-step", "sampled"])
def test_reshuffled_epochs_are_never_repeats(steps):
    assert judge(epochs(6, reshuffle=True, steps=steps)) == []


def test_the_same_order_every_epoch_is_named_at_the_second_epochs_second_step():
    (found,) = judge(epochs(4, reshuffle=False, steps=sampled(4)))
    assert found.detector == "repeated_data" and found.severity == "warning"
    assert found.step == SAMPLES // BATCH + 1 and found.epoch == 1
    assert "and so did its batch 1" in found.message
    assert_sentence(found, "set_epoch", names=["same order every epoch", "epoch 0"])


def batches_in(order: list[int]) -> list[np.ndarray]:
    """An epoch of whole batches in ``order`` (a Keras PyDataset shuffled by fit)."""
    return [batch_prints(np.arange(SAMPLES), b) for b in order]


def test_whole_batches_reshuffled_whose_first_comes_first_again_are_no_repeat():
    """One epoch in as many as there are batches begins with the last one's first."""
    first, second = batches_in([5, 2, 7, 0, 1, 3, 4, 6]), batches_in([5, 6, 1, 3, 0, 7, 2, 4])
    observations = [obs(t, 0, first[t]) for t in (0, 1, 4)]
    observations += [obs(8 + t, 1, second[t]) for t in (0, 1, 4)]
    assert judge(observations) == []


def test_a_next_batch_measured_elsewhere_leaves_the_first_to_tell():
    """Where the last epoch's next batch was measured at another place, the first batch
    alone says the order is the same."""
    order = batches_in(list(range(8)))
    observations = [obs(0, 0, order[0]), obs(3, 0, order[3])]
    observations += [obs(8, 1, order[0]), obs(9, 1, order[1])]
    (found,) = judge(observations)
    assert found.step == 9 and "epoch 1 began with the very batch epoch 0" in found.message
    assert "so did its batch" not in found.message


def test_an_order_asked_to_be_sequential_is_left_alone():
    observations = epochs(4, reshuffle=False)
    for o in observations:
        o.data_order = "sequential"
    assert judge(observations) == []


def test_full_batch_training_repeats_its_one_batch_by_design():
    everything = np.arange(SAMPLES, dtype=float) + 1
    assert judge([obs(t, t, everything) for t in range(20)]) == []


def test_a_loader_stuck_on_one_batch_is_named_at_the_step_after_a_repeat():
    stuck = batch_prints(np.arange(SAMPLES), 0)
    d = RepeatedData()
    # sampled steps 0 and 16 hold the same batch: a repeat, so the next step is asked for
    assert judge([obs(0, 0, stuck), obs(16, 0, stuck)], d) == []
    assert d.request == frozenset({"prints"})
    (found,) = judge([obs(17, 0, stuck)], d)
    assert found.step == 17 and "same batch again and again" in found.message
    assert "16 and 17" in found.message
    assert_sentence(found, "__getitem__")


def test_data_that_cycles_within_an_epoch_is_the_same_order_again():
    """A dataset of 4 batches repeated in its order within one long epoch (tf.data's
    repeat() without a shuffle): the batch of step 0 again at step 8, another at step 9."""
    order = np.arange(SAMPLES)
    cycle = [batch_prints(order, i % 4) for i in range(12)]
    found = judge([obs(0, 0, cycle[0]), obs(8, 0, cycle[8]), obs(9, 0, cycle[9])])
    (order_finding,) = found
    assert order_finding.step == 9 and "cycles within an epoch" in order_finding.message
    assert "step 0 came back at step 8" in order_finding.message


def test_a_repeat_whose_next_step_is_not_measured_stays_unjudged():
    order = np.arange(SAMPLES)
    cycle = [batch_prints(order, i % 4) for i in range(40)]
    assert judge([obs(0, 0, cycle[0]), obs(8, 0, cycle[8]), obs(24, 0, cycle[24])]) == []


def resumed(detector: RepeatedData) -> RepeatedData:
    """A fresh detector restored from ``detector``'s checkpoint, through strict JSON."""
    fresh = RepeatedData()
    fresh.load_state_dict(json.loads(json.dumps(detector.state_dict(), allow_nan=False)))
    return fresh


def test_a_resume_whose_loader_starts_the_epoch_again_is_named():
    """Lightning's mid-epoch resume with a loader that keeps no position: the checkpoint at
    step 13 (5 batches into epoch 1), and the resumed run's first batch is epoch 1's
    first."""
    order = np.arange(SAMPLES)
    d = RepeatedData()
    judge([obs(t, t // 8, batch_prints(order, t % 8), "sequential") for t in range(13)], d)
    d = resumed(d)
    (found,) = judge([obs(13, 1, batch_prints(order, 0), "sequential")], d)
    assert found.step == 13 and found.value == 5.0
    assert "5 batches into epoch 1" in found.message and "step 8" in found.message
    assert "trained on twice, and its last 5 never" in found.message
    assert_sentence(found, "stateful dataloader")


def test_a_resume_that_goes_on_where_it_stopped_is_no_repeat():
    order = np.arange(SAMPLES)
    d = RepeatedData()
    judge([obs(t, t // 8, batch_prints(order, t % 8), "sequential") for t in range(13)], d)
    d = resumed(d)
    assert judge([obs(t, 1, batch_prints(order, t % 8), "sequential") for t in (13, 14)], d) == []


def test_a_resume_that_skips_the_rest_of_an_epoch_is_named():
    """The checkpoint 3 batches into epoch 1; the resumed run starts epoch 2."""
    d = RepeatedData()
    judge(epochs(2, reshuffle=True)[:11], d)
    d = resumed(d)
    (found,) = judge([obs(11, 2, batch_prints(np.arange(SAMPLES)[::-1], 0))], d)
    assert found.value == 5.0 and "3 batches into epoch 1 of 8" in found.message
    assert "last 5 batches were never trained on" in found.message


def test_a_resume_at_an_epochs_end_is_no_skip():
    d = RepeatedData()
    judge(epochs(2, reshuffle=True), d)
    d = resumed(d)
    assert judge(epochs(3, reshuffle=True, seed=5)[16:18], d) == []


def test_each_mistake_is_named_once_and_then_it_has_done():
    stuck = batch_prints(np.arange(SAMPLES), 0)
    d = RepeatedData()
    found = judge([obs(t, 0, stuck) for t in range(10)], d)
    assert len(found) == 1 and not d.finished(10)


def test_a_checkpoint_goes_on_exactly_as_an_uninterrupted_run():
    assert_resumes(RepeatedData, epochs(5, reshuffle=False, steps=sampled(5)), at=5)


def test_without_prints_it_says_nothing():
    assert judge([Observation(step=t) for t in range(5)]) == []
    assert judge([obs(t, 0, np.zeros(0)) for t in range(5)]) == []


def validate(detector: RepeatedData, step: int, prints: np.ndarray) -> list:
    return judge([Observation(step=step, val_prints=prints)], detector)


def test_validation_samples_the_model_trains_on_are_named():
    """A validation set that is the training set: every validation sample was trained on;
    the run fingerprinted 4 batches of 8 (half an epoch's samples)."""
    d = RepeatedData()
    judge(epochs(1, reshuffle=True, steps=sampled(1)), d)
    everything = 1_000_003.0 * (np.arange(SAMPLES) + 1)
    (found,) = validate(d, 7, everything)
    assert found.where == "validation data" and found.value == pytest.approx(1.0)
    assert "32 of the 64 validation samples" in found.message
    assert "about 50% of the training set" in found.message
    assert_sentence(found, "split the data once", names=["overlaps the training data"])
    # the epoch summary's advice is the overlap's, not the loader's
    assert d.advice_for(found) == "split the data once; no sample in both splits"
    assert d.advice_for(replace(found, where="training data")) == d.advice


def test_a_validation_set_of_other_samples_is_no_overlap():
    d = RepeatedData()
    judge(epochs(3, reshuffle=True), d)
    others = 1_000_003.0 * (np.arange(SAMPLES, 3 * SAMPLES) + 1)
    assert validate(d, 23, others) == []
    # a few duplicates across the splits (4 of 128): under the bar, and too few
    assert validate(d, 23, np.r_[others, 1_000_003.0 * (np.arange(4) + 1)]) == []


def test_a_small_validation_is_not_judged():
    d = RepeatedData()
    judge(epochs(1, reshuffle=True), d)
    assert validate(d, 7, 1_000_003.0 * (np.arange(16) + 1)) == []


def test_a_loader_stuck_across_an_epochs_start_is_named_at_its_second_step():
    """The batch seen last (step 6) begins the next epoch (step 8): the second batch is
    asked for, and it is the same one again."""
    order = np.arange(SAMPLES)
    stuck = batch_prints(order, 5)
    d = RepeatedData()
    found = []
    for t in (0, 3, 6, 8, 9):
        prints = batch_prints(order, t % 8) if t < 5 else stuck
        found += d.update(obs(t, t // 8, prints))
        assert d.request == (frozenset({"prints"}) if t in (0, 8) else frozenset())
    (finding,) = found
    assert finding.step == 9 and "same batch again and again" in finding.message


def test_full_batch_training_asks_for_no_second_batch():
    everything = np.arange(SAMPLES, dtype=float) + 1
    d = RepeatedData()
    asked = []
    for t in range(6):
        d.update(obs(t, t, everything))
        asked.append(bool(d.request))
    # the same batch every step, and an epoch of one step: asked for at the first step
    # alone, before the length of an epoch is known
    assert asked == [True] + [False] * 5


# -- loader workers that serve the same batches ---------------------------------------------------
def with_workers(workers: int) -> RepeatedData:
    from stethoscope.advice import TrainingSetup

    d = RepeatedData()
    d.setup = TrainingSetup(loader_workers=workers)
    return d


def served_by_workers(workers: int, steps: int = 8) -> list[Observation]:
    """Each of ``workers`` workers serves the same batches (one random state copied into
    each), in turn: every batch ``workers`` times in a row, an epoch's first two measured."""
    order = np.arange(SAMPLES)
    return [obs(t, 0, batch_prints(order, t // workers)) for t in range(steps)]


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_that_share_a_random_state_are_named_as_such(workers):
    d = with_workers(workers)
    (found,) = judge(served_by_workers(workers), d)
    assert found.step == workers and found.where == "loader workers"
    assert f"{workers} workers serve the same batches" in found.message
    assert f"{workers} in a row" in found.message and "__getitem__" not in found.message
    assert_sentence(found, "worker_init_fn", names=["share one random state"])
    assert d.advice_for(found) == "seed each loader worker (worker_init_fn)"


def test_without_workers_the_same_batches_are_a_stuck_loader():
    (found,) = judge(served_by_workers(2))
    assert found.step == 1 and "same batch again and again" in found.message


def test_a_loader_stuck_under_workers_is_stuck_past_their_number():
    stuck = batch_prints(np.arange(SAMPLES), 0)
    (found,) = judge([obs(t, 0, stuck) for t in range(6)], with_workers(2))
    assert found.step == 2 and "same batch again and again" in found.message
    assert (
        "steps 0 to 2" in found.message
        and "more times in a row than its 2 workers" in found.message
    )


def test_workers_that_copy_one_random_state_every_epoch_are_not_named_twice():
    """Workers started afresh each epoch from the same state serve every epoch alike: the
    same order is that same cause, said once."""
    d = with_workers(2)
    order = np.arange(SAMPLES)
    found = judge(
        [obs(e * 8 + t, e, batch_prints(order, t // 2)) for e in range(3) for t in range(8)], d
    )
    assert [f.where for f in found] == ["loader workers"]


def test_workers_seeded_apart_are_left_alone():
    assert judge(epochs(3, reshuffle=True), with_workers(2)) == []


# -- a transductive split: one graph, its nodes split by masks ------------------------------------
def test_a_validation_on_the_one_training_batch_is_said_as_a_transductive_split():
    """Node classification on one graph: every epoch trains on the whole feature matrix,
    and the validation runs on it again (only the loss masks differ)."""
    graph = 1_000_003.0 * (np.arange(SAMPLES) + 1)
    d = RepeatedData()
    judge([obs(t, t, graph) for t in range(10)], d)
    (found,) = validate(d, 9, graph)
    assert found.severity == "info" and found.where == "validation inputs"
    assert "transductive split" in found.message and "validation mask" in found.message
    assert d.advice_for(found) == "take the validation loss over its own mask"
    assert validate(d, 19, graph) == []  # said once


def test_a_full_batch_run_validated_on_part_of_its_batch_is_still_an_overlap():
    graph = 1_000_003.0 * (np.arange(SAMPLES) + 1)
    d = RepeatedData()
    judge([obs(t, t, graph) for t in range(3)], d)
    others = 1_000_003.0 * (np.arange(SAMPLES, 2 * SAMPLES) + 1)
    (found,) = validate(d, 2, np.r_[graph[:32], others[:32]])
    assert found.severity == "warning" and found.where == "validation data"


# -- full-batch training served as many steps an epoch ---------------------------------------------
def with_setup(**setup) -> RepeatedData:
    from stethoscope.advice import TrainingSetup

    d = RepeatedData()
    d.setup = TrainingSetup(**setup)
    return d


WHOLE = {"whole_batches": True}  # DataLoader(batch_size=None): the dataset makes each batch
LBFGS = {"line_search": "LBFGS"}  # a full-batch method


@pytest.mark.parametrize(
    "setup", [WHOLE, LBFGS, {**WHOLE, **LBFGS}], ids=["whole", "lbfgs", "both"]
)
@pytest.mark.parametrize("steps", [list(range(10)), [0, 16, 17, 32, 33]], ids=["every", "sampled"])
def test_one_batch_at_every_step_since_the_first_is_full_batch_training(setup, steps):
    """The whole training set as each of an epoch's items (a dataset of one batch, n times;
    an iterable that yields it n times), or LBFGS's line search over one objective: the
    same batch from the run's first step on is the data, said once, an info (was a
    warning of a stuck loader)."""
    everything = np.arange(SAMPLES, dtype=float) + 1
    d = with_setup(**setup)
    (found,) = judge([obs(t, 0, everything) for t in steps], d)
    assert found.severity == "info" and found.step == steps[2 if steps[1] == 16 else 1]
    assert "full-batch training" in found.message
    assert ("full-batch method" in found.message) == ("line_search" in setup)
    assert_sentence(found, "__getitem__")
    later = [obs(t, 1, everything) for t in range(steps[-1] + 1, steps[-1] + 20)]
    assert judge(later, d) == []  # said once; a new epoch of the same batch says no more


@pytest.mark.parametrize("setup", [WHOLE, LBFGS])
def test_a_loader_that_served_other_batches_and_then_sticks_is_stuck_all_the_same(setup):
    """The fault suite's batch_served_again: batches that change, then one again and again
    (the suite's loader has batch_size=None and a sampler of index lists)."""
    order = np.arange(SAMPLES)
    batches = [obs(t, 0, batch_prints(order, t)) for t in range(3)]
    batches += [obs(t, 0, batch_prints(order, 3)) for t in range(3, 6)]
    (found,) = judge(batches, with_setup(**setup))
    assert found.severity == "warning" and "same batch again and again" in found.message


def test_a_collating_loader_stuck_from_the_first_step_is_stuck():
    """DataLoader(batch_size=32) over a dataset whose index never advances: its batches
    are drawn sample by sample, so one batch at every step is a stuck index."""
    stuck = batch_prints(np.arange(SAMPLES), 0)
    (found,) = judge([obs(t, 0, stuck) for t in range(4)], with_setup(whole_batches=False))
    assert found.severity == "warning" and found.step == 1


def test_a_checkpoint_from_before_the_first_batch_was_kept_judges_as_before():
    """A state without ``only`` (an older checkpoint) does not know the run's first batch:
    a batch served again is a stuck loader, as it was."""
    stuck = batch_prints(np.arange(SAMPLES), 0)
    d = with_setup(**WHOLE)
    judge([obs(0, 0, stuck)], d)
    state = d.state_dict()
    del state["only"]
    fresh = with_setup(**WHOLE)
    fresh.load_state_dict(state)
    (found,) = judge([obs(1, 0, stuck)], fresh)
    assert found.severity == "warning"


def test_one_batch_survives_a_resume():
    everything = np.arange(SAMPLES, dtype=float) + 1
    d = with_setup(**WHOLE)
    judge([obs(0, 0, everything)], d)
    fresh = resumed(d)
    fresh.setup = d.setup
    (found,) = judge([obs(t, 0, everything) for t in range(1, 4)], fresh)
    assert found.severity == "info"
