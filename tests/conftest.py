"""Shared fixtures: one local Ray cluster per test session, real databases, leak checks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    from failbench_ray import runtime
    from failbench_ray.pool import shutdown_shared_pool

    started = runtime.connect()
    yield
    shutdown_shared_pool()
    if started:
        ray.shutdown()


def alive_actors() -> list[dict[str, Any]]:
    """Live actors, less the idle processes of this driver's pool (reset and kept on purpose:
    `failbench_ray.pool`); anything else alive after a test is a leak."""
    from ray._private import state

    from failbench_ray.pool import shared_pool

    pooled = shared_pool().idle_actor_ids()
    return [
        a
        for aid, a in state.actors().items()
        if a["State"] != "DEAD" and a.get("ActorID", aid) not in pooled
    ]


@pytest.fixture
def no_leaks(ray_cluster: None) -> Iterator[None]:
    """Fails the test if it leaves a Ray actor alive (other than idle pooled processes)."""
    yield
    import time

    deadline = time.monotonic() + 10
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = alive_actors()
    assert not leaked, f"actors left alive: {[a.get('ActorClassName') for a in leaked]}"


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database on 127.0.0.1:5432 with a random name, dropped afterwards."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"failbench_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        # CI and the development machines run PostgreSQL; its absence is a failure, not a skip.
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc.orig}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'failbench.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Each test that takes it runs twice: on a fresh SQLite file and a fresh PostgreSQL db."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'failbench.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[Any]:
    from failbench_ray.storage.db import Database

    with Database(db_url) as database:
        yield database
