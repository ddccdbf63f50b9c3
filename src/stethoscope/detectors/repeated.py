"""Data served again: the same batch over and over, the same order every epoch, the
batches a resumed run sees twice or never, and validation samples the model trains on,
told by fingerprints of the batches' samples."""

from __future__ import annotations

import hashlib

import numpy as np

from stethoscope.advice import TrainingSetup
from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["RepeatedData"]

#: Where a finding of the validation data overlapping the training data points.
VALIDATION_DATA = "validation data"
#: Where the finding of a validation on the very inputs of training points (a
#: transductive split: one graph, its nodes split by masks).
SAME_INPUTS = "validation inputs"
#: Where the finding of loader workers serving the same batches points.
WORKERS = "loader workers"
#: The mistakes it names, each once (the same inputs, an info, is said once too).
MISTAKES = ("stuck", "workers", "order", "resume", "overlap")


def batch_key(prints: np.ndarray) -> str:
    """A short key of a batch: its samples' prints, in order (equal batches, equal keys)."""
    data = np.ascontiguousarray(prints, dtype="<f8").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class RepeatedData(Detector):
    """Batches served again where each should be new: a loader stuck on one batch, data
    that comes in the same order every epoch although shuffling was asked for, the
    batches a run resumed from a checkpoint sees twice or never, and validation samples
    that are training samples.

    Rule: each sampled batch, the first batch of every epoch and the first batch after a
    resume are fingerprinted (a print of each of their samples, in order: see the
    ``prints`` statistic), and so are a validation's first batches (``val_prints``). Four
    mistakes are warned of, each once:

    - *stuck*: a batch equal to the one just before it in the same epoch (a batch seen
      before, on a sampled step or at an epoch's start, asks for the next step's batch
      too): the loader serves one batch again and again. Where that batch is the only
      one the run has seen since its first step, and the loader serves batches its
      dataset makes whole (``TrainingSetup.whole_batches``: the whole training set as
      each of an epoch's items) or the optimizer is a line search, a full-batch method
      (``TrainingSetup.line_search``: LBFGS), the data is one batch on purpose: said
      once, an info. A loader that collates samples it draws by index, or that served
      other batches before, is stuck;
    - *workers*: under a loader with ``W > 1`` worker processes (see
      ``TrainingSetup.loader_workers``), a batch served two to ``W`` times in a row, and
      then another: each worker serves the same batches, as workers that share one
      random state do (a generator the dataset holds, copied into each worker), or an
      iterable dataset that each worker yields whole. More than ``W`` times in a row is
      a stuck loader;
    - *same order*: an epoch's first batch equals the one before's, and so does the
      next batch measured (where the last epoch's was measured at the same place), or a
      batch comes back later in the same epoch, while shuffling was not turned off (a
      sequential sampler, as ``shuffle=False`` or Lightning's ``overfit_batches`` make,
      orders the data on purpose). Whole batches reshuffled (a Keras ``PyDataset``)
      begin two epochs alike one time in as many as there are batches; their next
      batches differ. An epoch of one batch (full-batch training) is left alone;
    - *resume*: the first batch after a resume equals the first batch of the epoch the
      checkpoint was taken in, a few steps into it: the loader started the epoch again,
      so its first batches are seen twice and as many of its last never; or the resumed
      run starts a new epoch where the checkpoint's had not ended: its rest is skipped;
    - *overlap*: at a validation, at least 5 of its samples (of at least 32) are among
      the training samples fingerprinted so far (the first ``KEEP``), and so an estimated
      ``overlap`` share or more of the validation data: the number found over the share
      of the training set fingerprinted (its distinct prints over an epoch's samples).
      Where every epoch is one batch and a validation's inputs are all of that batch's,
      the split is transductive (a graph's nodes, split by the losses' masks) or the
      validation data is the training data itself; the inputs cannot tell which, so it
      is said once as that, an info.

    Sources: accelerate #2016 and #4233 (the wrong batch order after a resume, the same
    shuffle twice), verl #7401 (a resumed run silently skips an epoch); a
    ``DistributedSampler`` without ``set_epoch``, or a streaming dataset shuffled with a
    fixed seed, serves each epoch in the order of the first.
    """

    name = "repeated_data"
    needs = frozenset({"prints"})
    at_epoch_start = frozenset({"prints"})
    runs_on = frozenset({"prints", "val_prints"})
    base_interval = 16
    advice = "reshuffle every epoch; resume the loader's position"
    #: The advice for the validation data overlapping the training data.
    overlap_advice = "split the data once; no sample in both splits"
    #: The advice for a validation on the very inputs of training (a transductive split).
    same_inputs_advice = "take the validation loss over its own mask"
    #: The advice for loader workers that serve the same batches.
    workers_advice = "seed each loader worker (worker_init_fn)"
    blind_to = "no input tensor could be read from the batches"
    #: Training prints kept to compare validations against.
    KEEP = 16384
    #: The share of a validation's samples found in training above which it overlaps.
    OVERLAP = 0.05

    def __init__(self) -> None:
        super().__init__()
        #: The next observation is a resumed run's first (not part of the state).
        self._resumed = False

    def _initial_state(self) -> dict:
        # epoch: the epoch of the last batch seen, started at step start with the batch
        # first; length: steps in the last complete epoch; seen: this epoch's sampled
        # batches (key -> step); last: [step, key] of the last batch seen; cycle: [step,
        # earlier step] of a batch that came again, until the next step's tells why;
        # kept: training prints (the first KEEP), batch: the samples printed per batch;
        # warned: the mistakes already named; next: [offset from the epoch's start, key]
        # of the first batch measured after the epoch's first, next_before: the last
        # epoch's; order: whether this epoch began with the last one's first batch, until
        # its next batch tells; run: [key, times] of a batch served several times in a
        # row, until the next batch tells how many; only: the key of the run's first
        # batch while it is the only one seen ("" once another came)
        return {
            "epoch": None,
            "start": 0,
            "first": "",
            "length": 0,
            "seen": {},
            "last": [-1, ""],
            "cycle": [],
            "kept": [],
            "batch": 0,
            "warned": [],
            "next": None,
            "next_before": None,
            "order": False,
            "run": None,
            "only": None,
        }

    def finished(self, step: int) -> bool:
        # workers that share a random state need workers: a run with none cannot make it
        possible = MISTAKES if self.setup.loader_workers > 1 else set(MISTAKES) - {"workers"}
        return all(m in self.state["warned"] for m in possible)

    def advice_for(self, finding: Finding) -> str:
        if finding.where == VALIDATION_DATA:
            return self.overlap_advice
        if finding.where == SAME_INPUTS:
            return self.same_inputs_advice
        if finding.where == WORKERS:
            return self.workers_advice
        return self.current_advice()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._resumed = self.state["epoch"] is not None

    def _update(self, obs: Observation) -> list[Finding]:
        if obs.val_prints is not None:
            return self._validation(obs, np.unique(obs.val_prints))
        resumed, self._resumed = self._resumed, False
        if obs.sample_prints is None or not len(obs.sample_prints):
            return []
        prints = np.asarray(obs.sample_prints)
        st = self.state
        key, step = batch_key(prints), obs.step
        if st.get("only") is None:
            # a checkpoint from before this was kept: its batches are not known
            st["only"] = key if st["epoch"] is None else ""
        elif st["only"] != key:
            st["only"] = ""
        found: list[Finding] = []
        if st["epoch"] != obs.epoch:
            found += self._new_epoch(obs, key, resumed)
        else:
            if st.get("next") is None:
                found += self._next_batch(obs, key)
            found += self._resumed_within(obs, key) if resumed else self._again(obs, key)
        if key not in st["seen"] and len(st["kept"]) < self.KEEP:
            st["kept"].extend(prints[: self.KEEP - len(st["kept"])].tolist())
        st["seen"].setdefault(key, step)
        st["last"], st["batch"] = [step, key], len(prints)
        return found

    def _validation(self, obs: Observation, val: np.ndarray) -> list[Finding]:
        """A validation's prints: are its samples training samples?"""
        st = self.state
        if len(val) < 32 or not st["kept"] or "overlap" in st["warned"]:
            return []
        kept = set(st["kept"])
        hits = int(sum(p in kept for p in val.tolist()))
        # the share of an epoch's samples fingerprinted so far (an epoch not yet ended
        # counts its steps so far: fewer samples, a larger share, a smaller estimate)
        steps = st["length"] or obs.step - st["start"] + 1
        if steps == 1 and hits == len(val) == len(kept):
            return self._same_inputs(obs, len(val))
        covered = min(1.0, len(kept) / max(steps * st["batch"], 1))
        share = min(1.0, hits / (len(val) * covered))
        if hits < 5 or share < self.OVERLAP:
            return []
        return self._warn(
            obs,
            "overlap",
            f"The validation data overlaps the training data: {hits} of the {len(val)} "
            f"validation samples checked are samples the model trains on, and as the run "
            f"has fingerprinted about {covered:.0%} of the training set, roughly "
            f"{share:.0%} of the validation data is training data, so the validation "
            "loss flatters the model; split the data once, before shuffling or "
            "augmenting it, and remove duplicates across the splits.",
            value=share,
            threshold=self.OVERLAP,
            where=VALIDATION_DATA,
        )

    def _same_inputs(self, obs: Observation, n: int) -> list[Finding]:
        """Every epoch is one batch, and the validation's inputs are all of its own."""
        self.state["warned"].append("overlap")  # nothing more to tell of the two
        return [
            self.finding(
                obs,
                "info",
                f"The validation runs on the training inputs themselves: each epoch is one "
                f"batch, and the {n} validation samples checked are that batch's, all of "
                "them, as in a transductive split (node classification on one graph, where "
                "training and validation differ only in the nodes their losses are taken "
                "over), which the overlap check cannot tell from validating on the training "
                "data, so it leaves this run alone; check that the validation loss is "
                "taken over the validation mask alone (or, if the loaders were meant to "
                "differ, that the validation loader is not the training one).",
                value=1.0,
                where=SAME_INPUTS,
            )
        ]

    # -- the mistakes --------------------------------------------------------------
    def _new_epoch(self, obs: Observation, key: str, resumed: bool) -> list[Finding]:
        """An epoch's first batch: compare it with the last epoch's first."""
        st = self.state
        found: list[Finding] = []
        before, ran = st["epoch"], obs.step - st["start"]
        pending = False  # the epoch began with the last one's first batch
        # the very batch seen last, again: a stuck loader, which the next step tells
        again = key == st["last"][1]
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
        elif before is not None and not resumed and obs.epoch == before + 1:
            st["length"] = ran
            if ran > 1 and key == st["first"] and not again and obs.data_order != "sequential":
                # the same order, or whole batches reshuffled (a Keras PyDataset, batches
                # shuffled after batching) whose first came first again, one epoch in as
                # many as it has batches: the next batch measured tells
                pending = True
        if st["length"] != 1:
            # the next batch: is it the same one too, and is it the next epoch's next?
            self.request = self.needs
        st["epoch"], st["start"], st["first"], st["seen"] = obs.epoch, obs.step, key, {}
        st["next_before"], st["next"], st["order"] = st.get("next"), None, pending
        return found

    def _next_batch(self, obs: Observation, key: str) -> list[Finding]:
        """The first batch measured after an epoch's first: kept for the next epoch's, and
        set against the last epoch's where the epoch began with the last one's first."""
        st = self.state
        offset = obs.step - st["start"]
        st["next"] = [offset, key]
        pending, st["order"] = st.get("order"), False
        if not pending:
            return []
        earlier = st.get("next_before")
        if earlier is None or earlier[0] != offset:  # nothing to set it against
            what = ""
        elif earlier[1] == key:
            what = f", and so did its batch {offset}"
        else:
            return []  # whole batches reshuffled: only the first came first again
        return self._same_order(
            obs,
            f"epoch {obs.epoch} began with the very batch epoch {obs.epoch - 1} began with (the "
            f"same samples, in the same order){what}",
        )

    def _resumed_within(self, obs: Observation, key: str) -> list[Finding]:
        """A resumed run's first batch, in the epoch the checkpoint was taken in."""
        st = self.state
        again = obs.step - st["start"]
        if key != st["first"] or again <= 0 or st["only"] == key:
            return []  # the run's one batch so far tells nothing of where its loader is
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
        run, st["run"] = st.get("run"), None
        if consecutive and last_key == key:
            times = run[1] + 1 if run is not None and run[0] == key else 2
            workers = self.setup.loader_workers
            if times <= workers:
                # as many workers as that may each serve it once: the next batch tells
                st["run"] = [key, times]
                self.request = self.needs
                return []
            if st["only"] == key and (self.setup.whole_batches or self.setup.line_search):
                return self._one_batch(obs, times)
            return self._warn(
                obs,
                "stuck",
                f"The training loader serves the same batch again and again: the batches "
                f"of steps {step - times + 1} {'and' if times == 2 else 'to'} {step} are "
                "identical (the same samples, in the same order), as no shuffled or "
                "sequential loader serves them"
                + (f", and more times in a row than its {workers} workers" if workers > 1 else "")
                + "; check the dataset's __getitem__ and the loader for an index that never "
                "advances or a batch cached once (unless you overfit one batch on purpose).",
                value=float(times),
            )
        if consecutive and run is not None:
            return self._shared_workers(obs, run[1])
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

    def _one_batch(self, obs: Observation, times: int) -> list[Finding]:
        """The run's one batch, served at every step since its first: the data is that
        batch (full-batch training), said once."""
        if "one batch" in self.state["warned"]:
            return []
        self.state["warned"].append("one batch")
        return [self.finding(obs, "info", _one_batch(self.setup, obs.step), value=float(times))]

    def _shared_workers(self, obs: Observation, times: int) -> list[Finding]:
        """A batch came ``times`` times in a row, no more than the loader has workers,
        and then another."""
        workers = self.setup.loader_workers
        first = obs.step - times
        return self._warn(
            obs,
            "workers",
            f"The training loader's {workers} workers serve the same batches: the batches "
            f"of steps {first} {'and' if times == 2 else 'to'} {obs.step - 1} are identical "
            f"(the same samples, in the same order), {times} in a row, each from another "
            f"worker, and the batch of step "
            f"{obs.step} is new: the workers share one random state (a generator the "
            "dataset holds, np.random.default_rng or RandomState made before the workers "
            "start, is copied into each), or each yields a whole iterable dataset, so "
            "every sample is trained on "
            f"{times} times and augmentations repeat; seed each worker's generator in the "
            "loader's worker_init_fn (e.g. get_worker_info().dataset.rng = "
            "np.random.default_rng(get_worker_info().seed), or np.random.seed(torch."
            "initial_seed() % 2**32) for the global one), draw with torch's random "
            "functions, which the loader seeds per worker, or split an iterable dataset "
            "across workers with get_worker_info().",
            value=float(times),
            threshold=float(workers),
            where=WORKERS,
        )

    def _same_order(self, obs: Observation, what: str) -> list[Finding]:
        if "workers" in self.state["warned"]:
            return []  # workers that start from the same random state every epoch: said
        return self._warn(
            obs,
            "order",
            f"The training data comes in the same order every epoch: {what}, so every "
            "epoch repeats the same batches (a DistributedSampler without set_epoch, a "
            "dataset shuffled with a fixed seed, tf.data's "
            "shuffle(reshuffle_each_iteration=False), keras.utils.set_random_seed before "
            "fit(shuffle=True)); reshuffle "
            "every epoch with sampler.set_epoch(epoch) or a seed that changes with the "
            "epoch (unless the order is deliberate).",
            value=1.0,
        )

    def _warn(
        self,
        obs: Observation,
        mistake: str,
        message: str,
        *,
        value: float,
        threshold: float = 0.0,
        where: str = "data",
    ) -> list[Finding]:
        warned = self.state["warned"]
        if mistake in warned:
            return []
        warned.append(mistake)
        return [
            self.finding(obs, "warning", message, value=value, threshold=threshold, where=where)
        ]


def _one_batch(setup: TrainingSetup, step: int) -> str:
    """The info that the run's one batch at every step is full-batch training."""
    why = (
        f"its optimizer, {setup.line_search}, is a full-batch method (its line search and "
        "curvature need the same objective at every step)"
        if setup.line_search
        else "its loader serves batches its dataset makes whole (batch_size=None)"
    )
    return (
        "The training loader serves one batch at every step: every batch measured since the "
        f"run's first, up to step {step}, is the same one (the same samples, in the same "
        f"order), and {why}, so this is taken for full-batch training, the whole training "
        "set at every step, and left alone; if the dataset holds more than this one batch, "
        "its __getitem__ ignores its index or the loader caches one batch."
    )
