"""Peer benchmark: FailBench-Ray's mechanisms against Ray Train protecting the same job.

Ray Train is set up the way its users protect a job: `TorchTrainer` with DDP, a checkpoint
reported every K steps (`ray.train.report(..., checkpoint=...)`), `FailureConfig(max_failures=1)`.
Same model, world size, steps and kill (rank 1's process SIGKILLed at the same step) as our
runs. Measured on both: the time from the kill to the first step completed after recovery,
and the steps lost. Goal: our best mechanism's recovery <= 0.15x Ray Train's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import ddp_spec, with_status
from bench.ray_train import RayTrainJob, ray_train_recovery

if TYPE_CHECKING:
    from bench.common import BenchConfig, Env

RAY_TRAIN_GOAL = 0.15
STEPS, KILL_AT, INTERVAL = 30, 15, 10
MODEL = {"kind": "mlp", "input_dim": 256, "hidden_dim": 1024, "depth": 3}


def goal_ray_train(env: Env, cfg: BenchConfig) -> dict[str, Any]:
    from bench.common import run_spec

    world, rounds = 4, 2 if cfg.quick else 3
    ours: dict[str, list[float]] = {}
    lost: dict[str, list[int]] = {}
    for name, mech in [
        ("disk_ckpt", {"name": "disk_ckpt", "params": {"interval": INTERVAL}}),
        ("inmem_replica", {"name": "inmem_replica", "params": {"interval": INTERVAL}}),
        ("live_recovery", "live_recovery"),
        ("hot_spare", "hot_spare"),
    ]:
        spec = ddp_spec(
            f"bench-peer-{name}",
            mech,
            model=MODEL,
            trials=rounds,
            steps=STEPS,
            failures={"kind": "single", "rank": 1, "at_step": KILL_AT},
        )
        result, _ = run_spec(env, spec)
        fs = [f for t in result.trials for f in t.failures if f.phases.resumed_s is not None]
        if len(fs) != rounds:
            raise RuntimeError(f"{name}: {len(fs)} of {rounds} failures resumed")
        ours[name] = [f.phases.resumed_s for f in fs if f.phases.resumed_s is not None]
        lost[name] = [f.lost_steps or 0 for f in fs]
    job = RayTrainJob(world=world, model=MODEL, steps=STEPS, kill_rank=1, kill_at=KILL_AT)
    theirs = [ray_train_recovery(env.tmp, job, f"peer-{i}") for i in range(rounds)]
    medians = {k: statistics.median(v) for k, v in ours.items()}
    best = min(medians, key=medians.__getitem__)
    ray_train = statistics.median(r["recovery_s"] for r in theirs)
    return with_status(
        {
            "goal": f"our best mechanism's kill -> first step after recovery <= "
            f"{RAY_TRAIN_GOAL}x Ray Train's (TorchTrainer, FailureConfig, checkpoint every "
            f"{INTERVAL} steps)",
            "met": medians[best] <= RAY_TRAIN_GOAL * ray_train,
            "ours_recovery_s": ours,
            "ours_median_recovery_s": medians,
            "ours_lost_steps": lost,
            "best": best,
            "ray_train": theirs,
            "ray_train_median_recovery_s": ray_train,
            "ratio": medians[best] / ray_train,
        }
    )


_Writer = Callable[[int], tuple[float, float]]  # round -> (blocked_s, durable_s)


def goal_dcp_peer(tmp: Path, cfg: BenchConfig) -> dict[str, Any]:
    """`torch.distributed.checkpoint` `save` and `async_save` against our `disk_ckpt` and
    `async_ckpt` writes of the same ~100 MB state: time the caller is blocked, and time until
    the checkpoint is durable. Rounds rotate the order and start with no dirty pages."""
    where = tmp / "dcp-peer"
    writers = _dcp_writers(where)
    blocked, durable = _time_writers(writers, where, 2 if cfg.quick else 12)
    shutil.rmtree(where, ignore_errors=True)
    med_b = {k: statistics.median(v) for k, v in blocked.items()}
    med_d = {k: statistics.median(v) for k, v in durable.items()}
    return with_status(
        {
            "goal": "async_ckpt blocks <= dcp.async_save, disk_ckpt durable <= dcp.save",
            "met": med_b["async_ckpt"] <= med_b["dcp.async_save"]
            and med_d["disk_ckpt"] <= med_d["dcp.save"],
            "blocked_s": blocked,
            "durable_s": durable,
            "median_blocked_s": med_b,
            "median_durable_s": med_d,
        }
    )


def _dcp_writers(where: Path) -> list[tuple[str, _Writer]]:
    """The four writers of `goal_dcp_peer`'s ~100 MB state into `where` (which it creates)."""
    import torch.distributed.checkpoint as dcp

    from bench.common import MB, state_of_size
    from failbench_ray.replication import pack
    from mechanisms import checkpoint_io as io

    state = state_of_size(100 * MB)
    where.mkdir(parents=True, exist_ok=True)

    def disk_ckpt(i: int) -> tuple[float, float]:
        secs = io.save_atomic(state, where / f"disk{i}.pt")[1]
        return secs, secs

    def async_ckpt(i: int) -> tuple[float, float]:
        # what the async_ckpt hook does: snapshot at the step boundary, persist in a thread
        t0 = time.perf_counter()
        packed = pack(state)
        blocked = time.perf_counter() - t0
        t = threading.Thread(target=io.save_packed_atomic, args=(packed, where / f"async{i}.pt"))
        t.start()
        t.join()
        return blocked, time.perf_counter() - t0

    def dcp_save(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=where / f"dcp{i}", no_dist=True)
        secs = time.perf_counter() - t0
        return secs, secs

    def dcp_async_save(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(where / f"dcpa{i}"))
        blocked = time.perf_counter() - t0
        future.result()
        return blocked, time.perf_counter() - t0

    return [
        ("disk_ckpt", disk_ckpt),
        ("async_ckpt", async_ckpt),
        ("dcp.save", dcp_save),
        ("dcp.async_save", dcp_async_save),
    ]


def _time_writers(
    writers: list[tuple[str, _Writer]], where: Path, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(blocked_s, durable_s) of each writer, per round; `where` is emptied after each round."""
    blocked: dict[str, list[float]] = {n: [] for n, _ in writers}
    durable: dict[str, list[float]] = {n: [] for n, _ in writers}
    # Single writes of 100 MB on this shared disk swing 50-300 ms: many rounds, medians.
    for i in range(rounds):
        for name, fn in writers[i % 4 :] + writers[: i % 4]:
            os.sync()
            b, d = fn(i)
            blocked[name].append(b)
            durable[name].append(d)
        shutil.rmtree(where)
        where.mkdir()
    return blocked, durable
