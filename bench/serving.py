"""Starts `failbench serve` / `failbench dispatch` as a user would: a real process (in a session
of its own, so that it and everything it starts can be stopped), a real port on 127.0.0.1.

Shared by the tests (through `tests/service.py`) and the bench's soak (`bench/soak.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Process:
    """A `failbench` subcommand in its own process session; `stop()` ends the whole session."""

    def __init__(
        self, args: list[str], cwd: Path, env: dict[str, str] | None = None, log: str = "srv"
    ) -> None:
        self.log_path = cwd / f"{log}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "failbench_ray.cli", *args],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole session (the service dies mid-whatever): its process group, then
        every process of the session left, Ray's workers included."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (a clean stop), then SIGKILL whatever of the session is left."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self._signal(signal.SIGKILL)  # Ray processes it started, if any outlived it
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)  # the session this process leads: only what we started
        if sig == signal.SIGKILL:
            # Ray's workers each lead a process group of their own in the session: the group
            # alone leaves them running (and holding memory) after their raylet is gone
            for pid in session_processes(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)


def session_processes(sid: int) -> list[int]:
    """Live processes of the process session `sid` (a service and everything it started)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(d.name))
    return found


class Server(Process):
    def __init__(
        self,
        cwd: Path,
        db_url: str,
        *,
        dispatchers: int = 0,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db_url = db_url
        args = ["serve", "--port", str(self.port), "--db", db_url]
        args += ["--dispatchers", str(dispatchers), *(extra or [])]
        super().__init__(args, cwd, env)

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(f"{self.url}/healthz", timeout=2)
                # ours, not some other server that happens to answer on the port
                if r.status_code == 200 and r.json().get("database") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve did not come up in {timeout} s:\n{self.output()}")

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)


def wait_status(
    client: httpx.Client, exp_id: str, statuses: set[str], timeout: float = 300
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = client.get(f"/v1/experiments/{exp_id}")
        r.raise_for_status()
        body = r.json()
        if body["status"] in statuses:
            return body
        time.sleep(0.5)
    raise AssertionError(f"{exp_id} still {body.get('status')} after {timeout} s: {body}")
