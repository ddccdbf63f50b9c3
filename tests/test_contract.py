"""Layer 3, detectors: what every detector in ``DETECTORS`` promises, checked on each of them."""

from __future__ import annotations

import inspect
import json
import math
import pickle
import re

import numpy as np
import pytest

from stethoscope.advice import TrainingSetup, small_epsilon
from stethoscope.detectors import DETECTORS, Detector, EpsilonUnderflow, LossDividedTwice
from stethoscope.findings import FIELDS, Finding
from stethoscope.observation import Observation
from stethoscope.statistics import STATISTICS

#: The stable detector names (docs/detectors.md): findings, configs and stop_on use them.
STABLE_NAMES = (
    "nonfinite_loss",
    "nonfinite_gradients",
    "nonfinite_weights",
    "exploding_gradients",
    "vanishing_gradients",
    "loss_spike",
    "loss_not_decreasing",
    "loss_at_chance",
    "unstable_loss",
    "overfitting",
    "unlearned_validation",
    "dead_relu",
    "saturated_activation",
    "small_updates",
    "large_updates",
    "frozen_weights",
    "poor_initialization",
    "class_imbalance",
    "unnormalized_input",
    "unshuffled_data",
    "repeated_data",
    "logits_mismatch",
    "broadcast_loss",
    "collapsed_lr",
    "eval_mode",
    "validation_mode",
    "train_override",
    "unzeroed_gradients",
    "loss_divided_twice",
    "all_zero",
    "rounded_updates",
    "gradient_underflow",
    "loss_scale_collapse",
    "overflow_risk",
    "epsilon_underflow",
    "fp8_readiness",
    "replica_divergence",
    "straggler",
)


# loss_divided_twice in the only run it judges: one whose loss is divided twice (it reads
# nothing else of an observation)
class _DividedTwice(LossDividedTwice):
    __doc__ = LossDividedTwice.__doc__  # its contract is the detector's
    setup = TrainingSetup(divided_again=4)


# epsilon_underflow in the only run it judges: float16 weights under Adam's eps=1e-8
class _ZeroEpsilon(EpsilonUnderflow):
    __doc__ = EpsilonUnderflow.__doc__
    setup = TrainingSetup(small_epsilon=small_epsilon("Adam", "eps", 1e-8, ["float16"]))


#: Each detector as these runs need it: one that judges a setup alone is given that setup.
_IN_ITS_SETUP = {
    "loss_divided_twice": _DividedTwice,
    "epsilon_underflow": _ZeroEpsilon,
}
CLASSES = [pytest.param(_IN_ITS_SETUP.get(name, cls), id=name) for name, cls in DETECTORS.items()]
#: Detectors whose state is only streaks over the last few observations (a unit is dead after
#: ``window`` zero rows in a row), so a fresh one catches up with a restored one in the tail.
SHORT_MEMORY = {
    "dead_relu",
    "saturated_activation",
    "large_updates",
    "frozen_weights",
    "all_zero",
    "straggler",  # the ratios of its last ``window`` samples
    "nonfinite_gradients",  # a streak of overflows under a loss scaler
    "eval_mode",  # a streak of steps in eval mode
    "unlearned_validation",  # a streak of validations no better than the start
    "validation_mode",  # whether the first validation was judged: none in these runs
    "train_override",  # said once, at the first measured step
    "unzeroed_gradients",  # a streak of steps whose gradients were not zeroed
    "logits_mismatch",  # a streak of steps whose loss was fed the wrong output
    "broadcast_loss",  # a streak of steps whose loss broadcast
    "loss_divided_twice",  # said once, at the first gradients: whether it has is all
    "epsilon_underflow",  # likewise
    "rounded_updates",  # a streak of steps whose updates rounded away
    "gradient_underflow",  # a streak of steps whose gradients underflowed
    "overflow_risk",  # the tensors it warned of: the tail's, whatever came before
    "fp8_readiness",  # a streak, and each gradient's last largest magnitude
}
NAMES = ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias")
GRAD = np.array([0.5, 0.05, 0.8, 0.1])
UNITS = 128
FEATURES = 8
RANKS = 4
#: The tensors the replicas compare: the parameters, then a BatchNorm buffer.
REPLICAS = (*NAMES, "norm.running_mean")


