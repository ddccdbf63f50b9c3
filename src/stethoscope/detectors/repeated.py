"""Data served again: the same batch over and over, the same order every epoch, and the
batches a resumed run sees twice or never, told by fingerprints of the batches' samples."""

from __future__ import annotations

import hashlib

import numpy as np

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["RepeatedData"]


def batch_key(prints: np.ndarray) -> str:
    """A short key of a batch: its samples' prints, in order (equal batches, equal keys)."""
    data = np.ascontiguousarray(prints, dtype="<f8").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class RepeatedData(Detector):
    """Batches served again where each should be new: a loader stuck on one batch, data
    that comes in the same order every epoch although shuffling was asked for, and the
    batches a run resumed from a checkpoint sees twice or never.

    Rule: each sampled batch, the first batch of every epoch and the first batch after a
    resume are fingerprinted (a print of each of their samples, in order: see the
    ``prints`` statistic). Three mistakes are warned of, each once:

    - *stuck*: a batch equal to the one just before it in the same epoch (a repeat seen
      on a sampled step asks for the next step's batch too): the loader serves one batch
      again and again;
    - *same order*: an epoch's first batch equals the one before's, or a batch comes back
      later in the same epoch, while shuffling was not turned off (a sequential sampler,
      as ``shuffle=False`` or Lightning's ``overfit_batches`` make, orders the data on
      purpose). An epoch of one batch (full-batch training) is left alone;
    - *resume*: the first batch after a resume equals the first batch of the epoch the
      checkpoint was taken in, a few steps into it: the loader started the epoch again,
      so its first batches are seen twice and as many of its last never; or the resumed
      run starts a new epoch where the checkpoint's had not ended: its rest is skipped.

    Sources: accelerate #2016 and #4233 (the wrong batch order after a resume, the same
    shuffle twice), verl #7401 (a resumed run silently skips an epoch); a
    ``DistributedSampler`` without ``set_epoch``, or a streaming dataset shuffled with a
    fixed seed, serves each epoch in the order of the first.
    """

    name = "repeated_data"
    needs = frozenset({"prints"})
    at_epoch_start = frozenset({"prints"})
    base_interval = 16
    advice = "reshuffle every epoch; resume the loader's position"
    blind_to = "no input tensor could be read from the batches"

    def __init__(self) -> None:
        super().__init__()
        #: The next observation is a resumed run's first (not part of the state).
        self._resumed = False

    def _initial_state(self) -> dict:
        # epoch: the epoch of the last batch seen, started at step start with the batch
        # first; length: steps in the last complete epoch; seen: this epoch's sampled
        # batches (key -> step); last: [step, key] of the last batch seen; cycle: [step,
        # earlier step] of a batch that came again, until the next step's tells why;
        # warned: the mistakes already named
        return {
            "epoch": None,
            "start": 0,
            "first": "",
            "length": 0,
            "seen": {},
            "last": [-1, ""],
            "cycle": [],
            "warned": [],
        }

    def finished(self, step: int) -> bool:
        return len(self.state["warned"]) == 3

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._resumed = self.state["epoch"] is not None

    def _update(self, obs: Observation) -> list[Finding]:
        resumed, self._resumed = self._resumed, False
        if obs.sample_prints is None or not len(obs.sample_prints):
            return []
        prints = np.asarray(obs.sample_prints)
        st = self.state
        key, step = batch_key(prints), obs.step
        found: list[Finding] = []
        if st["epoch"] != obs.epoch:
            found += self._new_epoch(obs, key, resumed)
        elif resumed:
            found += self._resumed_within(obs, key)
        else:
            found += self._again(obs, key)
        st["seen"].setdefault(key, step)
        st["last"] = [step, key]
        return found

    # -- the three mistakes -----------------------------------------------------
    def _new_epoch(self, obs: Observation, key: str, resumed: bool) -> list[Finding]:
        """An epoch's first batch: compare it with the last epoch's first."""
        st = self.state
        found: list[Finding] = []
        before, ran = st["epoch"], obs.step - st["start"]
        if before is not None and resumed and 0 < ran < st["length"]:
            # the checkpoint was taken ``ran`` batches into epoch ``before``
            found += self._warn(
                obs,
                "resume",
                f"The run resumed at step {obs.step} in a new epoch ({obs.epoch}), but "
                f"the checkpoint was taken {ran} batches into epoch {before} of "
                f"{st['length']}, so its last {st['length'] - ran} batches were never "
                "trained on; resume from a checkpoint taken at an epoch's end, or with a "
                "loader that saves its position (a stateful dataloader).",
                value=float(st["length"] - ran),
            )
        elif before is not None and not resumed and obs.epoch == before + 1 and ran > 1:
            st["length"] = ran
            if key == st["first"] and obs.data_order != "sequential":
                found += self._same_order(
                    obs,
                    f"epoch {obs.epoch} began with the very batch epoch {before} began "
                    "with (the same samples, in the same order)",
                )
        st["epoch"], st["start"], st["first"], st["seen"] = obs.epoch, obs.step, key, {}
        return found

    def _resumed_within(self, obs: Observation, key: str) -> list[Finding]:
        """A resumed run's first batch, in the epoch the checkpoint was taken in."""
        st = self.state
        again = obs.step - st["start"]
        if key != st["first"] or again <= 0:
            return []
        lost = f", and its last {again} never" if st["length"] else ""
        return self._warn(
            obs,
            "resume",
            f"The run resumed at step {obs.step}, {again} batches into epoch "
            f"{obs.epoch}, but its loader started the epoch again (its first batch is "
            f"the one the epoch began with at step {st['start']}), so its first {again} "
            f"batches are trained on twice{lost}; resume from a checkpoint taken at an "
            "epoch's end, or with a loader that saves its position (a stateful "
            "dataloader).",
            value=float(again),
        )

    def _again(self, obs: Observation, key: str) -> list[Finding]:
        """A batch within an epoch: the very one just before (stuck), or one that came
        earlier in the epoch with others between (the data cycles)?"""
        st = self.state
        step, (last_step, last_key) = obs.step, st["last"]
        consecutive = last_step == step - 1
        if consecutive and last_key == key:
            return self._warn(
                obs,
                "stuck",
                f"The training loader serves the same batch again and again: the batches "
                f"of steps {last_step} and {step} are identical (the same samples, in the "
                "same order), as no shuffled or sequential loader serves them; check the "
                "dataset's __getitem__ and the loader for an index that never advances or "
                "a batch cached once (unless you overfit one batch on purpose).",
                value=2.0,
            )
        if consecutive and st["cycle"]:  # the batch after a repeat is another one
            earlier, st["cycle"] = st["cycle"], []
            if obs.data_order != "sequential":
                return self._same_order(
                    obs,
                    f"the batch of step {earlier[1]} came back at step {earlier[0]}, "
                    f"{earlier[0] - earlier[1]} steps later in the same epoch, with other "
                    "batches between (the data cycles within an epoch)",
                )
            return []
        st["cycle"] = []
        earlier = st["seen"].get(key)
        if earlier is not None:
            # a repeat: the next batch tells a stuck loader from data that cycles
            st["cycle"] = [step, earlier]
            self.request = self.needs
        return []

    def _same_order(self, obs: Observation, what: str) -> list[Finding]:
        return self._warn(
            obs,
            "order",
            f"The training data comes in the same order every epoch: {what}, so every "
            "epoch repeats the same batches (a DistributedSampler without set_epoch, a "
            "dataset shuffled with a fixed seed, tf.data's "
            "shuffle(reshuffle_each_iteration=False), fit(shuffle=False)); reshuffle "
            "every epoch with sampler.set_epoch(epoch) or a seed that changes with the "
            "epoch (unless the order is deliberate).",
            value=1.0,
        )

    def _warn(self, obs: Observation, mistake: str, message: str, *, value: float) -> list:
        warned = self.state["warned"]
        if mistake in warned:
            return []
        warned.append(mistake)
        return [self.finding(obs, "warning", message, value=value, threshold=0.0, where="data")]
