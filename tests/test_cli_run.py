"""`failbench run` / `show` as a user runs them: real subprocesses, their own Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from failbench_ray.storage import repo
from failbench_ray.storage.db import Database

SPEC = {
    "architecture": "ddp",
    "world_size": 3,
    "model": {"kind": "transformer", "vocab_size": 32, "d_model": 16, "n_heads": 2, "seq_len": 8},
    "optimizer": {"name": "adam", "lr": 0.01},
    "steps": 16,
    "batch_size": 12,
    "mechanism": {"name": "disk_ckpt", "params": {"interval": 4}},
    "failures": {"kind": "single", "rank": 2, "at_step": 10},
    "warmup_steps": 1,
}


def failbench(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "failbench_ray.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _closed_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def session_processes(sid: int) -> list[int]:
    """PIDs still alive in the process session `sid` (the CLI and everything it started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(d.name))
    return pids


def test_run_json_then_show_reads_the_same_result(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    db = f"sqlite:///{tmp_path / 'fb.db'}"
    # Ray's "latest cluster" file left behind by a cluster killed before it cleaned up, naming a
    # GCS nobody listens on: a plain `ray.init()` waits for it forever (CI lost every Ray test
    # to one). `failbench run` starts its own cluster all the same. (A short folder: Ray's
    # socket paths must fit in 107 bytes.)
    ray_tmp = Path(tempfile.mkdtemp(prefix="fbrt", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_closed_port()}")
    try:
        ran = failbench(
            "run", str(spec), "--json", "--db", db, "--out", "runs",
            cwd=tmp_path, env={"RAY_TMPDIR": str(ray_tmp)},
        )  # fmt: skip
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    trial = result["trials"][0]
    assert trial["matches_baseline"] is True, trial
    assert trial["failures"][0]["restored_from_step"] == 8
    assert set(trial["failures"][0]["phases"]) == {
        "detected_s", "quiesced_s", "reformed_s", "restored_s", "resumed_s", "caught_up_s"
    }  # fmt: skip
    assert "60/60" not in ran.stderr and "16/16" in ran.stderr  # the progress bar, on stderr
    # the injected kill reads as injected, once, and not as Ray's banner for a real crash
    assert ran.stderr.count("injected failure 0 detected") == 1, ran.stderr
    assert "A worker died or was killed" not in ran.stdout + ran.stderr
    shown = failbench("show", result["experiment_id"], "--json", "--db", db, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == result
    table = failbench("show", result["experiment_id"], "--db", db, cwd=tmp_path)
    assert "baseline" in table.stdout and "trial 0" in table.stdout
    assert (tmp_path / "runs" / result["experiment_id"] / "result.json").is_file()


def test_ctrl_c_stops_every_actor_and_marks_the_trial_interrupted(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "steps": 100000, "baseline": False, "failures": {}}))
    db_url = f"sqlite:///{tmp_path / 'fb.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "failbench_ray.cli", "run", str(spec), "--db", db_url],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        # and Ctrl-C's default action, even when this suite runs as a background job (which
        # a shell starts with SIGINT ignored, and children would inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    db = Database(db_url)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with db.session() as s:
                running = repo.list_experiments(s, status="running")
            if running and (tmp_path / "runs").exists():
                break
            time.sleep(0.5)
        time.sleep(3)  # let the trial train for a while
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
        with db.session() as s:
            (exp,) = repo.list_experiments(s)
            result = repo.load_result(s, exp.id)
        assert result.status == "interrupted"
        assert result.trials[0].status == "interrupted"
        deadline = time.monotonic() + 20
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(proc.pid) == [], "processes of the run outlived it"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        db.dispose()
