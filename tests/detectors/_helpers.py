"""Builders for the synthetic observations and sequences the detector units feed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding, Severity
from stethoscope.observation import Observation

#: Four parameters in registration order (input side first): two matrices, two biases.
NAMES = ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias")
IS_MATRIX = (True, False, True, False)
NUMEL = (784 * 128, 128, 128 * 10, 10)
#: Typical relative gradient norms of those four parameters.
GRAD_SHAPE = np.array([0.5, 0.05, 0.8, 0.1])

NAN, INF = float("nan"), float("inf")


def make_obs(
    step: int,
    *,
    loss: float | None = None,
    lr: float | None = None,
    grads: Sequence[float] | np.ndarray | None = None,
    weights: Sequence[float] | np.ndarray | None = None,
    updates: Sequence[float] | np.ndarray | None = None,
    names: Sequence[str] | None = None,
    is_matrix: Sequence[bool] | None = None,
    numel: Sequence[int] | None = None,
    epoch: int = 0,
    rank: int = 0,
) -> Observation:
    """One observation; with four parameters they are :data:`NAMES` unless given."""
    arrays = [a for a in (grads, weights, updates) if a is not None]
    n = len(arrays[0]) if arrays else 0
    default = n == len(NAMES)
    if names is None:
        names = NAMES if default else tuple(f"p{i}" for i in range(n))
    if is_matrix is None:
        is_matrix = IS_MATRIX if default else (True,) * n
    if numel is None:
        numel = NUMEL if default else (1000,) * n
    return Observation(
        step=step,
        epoch=epoch,
        rank=rank,
        loss=None if loss is None else float(loss),
        lr=None if lr is None else float(lr),
        names=tuple(names),
        numel=np.asarray(numel, dtype=np.int64) if arrays else None,
        is_matrix=np.asarray(is_matrix, dtype=bool) if arrays else None,
        grad_norm=None if grads is None else np.asarray(grads, dtype=np.float64),
        weight_norm=None if weights is None else np.asarray(weights, dtype=np.float64),
        update_norm=None if updates is None else np.asarray(updates, dtype=np.float64),
    )


def loss_obs(losses: Iterable[float], lr: float | Sequence[float] | None = None):
    """One loss-only observation per value, at steps 0, 1, 2 …"""
    losses = [float(x) for x in losses]
    lrs = list(lr) if isinstance(lr, (Sequence, np.ndarray)) else [lr] * len(losses)
    lrs = [None if r is None else float(r) for r in lrs]
    # what make_obs(t, loss=x, lr=r) builds, without its per-call overhead (100-seed loops)
    return [
        Observation(step=t, loss=x, lr=r) for t, (x, r) in enumerate(zip(losses, lrs, strict=True))
    ]


def grad_obs(grads: np.ndarray, losses: Iterable[float] | None = None, **kw):
    """One gradient observation per row of ``grads`` (samples x parameters), steps 0, 1, 2 …"""
    grads = np.asarray(grads, dtype=np.float64)
    losses = [2.3] * len(grads) if losses is None else [float(x) for x in losses]
    return [
        make_obs(t, loss=x, grads=g, **kw)
        for t, (g, x) in enumerate(zip(grads, losses, strict=True))
    ]


def run(detector: Detector, observations: Iterable[Observation]) -> list[Finding]:
    """Feed every observation in order; return every finding."""
    found: list[Finding] = []
    for obs in observations:
        found.extend(detector.update(obs))
    return found


def alarms(findings: Iterable[Finding]) -> list[Finding]:
    """The warnings and errors among ``findings``."""
    return [f for f in findings if f.severity >= Severity.WARNING]


def steps(findings: Iterable[Finding]) -> list[tuple[int, str]]:
    """(step, severity) of each finding: what most assertions compare."""
    return [(f.step, f.severity.value) for f in findings]


def assert_actionable(finding: Finding, *fix_words: str) -> None:
    """The message names the step, ends as one sentence, and its last clause is the fix."""
    msg = finding.message
    assert re.search(rf"\b(step|steps to) {finding.step}\b", msg), msg
    assert msg.endswith("."), msg
    fix = msg.rsplit(";", 1)[-1].lower()
    for word in fix_words:
        assert word.lower() in fix, (word, msg)


# -- healthy sequences (docs/detectors.md, "What healthy runs do") -----------------------------
def decaying_loss(seed: int, n: int = 2000, hard: float = 2.0, p_hard: float = 0.01):
    """Exponential decay 2.3 → 0.005, lognormal(σ=0.3) noise, ``p_hard`` batches ``hard``x."""
    rng = np.random.default_rng(seed)
    level = 2.3 * (0.005 / 2.3) ** (np.arange(n) / (n - 1))
    x = level * rng.lognormal(0.0, 0.3, n)
    return np.where(rng.random(n) < p_hard, hard * x, x)


def batch8_loss(seed: int, n: int = 2000, tau: float | None = None):
    """Mean of 8 per-sample losses, 20% of them hard (~5), the rest easy (~0.1).

    With ``tau`` the whole curve decays as exp(-t / tau).
    """
    rng = np.random.default_rng(seed)
    hard = rng.random((n, 8)) < 0.2
    per_sample = np.where(
        hard, rng.lognormal(np.log(5.0), 0.1, (n, 8)), rng.lognormal(np.log(0.1), 0.2, (n, 8))
    )
    x = per_sample.mean(axis=1)
    return x if tau is None else x * np.exp(-np.arange(n) / tau)


# -- layer-1 tests of the activation, weight, data and validation detectors ------------------------
def assert_sentence(finding: Finding, *fix_words: str, names: Sequence[str] = ()) -> None:
    """One sentence (no full stop inside but ``e.g.``) that names each of ``names`` and whose
    last clause holds the fix: for findings whose message need not name the step."""
    msg = finding.message
    assert msg[:1].isupper() and msg.endswith("."), msg
    assert not re.search(r"\.\s+[A-Z]", msg.replace("e.g.", "eg")), msg
    for name in names:
        assert name in msg, (name, msg)
    fix = msg.rsplit(";", 1)[-1].lower()
    for word in fix_words:
        assert word.lower() in fix, (word, msg)


def assert_resumes(
    cls: type[Detector], observations: Sequence[Observation], at: int, **kwargs
) -> list[Finding]:
    """Checkpoint a ``cls(**kwargs)`` after ``observations[:at]`` through strict JSON, restore it
    into a fresh one, and check it goes on exactly as an uninterrupted one; return the findings."""
    import json

    whole, head, resumed = cls(**kwargs), cls(**kwargs), cls(**kwargs)
    expected = run(whole, observations)
    found = run(head, observations[:at])
    resumed.load_state_dict(json.loads(json.dumps(head.state_dict(), allow_nan=False)))
    found += run(resumed, observations[at:])
    assert [f.to_dict(json_safe=True) for f in found] == [
        f.to_dict(json_safe=True) for f in expected
    ]
    assert resumed.state_dict() == whole.state_dict()
    return expected
