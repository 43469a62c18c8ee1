"""The results store against real databases: a SQLite file and a throwaway PostgreSQL database."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, inspect, select, text

from failbench_ray.records import PHASES, CheckpointEvent, FailureRecord, StepRecord
from failbench_ray.results import failure_result
from failbench_ray.storage import repo
from failbench_ray.storage.db import (
    DEFAULT_DB_URL,
    Database,
    DatabaseError,
    alembic_config,
    migrate,
    resolve_db_url,
)
from failbench_ray.storage.tables import Base, Experiment, StepRecordRow, Trial

TABLES = {
    "experiments", "trials", "step_records", "recovery_events", "checkpoint_events",
    "sweeps", "sweep_cells", "dispatchers",
}  # fmt: skip
HEAD = "0007"
T0 = 1_736_000_000.0  # epoch seconds: single precision would round these to 128 s


# ---------------------------------------------------------------------------------------------
# Test data


def step_records(n: int, seed: int = 0) -> list[StepRecord]:
    """`n` records of 2 ranks, with a re-formation (generation 1) replaying from step 100."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rank, k = i % 2, i // 2
        generation, step = (0, k + 1) if k < 125 else (1, k - 24)
        t_start = T0 + k * 0.25 + rng.random() * 1e-3
        t_end = t_start + 0.2 + rng.random() * 1e-2
        loss = 2.5 / (1 + k) + rng.random() * 1e-6
        out.append(
            StepRecord(rank, step, generation, loss, t_start, t_end, 32, rng.random() * 1e-2)
        )
    return out


def failures() -> list[FailureRecord]:
    full: dict[str, float | None] = dict(
        zip(PHASES, (0.1, 0.25, 1.5, 2.125, 3.0, 4.75), strict=True)
    )
    partial = {**dict.fromkeys(PHASES), "detected": T0 * 1e-9, "quiesced": 0.5}
    return [
        FailureRecord(
            0,
            [1],
            "sigkill",
            "step=125",
            125,
            T0 + 31.3,
            "abort",
            "disk",
            100,
            full,
            replacement="cold",
        ),
        FailureRecord(1, [0, 1], "node", "during=restoring", 100, T0 + 33.7, phases=partial),
    ]


def checkpoint_events() -> list[CheckpointEvent]:
    return [
        CheckpointEvent(rank, step, "save", 3 * 2**31, 0.125 + rank, T0 + step / 4, f"/ck/{step}")
        for step in (50, 100)
        for rank in (0, 1)
    ] + [CheckpointEvent(0, 100, "restore", 3 * 2**31, 0.5, T0 + 33.0)]


def new_experiment(
    db: Database, status: str = "queued", name: str | None = None, sweep_id: str | None = None
) -> str:
    spec = {"steps": 200, "nested": {"a": [1, 2.5, None]}}
    with db.session() as s:
        return repo.create_experiment(
            s,
            spec=spec,
            architecture="ddp",
            mechanism="ckpt",
            name=name,
            status=status,
            sweep_id=sweep_id,
        )


# ---------------------------------------------------------------------------------------------
# Schema


def test_migrate_is_idempotent_and_matches_the_models(db: Database) -> None:
    migrate(db.engine)
    migrate(db.engine)
    assert set(inspect(db.engine).get_table_names()) == TABLES | {"alembic_version"}
    with db.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == HEAD
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_downgrade_drops_everything_and_upgrade_restores_it(db: Database) -> None:
    config = alembic_config()
    with db.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert not TABLES & set(inspect(db.engine).get_table_names())
    migrate(db.engine)
    assert set(inspect(db.engine).get_table_names()) == TABLES | {"alembic_version"}


