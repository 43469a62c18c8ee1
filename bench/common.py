"""What the benchmark goals share: the configuration, statistics, a Ray cluster, a watchdog,
running one experiment or one command, and the specs and states the goals measure with.

The goal modules (`bench/mechanisms.py`, `monitoring.py`, `peers.py`, `api.py`, `soak.py`) import
this, `procs.py`, `serving.py` and `tcpproxy.py`, never `run.py` or each other (import-linter
checks it in `make lint`); `run.py` imports them all. Like `run.py`, it imports Ray and torch
inside functions only.
"""

from __future__ import annotations

import gc
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from bench.procs import wait_for_no_children

if TYPE_CHECKING:
    from failbench_ray.results import ExperimentResult
    from failbench_ray.storage.db import Database

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT_LIMIT_S = 420.0  # a watchdog per experiment: a hang becomes an error, not a stall
MB = 1 << 20


@dataclass(frozen=True)
class BenchConfig:
    quick: bool
    trials: int  # trials per recovery experiment (detection, each quiesce timeout)
    overhead_world: int
    overhead_pairs: int  # (plain, harness) pairs, run alternately
    measure_make_run: bool

    @classmethod
    def make(cls, quick: bool) -> BenchConfig:
        if quick:
            return cls(True, trials=2, overhead_world=4, overhead_pairs=1, measure_make_run=False)
        return cls(False, trials=5, overhead_world=8, overhead_pairs=2, measure_make_run=True)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_s": None, "p90_s": None, "max_s": None, "samples_s": []}
    return {
        "n": len(values),
        "p50_s": statistics.median(values),
        "p90_s": percentile(values, 90),
        "max_s": max(values),
        "min_s": min(values),
        "samples_s": values,
    }


def status_of(met: bool | None) -> str:
    return {True: "met", False: "not met", None: "not measured"}[met]


# ---------------------------------------------------------------------------------------------
# Processes: the Ray cluster, a watchdog, what is still running


@contextmanager
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster through the project's `connect()`, shut down (and gone) at the end."""
    import ray

    from failbench_ray import runtime

    t0 = time.monotonic()
    runtime.connect()
    log(f"Ray up in {time.monotonic() - t0:.1f} s")
    try:
        yield
    finally:
        # Object refs held in reference cycles (a finished trial's unanswered pings) must go
        # while Ray is up: freed after `ray.shutdown()`, they end the process from Ray's C++.
        gc.collect()
        ray.shutdown()
        left = wait_for_no_children()
        if left:
            log(f"warning: processes still alive after ray.shutdown(): {left}")


class WatchdogExpired(Exception):
    pass


@contextmanager
def watchdog(limit_s: float, what: str) -> Iterator[None]:
    """Raise WatchdogExpired in the main thread if the block runs longer than `limit_s`."""

    def expire(_signum: int, _frame: FrameType | None) -> None:
        raise WatchdogExpired(f"{what} did not finish within {limit_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------
# Experiments through the project's runner


@dataclass(frozen=True)
class Env:
    db: Database
    tmp: Path


def recovery_spec(name: str, trials: int, **override: Any) -> dict[str, Any]:
    """DDP on 4 ranks, small MLP, disk checkpoints every 10 steps, rank 1 SIGKILLed at step 15."""
    spec: dict[str, Any] = {
        "name": name,
        "architecture": "ddp",
        "world_size": 4,
        "model": {"kind": "mlp", "input_dim": 64, "hidden_dim": 128, "depth": 2},
        "steps": 25,
        "batch_size": 64,
        "trials": trials,
        "baseline": False,
        "mechanism": {"name": "disk_ckpt", "params": {"interval": 10}},
        "failures": {"kind": "single", "rank": 1, "at_step": 15, "kill": "sigkill"},
        "quiesce": "abort",
    }
    spec.update(override)
    return spec


def run_spec(env: Env, data: dict[str, Any]) -> tuple[ExperimentResult, float]:
    from failbench_ray.runner import run_experiment
    from failbench_ray.spec import parse_spec

    spec = parse_spec(data)
    t0 = time.monotonic()
    with watchdog(EXPERIMENT_LIMIT_S, f"experiment {spec.name}"):
        result = run_experiment(spec, db=env.db, out_dir=env.tmp / "runs")
    wall = time.monotonic() - t0
    log(f"{spec.name}: {result.status} in {wall:.1f} s (experiment {result.experiment_id})")
    return result, wall


def timed_command(cmd: list[str], limit_s: float) -> tuple[int, float, str]:
    """Run `cmd` from the repository root; on a hang, Ctrl-C it (it stops its actors), then kill."""
    env = {**os.environ, "COLUMNS": "160"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        output += f"\n[bench] killed after {limit_s:.0f} s"
    return proc.returncode, time.monotonic() - t0, output


# ---------------------------------------------------------------------------------------------
# What the mechanism, monitoring and peer goals measure with


def state_of_size(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A model-and-optimizer-shaped state of about `nbytes` (float32 tensors of a few sizes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    model = {f"layer{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(sizes[:2])}
    opt = {str(i): {"exp_avg": torch.randn(s, generator=g)} for i, s in enumerate(sizes[2:])}
    return {"model": model, "optimizer": {"state": opt, "param_groups": [{"lr": 0.01}]}}


def with_status(out: dict[str, Any]) -> dict[str, Any]:
    """The goal's numbers plus its status word (from its `met`)."""
    return {**out, "status": "met" if out["met"] else "not met"}


def ddp_spec(name: str, mechanism: Any, **over: Any) -> dict[str, Any]:
    """The mechanism benchmarks' DDP spec: 4 ranks, ~2.1M parameters, no failures."""
    spec: dict[str, Any] = {
        "name": name,
        "architecture": "ddp",
        "world_size": 4,
        # ~2.1M parameters: 8.4 MB of weights + 16.8 MB of Adam state per rank
        "model": {"kind": "mlp", "input_dim": 256, "hidden_dim": 1024, "depth": 3},
        "optimizer": {"name": "adam", "lr": 0.001},
        "steps": 60,
        "batch_size": 64,
        "baseline": False,
        "mechanism": mechanism,
        "failures": {"kind": "none"},
        "warmup_steps": 3,
    }
    spec.update(over)
    return spec
