"""The run record's file: one SQLite database in WAL mode, its schema and how it opens.

SQLite because it is in the standard library, a reader in another process (``watch``)
sees each committed batch while training writes the next, and a killed writer leaves
the last committed state readable. WAL mode lets readers and the one writer work at
once; ``synchronous=NORMAL`` syncs at checkpoints rather than at every commit, which a
record can afford (a power cut loses the last batches, never the file).

Arrays travel as little-endian blobs: the losses of a flush as one row, the per-layer
statistics of a sampled step as one row per kind, each aligned with a list of names
stored once (a *layout*).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = [
    "FILE_NAME",
    "FORMAT_VERSION",
    "SKIPPED_COLUMNS",
    "RecordError",
    "connect_reader",
    "connect_writer",
    "record_file",
]

#: The database's name inside the record's directory.
FILE_NAME = "record.sqlite"
#: The columns of ``skipped_batches``, in the order of ``SkippedBatch.to_row``.
SKIPPED_COLUMNS = "step, epoch, batch, fingerprint, why, replay"
#: The version of the schema below; a reader refuses a record written by a newer one.
FORMAT_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- the loss of every step, one row per flush: int64 steps, int32 epochs, float32 losses
CREATE TABLE IF NOT EXISTS losses (
    first_step INTEGER PRIMARY KEY, last_step INTEGER NOT NULL,
    steps BLOB NOT NULL, epochs BLOB NOT NULL, losses BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS losses_last ON losses (last_step);
-- one row per step that measured more than the loss
CREATE TABLE IF NOT EXISTS sampled (
    step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, lr REAL, interval INTEGER,
    grad_norm REAL
);
-- the names a per-layer array is aligned with (JSON list), stored once
CREATE TABLE IF NOT EXISTS layouts (id INTEGER PRIMARY KEY, names TEXT NOT NULL UNIQUE);
-- per-layer statistics of a sampled step: float32, shape (len(names),) or
-- (len(names), bins) for the distributions
CREATE TABLE IF NOT EXISTS layers (
    step INTEGER NOT NULL, kind TEXT NOT NULL, layout INTEGER NOT NULL,
    data BLOB NOT NULL, PRIMARY KEY (kind, step)
) WITHOUT ROWID;
-- the batches the recovery ladder skipped (a run resumed from an earlier checkpoint
-- skips them again where they come back), a batch skipped again with a row of its step
CREATE TABLE IF NOT EXISTS skipped_batches (
    step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, batch INTEGER NOT NULL,
    fingerprint TEXT, why TEXT NOT NULL, replay TEXT
);
CREATE TABLE IF NOT EXISTS findings (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, epoch INTEGER NOT NULL,
    detector TEXT NOT NULL, severity TEXT NOT NULL, message TEXT NOT NULL,
    value REAL, threshold REAL, "where" TEXT, rank INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS findings_step ON findings (step);
CREATE TABLE IF NOT EXISTS validation (
    step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, val_loss REAL, train_loss REAL
);
CREATE TABLE IF NOT EXISTS epochs (epoch INTEGER PRIMARY KEY, summary TEXT NOT NULL);
"""


class RecordError(Exception):
    """A run record that cannot be read: missing, empty, damaged or too new. The message
    is one sentence for the user."""


def record_file(path: str | Path) -> Path:
    """The database of the record at ``path`` (its directory, or the file itself).

    Raises:
        RecordError: Nothing there, or a directory that holds no record.
    """
    p = Path(path)
    if not p.exists():
        raise RecordError(f"There is no run record at {str(p)!r}: no such file or directory.")
    if p.is_dir():
        db = p / FILE_NAME
        if not db.exists():
            raise RecordError(
                f"{str(p)!r} holds no run record (no {FILE_NAME}): pass the directory given "
                "as record= to the callback, after training has started."
            )
        return db
    return p


def connect_writer(db: Path, meta: dict[str, str]) -> sqlite3.Connection:
    """Open (creating) the database for writing, in WAL mode; the schema and ``meta``
    are committed together, so that a reader never sees a record without its format."""
    # Training waits for no one: a file another process holds is retried at the next flush
    # rather than waited for (WAL readers never hold the writer up)
    con = sqlite3.connect(db, timeout=0.25, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("BEGIN")
    for statement in SCHEMA.split(";"):
        if statement.strip():
            con.execute(statement)
    con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", sorted(meta.items()))
    con.execute("COMMIT")
    return con


def connect_reader(path: str | Path) -> sqlite3.Connection:
    """Open the record at ``path`` read-only, after checking that it is one this version
    reads.

    Raises:
        RecordError: Missing, empty, not a record, damaged, or written by a newer format.
    """
    db = record_file(path)
    if db.stat().st_size == 0:
        raise RecordError(f"{str(db)!r} is empty: the run wrote nothing to its record yet.")
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
        rows = dict(con.execute("SELECT key, value FROM meta").fetchall())
        con.execute("SELECT count(*) FROM losses").fetchone()
    except sqlite3.DatabaseError as exc:
        raise RecordError(
            f"{str(db)!r} is not a readable run record ({exc}): the file is damaged or is "
            "not a stethoscope record."
        ) from None
    version = int(rows.get("format", "0") or 0)
    if version > FORMAT_VERSION:
        con.close()
        raise RecordError(
            f"{str(db)!r} was written by a newer stethoscope (record format {version}; this "
            f"one reads format {FORMAT_VERSION}): upgrade stethoscope to read it."
        )
    if version < 1:
        con.close()
        raise RecordError(f"{str(db)!r} is not a stethoscope run record (it has no format).")
    return con
