"""The tuning database: search winners and candidate measurements kept across runs.

One SQLite file, by default ``user_cache_dir("cherenkov")/tuning.sqlite`` (the folder is
``$CHERENKOV_CACHE_DIR`` when that is set), holds two kinds of record:

* a **winner** per :class:`WinnerKey` — graph structural hash, shapes-and-dtypes
  signature, target, GPU, compute capability, toolkit, cherenkov version and the digest
  of the code that generated the candidates — whose value is the JSON of the search's
  summary (a budgeted search's too, marked partial when the budget left candidates
  unmeasured);
* a **candidate measurement** per :class:`CandidateKey` — candidate source hash, shapes
  signature, target, GPU, toolkit — whose value is a :class:`CandidateResult`, failures
  included (the caller decides not to retry a status in ``FINAL_FAILURES``).

A key is stored as its canonical JSON text, so a lookup matches every field exactly:
records of another GPU, toolkit or target are simply other keys. A key whose ``gpu`` is
None is a record ranked by the cost model; it can never answer a lookup for a measured
GPU, nor the reverse.

Several processes may share the file: it is in WAL mode with a busy timeout, and every
write is one ``BEGIN IMMEDIATE`` transaction, so concurrent writers of different records
keep them all and a writer killed mid-transaction leaves every committed record intact
(``synchronous=NORMAL``: a power cut may lose the last commits, never the file).
On open the file is checked (``PRAGMA quick_check``); a corrupt file, or one of an older
schema, is renamed aside (``tuning.sqlite.corrupt-<UTC time>``, ``….schema-v<N>-<UTC
time>``, its WAL alongside) with a warning and a fresh database takes its place. A file of a newer or unknown schema raises
:class:`SchemaVersionError` and is left alone. Every statement is parameterised: nothing
a caller passes is formatted into SQL text.

``export`` writes every record as one JSON document; ``import_`` validates such a
document strictly (:class:`DatabaseError`) and merges it, keeping the newer record of a
key by its ``recorded_at`` time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, get_args

import platformdirs

from cherenkov.search.records import CandidateResult, Environment, Status, Timing

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "CHERENKOV_CACHE_DIR"
FILE_NAME = "tuning.sqlite"
SCHEMA_VERSION = 1
EXPORT_FORMAT = "cherenkov.tuning"
EXPORT_VERSION = 1
BUSY_TIMEOUT_S = 30.0
MODELLED = "modelled"  # how stats name records ranked by the cost model (key gpu None)

_SCHEMA = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value NOT NULL)",
    "CREATE TABLE winners (key TEXT PRIMARY KEY, gpu TEXT, toolkit TEXT NOT NULL,"
    " summary TEXT NOT NULL, recorded_at REAL NOT NULL)",
    "CREATE TABLE candidates (key TEXT PRIMARY KEY, gpu TEXT, toolkit TEXT NOT NULL,"
    " status TEXT NOT NULL, result TEXT NOT NULL, recorded_at REAL NOT NULL)",
    "CREATE INDEX candidates_status ON candidates (status)",
    "CREATE INDEX candidates_gpu ON candidates (gpu, toolkit)",
)
_WINNER_INSERT = (
    "INSERT INTO winners (key, gpu, toolkit, summary, recorded_at) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET summary = excluded.summary, recorded_at = excluded.recorded_at"
)
_CANDIDATE_INSERT = (
    "INSERT INTO candidates (key, gpu, toolkit, status, result, recorded_at) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET status = excluded.status, result = excluded.result,"
    " recorded_at = excluded.recorded_at"
)
# Import keeps an existing record unless the imported one is strictly newer.
_WINNER_MERGE = _WINNER_INSERT + " WHERE excluded.recorded_at > winners.recorded_at"
_CANDIDATE_MERGE = _CANDIDATE_INSERT + " WHERE excluded.recorded_at > candidates.recorded_at"

_STATUSES = frozenset(get_args(Status))
_DERIVED_RESULT_FIELDS = frozenset({"time_ms", "tflops", "percent_of_peak"})
_RESULT_FIELDS = frozenset(f.name for f in fields(CandidateResult)) | _DERIVED_RESULT_FIELDS
_REQUIRED_RESULT_TYPES: dict[str, type] = {
    "id": str, "kernel": str, "kind": str, "params": dict, "source_hash": str, "status": str,
}  # fmt: skip


class DatabaseError(ValueError):
    """The tuning database or an export document is unusable; the message says why."""


class SchemaVersionError(DatabaseError):
    """The file was written with a schema this cherenkov does not know."""


class _Unusable(DatabaseError):
    """The file must be set aside: ``label`` names the reason in the aside file's name."""

    def __init__(self, label: str, message: str):
        super().__init__(message)
        self.label = label