def ranks(step: int, *, slow: int | None = None, diverged: int | None = None):
    """The rank probes of a 4-rank run: each rank's busy seconds per step (a little
    jitter) and the replicas' checksums; ``slow`` takes 3x as long, ``diverged`` holds a
    different ``layer1.weight``. Their own generator, so the other probes draw as before."""
    rng = np.random.default_rng(10_000 + step)
    busy = 0.05 * rng.lognormal(0.0, 0.1, RANKS)
    if rng.random() < 0.02:
        busy[rng.integers(RANKS)] = float("nan")  # a rank that measured no step
    if slow is not None:
        busy[slow] *= 3
    sums = np.tile(np.arange(len(REPLICAS), dtype=np.int64) * 7919 + step, (RANKS, 1))
    if diverged is not None:
        sums[diverged, 2] += 1
    return {
        "replica_names": REPLICAS,
        "replica_buffer": np.array([False] * len(NAMES) + [True]),
        "replica_sums": sums,
        "rank_busy": busy,
    }


def obs(
    step: int,
    loss: float,
    grads,
    weights,
    updates,
    lr: float = 1e-3,
    *,
    rng: np.random.Generator | None = None,
    dead: float = 0.0,
    saturated: float = 0.05,
    rms=(1.0, 0.8),
    input_scale: float = 1.0,
    labels=None,
    val: tuple[float, float] | None = None,
    start: float | None = None,
    slow: int | None = None,
    diverged: int | None = None,
    eval_modules: tuple[str, ...] = (),
    stale: float = 0.0,
    stuck: bool = False,
    probabilities: bool = False,
    broadcast: bool = False,
    lost: float = 0.01,
    subnormal: float = 0.001,
    peak: float = 3.0,
    scale: float = 65536.0,
    skipped: int = 0,
    fp8_lost: float = 0.0,
    half: bool = False,
    training_calls: tuple[str, ...] | None = None,
    bypassed: str | None = None,
) -> Observation:
    """An observation with every probe: parameters, units, activations, data, validation,
    precision (layer1's output in float16, its parameters too if ``half``; a loss scaler),
    and the facts gathered from every rank of a distributed run."""
    rng = rng if rng is not None else np.random.default_rng(step)
    zero = rng.random(UNITS) < 0.05  # a healthy ReLU layer: a few units idle on a batch
    zero[: int(dead * UNITS)] = True
    return Observation(
        step=step,
        loss=float(loss),
        lr=lr,
        names=NAMES,
        numel=np.array([100352, 128, 1280, 10]),
        is_matrix=np.array([True, False, True, False]),
        grad_norm=np.asarray(grads, dtype=float),
        weight_norm=np.asarray(weights, dtype=float),
        update_norm=np.asarray(updates, dtype=float),
        fan_in=np.array([784.0, np.nan, 128.0, np.nan]),
        unit_names=("layer0",),
        unit_zero=(zero,),
        act_names=("layer0", "act0", "layer1"),
        act_kinds=("layer", "tanh", "layer"),
        act_saturated=np.array([np.nan, saturated, np.nan]),
        act_rms=np.array([rms[0], 0.7, rms[1]]),
        act_max=np.array([4.0, 1.0, peak]),
        act_dtypes=("float32", "float32", "float16"),
        dtypes=("float32", "float32", *(("float16",) * 2 if half else ("float32",) * 2)),
        grad_subnormal=np.array([0.0, 0.0, subnormal, 0.0]),
        grad_zero=np.array([0.0, 0.0, 0.01, 0.0]),
        grad_peak=np.array([0.1, 0.01, 0.2, 0.02]),
        update_lost=np.array([0.0, 0.0, lost, 0.0]),
        fp8_underflow=np.array([[0.0, 0.0, 0.0, 0.0]] * 4) + [[fp8_lost, 0.0, 0.0, fp8_lost]] * 4,
        fp8_amax=np.array([[1.0, 0.1]] * 4),
        loss_scale=scale,
        scale_skipped=skipped,
        scale_steps=1,
        input_sq=input_scale**2 * rng.lognormal(0.0, 0.1, FEATURES),
        input_count=32,
        labels=np.asarray(labels if labels is not None else rng.integers(0, 4, 32)),
        val_loss=None if val is None else val[0],
        train_loss=None if val is None else val[1],
        start_loss=start,
        val_training_calls=training_calls,
        eval_modules=eval_modules,
        bypassed_train=bypassed,
        stale_grads=stale,
        sample_prints=prints(step, stuck=stuck),
        output_probs=1.0 if probabilities else 0.0,
        output_width=4,
        loss_expects="logits",
        loss_broadcast=BROADCAST if broadcast else "",
        **ranks(step, slow=slow, diverged=diverged),
    )


#: What the loss graph says of a broadcast loss.
BROADCAST = "a (32, 1) prediction against a target made a (32, 32) tensor in Sub"


