"""The recovery ladder: skip a bad step, cool the learning rate, roll back to a healthy
snapshot, and only then stop. Framework-free: the adapters skip, scale and restore; this
package decides which, when, and says so in findings.

Each rung escalates when the one below has not helped:

1. **skip**: a step whose loss or gradients are non-finite, or past the detectors' bar
   (``loss_spike``, ``exploding_gradients``), is not applied;
2. **cool down**: ``cool_after`` skips within ``window`` steps scale the learning rate by
   ``cool_factor`` for ``cool_steps`` steps, on top of the user's schedule;
3. **roll back**: ``rollback_after`` more skips during a cool-down, or an error the skip
   could not prevent (weights gone non-finite, a loss climbing for a stretch), restores
   the last healthy snapshot and goes on with the next batches (those since the
   snapshot are skipped), cooled again;
4. **stop**: a roll back needed after ``max_rollbacks`` of them, or with no snapshot.

The package has one piece per concept: :mod:`~stethoscope.recovery.settings` (what
``recover=`` asks for, and which findings the ladder answers), :mod:`~.ladder` (the
rungs, climbed step by step), :mod:`~.recoverer` (the ladder's one hook into the
engine: it turns the findings the policy spares into rungs) and :mod:`~.snapshots`
(where the healthy states are kept).
"""

from stethoscope.recovery.ladder import Ladder, Rung
from stethoscope.recovery.recoverer import Recoverer
from stethoscope.recovery.settings import RECOVERABLE, Recovery, parse_recover
from stethoscope.recovery.snapshots import Snapshot, SnapshotStore

__all__ = [
    "RECOVERABLE",
    "Ladder",
    "Recoverer",
    "Recovery",
    "Rung",
    "Snapshot",
    "SnapshotStore",
    "parse_recover",
]