def default_path() -> Path:
    """``$CHERENKOV_CACHE_DIR/tuning.sqlite``, else the user cache folder's ``tuning.sqlite``."""
    root = os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir("cherenkov")
    return Path(root) / FILE_NAME


# --- keys ---------------------------------------------------------------------------


def _check_key_fields(key: WinnerKey | CandidateKey, optional: frozenset[str]) -> None:
    """Every field a string (``optional`` ones may be None); ``gpu`` ``""``/``"none"`` → None."""
    if key.gpu in ("", "none"):
        object.__setattr__(key, "gpu", None)
    for f in fields(key):
        value = getattr(key, f.name)
        if not isinstance(value, str) and not (value is None and f.name in optional):
            allowed = "a string or None" if f.name in optional else "a string"
            raise TypeError(f"{type(key).__name__}.{f.name} must be {allowed}, not {value!r}")


def _environment_gpu(env: Environment) -> str | None:
    """The GPU a key names: the measuring GPU, or None for a cost-model ranking."""
    if not env.measured:
        return None
    if not env.gpu or env.gpu == "none":
        raise ValueError(f"a measured environment must name its GPU, got gpu={env.gpu!r}")
    return env.gpu


@dataclass(frozen=True)
class WinnerKey:
    """What a search's winner depends on. ``gpu`` None: ranked by the cost model.
    ``generators``: the digest of the code that derived, enumerated and generated the
    candidates (:func:`cherenkov.search.space.generator_digest`), so that an answer is
    never served to code that would search another space."""

    graph_hash: str
    signature: str
    target: str
    gpu: str | None
    compute_capability: str | None
    toolkit: str
    cherenkov: str
    generators: str = ""

    def __post_init__(self) -> None:
        _check_key_fields(self, frozenset({"gpu", "compute_capability"}))

    @property
    def measured(self) -> bool:
        return self.gpu is not None

    @classmethod
    def from_environment(cls, graph_hash: str, signature: str, env: Environment, generators: str = "") -> WinnerKey:
        gpu = _environment_gpu(env)
        capability = env.compute_capability if gpu is not None else None
        return cls(graph_hash, signature, env.target, gpu, capability, env.toolkit, env.cherenkov, generators)


@dataclass(frozen=True)
class CandidateKey:
    """What one candidate's measurement depends on. ``gpu`` None: ranked by the cost model."""

    source_hash: str
    signature: str
    target: str
    gpu: str | None
    toolkit: str

    def __post_init__(self) -> None:
        _check_key_fields(self, frozenset({"gpu"}))

    @property
    def measured(self) -> bool:
        return self.gpu is not None

    @classmethod
    def from_environment(cls, source_hash: str, signature: str, env: Environment) -> CandidateKey:
        return cls(source_hash, signature, env.target, _environment_gpu(env), env.toolkit)