def test_0004_splits_the_quiesce_reason_out_of_old_rows(db: Database) -> None:
    """Rows written before 0004 kept the reason inside the strategy's string; upgrading
    splits it out, and downgrading puts it back."""
    exp = new_experiment(db)
    with db.session() as s:
        trial = repo.create_trial(s, experiment_id=exp, kind="trial", index=0)
        repo.add_failures(s, trial, failures())
    config = alembic_config()
    old = "kill_survivors (abort: fsdp's collectives are not abortable)"
    with db.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0003")
        conn.execute(text("UPDATE recovery_events SET quiesce = :q"), {"q": old})
    migrate(db.engine)
    with db.session() as s:
        got = repo.load_failures(s, trial)
    assert [(f.quiesce, f.quiesce_reason) for f in got] == [
        ("kill_survivors", "abort: fsdp's collectives are not abortable")
    ] * 2
    with db.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0003")
        assert conn.execute(
            text("SELECT DISTINCT quiesce FROM recovery_events")
        ).scalars().all() == [old]
    migrate(db.engine)


# ---------------------------------------------------------------------------------------------
# Round trip


def test_full_round_trip_through_load_result(db: Database) -> None:
    steps, fails, ckpts = step_records(500), failures(), checkpoint_events()
    experiment_id = new_experiment(db, name="rt", sweep_id="sw1", status="running")
    with db.session() as s:
        baseline = repo.create_trial(s, experiment_id=experiment_id, kind="baseline", index=0)
        # Created out of order on purpose: results are sorted by index.
        failing = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=1)
        ok = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.add_step_records(s, ok, steps)
        repo.add_failures(s, ok, fails)
        repo.add_checkpoint_events(s, ok, ckpts)
        repo.finish_trial(
            s,
            baseline,
            status="completed",
            step_time_s=0.2,
            mean_step_time_s=0.21,
            final_loss=0.0125,
            params_digest="abc",
            extra={"steps_done": 200, "note": "b"},
        )
        repo.finish_trial(
            s,
            ok,
            status="completed",
            step_time_s=0.25,
            mean_step_time_s=0.26,
            overhead_pct=23.8,
            final_loss=0.0125,
            params_digest="abc",
            matches_baseline=True,
            match_expected=True,
            extra={"lost_steps_total": 25, "per_rank": [1.5, 2.5]},
        )
        repo.finish_trial(s, failing, status="failed", error="rank 1 OOM")
        repo.set_experiment_status(s, experiment_id, "completed")

    with db.session() as s:
        result = repo.load_result(s, experiment_id)
        assert repo.load_step_records(s, ok) == sorted(
            steps, key=lambda r: (r.generation, r.step, r.rank)
        )
        assert repo.load_checkpoint_events(s, ok) == sorted(ckpts, key=lambda e: e.t_end)

    assert result.experiment_id == experiment_id
    assert result.status == "completed"
    assert result.spec == {"steps": 200, "nested": {"a": [1, 2.5, None]}}
    assert result.baseline is not None
    assert result.baseline.model_dump() == {
        "status": "completed",
        "step_time_s": 0.2,
        "mean_step_time_s": 0.21,
        "final_loss": 0.0125,
        "params_digest": "abc",
        "steps_done": 200,
        "note": "b",
    }
    assert [t.trial for t in result.trials] == [0, 1]
    done, failed = result.trials
    assert (failed.status, failed.error, failed.failures) == ("failed", "rank 1 OOM", [])
    assert (failed.step_time_s, failed.matches_baseline, failed.match_expected) == (
        None,
        None,
        False,
    )
    assert done.status == "completed" and done.error is None
    assert (done.step_time_s, done.mean_step_time_s, done.overhead_pct) == (0.25, 0.26, 23.8)
    assert (done.final_loss, done.params_digest) == (0.0125, "abc")
    assert (done.matches_baseline, done.match_expected) == (True, True)
    assert done.model_extra == {"lost_steps_total": 25, "per_rank": [1.5, 2.5]}
    assert done.failures == [failure_result(f) for f in fails]
    assert done.failures[1].phases.restored_s is None
    assert done.failures[0].lost_steps == 25


