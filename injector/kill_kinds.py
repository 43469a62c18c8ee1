"""Kill kinds: how workers are made to fail-stop. Each is one entry in `KILL_KINDS`.

A kind that is not `by_worker` is executed by the chaos actor: given the event's ranks and
every current target, it kills and returns the ranks it took down (a `node` kill takes every
rank on the victim's node, not only the one the event names).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from failbench_ray.registry import Registry


class Target(NamedTuple):
    """The current worker of a rank: its process, its actor, the Ray node it runs on."""

    pid: int
    handle: Any
    node_id: str = ""


KillFn = Callable[[list[int], dict[int, Target]], list[int]]


@dataclass(frozen=True)
class KillKind:
    name: str
    summary: str
    by_worker: bool  # True: the victim ends itself when told (it must reach a failpoint)
    kill: KillFn | None = None  # run by the chaos actor for kinds that are not `by_worker`


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone: nothing to kill
            os.kill(pid, signal.SIGKILL)


def _sigkill(ranks: list[int], targets: dict[int, Target]) -> list[int]:
    """SIGKILL each rank's process: from here when it runs on this node, else from a task
    placed on its node (a signal cannot cross machines)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(targets[rank].node_id or here, []).append(targets[rank].pid)
    _kill_pids(by_node.pop(here, []))
    if not by_node:
        return list(ranks)
    remote = ray.remote(num_cpus=0, max_retries=0)(_kill_pids)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            pids
        )
        for node, pids in by_node.items()
    ]
    ray.get(refs, timeout=30)
    return list(ranks)


def _ray_kill(ranks: list[int], targets: dict[int, Target]) -> list[int]:
    import ray

    for rank in ranks:
        ray.kill(targets[rank].handle, no_restart=True)
    return list(ranks)


def _node(ranks: list[int], targets: dict[int, Target]) -> list[int]:
    """The node of each named rank fails: its raylet is SIGKILLed (by one of its own workers,
    so this works on any node of the cluster), and every actor on it dies with it."""
    import ray

    one_per_node = {targets[r].node_id: r for r in ranks}
    nodes = set(one_per_node)
    refs = [targets[r].handle.kill_node.remote() for r in one_per_node.values()]
    # The calls never answer (the process dies); waiting bounds the time until the kill.
    ray.wait(refs, num_returns=len(refs), timeout=10)
    return sorted(r for r, t in targets.items() if t.node_id in nodes)


KILL_KINDS: Registry[KillKind] = Registry("kill kind")
KILL_KINDS.add(
    "sigkill",
    KillKind("sigkill", "SIGKILL of the worker process (true fail-stop)", False, _sigkill),
)
KILL_KINDS.add("ray_kill", KillKind("ray_kill", "ray.kill of the worker actor", False, _ray_kill))
KILL_KINDS.add("exit", KillKind("exit", "the worker calls os._exit(1) at the trigger", True))
KILL_KINDS.add(
    "node",
    KillKind(
        "node",
        "the Ray node of the named ranks fails (its raylet is SIGKILLed): every worker, replica "
        "holder and spare on it dies at once. Needs a multi-node cluster; never the head node",
        False,
        _node,
    ),
)