def _key_text(key: WinnerKey | CandidateKey, kind: type) -> str:
    """The canonical JSON of a key: the database's primary key."""
    if not isinstance(key, kind):
        raise TypeError(f"expected a {kind.__name__}, got {key!r}")
    return json.dumps(asdict(key), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class DatabaseStats:
    """What ``cherenkov db`` shows."""

    path: Path
    size_bytes: int
    winners: int
    candidates: int
    candidates_by_status: dict[str, int]
    records_by_gpu: dict[str, int]  # winners and candidates; MODELLED for cost-model ones

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


# --- the database -------------------------------------------------------------------


class TuningDatabase:
    """The tuning records in one SQLite file; a context manager that closes it."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path) if path is not None else default_path()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._connections = {threading.get_ident(): self._open()}

    @property
    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (autograd runs a backward search on a thread of its own;
        WAL mode lets the connections of one file read and write side by side)."""
        with self._lock:
            conn = self._connections.get(threading.get_ident())
            if self._closed:
                raise sqlite3.ProgrammingError(f"the tuning database {self.path} is closed")
            if conn is None:
                conn = self._connections[threading.get_ident()] = self._connect()
            return conn

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for conn in self._connections.values():
                conn.close()
            self._connections.clear()
            self._closed = True

    # winners

    def lookup_winner(self, key: WinnerKey) -> dict[str, Any] | None:
        """The summary recorded for exactly this key, or None."""
        row = self._conn.execute("SELECT summary FROM winners WHERE key = ?", (_key_text(key, WinnerKey),)).fetchone()
        return None if row is None else json.loads(row[0])

    def record_winner(self, key: WinnerKey, summary: Mapping[str, Any]) -> None:
        """Store (or replace) the winning search's summary for ``key``."""
        if not isinstance(summary, Mapping):
            raise TypeError(f"a winner summary must be a dict, not {type(summary).__name__}")
        row = (_key_text(key, WinnerKey), key.gpu, key.toolkit, json.dumps(summary, sort_keys=True), time.time())
        with _transaction(self._conn):
            self._conn.execute(_WINNER_INSERT, row)

    # candidates

    def lookup_candidate(self, key: CandidateKey) -> CandidateResult | None:
        """The result recorded for exactly this key (``from_database=True``), or None."""
        return self.lookup_candidates([key]).get(key)

    def lookup_candidates(self, keys: Iterable[CandidateKey]) -> dict[CandidateKey, CandidateResult]:
        """The recorded results among ``keys``, in one query; keys without one are absent."""
        wanted = {_key_text(key, CandidateKey): key for key in keys}
        if not wanted:
            return {}
        rows = self._conn.execute(
            "SELECT key, result FROM candidates WHERE key IN (SELECT value FROM json_each(?))",
            (json.dumps(list(wanted)),),
        )
        return {wanted[key]: _stored_result(text) for key, text in rows}

    def record_candidate(self, key: CandidateKey, result: CandidateResult) -> None:
        """Store (or replace) one candidate's result."""
        self.record_candidates([(key, result)])

    def record_candidates(self, items: Iterable[tuple[CandidateKey, CandidateResult]]) -> int:
        """Store (or replace) many results in one transaction; returns how many."""
        now = time.time()
        rows = (_candidate_row(key, result, now) for key, result in items)
        with _transaction(self._conn):
            before = self._conn.total_changes
            self._conn.executemany(_CANDIDATE_INSERT, rows)
            return self._conn.total_changes - before

    # stats

    def count(self) -> tuple[int, int]:
        """(winners, candidates) stored."""
        with _transaction(self._conn, write=False):
            return self._counts()

    def _counts(self) -> tuple[int, int]:
        winners = self._conn.execute("SELECT count(*) FROM winners").fetchone()[0]
        candidates = self._conn.execute("SELECT count(*) FROM candidates").fetchone()[0]
        return winners, candidates

    def stats(self) -> DatabaseStats:
        """Counts by kind, candidate status and GPU, and the file's size on disk."""
        with _transaction(self._conn, write=False):
            winners, candidates = self._counts()
            by_status = dict(
                self._conn.execute("SELECT status, count(*) FROM candidates GROUP BY status ORDER BY status")
            )
            by_gpu = self._conn.execute(
                "SELECT gpu, count(*) FROM (SELECT gpu FROM winners UNION ALL SELECT gpu FROM candidates)"
                " GROUP BY gpu ORDER BY gpu"
            ).fetchall()
        size = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())
        return DatabaseStats(self.path, size, winners, candidates, by_status, {gpu or MODELLED: n for gpu, n in by_gpu})

    # export / import

    def export(self, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Write every record as one JSON document; returns (winners, candidates) written."""
        with _transaction(self._conn, write=False):
            winners = self._exported("SELECT key, summary, recorded_at FROM winners ORDER BY key", "summary")
            candidates = self._exported("SELECT key, result, recorded_at FROM candidates ORDER BY key", "result")
        document = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "winners": winners, "candidates": candidates}
        _write_atomic(Path(path), json.dumps(document, indent=1, sort_keys=True))
        log.info("exported %d winners and %d candidates to %s", len(winners), len(candidates), path)
        return len(winners), len(candidates)

    def import_(self, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Merge an exported document; returns (winners, candidates) added or replaced by newer ones.

        The whole document is validated before anything is written; a bad one raises
        :class:`DatabaseError` and changes nothing.
        """
        document = _read_document(Path(path))
        winners = [_winner_row(record, f"winners[{i}]") for i, record in enumerate(document["winners"])]
        candidates = [
            _imported_candidate_row(record, f"candidates[{i}]") for i, record in enumerate(document["candidates"])
        ]
        with _transaction(self._conn):
            start = self._conn.total_changes
            self._conn.executemany(_WINNER_MERGE, winners)
            middle = self._conn.total_changes
            self._conn.executemany(_CANDIDATE_MERGE, candidates)
            end = self._conn.total_changes
        log.info("imported %d winners and %d candidates from %s", middle - start, end - middle, path)
        return middle - start, end - middle

    def _exported(self, query: str, value_name: str) -> list[dict[str, Any]]:
        """The rows of ``query`` (key, value, recorded_at) as export records."""
        return [
            {"key": json.loads(key), value_name: json.loads(value), "recorded_at": at}
            for key, value, at in self._conn.execute(query)
        ]

    # opening

    def _open(self) -> sqlite3.Connection:
        """Connect, setting aside (once) a file that is corrupt or of an older schema."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        identity = _file_identity(self.path)
        try:
            try:
                return self._connect()
            except _Unusable as problem:
                self._set_aside(identity, problem)
                return self._connect()
        except SchemaVersionError as error:
            raise SchemaVersionError(f"{self.path}: {error}") from None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._timeout_s, autocommit=True, check_same_thread=False)
        try:
            _check_integrity(conn)
            _check_schema(conn)  # before anything is changed: a foreign or newer file stays as it was
            _enable_wal(conn, self._timeout_s)
            conn.execute("PRAGMA synchronous = NORMAL")  # in WAL mode: safe when a process dies
            _create_schema(conn)
        except sqlite3.DatabaseError as error:
            conn.close()
            if _is_corruption(error):
                raise _Unusable("corrupt", f"it is not a readable SQLite database ({error})") from error
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _set_aside(self, identity: tuple[int, int] | None, problem: _Unusable) -> None:
        """Rename the file (and its WAL) aside, unless another process already replaced it."""
        if identity is None or identity != _file_identity(self.path):
            log.warning("tuning database %s was unusable (%s); another process has replaced it", self.path, problem)
            return
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.{problem.label}-{stamp}")
        os.replace(self.path, aside)
        wal = Path(f"{self.path}-wal")
        if wal.exists():
            os.replace(wal, f"{aside}-wal")
        Path(f"{self.path}-shm").unlink(missing_ok=True)
        log.warning(
            "tuning database %s is unusable (%s); moved it to %s and started a fresh one", self.path, problem, aside
        )


# --- helpers ------------------------------------------------------------------------


@contextmanager
def _transaction(conn: sqlite3.Connection, *, write: bool = True) -> Iterator[None]:
    """One transaction (``BEGIN IMMEDIATE`` for writes), rolled back on any exception."""
    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _is_corruption(error: sqlite3.DatabaseError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _enable_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Switch to WAL, retrying while busy: this pragma can fail at once, without the busy timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            break
        except sqlite3.OperationalError as error:
            busy = getattr(error, "sqlite_errorcode", 0) & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    if mode != "wal":
        log.warning("tuning database: journal mode is %s, not wal; concurrent writers will wait longer", mode)


def _check_integrity(conn: sqlite3.Connection) -> None:
    rows = [row[0] for row in conn.execute("PRAGMA quick_check")]
    if rows != ["ok"]:
        raise _Unusable("corrupt", "integrity check failed: " + "; ".join(rows[:3]))


def _check_schema(conn: sqlite3.Connection) -> bool:
    """True for an empty file; raises for a foreign file or another schema version."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return True
    version = _schema_version(conn, tables)
    if version < SCHEMA_VERSION:
        raise _Unusable(f"schema-v{version}", f"it has the older schema version {version}, not {SCHEMA_VERSION}")
    return False


def _create_schema(conn: sqlite3.Connection) -> None:
    """Create the schema unless another process has just done so."""
    with _transaction(conn):
        if _check_schema(conn):
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute("INSERT INTO meta (name, value) VALUES (?, ?)", ("schema_version", SCHEMA_VERSION))


def _schema_version(conn: sqlite3.Connection, tables: set[str]) -> int:
    if "meta" not in tables:
        raise SchemaVersionError(f"not a cherenkov tuning database (no meta table; it has {sorted(tables)})")
    row = conn.execute("SELECT value FROM meta WHERE name = ?", ("schema_version",)).fetchone()
    version = None if row is None else row[0]
    if not isinstance(version, int) or version < 0:
        raise SchemaVersionError(f"the tuning database has an unknown schema version {version!r}")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the tuning database has schema version {version}, newer than this cherenkov reads"
            f" ({SCHEMA_VERSION}): upgrade cherenkov or use another database path"
        )
    return version


