"""The driver tells a dead rank from a live rank whose call failed because *another* actor
died (Ray re-raises that inside the live rank's task as the same error class)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import ray

from failbench_ray.controller import gather


@ray.remote(num_cpus=0)
class Callee:
    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> str:
        return "pong"


@ray.remote(num_cpus=0)
class Caller:
    def call(self, other: Any) -> str:
        return ray.get(other.ping.remote())

    def fine(self) -> int:
        return 7

    def broken(self) -> int:
        raise ValueError("bad input")


@pytest.mark.usefixtures("no_leaks")
def test_a_live_rank_that_saw_a_peer_die_is_not_counted_dead() -> None:
    callee, caller = Callee.remote(), Caller.remote()  # type: ignore[attr-defined]
    try:
        os.kill(ray.get(callee.pid.remote()), signal.SIGKILL)
        time.sleep(0.5)
        got = gather(
            {
                0: caller.call.remote(callee),  # alive; its callee is dead
                1: callee.ping.remote(),  # dead itself
                2: caller.fine.remote(),
                3: caller.broken.remote(),
            }
        )
        assert got.dead == {1}
        assert got.peer_lost == {0}
        assert got.values == {2: 7}
        assert set(got.errors) == {0, 3}
        assert got.errors[0].startswith("an actor it called died")
        assert "bad input" in got.errors[3]
    finally:
        ray.kill(caller)
        ray.kill(callee)
