"""A hang is turned into an answer: a trial whose ranks stop completing steps fails with a
reason instead of holding the sweep forever."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from failbench_ray.runner import run_experiment
from failbench_ray.spec import parse_spec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database


def _stop_rank_when_training(
    rank: int, at_step: int, experiments: list[str], stopped: list[int]
) -> None:
    """SIGSTOP the worker of `rank` once it has completed `at_step` (it hangs, it does not die).
    Its actor is a pooled process or one named after the trial: each says whose rank of which
    trial it is (a pooled process parked since an earlier test still says its old one)."""
    import ray
    from ray.util import list_named_actors

    deadline = time.monotonic() + 120
    while not experiments and time.monotonic() < deadline:
        time.sleep(0.1)
    trial = f"{experiments[0][:8]}-trial0" if experiments else ""
    seen: dict[int, int] = {}  # pid -> the first step it reported for this trial
    while time.monotonic() < deadline:
        for a in list_named_actors(all_namespaces=True):
            if not a["name"].startswith("fb-") or "-chaos" in a["name"]:
                continue
            with contextlib.suppress(Exception):
                handle = ray.get_actor(a["name"], namespace=a["namespace"])
                me = ray.get(handle.identity.remote(), timeout=5)
                if me["rank"] != rank or me["trial"] != trial:
                    continue
                # A reused process can say its new trial before its progress is reset: stop
                # it only once its step has moved since first seen (it trains this trial).
                step = ray.get(handle.progress.remote(), timeout=5)[0]
                first = seen.setdefault(me["pid"], step)
                if step >= at_step and step > first:
                    os.kill(me["pid"], signal.SIGSTOP)
                    stopped.append(me["pid"])
                    return
        time.sleep(0.1)


@pytest.mark.usefixtures("no_leaks")
def test_a_hung_rank_fails_the_trial_with_a_reason_instead_of_holding_it(
    sqlite_url: str, tmp_path: Path
) -> None:
    spec = parse_spec(
        {
            "architecture": "ddp",
            "world_size": 2,
            "model": {"kind": "mlp", "input_dim": 16, "hidden_dim": 32, "depth": 2},
            "steps": 100_000,
            "batch_size": 16,
            "baseline": False,
            # The survivor's all-reduce would wait 10 minutes; the watchdog gives up after 3 s.
            "pg_timeout_s": 600,
            "stall_timeout_s": 3,
            # The heartbeat would find the stopped rank and recover it: this is the watchdog's
            # test, for runs with the heartbeat off.
            "detectors": {"heartbeat_timeout_s": None},
        }
    )
    stopped: list[int] = []
    experiments: list[str] = []
    stopper = threading.Thread(target=_stop_rank_when_training, args=(1, 5, experiments, stopped))
    stopper.start()
    db = Database(sqlite_url)
    try:
        result = run_experiment(
            spec, db=db, out_dir=tmp_path / "runs", on_created=experiments.append
        )
    finally:
        stopper.join()
        for pid in stopped:  # let the stopped process take its SIGKILL if it has not yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        db.dispose()
    assert stopped, "rank 1 never reached step 5"
    trial = result.trials[0]
    assert (result.status, trial.status) == ("failed", "failed"), trial
    assert trial.error is not None and "no rank completed a step for" in trial.error
    # the experiment's own row says why too (issue 16: it was empty, the reason only on the trial)
    db = Database(sqlite_url)
    try:
        with db.session() as s:
            row = repo.get_experiment(s, result.experiment_id)
            assert row.error is not None and row.error.startswith("trial 0: no rank completed")
    finally:
        db.dispose()
    assert "raise stall_timeout_s" in trial.error
