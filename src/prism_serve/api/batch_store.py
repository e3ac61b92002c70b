"""The batch lane's state: files, batches and each batch line's result, in one SQLite database.

Everything the Files and Batches routes accept is written here before they answer, so a restart
(or a SIGKILL) loses nothing that was accepted:

- ``<state_dir>/prism.sqlite3`` (WAL journal, ``synchronous=NORMAL``: a committed transaction
  survives the process dying at any point) holds the files' records, the batches and one row per
  batch line, with its request body and, once it ran, its output line;
- ``<state_dir>/lock`` is held (flock) while a server runs, so a second server on the same
  directory refuses to start instead of running the same lines;
- ``<state_dir>/files/<file id>`` holds a file's bytes, written to a temporary name and renamed
  before its record is committed, so a record never names a partial file; a file with no record
  (the process died between the two) is removed at the next start.

A line's result and its ``done`` mark are one UPDATE, so a line that finished is never run again;
a line that was running when the process died was never marked, and runs once more after the
restart (its first run left no output). Times are Unix seconds, as OpenAI's objects give them.
Every call runs on the server's event loop; each is one short transaction.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BatchStore", "FileRecord", "LineSpec", "StateDirInUseError"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT, errors TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, model TEXT NOT NULL,
    body TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    result TEXT, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_todo ON lines (done, batch_id, model);
"""

_BATCH_TIMES = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at",
                "failed_at", "expired_at", "cancelling_at", "cancelled_at")  # fmt: skip
# batches not yet final: still to run, or settled but with their files not written yet
OPEN = ("validating", "in_progress", "cancelling", "finalizing")
_IN_OPEN = f"({','.join('?' * len(OPEN))})"


class StateDirInUseError(RuntimeError):
    """Another running server holds this state directory."""


@dataclass(frozen=True)
class FileRecord:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def card(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}  # fmt: skip


@dataclass(frozen=True)
class LineSpec:
    """One checked line of a batch's input file."""

    custom_id: str
    model: str
    body: dict[str, Any]


