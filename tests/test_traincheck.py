"""The TrainCheck family (``python -m benchmarks.faults.traincheck``): each of its 11 silent
bugs, rebuilt in Lightning, is named by a detector whose message gives the cause, and its
healthy twin (the same code with the fix) raises no warning and no error.

The family runs once for the module: the bugs of one process here, the four on DDP ranks
in one launch of two gloo processes (about 40 s in all on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from benchmarks.faults.traincheck import BUGS, main, render, run_family

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="the DDP bugs need torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def rows() -> dict:
    return {row.bug.name: row for row in run_family(timeout=240)}


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_the_bug_is_named_with_its_cause(rows, bug):
    row = rows[bug.name]
    found = row.naming
    alarms = [(f["detector"], f["severity"], f["message"][:200]) for f in row.found]
    assert found is not None, alarms
    assert found["detector"] in bug.expected and found["severity"] in ("warning", "error")
    for phrase in bug.says:
        assert phrase in found["message"].lower(), (phrase, found["message"])


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_the_twin_with_the_fix_is_quiet(rows, bug):
    alarms = rows[bug.name].twin_alarms
    assert alarms == [], [(f["detector"], f["severity"], f["message"][:200]) for f in alarms]


def test_the_table_counts_every_bug_named_and_every_twin_quiet(rows):
    table = render(list(rows.values()))
    assert "11/11 named, 11/11 twins quiet" in table
    assert all(name in table for name in rows)
    assert "| bug | expected |" in render(list(rows.values()), markdown=True)


def test_the_command_line_lists_the_bugs(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(b.name in out for b in BUGS)
    with pytest.raises(SystemExit):
        main(["--only", "no-such-bug"])
