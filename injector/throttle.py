"""Slowing a process down from outside (the `straggler` kind), as a slow node does to a rank.

A CPU quota in a cgroup would be the gentlest way, but a process can only be moved into a
cgroup the injector may write; on hosts where /sys/fs/cgroup is read-only (containers, this
project's CI machines) there is none. So the rank runs a SIGSTOP/SIGCONT duty cycle: in each
`period_s` it runs for period_s / factor and is stopped for the rest, which is what a CPU
quota does too, at the quota's period. Over a window of several periods the process gets
1 / factor of the time it had, whatever it does.

The cycle runs on the victim's node (a signal cannot cross machines): in a thread of the chaos
actor when they share it, else in a task placed there. Every cycle ends with SIGCONT, also
when it is stopped early, so no rank is ever left stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

_active: list[tuple[threading.Event, threading.Thread]] = []
_remote: list[object] = []  # refs of cycles running on other nodes


def duty_cycle(
    pids: list[int],
    factor: float,
    period_s: float,
    duration_s: float,
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Run `pids` at 1 / factor of their speed for `duration_s` (or until `stopped()`)."""
    run_s = period_s / factor
    until = time.monotonic() + duration_s
    alive = list(pids)
    try:
        while alive and time.monotonic() < until and not stopped():
            alive = _signal(alive, signal.SIGSTOP)
            time.sleep(period_s - run_s)
            alive = _signal(alive, signal.SIGCONT)
            time.sleep(run_s)
    finally:
        _signal(alive, signal.SIGCONT)


def _signal(pids: list[int], sig: int) -> list[int]:
    """Signal each pid; returns those still there (a replaced rank's process is gone)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            alive.append(pid)
    return alive


def start(
    pids_by_node: dict[str, list[int]], here: str, factor: float, period_s: float, duration_s: float
) -> None:
    """Start a duty cycle for each node's pids: here in a thread, elsewhere in a task."""
    for node, pids in pids_by_node.items():
        if node == here:
            stop = threading.Event()
            thread = threading.Thread(
                target=duty_cycle,
                args=(pids, factor, period_s, duration_s, stop.is_set),
                daemon=True,
                name="straggler",
            )
            thread.start()
            _active.append((stop, thread))
            continue
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(duty_cycle)
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        _remote.append(
            task.options(scheduling_strategy=strategy).remote(pids, factor, period_s, duration_s)
        )


def stop_all(timeout_s: float = 5.0) -> None:
    """End every cycle started here; each resumes its processes on the way out."""
    for stop, _ in _active:
        stop.set()
    for _, thread in _active:
        thread.join(timeout_s)
    _active.clear()
    if _remote:
        import ray

        for ref in _remote:
            with contextlib.suppress(Exception):  # already finished
                ray.cancel(ref)  # KeyboardInterrupt in the task: its `finally` resumes them
        ray.wait(_remote, num_returns=len(_remote), timeout=timeout_s)
        _remote.clear()