def test_step_timestamps_come_back_exactly(db: Database) -> None:
    experiment_id = new_experiment(db)
    steps = step_records(500, seed=7)
    with db.session() as s:
        trial = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.add_step_records(s, trial, steps)
    with db.session() as s:
        back = {(r.generation, r.step, r.rank): r for r in repo.load_step_records(s, trial)}
    assert len(back) == 500
    for r in steps:
        got = back[(r.generation, r.step, r.rank)]
        assert (got.t_start, got.t_end, got.loss, got.blocked_s) == (
            r.t_start,
            r.t_end,
            r.loss,
            r.blocked_s,
        )


def test_load_failures_rebuilds_equal_dataclasses(db: Database) -> None:
    experiment_id = new_experiment(db)
    with db.session() as s:
        trial = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.add_failures(s, trial, list(reversed(failures())))
    with db.session() as s:
        back = repo.load_failures(s, trial)
        lost = s.execute(text("SELECT lost_steps FROM recovery_events ORDER BY failure_index"))
        assert [row[0] for row in lost] == [25, None]
    assert back == failures()
    assert list(back[1].phases) == list(PHASES)


def test_nan_loss_survives(db: Database) -> None:
    experiment_id = new_experiment(db)
    with db.session() as s:
        trial = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.add_step_records(s, trial, [StepRecord(0, 1, 0, math.nan, T0, T0 + 1, 8)])
    with db.session() as s:
        assert math.isnan(repo.load_step_records(s, trial)[0].loss)


# ---------------------------------------------------------------------------------------------
# Life cycle


def test_mark_interrupted_closes_running_trials_only(db: Database) -> None:
    experiment_id = new_experiment(db, status="running")
    with db.session() as s:
        done = repo.create_trial(s, experiment_id=experiment_id, kind="baseline", index=0)
        running = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.finish_trial(s, done, status="completed")
    with db.session() as s:
        repo.mark_interrupted(s, experiment_id, "driver lost")
    with db.session() as s:
        experiment = repo.get_experiment(s, experiment_id)
        baseline, trial = s.get(Trial, done), s.get(Trial, running)
        assert (experiment.status, experiment.error) == ("interrupted", "driver lost")
        assert experiment.updated_at > experiment.created_at
        assert baseline is not None and trial is not None
        assert (baseline.status, baseline.error) == ("completed", None)
        assert (trial.status, trial.error) == ("interrupted", "driver lost")
        assert trial.finished_at is not None and trial.finished_at.tzinfo is not None
        assert repo.load_result(s, experiment_id).trials[0].status == "interrupted"


def test_unknown_ids_and_values(db: Database) -> None:
    with db.session() as s, pytest.raises(repo.ExperimentNotFound, match="no experiment with id"):
        repo.load_result(s, "nope")
    with db.session() as s, pytest.raises(repo.ExperimentNotFound):
        repo.create_trial(s, experiment_id="nope", kind="trial", index=0)
    with db.session() as s, pytest.raises(ValueError, match="unknown experiment status 'done'"):
        repo.set_experiment_status(s, new_experiment(db), "done")
    with db.session() as s, pytest.raises(LookupError, match="no trial with id 12345"):
        repo.finish_trial(s, 12345, status="completed")


def test_list_experiments_newest_first_and_by_status(db: Database) -> None:
    ids = [new_experiment(db) for _ in range(3)]
    with db.session() as s:
        repo.set_experiment_status(s, ids[1], "failed", error="boom")
    with db.session() as s:
        assert [e.id for e in repo.list_experiments(s)] == ids[::-1]
        assert [e.id for e in repo.list_experiments(s, limit=2)] == ids[:0:-1]
        failed = repo.list_experiments(s, status="failed")
        assert [(e.id, e.error) for e in failed] == [(ids[1], "boom")]
        assert failed[0].created_at.tzinfo is not None


