"""The tuning database: round trips, key isolation, concurrency, crashes, corruption, export."""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cherenkov.search.database import (
    CACHE_DIR_ENV,
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MODELLED,
    CandidateKey,
    DatabaseError,
    SchemaVersionError,
    TuningDatabase,
    WinnerKey,
    default_path,
)
from cherenkov.search.records import FINAL_FAILURES, CandidateResult, Environment, Timing

H200 = Environment(target="sm_90", gpu="NVIDIA H200", compute_capability="9.0", toolkit="nvcc 12.8",
                   cherenkov="0.1.0", measured=True)  # fmt: skip
MODELLED_ENV = Environment(target="sm_90", toolkit="nvcc 12.8", cherenkov="0.1.0")
SIGNATURE = "q:bf16[1,8,4096,128];k:bf16[1,8,8192,128];v:bf16[1,8,8192,128]"
INJECTION = "x'); DROP TABLE winners; --\" OR 1=1; /* \\ % _ ? :name \u00e9\u2603"


def result(name: str = "c0", status: str = "ok", **changes) -> CandidateResult:
    base = CandidateResult(
        id=name, kernel="flash_attention", kind="fused", params={"block_q": 128, "stages": 2, "swizzle": True},
        source_hash=f"hash-{name}", status=status, registers=168, smem_bytes=81920, spill_bytes=0,
        compile_seconds=1.25, rel_error=3.1e-3, timing=Timing(0.91, 0.95, 1.2, 50), flops=1.1e12, peak_tflops=989.0,
    )  # fmt: skip
    return replace(base, **changes)


def candidate_key(name: str = "c0", env: Environment = H200) -> CandidateKey:
    return CandidateKey.from_environment(f"hash-{name}", SIGNATURE, env)


def winner_key(env: Environment = H200, graph_hash: str = "g0") -> WinnerKey:
    return WinnerKey.from_environment(graph_hash, SIGNATURE, env)


@pytest.fixture
def db(tmp_path):
    with TuningDatabase(tmp_path / "tuning.sqlite") as database:
        yield database


# --- round trips --------------------------------------------------------------------


def test_winner_round_trip(db):
    summary = {"best": {"id": "c3", "time_ms": 0.95, "params": {"block_q": 128}}, "candidates": 42, "note": None}
    assert db.lookup_winner(winner_key()) is None
    db.record_winner(winner_key(), summary)
    assert db.lookup_winner(winner_key()) == summary
    db.record_winner(winner_key(), {"best": None})
    assert db.lookup_winner(winner_key()) == {"best": None}
    assert db.count() == (1, 0)


def test_candidate_round_trip(db):
    assert db.lookup_candidate(candidate_key()) is None
    db.record_candidate(candidate_key(), result())
    found = db.lookup_candidate(candidate_key())
    assert found == result() and found.from_database
    assert found.timing == Timing(0.91, 0.95, 1.2, 50) and found.params == result().params
    assert not result().from_database  # the stored copy is not marked


@pytest.mark.parametrize("status", sorted(FINAL_FAILURES))
def test_final_failures_are_remembered(db, status):
    failed = result(status=status, reason=f"{status}: ptxas error at line 7", timing=None, rel_error=None)
    db.record_candidate(candidate_key(), failed)
    found = db.lookup_candidate(candidate_key())
    assert found == failed and found.status in FINAL_FAILURES and found.reason == failed.reason


def test_lookup_candidates_returns_only_those_recorded(db):
    keys = [candidate_key(f"c{i}") for i in range(300)]
    assert db.record_candidates((key, result(f"c{i}")) for i, key in enumerate(keys) if i % 3 == 0) == 100
    found = db.lookup_candidates(keys)
    assert set(found) == set(keys[::3])
    assert all(found[key].id == f"c{i}" and found[key].from_database for i, key in enumerate(keys) if i % 3 == 0)
    assert db.lookup_candidates([]) == {}


def test_non_finite_values_round_trip(db):
    db.record_candidate(candidate_key(), result(status="wrong", rel_error=math.nan, timing=None, predicted_ms=math.inf))
    found = db.lookup_candidate(candidate_key())
    assert math.isnan(found.rel_error) and found.predicted_ms == math.inf


