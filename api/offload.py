"""CPU-bound request work (`recommend`'s seeded simulations) in a few spawned worker processes.

A worst allowed `recommend` costs seconds of CPU. Run in the server's own threads, a handful
of them hold the GIL and the thread pool, and `/healthz` and every other request wait behind
them. Here each such call runs in a worker process, at most `workers` at once, and has a
deadline: a call still waiting for a worker at its deadline is refused, and one still running
at its deadline has its worker killed (a fresh one starts on next use). So no request costs the
service more than `workers` cores for `deadline_s`, and stopping the service kills them at once.
"""

from __future__ import annotations

import importlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import anyio

from failbench_ray.errors import DatabaseError, FailBenchError, Overloaded

log = logging.getLogger("failbench.api")


def _serve(fd: int, warm: list[str]) -> None:
    """A worker (`python -c`, see `_Worker.ready`): imports `warm`, then one call at a time
    until its socket closes (the service stopped or died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the server's
    for module in warm:  # before the first call, which would otherwise wait for them
        importlib.import_module(module)
    conn = Connection(fd)
    try:
        conn.send(("ready", None))
    except OSError:
        return
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        out: tuple[str, Any]
        try:
            out = ("ok", fn(*args))
        except FailBenchError as err:  # pickles with its message (errors.py)
            out = ("raise", err)
        except Exception as err:  # noqa: BLE001  (reported to the server, which logs it)
            from sqlalchemy.exc import OperationalError

            if isinstance(err, OperationalError):  # the database went away mid-call
                out = ("raise", DatabaseError(str(err).splitlines()[0]))
            else:
                out = ("crash", traceback.format_exc())
        try:
            conn.send(out)
        except OSError:
            return


class _Worker:
    """One worker process and the server's end of its pipe, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.warmed = False  # it said it is ready (imports done)

    def ready(self, warm: list[str]) -> Connection:
        if self.proc is None or self.proc.poll() is not None or self.conn is None:
            self.stop()
            ours, theirs = socket.socketpair()
            # A new interpreter, not a fork (the server may be a Ray driver, with threads a
            # fork would copy mid-lock) nor multiprocessing's spawn (which re-runs the
            # server's __main__ first). A worker whose server died reads end-of-file and ends.
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from api.offload import _serve; _serve({theirs.fileno()}, {warm!r})",
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            self.conn = Connection(ours.detach())
            self.warmed = False
        return self.conn

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class Offload:
    """`await call(fn, *args)`: `fn(*args)` in a worker process, within `deadline_s` (waiting
    for a free worker included); raises `Overloaded` past it. `fn` and its arguments and result
    must pickle; a FailBenchError it raises is raised here."""

    def __init__(
        self, workers: int, deadline_s: float, setting: str, warm: tuple[str, ...] = ()
    ) -> None:
        self.workers, self.deadline_s, self.setting = workers, deadline_s, setting
        self.warm = list(warm)  # modules a worker imports as it starts, not in a call's time
        self._idle = [_Worker() for _ in range(workers)]
        self._all = list(self._idle)
        # close() against a worker starting; reentrant: close() runs in a signal handler,
        # which may interrupt start() on the same thread
        self._lock = threading.RLock()
        self._closed = False
        # anyio's primitives belong to the event loop: made on the first call, in it
        self._slots: anyio.CapacityLimiter | None = None
        self._threads: anyio.CapacityLimiter | None = None

    def start(self) -> None:
        """Start every worker now; each imports `warm` before it takes its first call."""
        with self._lock:
            for w in self._all:
                if not self._closed:
                    w.ready(self.warm)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._slots is None or self._threads is None:
            self._slots = anyio.CapacityLimiter(self.workers)
            self._threads = anyio.CapacityLimiter(self.workers)
            self.start()  # all at the first call: a service that is never asked pays nothing
        end = time.monotonic() + self.deadline_s
        with anyio.move_on_after(self.deadline_s) as waited:
            await self._slots.acquire()
        if waited.cancelled_caught:  # the wait was cut: no slot is held
            raise Overloaded(
                f"all {self.workers} compute workers were busy for {self.deadline_s:g} s; "
                f"retry shortly, or raise {self.setting}"
            )
        try:
            # as many slots as workers: one is idle; the longest idle, as a replaced one starts last
            worker = self._idle.pop(0)
            try:
                # a thread of its own, not one of the request threads, waits on the pipe
                return await anyio.to_thread.run_sync(
                    self._exchange, worker, fn, args, end, limiter=self._threads
                )
            finally:
                self._idle.append(worker)
        finally:
            self._slots.release()

    def _exchange(self, worker: _Worker, fn: Callable[..., Any], args: Any, end: float) -> Any:
        with self._lock:
            if self._closed:
                raise Overloaded("the service is stopping; retry on its next start")
            conn = worker.ready(self.warm)
        try:
            if not worker.warmed:  # still importing: not this call's work, so never killed
                if not conn.poll(max(0.0, end - time.monotonic())):
                    raise Overloaded(
                        f"the compute workers are still starting after {self.deadline_s:g} s; "
                        "retry shortly"
                    )
                conn.recv()
                worker.warmed = True
            conn.send((fn, args))
            if not conn.poll(max(0.0, end - time.monotonic())):
                log.warning("%s ran past %g s: its worker is killed", fn.__name__, self.deadline_s)
                self._replace(worker)
                raise Overloaded(
                    f"the request ran past the server's deadline of {self.deadline_s:g} s "
                    "(FAILBENCH_REQUEST_TIMEOUT_S) and was stopped: ask for less work, or "
                    "retry when the service is less loaded"
                )
            kind, value = conn.recv()
        except (EOFError, OSError) as err:  # killed by close(), or died (out of memory?)
            if self._closed:  # close() stops the workers
                raise Overloaded("the service is stopping; retry on its next start") from None
            self._replace(worker)
            log.error("a compute worker died during %s: %r", fn.__name__, err)
            raise Overloaded("the worker running this request died; retry") from None
        if kind == "ok":
            return value
        if kind == "raise":
            raise value
        log.error("%s failed in a compute worker:\n%s", fn.__name__, value)
        raise RuntimeError(f"{fn.__name__} failed in a compute worker")

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start its successor at once, warm for the next call."""
        with self._lock:
            worker.stop()
            if not self._closed:
                worker.ready(self.warm)

    def pids(self) -> list[int]:
        """The worker processes alive now."""
        return [p for w in self._all if (p := w.pid) is not None]

    def close(self) -> None:
        """Kill every worker now; calls in flight get `Overloaded`."""
        with self._lock:
            self._closed = True
        for w in self._all:
            w.stop()
