"""`failbench serve` (the REST API plus N dispatchers) and `failbench dispatch` (dispatchers
only, e.g. on more machines sharing one PostgreSQL queue)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from failbench_ray.errors import UsageError
from failbench_ray.storage.db import Database

log = logging.getLogger("failbench.service")

# How long a stop waits for the dispatchers to hand their experiments back.
_STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class Dispatching:
    """What `serve` and `dispatch` share: where the queue and the cluster are, and how many
    dispatchers run it."""

    db_url: str | None
    ray_address: str | None
    n: int
    out_dir: Path
    lease_s: float
    max_attempts: int
    dashboard: bool = False  # a local cluster runs Ray's dashboard
    dashboard_port: int = 8265
    prometheus_sd: Path | None = None  # keep the Ray nodes' metrics endpoints in this file
    reuse_workers: bool = True  # trials reuse started processes (failbench_ray.pool)


@contextmanager
def dispatchers(db: Database, cfg: Dispatching) -> Iterator[threading.Event]:
    """Run `cfg.n` dispatcher threads until the block ends (each finishes its current
    experiment's bookkeeping: a run cut short by the stop goes back to the queue)."""
    from service.dispatcher import Dispatcher

    stop = threading.Event()
    threads = []
    for i in range(cfg.n):
        d = Dispatcher(
            db,
            lease_s=cfg.lease_s,
            max_attempts=cfg.max_attempts,
            out_dir=cfg.out_dir,
            stop_event=stop,
            cluster_share=1.0 / cfg.n,  # experiments at once share the cluster evenly
            reuse_workers=cfg.reuse_workers,
        )
        # Daemons: a dispatcher stuck on a Ray cluster that is going down with the service
        # (a SIGTERM to the whole process group reaches Ray's processes too) must not keep the
        # process alive; its experiment goes back to the queue when its lease expires.
        t = threading.Thread(
            target=d.run_forever, args=(stop,), name=f"dispatcher-{i}", daemon=True
        )
        t.start()
        threads.append(t)
    try:
        yield stop
    finally:
        stop.set()
        deadline = time.monotonic() + _STOP_GRACE_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning(
                "%s did not stop within %.0f s (is the Ray cluster gone?); their experiments "
                "go back to the queue when their leases expire",
                ", ".join(stuck),
                _STOP_GRACE_S,
            )


def _check_bind(host: str, token: bool) -> None:
    from api.settings import is_loopback

    if not is_loopback(host) and not token:
        raise UsageError(
            f"refusing to serve on {host} without a token: anyone who can reach it could run "
            "jobs on your cluster. Set FAILBENCH_API_TOKEN, or bind 127.0.0.1"
        )


def _listen(host: str, port: int) -> socket.socket:
    """Bind the API's port before anything else starts: a local Ray cluster opens ports of its
    own (metrics and dashboard agents) and could take ours in the meantime, and a busy port is
    then a clear error before any cluster was started for nothing."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as err:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {err.strerror}. Stop what uses that port, or "
            "choose another with --port"
        ) from err
    return sock  # not inheritable (PEP 446): Ray's child processes do not hold it


def serve(*, host: str, port: int, cfg: Dispatching) -> int:
    import ray
    import uvicorn

    from api.app import create_app
    from api.settings import Settings
    from failbench_ray import runtime

    settings = Settings(host=host)
    _check_bind(host, settings.api_token is not None)
    # Read once, here; no process this one starts (Ray's, the workers') needs the token.
    os.environ.pop("FAILBENCH_API_TOKEN", None)
    sock = _listen(host, port)
    started = False
    db = None
    try:
        # migrates on start; a connection for each request thread and each dispatcher
        db = Database(cfg.db_url, pool_size=settings.threads + cfg.n)
        started = (
            runtime.connect(
                cfg.ray_address, dashboard=cfg.dashboard, dashboard_port=cfg.dashboard_port
            )
            if cfg.n
            else False
        )
        app = create_app(settings, db)
        config = uvicorn.Config(app, log_level="info", access_log=False)
        with dispatchers(db, cfg), runtime.prometheus_sd(cfg.prometheus_sd if cfg.n else None):
            # uvicorn handles SIGINT/SIGTERM: it stops serving and returns; then the
            # dispatchers stop (their runs go back to the queue).
            uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if db is not None:
            db.dispose()
        if started:
            ray.shutdown()
    return 0


def dispatch(cfg: Dispatching) -> int:
    import ray

    from failbench_ray import runtime

    db = Database(cfg.db_url)
    started = runtime.connect(cfg.ray_address)
    done = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        with dispatchers(db, cfg), runtime.prometheus_sd(cfg.prometheus_sd):
            done.wait()
    finally:
        db.dispose()
        if started:
            ray.shutdown()
    return 0
