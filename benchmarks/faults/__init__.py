"""Fault-injection suite: how well stethoscope's detectors find known faults, with numbers.

Each scenario (``scenarios.py``) trains a small model (an MLP, a CNN or a GRU, on
synthetic data or scikit-learn's bundled digits; seconds on 2 CPU cores) and
injects one fault at a known step, or none (a healthy control that sets a known
trap: standardised data past ±1, a loss converging to ~0.005, warm-up from 0 with
clipping, noisy small-batch SGD, a frozen layer, a cosine schedule to 0, batch norm
and dropout …). It states the detector that must name the fault, a step window,
and the detectors whose findings are acceptable collateral.

Every scenario runs for several seeds. In Lightning (``lightning_suite.py``) one
``Trainer.fit`` each is watched at the same time by stethoscope under one or three
sampling settings and by what users use today (Lightning's
``EarlyStopping(check_finite=True)`` and ``SpikeDetection``, a hand-written NaN
check). In Keras 3 (``keras_suite.py``, TensorFlow backend) a model carries one
``KerasStethoscope`` per fit, so each setting gets its own, identical ``model.fit``
(checked step by step), and the baselines (Keras' ``EarlyStopping``,
``TerminateOnNaN`` and the same hand-written check) watch one more, unwatched by
stethoscope, as a user without it would train (see ``keras_suite``). ``metrics.py`` turns the
findings into recall, false alarms, misdiagnoses and latency; ``report.py`` prints
the tables.

The scenario specs, data, results and scoring know no framework;
``lightning_overhead.py`` measures the per-step cost of each sampling setting in
Lightning.

Run:
    python -m benchmarks.faults                       # every scenario, 3 seeds, adaptive
    python -m benchmarks.faults --setting all         # + every-step and sparse, + overhead
    python -m benchmarks.faults --quick --only nan_input,healthy_standardized
    python -m benchmarks.faults --framework keras     # the Keras 3 implementation
    python -m benchmarks.faults --framework all       # both in turn, then side by side
    python -m benchmarks.faults --markdown --json faults.json
"""

from __future__ import annotations

from benchmarks.faults.metrics import Summary, Verdict, judge, judge_baseline, summarize
from benchmarks.faults.results import BASELINES, RunResult
from benchmarks.faults.scenarios import SCENARIOS, SETTINGS, Scenario, select

__all__ = [
    "BASELINES",
    "SCENARIOS",
    "SETTINGS",
    "RunResult",
    "Scenario",
    "Summary",
    "Verdict",
    "judge",
    "judge_baseline",
    "select",
    "summarize",
]
