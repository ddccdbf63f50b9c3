"""What the ranks of a distributed test wrote, read back: the findings rank zero's sink
kept, each rank's result, and what the detectors were handed (the workers write them:
``_ddp_worker.py``, ``_fsdp_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path


def findings(out: Path, scenario: str) -> list[dict]:
    """Rank zero's findings of ``scenario``, as its JSONL sink wrote them."""
    path = out / f"{scenario}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def ranks(out: Path, scenario: str) -> list[dict]:
    """What each of the two ranks wrote of ``scenario`` (its last step, its stop...)."""
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in (0, 1)]


def observed(out: Path, scenario: str) -> dict[int, dict]:
    """The per-parameter statistics handed to rank zero's detectors, by step."""
    steps = json.loads((out / f"{scenario}-observed.json").read_text())
    return {int(step): row for step, row in steps.items()}