# --- keys never cross GPUs, toolkits, targets, or measured vs modelled --------------

OTHER_ENVIRONMENTS = {
    "other gpu": replace(H200, gpu="NVIDIA GeForce RTX 5090", compute_capability="12.0"),
    "same gpu name, other capability": replace(H200, compute_capability="9.0a"),
    "other toolkit": replace(H200, toolkit="nvcc 13.0"),
    "no toolkit": replace(H200, toolkit="none"),
    "other target": replace(H200, target="sm_120"),
    "modelled": MODELLED_ENV,
    "modelled on a machine with a gpu": replace(H200, measured=False),
}


@pytest.mark.parametrize("other", OTHER_ENVIRONMENTS.values(), ids=OTHER_ENVIRONMENTS.keys())
def test_records_of_another_environment_never_match(db, other):
    db.record_winner(winner_key(H200), {"from": "h200"})
    db.record_candidate(candidate_key("c0", H200), result())
    if candidate_key("c0", other) != candidate_key("c0", H200):  # the GPU's name implies its capability
        assert db.lookup_candidate(candidate_key("c0", other)) is None
    assert db.lookup_winner(winner_key(other)) is None

    db.record_winner(winner_key(other), {"from": "other"})
    assert db.lookup_winner(winner_key(H200)) == {"from": "h200"}
    assert db.lookup_winner(winner_key(other)) == {"from": "other"}


def test_modelled_and_measured_records_stay_apart(db):
    db.record_candidate(candidate_key("c0", MODELLED_ENV), result(status="modelled", timing=None, predicted_ms=1.5))
    assert db.lookup_candidate(candidate_key("c0", H200)) is None
    db.record_candidate(candidate_key("c0", H200), result())
    assert db.lookup_candidate(candidate_key("c0", MODELLED_ENV)).status == "modelled"
    assert db.lookup_candidate(candidate_key("c0", H200)).status == "ok"


def test_modelled_keys_have_no_gpu():
    assert not winner_key(MODELLED_ENV).measured and winner_key(H200).measured
    assert winner_key(replace(H200, measured=False)) == winner_key(MODELLED_ENV)
    assert WinnerKey("g0", SIGNATURE, "sm_90", "none", None, "nvcc 12.8", "0.1.0") == winner_key(MODELLED_ENV)
    assert CandidateKey("hash-c0", SIGNATURE, "sm_90", "", "nvcc 12.8") == candidate_key("c0", MODELLED_ENV)
    for gpu in (None, "none"):
        with pytest.raises(ValueError, match="measured environment must name its GPU"):
            CandidateKey.from_environment("h", SIGNATURE, replace(H200, gpu=gpu))


def test_keys_and_values_are_type_checked(db):
    with pytest.raises(TypeError, match="signature must be a string"):
        CandidateKey("h", 42, "sm_90", None, "none")
    with pytest.raises(TypeError, match="expected a WinnerKey"):
        db.lookup_winner(candidate_key())
    with pytest.raises(TypeError, match="must be a dict"):
        db.record_winner(winner_key(), ["not", "a", "dict"])
    with pytest.raises(TypeError, match="expected a CandidateResult"):
        db.record_candidate(candidate_key(), {"id": "c0"})


def test_sql_injection_looking_strings_are_stored_verbatim(db):
    wkey = WinnerKey(INJECTION, INJECTION, INJECTION, INJECTION, INJECTION, INJECTION, INJECTION)
    ckey = CandidateKey(INJECTION, INJECTION, INJECTION, INJECTION, INJECTION)
    value = result(INJECTION, reason=INJECTION, params={INJECTION: INJECTION})
    db.record_winner(wkey, {INJECTION: [INJECTION]})
    db.record_candidate(ckey, value)
    assert db.lookup_winner(wkey) == {INJECTION: [INJECTION]}
    assert db.lookup_candidate(ckey) == value
    assert db.lookup_candidate(replace(ckey, source_hash="' OR '1'='1")) is None
    assert db.lookup_candidates([ckey, replace(ckey, gpu="%")]) == {ckey: value}
    assert db.count() == (1, 1)


# --- several processes --------------------------------------------------------------


