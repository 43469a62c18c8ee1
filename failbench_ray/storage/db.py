"""Where results are stored: resolving the URL, building the engine, migrating, sessions.

SQLite (the default, one file next to the user) and PostgreSQL (shared, for sweeps and the API)
are both supported. Mistakes a user can make with the URL become a `DatabaseError` whose message
says what to change, instead of a driver stack trace.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.engine import Connection
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from failbench_ray.errors import DatabaseError

log = logging.getLogger("failbench.db")
T = TypeVar("T")

DEFAULT_DB_URL = "sqlite:///failbench.db"
ENV_VAR = "FAILBENCH_DB_URL"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"

_HINT = "pass another --db / FAILBENCH_DB_URL"
_SQLITE_PRAGMAS = (
    "PRAGMA foreign_keys=ON",  # off by default in SQLite: ON DELETE CASCADE needs it
    "PRAGMA busy_timeout=30000",  # before journal_mode, which may have to wait for a lock
    "PRAGMA journal_mode=WAL",  # readers (the API, `failbench list`) never block the writer
)
# What psycopg puts before the reason: 'connection failed: connection to server at "h", port 1
# failed: FATAL:  database "x" does not exist'.
_DRIVER_PREFIXES = re.compile(
    r"^(?:connection (?:failed|is bad): |connection to server .*? failed: |FATAL: +)+"
)
# Connections kept open per process (opened only when needed) unless the caller says how many
# threads use it: below that, the rest would open (and set up) a connection per request.
DEFAULT_POOL_SIZE = 10
# Any constant: serializes concurrent `migrate` calls (several workers starting at once).
_PG_MIGRATION_LOCK = 0x46424D47


def resolve_db_url(url: str | None = None) -> str:
    """The URL to use: the argument, else $FAILBENCH_DB_URL, else `DEFAULT_DB_URL`.

    Bare `postgresql://` / `postgres://` URLs (what people copy from elsewhere) would ask
    SQLAlchemy for psycopg2; they are pointed at psycopg 3, the driver installed.
    """
    return _normalize((url or os.environ.get(ENV_VAR) or DEFAULT_DB_URL).strip())


def _normalize(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def mask_url(url: str) -> str:
    """The URL with its password hidden, also for URLs SQLAlchemy cannot parse."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def make_engine(url: str, pool_size: int = DEFAULT_POOL_SIZE) -> Engine:
    """An engine for `url`, without connecting yet; raises DatabaseError for a bad URL.
    `pool_size`: connections kept open, one per thread that uses the database at once."""
    url = _normalize(url)
    try:
        sa_url = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise DatabaseError(
            f"malformed database URL {mask_url(url)!r}. Use e.g. sqlite:///failbench.db or "
            f"postgresql://user@host:5432/failbench, or {_HINT}."
        ) from exc
    try:
        if sa_url.get_backend_name() == "sqlite":
            return _sqlite_engine(url, pool_size)
        connect_args = {} if "connect_timeout" in sa_url.query else {"connect_timeout": 10}
        return create_engine(
            url, pool_pre_ping=True, pool_size=pool_size, connect_args=connect_args
        )
    except NoSuchModuleError as exc:
        raise DatabaseError(
            f"unknown database type in {mask_url(url)!r}: use sqlite:///PATH or "
            f"postgresql://..., or {_HINT}."
        ) from exc
    except ImportError as exc:
        raise DatabaseError(
            f"the driver for {mask_url(url)} is not installed ({exc}). Install it, use "
            f"postgresql+psycopg:// (psycopg 3 is installed), or {_HINT}."
        ) from exc


def _sqlite_engine(url: str, pool_size: int) -> Engine:
    engine = create_engine(
        url,
        pool_size=pool_size,
        connect_args={"check_same_thread": False, "timeout": 30},
    )

    @event.listens_for(engine, "connect")
    def _set_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        cursor = dbapi_connection.cursor()
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()

    return engine


def _unreachable_message(engine: Engine, exc: DBAPIError) -> str:
    detail = str(exc.orig).strip() or str(exc)
    reason = _DRIVER_PREFIXES.sub("", detail.splitlines()[0]).strip()
    reason = reason[:1].lower() + reason[1:]
    if engine.dialect.name == "sqlite":
        check = "Check the path: its directory must exist and be writable"
    else:
        check = "Check that the server is running and that the database and user exist"
    where = engine.url.render_as_string(hide_password=True)
    return f"cannot connect to {where}: {reason}. {check}, or {_HINT}."


@contextmanager
def _connect(engine: Engine) -> Iterator[Connection]:
    """A connection; failing to open one is a DatabaseError (errors later on are not)."""
    try:
        connection = engine.connect()
    except DBAPIError as exc:  # refused, unknown host or database, bad password, not SQLite...
        raise DatabaseError(_unreachable_message(engine, exc)) from exc
    with connection:
        yield connection


def alembic_config() -> Config:
    """The Alembic configuration of the packaged migrations, without an alembic.ini."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (`alembic upgrade head`); a no-op when it is."""
    config = alembic_config()
    with _connect(engine) as connection, connection.begin():
        if connection.dialect.name == "postgresql":
            # DDL is transactional there: a second process waits, then finds nothing to do.
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


_migrate = migrate  # `Database.__init__` has a parameter of that name


class Database:
    """An engine and a session factory for one database URL, migrated on open by default."""

    def __init__(
        self, url: str | None = None, *, migrate: bool = True, pool_size: int = DEFAULT_POOL_SIZE
    ) -> None:
        self.url = resolve_db_url(url)
        self.engine = make_engine(self.url, pool_size)
        try:
            if migrate:
                _migrate(self.engine)
            else:
                with _connect(self.engine):
                    pass
        except BaseException:
            self.engine.dispose()
            raise
        self.sessionmaker: sessionmaker[Session] = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def display_url(self) -> str:
        """The URL with the password hidden, for messages and logs."""
        return mask_url(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed when the block succeeds, rolled back if it raises."""
        with self.sessionmaker.begin() as session:
            yield session

    def write(self, work: Callable[[Session], T], *, retry_s: float = 0.0) -> T:
        """`work(session)` in one transaction; if the database cannot be reached
        (OperationalError: an outage, a restart, a dropped connection), the whole transaction
        is tried again, with backoff, for up to `retry_s` seconds. `work` must be safe to run
        again after a rollback (it only writes through the session)."""
        deadline = time.monotonic() + retry_s
        delay = 0.1
        while True:
            try:
                with self.session() as s:
                    return work(s)
            except OperationalError as err:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "database unreachable (%s); retrying in %.1f s",
                    str(err).splitlines()[0][:200],
                    delay,
                )
                time.sleep(delay)
                delay = min(2 * delay, 2.0)

    def dispose(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.dispose()

    def __repr__(self) -> str:
        return f"Database({self.display_url!r})"


__all__ = [
    "DEFAULT_DB_URL",
    "ENV_VAR",
    "Database",
    "DatabaseError",
    "alembic_config",
    "make_engine",
    "mask_url",
    "migrate",
    "resolve_db_url",
]
