"""Train an MLP on scikit-learn's digits with Lightning, and let stethoscope listen.

    python examples/lightning_digits.py --fault none      # a healthy run: nothing to report
    python examples/lightning_digits.py --fault lr        # learning rate far too high
    python examples/lightning_digits.py --fault nan       # a corrupt batch holds a NaN
    python examples/lightning_digits.py --fault vanishing # deep sigmoid net, tiny init
    python examples/lightning_digits.py --fault spike     # one batch unnormalised (x100)
    python examples/lightning_digits.py --fault stall     # learning rate 1e-7: nothing learns

The digits ship inside scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import math

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stethoscope import LightningStethoscope
from stethoscope.sinks import ConsoleSink, JSONLSink
from stethoscope.testing import CapturingSink

FAULTS = {
    "none": "a healthy run",
    "lr": "SGD with a learning rate far too high (lr=3.0, momentum 0.9)",
    "nan": "one corrupt input batch at step 150 holds a NaN",
    "vanishing": "a 10-layer sigmoid network initialised with tiny weights",
    "spike": "one batch at step 150 is not normalised (inputs x100)",
    "stall": "a learning rate of 1e-7: the loss cannot move",
}
ONSET = 150


def digits_loader(batch_size: int, seed: int) -> DataLoader:
    """The 1797 8x8 digits, standardised per feature."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    data = TensorDataset(x, torch.tensor(y))
    return DataLoader(
        data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


class DigitsMLP(L.LightningModule):
    def __init__(self, fault: str = "none") -> None:
        super().__init__()
        self.fault = fault
        if fault == "vanishing":
            layers: list[nn.Module] = []
            for fan_in in [64] + [64] * 9:
                layers += [nn.Linear(fan_in, 64), nn.Sigmoid()]
            self.net = nn.Sequential(*layers, nn.Linear(64, 10))
            with torch.no_grad():
                for m in self.net:
                    if isinstance(m, nn.Linear):
                        m.weight.mul_(0.05)
        else:
            self.net = nn.Sequential(
                nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == ONSET and self.fault == "nan":
            x = x.clone()
            x[0, 0] = math.nan
        if self.global_step == ONSET and self.fault == "spike":
            x = x * 100
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        if self.fault == "lr":
            return torch.optim.SGD(self.parameters(), lr=3.0, momentum=0.9)
        lr = 1e-7 if self.fault == "stall" else 1e-3
        return torch.optim.Adam(self.parameters(), lr=lr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=sorted(FAULTS), default="none")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default=None, help="also write findings to this JSONL file")
    parser.add_argument(
        "--record", default=None, help="keep the run's record in this directory, and report it"
    )
    parser.add_argument(
        "--recover", action="store_true", help="skip bad steps, cool the LR, roll back, then stop"
    )
    args = parser.parse_args(argv)

    L.seed_everything(args.seed, verbose=False)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    print(f"Training a digits MLP with fault '{args.fault}': {FAULTS[args.fault]}")

    captured = CapturingSink()
    sinks = [ConsoleSink(), captured] + ([JSONLSink(args.jsonl)] if args.jsonl else [])
    trainer = L.Trainer(
        max_epochs=args.epochs,
        callbacks=[LightningStethoscope(sinks=sinks, record=args.record, recover=args.recover)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(DigitsMLP(args.fault), digits_loader(args.batch_size, args.seed))

    problems = [f for f in captured.findings if f.severity != "info"]
    if not problems:
        print(f"stethoscope: no problem found in {trainer.global_step} steps.")
    else:
        first = problems[0]
        stopped = " and stopped training" if trainer.should_stop else ""
        print(
            f"stethoscope caught {first.detector} ({first.severity}) at step {first.step}"
            f"{stopped}; {len(problems)} finding(s) in all, detectors: "
            f"{', '.join(sorted(captured.detectors()))}."
        )
    if args.record:
        print_report(args.record)
    return 0


def print_report(record: str) -> None:
    """Write the record's report and say where it is and how to look again."""
    from stethoscope.record.report import write_report

    html = write_report(record)[0]
    print(
        f"The run's report: {html}  (again: stethoscope report {record}; live: "
        f"stethoscope watch {record})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