def test_session_rolls_back_on_error_and_delete_cascades(db: Database) -> None:
    with pytest.raises(RuntimeError), db.session() as s:
        repo.create_experiment(s, spec={}, architecture="a", mechanism="m")
        raise RuntimeError
    experiment_id = new_experiment(db)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Experiment)) == 1
        trial = repo.create_trial(s, experiment_id=experiment_id, kind="trial", index=0)
        repo.add_step_records(s, trial, step_records(10))
    with db.session() as s:
        s.delete(repo.get_experiment(s, experiment_id))
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(StepRecordRow)) == 0


# ---------------------------------------------------------------------------------------------
# Configuration mistakes


def test_unreachable_postgres_is_a_clear_error() -> None:
    with pytest.raises(DatabaseError) as info:
        Database("postgresql://postgres:s3cret@127.0.0.1:1/test")
    message = str(info.value)
    assert message.startswith(
        "cannot connect to postgresql+psycopg://postgres:***@127.0.0.1:1/test"
    )
    assert "connection refused" in message.lower()
    assert "FAILBENCH_DB_URL" in message and "s3cret" not in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", "malformed database URL 'not a url'"),
        (
            "postgres://u:pw@h:abc/db",
            "malformed database URL 'postgresql+psycopg://u:***@h:abc/db'",
        ),
        ("nosuchdb://u:pw@host/x", "unknown database type in 'nosuchdb://u:***@host/x'"),
        ("sqlite:////no/such/dir/x.db", "cannot connect to sqlite:////no/such/dir/x.db"),
    ],
)
def test_bad_urls_are_clear_errors(url: str, expected: str) -> None:
    with pytest.raises(DatabaseError, match="FAILBENCH_DB_URL") as info:
        Database(url)
    assert str(info.value).startswith(expected)
    assert "pw" not in str(info.value)


def test_a_file_that_is_not_sqlite_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    with pytest.raises(DatabaseError, match="notes.txt: file is not a database. Check the path"):
        Database(f"sqlite:///{tmp_path / 'notes.txt'}")


def test_missing_driver_is_a_clear_error() -> None:
    assert importlib.util.find_spec("pymssql") is None, "the test needs a driver that is absent"
    with pytest.raises(
        DatabaseError, match=r"the driver for mssql\+pymssql://u:\*\*\*@h/db is not"
    ):
        Database("mssql+pymssql://u:pw@h/db")


def test_resolve_db_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAILBENCH_DB_URL", raising=False)
    assert resolve_db_url(None) == DEFAULT_DB_URL == "sqlite:///failbench.db"
    monkeypatch.setenv("FAILBENCH_DB_URL", "postgres://u:p@db:5432/fb")
    assert resolve_db_url(None) == "postgresql+psycopg://u:p@db:5432/fb"
    assert resolve_db_url("postgresql://h/x") == "postgresql+psycopg://h/x"
    assert resolve_db_url("postgresql+psycopg://h/x") == "postgresql+psycopg://h/x"
    assert resolve_db_url("sqlite:///a.db") == "sqlite:///a.db"


def _connections_opened(db_url: str, pool_size: int, threads: int = 16, rounds: int = 5) -> int:
    """`threads` threads that each hold a connection at the same moment, then all let go:
    `rounds` bursts."""
    import threading

    from sqlalchemy import event, text

    with Database(db_url, pool_size=pool_size) as db:
        opened: list[int] = []
        event.listen(db.engine, "connect", lambda conn, rec: opened.append(1))
        barrier = threading.Barrier(threads)

        def work() -> None:
            for _ in range(rounds):
                with db.session() as s:
                    s.execute(text("SELECT 1"))
                    barrier.wait(timeout=30)  # every thread holds a connection now
                barrier.wait(timeout=30)  # and every one is idle now (a lull between bursts)

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        return len(opened)


def test_the_pool_keeps_as_many_connections_as_threads_use_it(db_url: str) -> None:
    """A pool sized for the threads opens each connection once; an undersized one (SQLAlchemy
    lets 10 more overflow) opens, sets up and closes the surplus again in every round."""
    assert _connections_opened(db_url, pool_size=16) <= 16
    assert _connections_opened(db_url, pool_size=6) > 16
