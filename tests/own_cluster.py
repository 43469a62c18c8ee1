"""Runs a Python snippet that starts a Ray cluster of its own, in a process session of its own:
whatever it leaves (its raylet, its workers) is killed with the session afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_snippet(code: str, *, timeout: float = 240, drop_env: tuple[str, ...] = ()) -> str:
    """Run `code`; its stdout. Fails with its stderr's end if it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    # Ray's files in a folder of its own (short: its socket paths must fit in 107 bytes)
    env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="fbown", dir="/tmp")
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of its session is left
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    return out
