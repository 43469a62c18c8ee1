"""Benchmarks of the mechanisms' costs: each goal a ratio of two things measured in the same run.

- inmem_restore: restoring a 100 MB state from a replica holder (object store, another process)
  runs at >= 0.5x this machine's memcpy bandwidth (measured in the same actor);
- disk_write: `disk_ckpt`'s write (temp file, fsync, rename, fsync dir) runs at >= 0.8x a raw
  sequential write of the same bytes with fsync, and is no slower than
  `torch.distributed.checkpoint.save` of the same state;
- async_overhead: `async_ckpt`'s steady-state overhead <= 1/3 of `disk_ckpt`'s, same interval;
- hot_spare_recovery: injected -> resumed with `hot_spare` <= 0.3x `disk_ckpt`'s on ddp.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.common import MB, ddp_spec, state_of_size, with_status

if TYPE_CHECKING:
    from bench.common import BenchConfig, Env

RESTORE_GOAL = 0.5
DISK_GOAL = 0.8
ASYNC_GOAL = 1 / 3
SPARE_GOAL = 0.3


# ---------------------------------------------------------------------------------------------
# inmem_replica restore vs memcpy


class _Source:
    """Plays a rank that published a snapshot (a holder pulls it, as in training)."""

    def __init__(self, nbytes: int) -> None:
        from failbench_ray.replication import pack

        self.packed = pack(state_of_size(nbytes))

    def snapshot_for(self, step: int) -> Any:
        return self.packed


class _Replacement:
    """Plays the replacement rank: live tensors to restore into, and a memcpy to compare with."""

    def __init__(self, nbytes: int) -> None:
        from failbench_ray.replication import unpack

        torch.set_num_threads(1)
        self.nbytes = nbytes
        shapes = state_of_size(nbytes)
        self.live = [t.clone().zero_() for t in _flat(shapes)]
        self.unpack = unpack

    def memcpy_s(self) -> float:
        src = torch.empty(self.nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch the pages first
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    def restore_s(self, holder: Any) -> float:
        from failbench_ray.replication import fetch

        t0 = time.perf_counter()
        state = self.unpack(fetch(holder, 0, 1))
        for dst, src in zip(self.live, _flat(state), strict=True):
            dst.copy_(src)
        return time.perf_counter() - t0


def _flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _flat(v)]
    if isinstance(state, list):
        return [t for v in state for t in _flat(v)]
    return []


def goal_inmem_restore(cfg: BenchConfig) -> dict[str, Any]:
    import ray

    from failbench_ray.replication import ReplicaHolderActor

    nbytes = 100 * MB
    source = ray.remote(num_cpus=0)(_Source).remote(nbytes)
    holder = ReplicaHolderActor.remote()  # type: ignore[attr-defined]
    replacement = ray.remote(num_cpus=0)(_Replacement).remote(nbytes)
    try:
        assert ray.get(holder.pull.remote(0, 1, source)), "the holder could not pull the copy"
        ray.kill(source)  # the copy must outlive the rank it protects
        rounds = 3 if cfg.quick else 5
        memcpy = [ray.get(replacement.memcpy_s.remote()) for _ in range(rounds)]
        restore = [ray.get(replacement.restore_s.remote(holder)) for _ in range(rounds)]
    finally:
        for a in (holder, replacement, source):
            ray.kill(a)
    memcpy_gbs = nbytes / statistics.median(memcpy) / 1e9
    restore_gbs = nbytes / statistics.median(restore) / 1e9
    ratio = restore_gbs / memcpy_gbs
    return with_status(
        {
            "goal": f"restore of a 100 MB state from a replica holder >= {RESTORE_GOAL}x memcpy",
            "met": ratio >= RESTORE_GOAL,
            "state_bytes": nbytes,
            "memcpy_gb_s": memcpy_gbs,
            "restore_gb_s": restore_gbs,
            "ratio": ratio,
            "restore_s": restore,
            "memcpy_s": memcpy,
            "note": "restore = read the holder's copy (zero-copy map) + copy into live tensors, "
            "in a process other than the holder, after the source rank was killed",
        }
    )


# ---------------------------------------------------------------------------------------------
# disk_ckpt write vs a raw write and vs torch.distributed.checkpoint


def _raw_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def goal_disk_write(tmp: Path, cfg: BenchConfig) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from mechanisms import checkpoint_io as io

    state = state_of_size(100 * MB)
    where = tmp / "disk-bench"
    where.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {"ours": [], "raw": [], "dcp": []}
    nbytes = io.save_atomic(state, where / "size.pt")[0]  # the raw write writes as many bytes
    payload = os.urandom(16) * (nbytes // 16) + os.urandom(nbytes % 16)

    def write_ours(i: int) -> float:
        return io.save_atomic(state, where / f"ours{i}.pt")[1]

    def write_raw(i: int) -> float:
        return _raw_write(where / f"raw{i}.bin", payload)

    def write_dcp(i: int) -> float:
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=where / f"dcp{i}", no_dist=True)
        return time.perf_counter() - t0

    writers = [("ours", write_ours), ("raw", write_raw), ("dcp", write_dcp)]
    for i in range(3 if cfg.quick else 6):
        # Rotate the order and start each write with no dirty pages, so that one write's
        # background writeback is not charged to the next.
        for name, fn in writers[i % 3 :] + writers[: i % 3]:
            os.sync()
            times[name].append(fn(i))
        shutil.rmtree(where)
        where.mkdir()
    ours_s, raw_s, dcp_s = times["ours"], times["raw"], times["dcp"]
    shutil.rmtree(where, ignore_errors=True)
    ours, raw, ref = (statistics.median(v) for v in (ours_s, raw_s, dcp_s))
    ratio = raw / ours  # bandwidth ratio for the same bytes
    return with_status(
        {
            "goal": f"disk_ckpt write >= {DISK_GOAL}x raw write+fsync, and <= dcp.save's time",
            "met": ratio >= DISK_GOAL and ours <= ref,
            "bytes": nbytes,
            "disk_ckpt_s": ours,
            "raw_write_fsync_s": raw,
            "dcp_save_s": ref,
            "disk_ckpt_gb_s": nbytes / ours / 1e9,
            "raw_gb_s": nbytes / raw / 1e9,
            "ratio_vs_raw": ratio,
            "ratio_vs_dcp": ref / ours,
            "samples": {"disk_ckpt_s": ours_s, "raw_s": raw_s, "dcp_s": dcp_s},
        }
    )


# ---------------------------------------------------------------------------------------------
# Experiments: async vs disk overhead, hot spare vs disk recovery


def goal_async_overhead(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    from bench.common import run_spec

    interval = 5
    rounds = 2 if cfg.quick else 3
    configs: list[tuple[str, Any]] = [
        ("none", "none"),
        ("disk_ckpt", {"name": "disk_ckpt", "params": {"interval": interval}}),
        ("async_ckpt", {"name": "async_ckpt", "params": {"interval": interval}}),
    ]
    means: dict[str, list[float]] = {name: [] for name, _ in configs}
    per_save: dict[str, list[float]] = {name: [] for name, _ in configs}
    # Rounds interleave the three runs so that drift in this shared machine's speed hits each
    # alike; the medians over rounds are compared.
    for i in range(rounds):
        for name, mech in configs:
            result, _ = run_spec(env, ddp_spec(f"bench-overhead-{name}-{i}", mech))
            t = result.trials[0]
            if t.status != "completed" or t.mean_step_time_s is None:
                raise RuntimeError(f"{name}: {t.status}: {t.error}")
            means[name].append(t.mean_step_time_s)
            blocked = (t.model_extra or {}).get("checkpoint", {}).get("blocked_s_per_save")
            if blocked is not None:
                per_save[name].append(blocked)
    med = {name: statistics.median(v) for name, v in means.items()}
    disk = (med["disk_ckpt"] / med["none"] - 1) * 100
    asyn = (med["async_ckpt"] / med["none"] - 1) * 100
    return with_status(
        {
            "goal": "async_ckpt steady-state overhead <= 1/3 of disk_ckpt's (same interval)",
            "met": disk > 0 and asyn <= disk * ASYNC_GOAL,
            "interval": interval,
            "rounds": rounds,
            "mean_step_s": means,
            "median_mean_step_s": med,
            "overhead_pct": {"disk_ckpt": disk, "async_ckpt": asyn},
            "ratio": asyn / disk if disk > 0 else None,
            "blocked_s_per_save": {
                k: statistics.median(v) if v else None for k, v in per_save.items()
            },
        }
    )


def goal_hot_spare_recovery(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    from bench.common import run_spec

    trials = 2 if cfg.quick else 3
    resumed: dict[str, list[float]] = {}
    for name, mech in [
        ("disk_ckpt", {"name": "disk_ckpt", "params": {"interval": 10}}),
        ("hot_spare", "hot_spare"),
    ]:
        spec = ddp_spec(
            f"bench-recovery-{name}",
            mech,
            trials=trials,
            steps=30,
            failures={"kind": "single", "rank": 1, "at_step": 15},
        )
        result, _ = run_spec(env, spec)
        resumed[name] = [
            f.phases.resumed_s
            for t in result.trials
            for f in t.failures
            if f.phases.resumed_s is not None
        ]
        if len(resumed[name]) != trials:
            raise RuntimeError(f"{name}: {len(resumed[name])} of {trials} failures resumed")
    disk, spare = (statistics.median(resumed[k]) for k in ("disk_ckpt", "hot_spare"))
    return with_status(
        {
            "goal": f"hot_spare injected -> resumed <= {SPARE_GOAL}x disk_ckpt's on ddp",
            "met": spare <= SPARE_GOAL * disk,
            "resumed_s": resumed,
            "median_resumed_s": {"disk_ckpt": disk, "hot_spare": spare},
            "ratio": spare / disk,
        }
    )


# ---------------------------------------------------------------------------------------------
# The whole paper matrix, one trial per cell

PAPER_MATRIX_GOAL_S = 20 * 60
PAPER_MATRIX_LIMIT_S = 75 * 60


def goal_paper_matrix(tmp: Path, cfg: BenchConfig) -> dict[str, Any]:
    """`failbench sweep examples/paper_matrix.yaml` on a fresh database, timed (full mode)."""
    import json
    import sys

    from bench.common import REPO, timed_command

    goal = f"the paper matrix (one trial per cell) < {PAPER_MATRIX_GOAL_S / 60:.0f} min"
    if cfg.quick:
        return {"goal": goal, "met": None, "status": "not measured", "note": "--quick"}
    out = tmp / "paper_matrix"
    out.mkdir(parents=True, exist_ok=True)
    failbench = Path(sys.executable).parent / "failbench"
    cmd = [str(failbench), "sweep", str(REPO / "examples" / "paper_matrix.yaml"), "--json"]
    cmd += ["--db", f"sqlite:///{out}/matrix.db", "--out", str(out)]
    resource_log = out / "resources.jsonl"
    cmd += ["--resource-log", str(resource_log)]
    rc, wall, output = timed_command(cmd, PAPER_MATRIX_LIMIT_S)
    report: dict[str, Any] | None = None
    # stdout and stderr are merged: the report is the JSON object that starts a line
    for start in [0] + [i + 1 for i, ch in enumerate(output) if ch == "\n"]:
        if output.startswith("{", start):
            try:
                found = json.JSONDecoder().raw_decode(output, start)[0]
            except ValueError:
                continue
            if isinstance(found, dict) and "progress" in found:
                report = found
                break
    counts: dict[str, int] = dict(report["progress"]) if report else {}
    cells = report["cells"] if report else []
    mismatched = [c["key"] for c in cells if c.get("matches_baseline") is False]
    shared = sum(1 for c in cells if c.get("baseline_from"))
    kept = None
    if (rc != 0 or mismatched or counts.get("failed")) and (out / "matrix.db").exists():
        # The temporary directory goes when the bench ends: keep the database to look into
        # (`failbench show ID --db sqlite:///bench/paper_matrix.db`).
        kept = REPO / "bench" / "paper_matrix.db"
        shutil.copyfile(out / "matrix.db", kept)
    pool = report.get("pool") if report else None
    lines = resource_log.read_text().splitlines() if resource_log.exists() else []
    # Context, not this goal: the matrix changes architecture every 27 cells, and a process
    # that has trained a new one holds its modules from then on.
    resources = leak_verdict([json.loads(line) for line in lines])
    return with_status(
        {
            "goal": goal,
            "met": rc == 0 and wall < PAPER_MATRIX_GOAL_S,
            "pool": pool,
            "resources": {k: v for k, v in resources.items() if k != "worker_ratios"},
            "wall_s": wall,
            "exit_code": rc,
            "cells_by_status": counts,
            "cells_not_matching_baseline": mismatched,
            "cells_sharing_a_baseline": shared,
            "database_kept": str(kept) if kept else None,
            "output_tail": "" if report else output[-3000:],
        }
    )


# ---------------------------------------------------------------------------------------------
# Reusing worker processes leaks nothing

LEAK_TOLERANCE = 0.10  # within 10% of the values after cell 5
LEAK_REFERENCE_CELL = 5
LEAK_LIMIT_S = 40 * 60


def leak_verdict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """From `failbench sweep --resource-log` lines: the driver's memory, threads and open files
    at the end against after cell 5; the same for the pooled processes, as the largest value
    over the idle ones (processes come and go as ranks are killed, so the pool is compared as
    a whole), and for the longest-lived one against its own first sample; and any actor alive
    between cells."""
    if len(samples) <= LEAK_REFERENCE_CELL:
        return {"met": False, "why": f"only {len(samples)} cells logged"}
    ref, end = samples[LEAK_REFERENCE_CELL - 1], samples[-1]
    keys = ("rss_bytes", "threads", "open_files")

    def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        return {k: b[k] / a[k] for k in keys if a.get(k)}

    def largest(sample: dict[str, Any]) -> dict[str, int]:
        return {k: max((w[k] for w in sample["pooled"]), default=0) for k in keys}

    driver = ratios(ref["driver"], end["driver"])
    pooled = ratios(largest(ref), largest(end))
    seen: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        for w in sample["pooled"]:
            seen.setdefault(w["pid"], []).append(w)
    oldest_pid, life = max(seen.items(), key=lambda kv: len(kv[1]))
    oldest = {"pid": oldest_pid, "cells": len(life), **ratios(life[0], life[-1])}
    alive = {s["cell"]: s["other_actors_alive"] for s in samples if s["other_actors_alive"]}
    every = [*driver.values(), *pooled.values(), *(oldest[k] for k in keys if k in oldest)]
    return {
        "met": all(abs(r - 1) <= LEAK_TOLERANCE for r in every) and not alive and bool(pooled),
        "cells": len(samples),
        "driver_after_cell5": {k: ref["driver"][k] for k in keys},
        "driver_at_end": {k: end["driver"][k] for k in keys},
        "driver_ratio": driver,
        "pooled_largest_after_cell5": largest(ref),
        "pooled_largest_at_end": largest(end),
        "pooled_ratio": pooled,
        "longest_lived_worker": oldest,
        "worst_ratio": max(every),
        "actors_alive_between_cells": alive,
        "pool_at_end": {k: end[k] for k in ("started", "reused", "ended", "idle", "parked")},
        # the driver keeps about one socket per pooled process: a pool that grew to a wider
        # cell's working set shows here, apart from growth per cell
        "pool_processes_after_cell5": ref["idle"] + ref["parked"],
        "pool_processes_at_end": end["idle"] + end["parked"],
    }


def goal_pool_leaks(tmp: Path, cfg: BenchConfig) -> dict[str, Any]:
    """`failbench sweep bench/leak_sweep.yaml --resource-log`: 54 cells on reused processes."""
    import sys

    from bench.common import REPO, timed_command

    goal = (
        "after a 54-cell sweep, driver and pooled workers' RSS, threads and open files within "
        f"{LEAK_TOLERANCE:.0%} of their values after cell {LEAK_REFERENCE_CELL}; no actor of "
        "an earlier cell alive"
    )
    if cfg.quick:
        return {"goal": goal, "met": None, "status": "not measured", "note": "--quick"}
    out = tmp / "pool_leaks"
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "resources.jsonl"
    failbench = Path(sys.executable).parent / "failbench"
    cmd = [str(failbench), "sweep", str(REPO / "bench" / "leak_sweep.yaml"), "--json"]
    cmd += ["--db", f"sqlite:///{out}/leaks.db", "--out", str(out)]
    cmd += ["--resource-log", str(log_path)]
    rc, wall, output = timed_command(cmd, LEAK_LIMIT_S)
    samples = (
        [json.loads(line) for line in log_path.read_text().splitlines()]
        if (log_path.exists())
        else []
    )
    verdict = leak_verdict(samples)
    verdict["met"] = bool(verdict["met"]) and rc == 0
    return with_status(
        {
            "goal": goal,
            "wall_s": wall,
            "exit_code": rc,
            **verdict,
            "output_tail": "" if rc == 0 else output[-3000:],
        }
    )