def _write_records(path: str, writer: int, count: int, barrier) -> None:
    """Child: record ``count`` candidates and a winner, each write its own transaction."""
    barrier.wait()
    with TuningDatabase(path) as database:
        for i in range(count):
            database.record_candidate(candidate_key(f"w{writer}-{i}"), result(f"w{writer}-{i}"))
        database.record_winner(winner_key(graph_hash=f"g{writer}"), {"writer": writer})


def test_two_processes_writing_at_once_keep_all_records(tmp_path):
    path, count = tmp_path / "shared.sqlite", 150
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    writers = [spawn.Process(target=_write_records, args=(str(path), w, count, barrier)) for w in range(2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(60)
    assert [p.exitcode for p in writers] == [0, 0]
    with TuningDatabase(path) as database:
        keys = [candidate_key(f"w{w}-{i}") for w in range(2) for i in range(count)]
        assert len(database.lookup_candidates(keys)) == 2 * count
        for w in range(2):
            assert database.lookup_winner(winner_key(graph_hash=f"g{w}")) == {"writer": w}
        assert database.count() == (2, 2 * count)


def _write_then_hang(path: str, committed: int, started) -> None:
    """Child: commit ``committed`` records, then hang in the middle of a long bulk write."""
    with TuningDatabase(path) as database:
        for i in range(committed):
            database.record_candidate(candidate_key(f"done-{i}"), result(f"done-{i}"))

        def pending():
            for i in range(4000):  # ~4 MB: more than SQLite's page cache, so frames reach the WAL
                yield candidate_key(f"pending-{i}"), result(f"pending-{i}", reason="x" * 1000)
            started.set()
            time.sleep(120)

        database.record_candidates(pending())


def test_process_killed_mid_write_leaves_committed_records(tmp_path):
    path, committed = tmp_path / "killed.sqlite", 25
    spawn = multiprocessing.get_context("spawn")
    started = spawn.Event()
    child = spawn.Process(target=_write_then_hang, args=(str(path), committed, started))
    child.start()
    try:
        assert started.wait(30), "the child never reached the middle of its write"
        assert Path(f"{path}-wal").stat().st_size > 1_000_000  # uncommitted frames are on disk
    finally:
        child.kill()
        child.join(10)
    assert child.exitcode == -9
    with TuningDatabase(path) as database:
        assert database.count() == (0, committed)
        assert len(database.lookup_candidates(candidate_key(f"done-{i}") for i in range(committed))) == committed
        assert database.lookup_candidate(candidate_key("pending-0")) is None
        database.record_candidate(candidate_key("after"), result("after"))
        assert database.lookup_candidate(candidate_key("after")) == result("after")


# --- corrupt and foreign files ------------------------------------------------------


def _aside_files(path: Path, label: str) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.{label}-*"))


def _assert_fresh_and_working(path: Path) -> None:
    with TuningDatabase(path) as database:
        assert database.count() == (0, 0)
        database.record_candidate(candidate_key(), result())
        assert database.lookup_candidate(candidate_key()) == result()


def test_random_bytes_are_set_aside(tmp_path, caplog):
    path = tmp_path / "tuning.sqlite"
    garbage = os.urandom(64 * 1024)
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.database"):
        _assert_fresh_and_working(path)
    [aside] = _aside_files(path, "corrupt")
    assert aside.read_bytes() == garbage
    assert any("unusable" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("keep", [0.5, 0.2, 60 / 1e9], ids=["half", "fifth", "header only"])
def test_truncated_database_is_set_aside(tmp_path, caplog, keep):
    path = tmp_path / "tuning.sqlite"
    with TuningDatabase(path) as database:
        database.record_candidates((candidate_key(f"c{i}"), result(f"c{i}", reason="r" * 2000)) for i in range(300))
    size = path.stat().st_size
    assert not Path(f"{path}-wal").exists()  # checkpointed on close: the main file holds everything
    with path.open("r+b") as f:
        f.truncate(max(60, int(size * keep)))
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.database"):
        _assert_fresh_and_working(path)
    assert len(_aside_files(path, "corrupt")) == 1
    assert "unusable" in caplog.text


def test_foreign_sqlite_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE precious (x)")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(SchemaVersionError, match="not a cherenkov tuning database"):
        TuningDatabase(path)
    assert path.read_bytes() == before and not _aside_files(path, "*")


# --- schema versions ----------------------------------------------------------------


def _set_schema_version(path: Path, version) -> None:
    TuningDatabase(path).close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (version,))
    conn.close()


@pytest.mark.parametrize(("version", "message"), [(99, "newer than this cherenkov reads"),
                                                  ("one", "unknown schema version"),
                                                  (-1, "unknown schema version")])  # fmt: skip
def test_newer_or_unknown_schema_raises_and_keeps_the_file(tmp_path, version, message):
    path = tmp_path / "tuning.sqlite"
    _set_schema_version(path, version)
    with pytest.raises(SchemaVersionError, match=message) as raised:
        TuningDatabase(path)
    assert str(path) in str(raised.value)
    assert not _aside_files(path, "*")
    with pytest.raises(DatabaseError):  # a ValueError the CLI can report
        TuningDatabase(path)


def test_older_schema_is_set_aside(tmp_path, caplog):
    path = tmp_path / "tuning.sqlite"
    _set_schema_version(path, 0)
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.database"):
        _assert_fresh_and_working(path)
    assert len(_aside_files(path, "schema-v0")) == 1
    assert "older schema version 0" in caplog.text


# --- export / import ----------------------------------------------------------------


def _fill(database: TuningDatabase) -> None:
    database.record_winner(winner_key(H200), {"best": "c1", "time_ms": 0.95})
    database.record_winner(winner_key(MODELLED_ENV), {"best": "c2", "predicted_ms": 1.7})
    database.record_winner(winner_key(OTHER_ENVIRONMENTS["other gpu"]), {"best": "c3"})
    database.record_candidates([
        (candidate_key("c1"), result("c1")),
        (candidate_key("c2", MODELLED_ENV), result("c2", status="modelled", timing=None, predicted_ms=1.7)),
        (candidate_key("c3", OTHER_ENVIRONMENTS["other toolkit"]), result("c3", status="compile_error", reason="x")),
        (CandidateKey(INJECTION, INJECTION, "sm_90", INJECTION, INJECTION), result("c4", reason=INJECTION)),
    ])  # fmt: skip


def test_export_import_round_trips_exactly(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    with TuningDatabase(tmp_path / "a.sqlite") as source:
        _fill(source)
        assert source.export(first) == (3, 4)
    with TuningDatabase(tmp_path / "b.sqlite") as copy:
        assert copy.import_(first) == (3, 4)
        copy.export(second)
        assert copy.lookup_candidate(candidate_key("c3", OTHER_ENVIRONMENTS["other toolkit"])).reason == "x"
        assert copy.lookup_candidate(candidate_key("c3")) is None  # kept under its own toolkit's key
        assert copy.lookup_winner(winner_key(MODELLED_ENV)) == {"best": "c2", "predicted_ms": 1.7}
        assert copy.import_(first) == (0, 0)  # nothing newer
    assert second.read_text() == first.read_text()
    document = json.loads(first.read_text())
    assert (document["format"], document["version"]) == (EXPORT_FORMAT, EXPORT_VERSION)


def test_import_keeps_the_newer_record(tmp_path):
    exported = tmp_path / "export.json"
    with TuningDatabase(tmp_path / "a.sqlite") as database:
        database.record_winner(winner_key(), {"version": "old"})
        database.record_candidate(candidate_key(), result(reason="old"))
        database.export(exported)
        document = json.loads(exported.read_text())
        database.record_winner(winner_key(), {"version": "new"})
        assert database.import_(exported) == (0, 0)
        assert database.lookup_winner(winner_key()) == {"version": "new"}

        document["winners"][0]["recorded_at"] = time.time() + 3600
        document["candidates"][0]["recorded_at"] = time.time() + 3600
        document["candidates"][0]["result"]["reason"] = "imported"
        exported.write_text(json.dumps(document))
        assert database.import_(exported) == (1, 1)
        assert database.lookup_winner(winner_key()) == {"version": "old"}
        assert database.lookup_candidate(candidate_key()).reason == "imported"


def _valid_document(tmp_path: Path) -> dict:
    path = tmp_path / "valid.json"
    with TuningDatabase(tmp_path / "valid.sqlite") as database:
        _fill(database)
        database.export(path)
    return json.loads(path.read_text())


MALFORMED = {
    "not an object": lambda d: [d],
    "wrong format": lambda d: {**d, "format": "something.else"},
    "newer version": lambda d: {**d, "version": EXPORT_VERSION + 1},
    "version as text": lambda d: {**d, "version": str(EXPORT_VERSION)},
    "extra top-level field": lambda d: {**d, "extra": 1},
    "winners not a list": lambda d: {**d, "winners": {}},
    "record not an object": lambda d: {**d, "candidates": [*d["candidates"], "x"]},
    "key missing a field": lambda d: _edit(d, "winners", lambda r: r["key"].pop("toolkit")),
    "key with an extra field": lambda d: _edit(d, "winners", lambda r: r["key"].update(extra="x")),
    "key field not a string": lambda d: _edit(d, "candidates", lambda r: r["key"].update(signature=7)),
    "summary not an object": lambda d: _edit(d, "winners", lambda r: r.update(summary=[1])),
    "recorded_at missing": lambda d: _edit(d, "winners", lambda r: r.pop("recorded_at")),
    "recorded_at text": lambda d: _edit(d, "candidates", lambda r: r.update(recorded_at="yesterday")),
    "recorded_at negative": lambda d: _edit(d, "candidates", lambda r: r.update(recorded_at=-1)),
    "unknown status": lambda d: _edit(d, "candidates", lambda r: r["result"].update(status="great")),
    "result missing id": lambda d: _edit(d, "candidates", lambda r: r["result"].pop("id")),
    "result unknown field": lambda d: _edit(d, "candidates", lambda r: r["result"].update(speed=1)),
    "params not an object": lambda d: _edit(d, "candidates", lambda r: r["result"].update(params=[])),
    "timing malformed": lambda d: _edit(d, "candidates", lambda r: r["result"].update(timing={"median_ms": 1})),
}


def _edit(document: dict, kind: str, change) -> dict:
    change(document[kind][-1])
    return document


@pytest.mark.parametrize("corrupt", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_import_raises_and_changes_nothing(tmp_path, corrupt):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(corrupt(_valid_document(tmp_path))))
    with TuningDatabase(tmp_path / "target.sqlite") as database:
        with pytest.raises(DatabaseError):
            database.import_(path)
        assert database.count() == (0, 0)


@pytest.mark.parametrize("text", [b"{not json", b"\xff\xfe\x00garbage", b""])
def test_import_of_non_json_raises(tmp_path, db, text):
    path = tmp_path / "bad.json"
    path.write_bytes(text)
    with pytest.raises(DatabaseError, match="not a JSON document"):
        db.import_(path)


# --- paths and stats ----------------------------------------------------------------


def test_default_path_honours_the_cache_dir_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "tuning.sqlite"
    with TuningDatabase() as database:
        assert database.path == tmp_path / "cache" / "tuning.sqlite" and database.path.exists()
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert default_path().name == "tuning.sqlite" and default_path().parent.name.lower() == "cherenkov"


def test_stats(db):
    _fill(db)
    stats = db.stats()
    assert (stats.winners, stats.candidates) == (3, 4) and stats.size_bytes > 0
    assert stats.candidates_by_status == {"compile_error": 1, "modelled": 1, "ok": 2}
    assert stats.records_by_gpu == {"NVIDIA H200": 3, "NVIDIA GeForce RTX 5090": 1, MODELLED: 2, INJECTION: 1}
    assert json.loads(json.dumps(stats.to_json()))["path"] == str(db.path)


def test_another_thread_reads_and_writes_through_its_own_connection(db):
    """autograd runs a backward's search on a thread of its own, with the caller's database."""
    import threading

    seen = []
    worker = threading.Thread(target=lambda: (db.record_winner(winner_key(), {"best": None}),
                                              seen.append(db.lookup_winner(winner_key()))))  # fmt: skip
    worker.start()
    worker.join()
    assert seen == [{"best": None}] and db.lookup_winner(winner_key()) == {"best": None}


def test_closed_database_refuses_use(tmp_path):
    with TuningDatabase(tmp_path / "tuning.sqlite") as database:
        pass
    with pytest.raises(sqlite3.ProgrammingError):
        database.count()
