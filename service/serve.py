"""`failbench serve` (the REST API plus N dispatchers) and `failbench dispatch` (dispatchers
only, e.g. on more machines sharing one PostgreSQL queue)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from failbench_ray.errors import UsageError
from failbench_ray.storage.db import Database

log = logging.getLogger("failbench.service")

# A stop (SIGTERM, Ctrl-C) ends within 10 s in any state (what `docker stop` and systemd
# allow before SIGKILL): requests get up to _DRAIN_S to finish while the dispatchers, told at
# once, get _STOP_GRACE_S to hand their experiments back; stopping Ray takes the rest.
_STOP_GRACE_S = 5.0
_DRAIN_S = 2


class _Stopped(BaseException):
    """SIGTERM while no server handles it (starting, or after uvicorn returned): unwind
    through every `finally`, which stops what was started."""


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise _Stopped


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


class StopSignal(threading.Event):
    """The dispatchers' stop, remembering when it was first asked for: their grace counts
    from the signal, not from when the server has finished draining."""

    at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()


@contextmanager
def dispatchers(db: Database, cfg: Dispatching) -> Iterator[StopSignal]:
    """Run `cfg.n` dispatcher threads until the block ends (set the yielded event to begin
    the stop sooner). Each gives its current experiment back to the queue; one that has not
    within `_STOP_GRACE_S` of the stop has it given back for it (no attempt counted either)."""
    from service.dispatcher import Dispatcher

    stop = StopSignal()
    running = []
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
        # Daemons: a dispatcher still winding its run down when the grace ends must not keep
        # the process alive (its experiment is given back for it, and its actors end with Ray).
        t = threading.Thread(
            target=d.run_forever, args=(stop,), name=f"dispatcher-{i}", daemon=True
        )
        t.start()
        running.append((d, t))
    try:
        yield stop
    finally:
        stop.set()
        deadline = (stop.at or time.monotonic()) + _STOP_GRACE_S
        for _, t in running:
            t.join(max(0.0, deadline - time.monotonic()))
        for d, t in running:
            if t.is_alive():
                log.warning(
                    "%s still winding down %.0f s after the stop: its experiment goes back "
                    "to the queue now",
                    t.name,
                    _STOP_GRACE_S,
                )
                d.abandon()


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
    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        return _serve(host=host, port=port, cfg=cfg)
    except _Stopped:
        log.info("stopped by SIGTERM")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(*, host: str, port: int, cfg: Dispatching) -> int:
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
        try:
            started = (
                runtime.connect(
                    cfg.ray_address, dashboard=cfg.dashboard, dashboard_port=cfg.dashboard_port
                )
                if cfg.n
                else False
            )
        except SystemExit as err:  # ray.init's own SIGTERM handler: sys.exit(15)
            raise _Stopped from err
        signal.signal(signal.SIGTERM, _on_term)  # in place of ray.init's
        app = create_app(settings, db)
        config = uvicorn.Config(
            app, log_level="info", access_log=False, timeout_graceful_shutdown=_DRAIN_S
        )
        with (
            dispatchers(db, cfg) as stop,
            runtime.prometheus_sd(cfg.prometheus_sd if cfg.n else None),
        ):
            # uvicorn handles SIGINT/SIGTERM while it runs: it stops serving and returns;
            # the dispatchers start stopping at the signal, not after the drain
            _server(config, on_exit=lambda: _stopping(stop, app)).run(sockets=[sock])
    finally:
        sock.close()
        if db is not None:
            db.dispose()
        if started or ray.is_initialized():  # a cluster cut off while starting, too
            ray.shutdown()
    return 0


def _stopping(stop: StopSignal, app: Any) -> None:
    """At the signal: the dispatchers begin to give their runs back, trials that end no
    longer reset their processes for reuse, and recommend's workers end (their requests get
    503 now rather than being cut off when the drain ends)."""
    from failbench_ray import pool

    stop.set()
    pool.stop_reusing()
    app.state.compute.close()


def _server(config: Any, on_exit: Callable[[], None]) -> Any:
    """uvicorn's server, also calling `on_exit` at the signal (uvicorn is imported lazily)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


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