def _candidate_row(key: CandidateKey, result: CandidateResult, recorded_at: float) -> tuple[Any, ...]:
    if not isinstance(result, CandidateResult):
        raise TypeError(f"expected a CandidateResult, got {result!r}")
    text = json.dumps(replace(result, from_database=False).to_json(), sort_keys=True)
    return _key_text(key, CandidateKey), key.gpu, key.toolkit, result.status, text, recorded_at


def _stored_result(text: str) -> CandidateResult:
    return replace(CandidateResult.from_json(json.loads(text)), from_database=True)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- validation of imported documents -----------------------------------------------


def _read_document(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatabaseError(f"{path}: not a JSON document ({error})") from error
    _expect(isinstance(document, dict), f"{path}: the document must be a JSON object")
    found = document.get("format")
    _expect(found == EXPORT_FORMAT, f"{path}: format must be {EXPORT_FORMAT!r}, not {found!r}")
    version = document.get("version")
    _expect(
        type(version) is int and version == EXPORT_VERSION,
        f"{path}: version {version!r} is not one this cherenkov reads ({EXPORT_VERSION})",
    )
    _expect_keys(document, {"format", "version", "winners", "candidates"}, str(path))
    for kind in ("winners", "candidates"):
        _expect(isinstance(document[kind], list), f"{path}: {kind} must be a list")
    return document


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise DatabaseError(message)


def _expect_keys(record: dict[str, Any], names: set[str], where: str) -> None:
    _expect(set(record) == names, f"{where}: expected the fields {sorted(names)}, got {sorted(record)}")


def _record_parts(record: Any, value_name: str, where: str) -> tuple[dict[str, Any], Any, float]:
    """(key dict, value, recorded_at) of one imported record, checked for shape."""
    _expect(isinstance(record, dict), f"{where}: a record must be a JSON object")
    _expect_keys(record, {"key", value_name, "recorded_at"}, where)
    at = record["recorded_at"]
    _expect(
        type(at) in (int, float) and math.isfinite(at) and at >= 0,
        f"{where}.recorded_at must be a non-negative number, not {at!r}",
    )
    _expect(isinstance(record["key"], dict), f"{where}.key must be a JSON object")
    return record["key"], record[value_name], float(at)


def _parse_key[K: (WinnerKey, CandidateKey)](kind: type[K], data: dict[str, Any], where: str) -> K:
    _expect_keys(data, {f.name for f in fields(kind)}, f"{where}.key")
    try:
        return kind(**data)
    except TypeError as error:
        raise DatabaseError(f"{where}.key: {error}") from error


def _winner_row(record: Any, where: str) -> tuple[Any, ...]:
    key_data, summary, at = _record_parts(record, "summary", where)
    key = _parse_key(WinnerKey, key_data, where)
    _expect(isinstance(summary, dict), f"{where}.summary must be a JSON object")
    return _key_text(key, WinnerKey), key.gpu, key.toolkit, json.dumps(summary, sort_keys=True), at


def _imported_candidate_row(record: Any, where: str) -> tuple[Any, ...]:
    key_data, result_data, at = _record_parts(record, "result", where)
    key = _parse_key(CandidateKey, key_data, where)
    return _candidate_row(key, _parse_result(result_data, f"{where}.result"), at)


def _parse_result(data: Any, where: str) -> CandidateResult:
    _expect(isinstance(data, dict), f"{where} must be a JSON object")
    unknown = set(data) - _RESULT_FIELDS
    _expect(not unknown, f"{where}: unknown fields {sorted(unknown)}")
    for name, kind in _REQUIRED_RESULT_TYPES.items():
        _expect(isinstance(data.get(name), kind), f"{where}.{name} must be a {kind.__name__}, not {data.get(name)!r}")
    _expect(data["status"] in _STATUSES, f"{where}.status {data['status']!r} is not one of {sorted(_STATUSES)}")
    timing = data.get("timing")
    _expect(timing is None or isinstance(timing, dict), f"{where}.timing must be a JSON object or null")
    if timing is not None:
        _expect_keys(timing, {f.name for f in fields(Timing)}, f"{where}.timing")
    try:
        return CandidateResult.from_json(data)
    except (TypeError, ValueError) as error:
        raise DatabaseError(f"{where}: {error}") from error
