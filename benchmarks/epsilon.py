"""Adam's epsilon against float16 weights: where the training ends, epsilon by epsilon.

An MLP (two hidden ReLU layers) learns ``sklearn``'s digits for 300 steps of 64 samples,
its weights and Adam's moments in float16 ("16-true"; Keras: the "float16" dtype
policy), at several epsilons, beside the same training in float32. Each cell is the
final cross-entropy on the whole set. It is the evidence behind ``epsilon_underflow``
and behind the epsilon that ``nonfinite_weights`` and ``large_updates`` name (see
docs/detectors.md#epsilon_underflow). No stethoscope runs here: it measures the
optimizer, not the detector.

Run:
    python -m benchmarks.epsilon                     # torch, ~1 min
    python -m benchmarks.epsilon --framework keras   # Keras 3 on TensorFlow, ~2 min
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np
from sklearn.datasets import load_digits

from benchmarks._machine import machine

EPSILONS = (1e-8, 1e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4)
SETTINGS = ((1e-3, 128), (1e-3, 512), (1e-4, 128), (1e-4, 512))  # (lr, width)
STEPS, BATCH = 300, 64


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def torch_run(eps: float, half: bool, lr: float, width: int, *, fused: bool = False) -> float:
    """The final loss of one torch training."""
    import torch

    x, y = (torch.tensor(a) for a in _digits())
    dtype = torch.float16 if half else torch.float32
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, eps=eps, fused=fused or None)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        i = torch.randint(0, len(x), (BATCH,), generator=g)
        loss = torch.nn.functional.cross_entropy(net(x[i].to(dtype)).float(), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(net(x.to(dtype)).float(), y).item()


def keras_run(eps: float, half: bool, lr: float, width: int, *, fused: bool = False) -> float:
    """The final loss of one Keras training (the same steps: 300 batches of 64)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    x, y = _digits()
    keras.config.set_dtype_policy("float16" if half else "float32")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(10, dtype="float32"),
            ]
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.Adam(lr, epsilon=eps), loss)
        rng = np.random.default_rng(0)
        i = rng.integers(0, len(x), STEPS * BATCH)
        model.fit(x[i], y[i], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return float(model.evaluate(x, y, verbose=0))
    finally:
        keras.config.set_dtype_policy("float32")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch")
    args = parser.parse_args(argv)
    run = torch_run if args.framework == "torch" else keras_run
    print(f"# {args.framework}, {STEPS} steps of {BATCH}; {machine()}")
    header = " | ".join(f"{e:g}" for e in EPSILONS)
    print(f"| lr, width | float32 | float16 eps {header} |")
    print("|---" * (len(EPSILONS) + 2) + "|")
    for lr, width in SETTINGS:
        ref = run(1e-8 if args.framework == "torch" else 1e-7, False, lr, width)
        cells = " | ".join(f"{run(e, True, lr, width):.3g}" for e in EPSILONS)
        print(f"| {lr:g}, {width} | {ref:.3g} | {cells} |", flush=True)
    if args.framework == "torch":  # a fused kernel computes in float32, keeps v in float16
        lr, width = SETTINGS[0]
        print(
            f"fused AdamW, eps 1e-8, lr {lr:g}, width {width}: "
            f"{torch_run(1e-8, True, lr, width, fused=True):.3g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