def new_object_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.root = Path(state_dir).expanduser()
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # one server per state directory: two would both run its batches' lines
        self._lock = open(self.root / "lock", "a+")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StateDirInUseError(
                f"{self.root} is the state directory of another running server; give each its own"
            ) from None
        # made where the server is built, used on its event loop (one thread at a time)
        self.db = sqlite3.connect(self.root / "prism.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        # what a process that died left on disk without a record: a partial or unrecorded upload,
        # an output file of a finalize that did not commit (finalize writes it again)
        known = {r[0] for r in self.db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()
        self._lock.close()  # the lock goes with the descriptor (and with the process, however it ends)

    # ---- files --------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def write_file(self, chunks: Iterable[bytes]) -> tuple[str, int]:
        """A new file's bytes on disk (any thread): its id and size, for ``add_file``."""
        file_id = new_object_id("file")
        part = self.files_dir / f"{file_id}.part"
        size = 0
        with open(part, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, self.file_path(file_id))
        return file_id, size

    def add_file(self, file_id: str, size: int, owner: str, purpose: str, filename: str) -> FileRecord:
        """The record of a file ``write_file`` wrote: from now on it exists."""
        record = FileRecord(file_id, owner, purpose, filename, size, int(time.time()))
        self.db.execute(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, owner, purpose, filename, size, record.created_at),
        )
        return record

    def file(self, file_id: str, owner: str | None = None) -> FileRecord | None:
        """The file, if it exists and (``owner`` given) is ``owner``'s."""
        row = self.db.execute(
            "SELECT * FROM files WHERE id = ? AND (? IS NULL OR owner = ?)", (file_id, owner, owner)
        ).fetchone()
        return FileRecord(**dict(row)) if row is not None else None

    def files(self, owner: str | None, purpose: str | None) -> list[FileRecord]:
        """Newest first; ``owner`` None: every owner's."""
        sql, args = "SELECT * FROM files WHERE 1", []
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        rows = self.db.execute(sql + " ORDER BY created_at DESC, rowid DESC", args).fetchall()
        return [FileRecord(**dict(r)) for r in rows]

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    # ---- batches ------------------------------------------------------------------------------

    def add_batch(
        self, owner: str, endpoint: str, input_file_id: str, window: str, window_s: float,
        metadata: dict | None, lines: list[LineSpec] | None, errors: list[dict] | None,
    ) -> str:  # fmt: skip
        """A new batch: ``in_progress`` with its lines, or ``failed`` with ``errors`` (no lines)."""
        batch_id = new_object_id("batch")
        now = int(time.time())
        status = "failed" if errors else "in_progress"
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
                "metadata, errors, created_at, expires_at, in_progress_at, failed_at, total) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, owner, endpoint, input_file_id, window, status,
                 json.dumps(metadata) if metadata is not None else None,
                 json.dumps(errors) if errors else None, now, now + int(window_s),
                 None if errors else now, now if errors else None, len(lines or ())),
            )  # fmt: skip
            self.db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, model, body) VALUES (?, ?, ?, ?, ?)",
                ((batch_id, i, s.custom_id, s.model, json.dumps(s.body)) for i, s in enumerate(lines or ())),
            )
        return batch_id

    def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The batch's card, if it exists and (``owner`` given) is ``owner``'s."""
        row = self.db.execute(
            "SELECT * FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)", (batch_id, owner, owner)
        ).fetchone()
        return self._card(row) if row is not None else None

    def batches(self, owner: str | None) -> list[dict[str, Any]]:
        """Newest first; ``owner`` None: every owner's."""
        if owner is None:
            rows = self.db.execute("SELECT * FROM batches ORDER BY created_at DESC, rowid DESC")
        else:
            rows = self.db.execute(
                "SELECT * FROM batches WHERE owner = ? ORDER BY created_at DESC, rowid DESC", (owner,)
            )
        return [self._card(r) for r in rows.fetchall()]

    def _card(self, row: sqlite3.Row) -> dict[str, Any]:
        """OpenAI's batch object."""
        counts = self.counts(row["id"])
        errors = json.loads(row["errors"]) if row["errors"] else None
        card = {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"],
            "error_file_id": row["error_file_id"],
            **{k: row[k] for k in _BATCH_TIMES},
            "request_counts": {"total": row["total"], **counts},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        }  # fmt: skip
        return card

    def counts(self, batch_id: str) -> dict[str, int]:
        """Lines finished with a 2xx answer (``completed``) and otherwise (``failed``)."""
        done, failed = self.db.execute(
            "SELECT COALESCE(SUM(done AND NOT failed), 0), COALESCE(SUM(failed), 0) FROM lines "
            "WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return {"completed": done, "failed": failed}

    def set_status(self, batch_id: str, status: str, at: str | None = None) -> None:
        if at is None:
            self.db.execute("UPDATE batches SET status = ? WHERE id = ?", (status, batch_id))
        else:
            assert at in _BATCH_TIMES
            self.db.execute(
                f"UPDATE batches SET status = ?, {at} = ? WHERE id = ?", (status, int(time.time()), batch_id)
            )

    def running(self) -> list[sqlite3.Row]:
        """Batches not yet final, oldest first: the runner's work after a restart too."""
        return self.db.execute(
            "SELECT id, status, owner, endpoint, created_at, expires_at FROM batches "
            f"WHERE status IN {_IN_OPEN} ORDER BY created_at, rowid",
            OPEN,
        ).fetchall()

    def status_counts(self) -> dict[str, int]:
        """Batches by status (for /metrics)."""
        return dict(self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())

    def pending_lines(self) -> int:
        """Lines not yet done in batches still running (for /metrics)."""
        return self.db.execute(
            "SELECT COUNT(*) FROM lines JOIN batches ON lines.batch_id = batches.id WHERE lines.done = 0 "
            f"AND batches.status IN {_IN_OPEN}",
            OPEN,
        ).fetchone()[0]

    # ---- lines --------------------------------------------------------------------------------

    def todo_models(self, batch_id: str) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT model, COUNT(*) FROM lines WHERE batch_id = ? AND done = 0 GROUP BY model", (batch_id,)
        ).fetchall()
        return {m: n for m, n in rows}

    def todo_of(self, batch_id: str, model: str, limit: int, skip: set[int]) -> list[sqlite3.Row]:
        """Up to ``limit`` of ``model``'s lines not yet done, in file order, past those in ``skip``
        (running now)."""
        rows = self.db.execute(
            "SELECT idx, custom_id, model, body FROM lines WHERE batch_id = ? AND done = 0 AND model = ? "
            "ORDER BY idx LIMIT ?",
            (batch_id, model, limit + len(skip)),
        ).fetchall()
        return [r for r in rows if r["idx"] not in skip][:limit]

    def finish_line(self, batch_id: str, idx: int, result: dict[str, Any], failed: bool) -> None:
        """The line's output line and its ``done`` mark, in one statement (never run again)."""
        self.db.execute(
            "UPDATE lines SET done = 1, failed = ?, result = ? WHERE batch_id = ? AND idx = ? AND done = 0",
            (int(failed), json.dumps(result), batch_id, idx),
        )

    def settle_rest(self, batch_id: str, code: str, message: str) -> None:
        """Every line not done gets ``error`` {code, message} (expired or cancelled)."""
        rows = self.db.execute(
            "SELECT idx, custom_id FROM lines WHERE batch_id = ? AND done = 0", (batch_id,)
        ).fetchall()
        error = {"code": code, "message": message}
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "UPDATE lines SET done = 1, failed = 1, result = ? WHERE batch_id = ? AND idx = ?",
                ((json.dumps({"id": new_object_id("batch_req"), "custom_id": r["custom_id"],
                              "response": None, "error": error}), batch_id, r["idx"]) for r in rows),
            )  # fmt: skip

    def finalize(self, batch_id: str, status: str, at: str) -> None:
        """Write the output file (lines answered 2xx) and the error file (the rest), in input order,
        and mark the batch ``status``. Safe to redo: a finalize the process died in left only files
        with no record, which this one replaces."""
        row = self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        ids: dict[str, str | None] = {}
        now = int(time.time())
        records = []
        for kind, failed in (("output", 0), ("error", 1)):
            rows = self.db.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND failed = ? ORDER BY idx",
                (batch_id, failed),
            )
            data = b"".join(r[0].encode() + b"\n" for r in rows)
            if not data:
                ids[kind] = None
                continue
            file_id = f"file-{batch_id.removeprefix('batch-')}-{kind}"
            part = self.files_dir / f"{file_id}.part"
            with open(part, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, self.file_path(file_id))
            ids[kind] = file_id
            name = f"{batch_id}_{kind}.jsonl"
            records.append((file_id, row["owner"], f"batch_{kind}", name, len(data), now))
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)", records)
            self.db.execute(
                f"UPDATE batches SET status = ?, {at} = ?, output_file_id = ?, error_file_id = ? "
                "WHERE id = ?",
                (status, now, ids["output"], ids["error"], batch_id),
            )