def prints(step: int, *, stuck: bool = False) -> np.ndarray:
    """The prints of a batch of 32 samples: new ones each step, or (``stuck``) those of
    one batch served again and again. Their own generator, so the other probes draw as
    before."""
    rng = np.random.default_rng(20_000 + (0 if stuck else step))
    return rng.integers(0, 2**47, 32).astype(float)


def random_run(
    n: int = 300, seed: int = 0, *, bad_start: bool = False, level: float = 2.3
) -> list[Observation]:
    """Healthy-looking random observations with every probe, a few NaNs among them, the
    loss around ``level``.

    ``bad_start``: the run also starts badly (huge first-layer weights, exploding
    activations, skewed labels, inputs x100), for the detectors that judge the start.
    """
    rng = np.random.default_rng(seed)
    out = []
    for t in range(n):
        loss = level * rng.lognormal(0.0, 0.1)
        grads = GRAD * rng.lognormal(0.0, 0.3, 4)
        if rng.random() < 0.02:
            loss = float("nan")
        if rng.random() < 0.02:
            grads[rng.integers(4)] = float("inf")
        weights = 5 * rng.lognormal(0, 0.01, 4)
        early = bad_start and t < 20
        if early:
            weights[0] *= 100
        val = (1.0 - t / 1000, 0.9 - t / 1000) if t % 10 == 9 else None
        out.append(
            obs(
                t,
                loss,
                grads,
                weights,
                rng.lognormal(-5, 0.3, 4),
                rng=rng,
                rms=(1.0, 5000.0) if early else (1.0, 0.8),
                input_scale=100.0 if early else 1.0,
                labels=np.r_[np.zeros(31, int), 1] if early else None,
                val=val,
            )
        )
    return out


