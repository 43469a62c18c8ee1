"""Alembic environment of the results store.

`failbench_ray.storage.db.migrate` passes its own connection in `config.attributes["connection"]`
(so the upgrade runs inside the caller's transaction); the alembic CLI gets an engine built from
`sqlalchemy.url`, or from FAILBENCH_DB_URL / the default when that is unset.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from failbench_ray.storage.db import make_engine, resolve_db_url
from failbench_ray.storage.tables import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    return resolve_db_url(config.get_main_option("sqlalchemy.url"))


def _run(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode copies the table instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Print the SQL (`alembic upgrade head --sql`) for a DBA to review and apply."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
