"""Reusing started worker processes changes nothing a trial measures or computes.

A pooled process serves trial after trial (`failbench_ray.pool`); a replacement for a dead
rank is still a new process. Run one cell on fresh processes and on reused ones: the same
digests, losses, restored steps and set of recovery phases, and the failure says `cold`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from failbench_ray import results
from failbench_ray.pool import shared_pool
from failbench_ray.results import ExperimentResult
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from tests.own_cluster import run_snippet
from tests.test_engine import run

# hybrid dp 2 x pp 2: a DeviceMesh, pipeline schedules and data parallel in every process,
# so what a process keeps between trials (torch's distributed globals) is exercised.
CELL: dict[str, Any] = {
    "architecture": {"name": "hybrid", "params": {"dp": 2, "pp": 2}},
    "world_size": 4,
    "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 3},
    "optimizer": {"name": "adam", "lr": 0.01},
    "steps": 16,
    "batch_size": 16,
    "mechanism": {"name": "disk_ckpt", "params": {"interval": 5}},
    "failures": {"kind": "single", "rank": 1, "at_step": 12},
    "warmup_steps": 1,
    "pg_timeout_s": 60,
}


def _reading(result: ExperimentResult, url: str) -> dict[str, Any]:
    """What must not depend on where the processes came from."""
    assert result.status == "completed", [t.error for t in result.trials]
    assert result.baseline is not None
    trial = result.trials[0]
    db = Database(url)
    try:
        with db.session() as s:
            ids = [t.id for t in repo.get_experiment(s, result.experiment_id).trials]
            losses = [results.step_losses(repo.load_step_records(s, i)) for i in sorted(ids)]
    finally:
        db.dispose()
    return {
        "baseline_digest": result.baseline.params_digest,
        "trial_digest": trial.params_digest,
        "matches_baseline": trial.matches_baseline,
        "losses": losses,
        "failures": [
            (
                f.ranks,
                f.injected_at_step,
                f.restored_from_step,
                f.lost_steps,
                f.replacement,
                f.restore_source,
                sorted(k for k, v in f.phases.model_dump().items() if v is not None),
            )
            for f in trial.failures
        ],
    }


@pytest.mark.usefixtures("no_leaks")
def test_a_cell_reads_the_same_on_fresh_and_on_reused_processes(
    sqlite_url: str, tmp_path: Path
) -> None:
    fresh = _reading(run(CELL, sqlite_url, tmp_path, reuse_workers=False), sqlite_url)
    pool = shared_pool()
    run(CELL, sqlite_url, tmp_path)  # leaves processes that trained this cell in the pool
    before = pool.stats()
    reused = _reading(run(CELL, sqlite_url, tmp_path), sqlite_url)
    after = pool.stats()
    # Processes that had served a trial before: some of the baseline's (the earlier trial's
    # survivors that reset clean) and every rank of the trial (the baseline's, no failure).
    assert before.idle >= 1
    assert after.reused - before.reused >= CELL["world_size"] + 1, (before, after)
    assert reused == fresh
    (failure,) = fresh["failures"]
    assert failure[4] == "cold"  # the replacement is a new process, pool or not
    assert fresh["matches_baseline"] is True


@pytest.mark.usefixtures("no_leaks")
def test_the_pool_keeps_only_processes_that_reset_clean(sqlite_url: str, tmp_path: Path) -> None:
    """DDP survivors abort the all-reduce the killed rank never joined; a survivor whose
    collective is still parked in gloo cannot be freed before the group's timeout, so the pool
    parks it until then; every process it keeps idle holds nothing of the trial (no trainer,
    no process group, no file)."""
    spec = {**CELL, "architecture": "ddp", "world_size": 4}
    pool = shared_pool()
    run(spec, sqlite_url, tmp_path)
    import ray

    for handle in pool.idle_workers():
        assert ray.get(handle.reset.remote()).reason is None  # nothing left to shed
        assert ray.get(handle.leftovers.remote()) == {}
    assert pool.stats().idle >= 1


@pytest.mark.usefixtures("no_leaks")
def test_a_cancelled_trial_leaves_only_reset_processes(sqlite_url: str, tmp_path: Path) -> None:
    """A cancel stops a trial mid-training: its processes are ended or reset into the pool,
    never kept with anything of the trial (the service's cancel, at the engine's level)."""
    import time

    import ray

    from failbench_ray.errors import TrialInterrupted
    from failbench_ray.runner import run_experiment
    from failbench_ray.spec import parse_spec

    spec = parse_spec({**CELL, "architecture": "ddp", "steps": 100_000, "baseline": False})
    t0 = time.monotonic()
    db = Database(sqlite_url)
    try:
        with pytest.raises(TrialInterrupted, match="cancelled"):
            run_experiment(
                spec,
                db=db,
                out_dir=tmp_path / "runs",
                should_stop=lambda: "cancelled" if time.monotonic() - t0 > 8 else None,
            )
    finally:
        db.dispose()
    for handle in shared_pool().idle_workers():
        assert ray.get(handle.leftovers.remote()) == {}


@pytest.mark.usefixtures("no_leaks")
def test_a_process_still_starting_when_its_trial_ends_is_not_lent_again(tmp_path: Path) -> None:
    """An elastic replacement may still be in configure() (importing what its trainer needs)
    when training ends. Were it pooled, that configure would finish after the next trial's
    and give the process the old trial's rank: two ranks of one group alike, a rendezvous
    that never completes. It is ended instead."""
    import ray

    from failbench_ray.spec import parse_spec
    from failbench_ray.worker_group import Placement, WorkerGroup

    pool = shared_pool()
    spec = parse_spec({**CELL, "architecture": "ddp", "world_size": 2, "reform": "fast"})
    group = WorkerGroup(
        spec, tmp_path, None, Placement(0.01, 0.0, "gloo", "cpu"), "starting", pool=pool
    )
    ((handle, configuring),) = group.start_async([1]).values()
    assert not ray.wait([configuring], timeout=0)[0], "configure() returned before the end"
    group.shutdown()
    assert not pool.owns(handle)
    assert handle._actor_id not in {h._actor_id for h in pool.idle_workers()}
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(configuring, timeout=60)


_TWO_CLUSTERS = """
import ray
from failbench_ray import runtime
from failbench_ray.pool import shared_pool
runtime.connect()
first = shared_pool()
ray.shutdown()  # without shutdown_shared_pool(): the bench did this between its goals
runtime.connect()
second = shared_pool()
assert second is not first, "a new cluster got the dead cluster's pool"
assert shared_pool() is second
ray.shutdown()
print("ok")
"""


def test_a_new_cluster_gets_a_new_pool() -> None:
    """Each new local cluster numbers its jobs from 01000000 again: a pool keyed on the job
    id alone outlived `ray.shutdown()` and handed the next cluster actors of the dead one
    ("Can't find actor ...", the bench's harness_overhead goal). Its own process and cluster."""
    assert run_snippet(_TWO_CLUSTERS).strip().endswith("ok")


@pytest.mark.usefixtures("no_leaks")
def test_a_pool_that_fails_to_take_processes_back_leaves_nothing_of_the_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's memory monitor killed two ranks of a 1 GB cell while they reset: the reset's
    OutOfMemoryError left the trial's placement group and its actors behind, and every later
    cell of the sweep could not be placed. Whatever fails, the trial's actors are ended and its
    placement group removed. (The monitor's kill is the one thing simulated: the pool raising
    what it raised.)"""
    import ray
    from ray.util.placement_group import placement_group_table

    from failbench_ray.spec import parse_spec
    from failbench_ray.worker_group import Placement, WorkerGroup

    pool = shared_pool()
    spec = parse_spec({**CELL, "architecture": "ddp", "world_size": 2})
    group = WorkerGroup(spec, tmp_path, None, Placement(0.01, 0.0, "gloo", "cpu"), "oom", pool=pool)
    group.reserve()
    group.start_first([0, 1])
    handles, pg = list(group.handles.values()), group.pg
    assert pg is not None

    def memory_monitor_killed(*_: Any) -> None:
        raise ray.exceptions.OutOfMemoryError("2 worker(s) were killed (simulated)")

    monkeypatch.setattr(pool, "give_back", memory_monitor_killed)
    with pytest.raises(ray.exceptions.OutOfMemoryError):
        group.shutdown()
    assert placement_group_table(pg)["state"] == "REMOVED"
    for h in handles:
        assert not pool.owns(h)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.ready.remote(), timeout=60)