def fault_tail(start: int, n: int = 50, seed: int = 1, level: float = 2.3) -> list[Observation]:
    """``n`` steps after a random run: a spike, NaNs, an explosion, starved gradients, a
    climb; from step 40 on, dead units and saturation, then huge, zero and tiny updates,
    a zero gradient, and a validation loss that rises while training improves, never better
    than where the run began; from step
    48, batches of one class at a time (unshuffled labels); from step 60 to 70, the model
    left in eval mode; from step 85 to 90, one batch served again and again; from step 90
    to 95, probabilities fed to a loss that takes logits; from step 95 to 100, a loss that
    broadcasts the prediction against the target; from step 100 to 110, gradients never
    zeroed; from step 120, a learning rate collapsed to a ten-thousandth. From step 40
    layer1 is held in float16: its updates round away from step 50 to 60, its gradient
    underflows from 60 to 66, its output nears float16's maximum at step 70, the loss
    scaler skips every step from 64 on, and a tenth of the weights and gradients would
    round to zero in fp8 from step 110. Rank 3's replica differs throughout; rank 2 is
    three times slower from step 20 to 40."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        loss = level * rng.lognormal(0.0, 0.1) * (3.0 if i >= 8 else 1.0)
        grads = GRAD * rng.lognormal(0.0, 0.3, 4)
        weights = 5 * rng.lognormal(0, 0.01, 4)
        updates = rng.lognormal(-5, 0.3, 4)
        if i == 5:
            loss *= 10
        if i == 10:
            loss = float("nan")
        if 15 <= i < 18:
            grads = grads * 1000
        if i == 20:
            grads[1] = float("nan")
        if i == 25:
            weights[2] = float("inf")
        if 30 <= i < 35:
            grads = np.array([1e-9, 1e-9, 1e-2, 1e-3])
        if 40 <= i < 45:
            updates[2] *= 1e4  # ratio ~10: the optimizer step is as large as the weights
        if i >= 45:
            updates = updates * 1e-4  # far too small to train
        if 20 <= i < 35:
            updates[2] = 0.0  # layer1.weight stops moving while the others move
        if 75 <= i < 80:
            grads[2] = 0.0  # no gradient reaches layer1.weight
        val = (1.0 + 0.1 * i / 10, 0.5 - 0.01 * i / 10) if i % 10 == 9 else None
        labels = np.full(32, (i // 4) % 4) if i >= 48 else None
        left_in_eval = ("<model>",) if 60 <= i < 70 else ()
        unzeroed = 4.0 if 100 <= i < 110 else 0.0
        stuck = 85 <= i < 90
        probabilities = 90 <= i < 95
        broadcast = 95 <= i < 100
        skipping = i >= 64
        out.append(
            obs(
                start + i,
                loss,
                grads,
                weights,
                updates,
                1e-7 if i >= 120 else 1e-3,
                rng=rng,
                labels=labels,
                eval_modules=left_in_eval,
                stale=unzeroed,
                stuck=stuck,
                probabilities=probabilities,
                broadcast=broadcast,
                lost=0.9 if 50 <= i < 60 else 0.01,
                subnormal=0.3 if 60 <= i < 66 else 0.001,
                peak=30000.0 if i == 70 else 3.0,
                scale=65536.0 / 2.0 ** max(i - 63, 0),
                skipped=int(skipping),
                fp8_lost=0.1 if i >= 110 else 0.0,
                half=i >= 40,
                dead=0.8 if i >= 40 else 0.0,
                saturated=0.9 if i >= 40 else 0.05,
                val=val,
                start=None if val is None else 1.0,  # the validations stay above it
                training_calls=("F.dropout(training=True) in layer0",) if i == 109 else None,
                bypassed="layer0 overrides train() to put layer0 in eval mode" if i == 0 else None,
                slow=2 if 20 <= i < 40 else None,
                diverged=3,
            )
        )
    return out


def fault_run() -> list[Observation]:
    """A run in which every detector has something to report."""
    # the loss is flat (loss_not_decreasing at 200) at the chance level of the skewed
    # labels counted at the start (loss_at_chance at 304)
    flat = random_run(300, seed=2, bad_start=True, level=SKEWED_CHANCE)
    tail = fault_tail(300, 130, level=SKEWED_CHANCE)  # it climbs 3x and stays: unstable_loss
    return [*flat, *tail]


#: The entropy (nats) of the skewed labels of a bad start: 31 of 32 are class 0.
SKEWED_CHANCE = -(31 / 32 * math.log(31 / 32) + 1 / 32 * math.log(1 / 32))


def feed(detector: Detector, observations) -> list[Finding]:
    return [f for o in observations for f in detector.update(o)]


def numeric_args(cls: type[Detector]) -> list[inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [
        p for p in params if isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
    ]


def _bad_arg_cases():
    for name, cls in DETECTORS.items():
        for p in numeric_args(cls):
            bads = [0, -1, "x", True, None]
            if isinstance(p.default, int):
                bads.append(2.5)
            for bad in bads:
                yield pytest.param(cls, p.name, bad, id=f"{name}-{p.name}={bad!r}")


# -- identity -------------------------------------------------------------------------------------
def test_registry_is_keyed_by_name_and_covers_every_stable_name():
    assert all(cls.name == name for name, cls in DETECTORS.items())
    assert sorted(DETECTORS) == sorted(STABLE_NAMES)  # every stable name is implemented


@pytest.mark.parametrize("cls", CLASSES)
def test_class_attributes(cls):
    assert cls.name in STABLE_NAMES
    assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", cls.name)
    assert cls.needs and set(cls.needs) <= set(STATISTICS)
    assert isinstance(cls.base_interval, int) and cls.base_interval >= 1
    assert cls.advice and isinstance(cls.advice, str)
    assert "Rule:" in cls.__doc__


# -- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_construction_with_defaults(cls):
    d = cls()
    assert d.state == d.state_dict() == cls().state_dict()
    assert d.suspect is None
    assert repr(d) == f"{cls.__name__}()"
    for p in numeric_args(cls):  # the defaults are what the instance uses
        assert getattr(d, p.name) == p.default


@pytest.mark.parametrize("cls", CLASSES)
def test_arguments_are_keyword_only(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    with pytest.raises(TypeError):
        cls(1)


@pytest.mark.parametrize(("cls", "arg", "bad"), list(_bad_arg_cases()))
def test_bad_numeric_argument_raises_naming_it(cls, arg, bad):
    with pytest.raises(ValueError, match=re.escape(f"{arg}={bad!r}")) as info:
        cls(**{arg: bad})
    assert cls.name in str(info.value)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        pytest.param(DETECTORS["exploding_gradients"], {"factor": 1}, "factor=1", id="factor-1"),
        pytest.param(DETECTORS["loss_spike"], {"warmup": 200}, "warmup=200", id="warmup>window"),
        pytest.param(
            DETECTORS["loss_not_decreasing"], {"patience": 10}, "patience=10", id="patience<window"
        ),
        pytest.param(
            DETECTORS["loss_not_decreasing"], {"min_progress": 1}, "min_progress=1", id="progress"
        ),
        # d6cb240: a loss / median ratio below 1 and gradient fractions of 1 or more are nonsense
        pytest.param(DETECTORS["loss_spike"], {"ratio": 0.5}, "ratio=0.5", id="spike-ratio<1"),
        pytest.param(DETECTORS["vanishing_gradients"], {"ratio": 1}, "ratio=1", id="vg-ratio-1"),
        pytest.param(
            DETECTORS["vanishing_gradients"], {"ratio": 1.5}, "ratio=1.5", id="vg-ratio>1"
        ),
        pytest.param(
            DETECTORS["vanishing_gradients"],
            {"loss_fraction": 1.0},
            "loss_fraction=1.0",
            id="vg-loss-fraction-1",
        ),
    ],
)
def test_inconsistent_arguments_raise_naming_them(cls, kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        cls(**kwargs)
    assert cls.name in str(info.value)


def test_boundary_arguments_are_accepted():
    assert DETECTORS["loss_spike"](ratio=1).ratio == 1.0  # ratio >= 1, not > 1
    vg = DETECTORS["vanishing_gradients"](ratio=0.999, loss_fraction=0.999)
    assert (vg.ratio, vg.loss_fraction) == (0.999, 0.999)


# -- state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_pickle_round_trip_keeps_config_and_state(cls):
    d = cls()
    feed(d, random_run())
    copy = pickle.loads(pickle.dumps(d))
    assert type(copy) is cls
    assert vars(copy) == vars(d)
    tail = fault_tail(300)
    assert [f.to_dict(json_safe=True) for f in feed(copy, tail)] == [
        f.to_dict(json_safe=True) for f in feed(d, tail)
    ]


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_round_trip_through_json_continues_identically(cls):
    d = cls()
    feed(d, random_run())
    state = json.loads(json.dumps(d.state_dict(), allow_nan=False))
    restored, fresh = cls(), cls()
    restored.load_state_dict(state)
    assert restored.state_dict() == d.state_dict()
    tail = fault_tail(300)
    expected = [f.to_dict(json_safe=True) for f in feed(d, tail)]
    assert [f.to_dict(json_safe=True) for f in feed(restored, tail)] == expected
    assert restored.state_dict() == d.state_dict()
    if d.state_dict() and cls.name not in SHORT_MEMORY:
        feed(fresh, tail)  # a stateful detector: the restored baselines made the difference
        assert fresh.state_dict() != d.state_dict()


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_is_strict_json_after_a_fault_run(cls):
    d = cls()
    feed(d, fault_run())
    text = json.dumps(d.state_dict(), allow_nan=False)
    assert json.loads(text) == d.state_dict()


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_is_a_copy_and_load_ignores_unknown_keys(cls):
    d = cls()
    feed(d, random_run(100))
    state = d.state_dict()
    before = json.dumps(d.state_dict())
    for v in state.values():
        if isinstance(v, list):
            v.append(123.0)
    assert json.dumps(d.state_dict()) == before
    other = cls()
    other.load_state_dict({**d.state_dict(), "from_a_future_version": 1})
    assert other.state_dict() == d.state_dict()
    other.load_state_dict({})
    assert other.state_dict() == cls().state_dict()


@pytest.mark.parametrize("cls", CLASSES)
def test_reset_returns_to_the_initial_state(cls):
    d = cls()
    first = [f.to_dict(json_safe=True) for f in feed(d, fault_run())]
    d.reset()
    assert d.state_dict() == cls().state_dict()
    assert d.suspect is None
    assert [f.to_dict(json_safe=True) for f in feed(d, fault_run())] == first


# -- findings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_fault_run_findings_are_well_formed(cls):
    found = feed(cls(), fault_run())
    assert found, f"{cls.name} found nothing in the fault run"
    for f in found:
        assert f.detector == cls.name
        assert f.severity.value in ("warning", "error")
        assert f.message.strip() and f.message.endswith(".")
        assert f.message[0].isupper()
        d = f.to_dict(json_safe=True)
        assert tuple(d) == FIELDS
        assert json.loads(json.dumps(d, allow_nan=False)) == d
        assert Finding.from_dict(d).to_dict(json_safe=True) == d


@pytest.mark.parametrize("cls", CLASSES)
def test_suspect_is_cleared_by_the_next_update(cls):
    d = cls()
    feed(d, random_run(100))
    d.suspect = "left over from the previous step"
    d.update(obs(100, 2.3, GRAD, np.full(4, 10.0), np.full(4, 7e-3)))
    assert d.suspect is None


def test_dir_lists_the_callbacks_that_are_imported_lazily():
    import stethoscope

    names = dir(stethoscope)
    assert {"LightningStethoscope", "KerasStethoscope", "Recovery", "Monitor"} <= set(names)
