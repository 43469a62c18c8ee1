"""Runs experiments on a simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`: one
head with no CPUs, so no rank lands where the driver lives, and N worker nodes, each a raylet
of its own on loopback), then prints one JSON line per experiment.

Its own process (the test suite's Ray cluster is a single node); `tests/test_multinode.py`
starts it in a session of its own and stops the whole session afterwards.

    python -m tests.multinode OUT_DIR SPEC.json [SPEC.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NODES = 3
CPUS_PER_NODE = 2
# Notice a dead node in about 8 s instead of Ray's default of about 15. (2 s was too eager:
# on a loaded CI machine a live raylet, the head's with the chaos actor, missed 4 checks.)
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 8}


def _wait_alive(n: int, gone: set[str] | None = None, timeout: float = 60) -> None:
    """Until n nodes are alive and none of `gone` still counts as alive (Ray notices a dead
    node only after its health checks fail)."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while True:
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        if len(alive) >= n and not alive & (gone or set()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(alive)} Ray nodes alive after {timeout} s, wanted {n}")
        time.sleep(0.2)


def _raylet_exited(node: Any) -> bool:
    from ray._private import ray_constants

    procs = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return any(p.process.poll() is not None for p in procs)


def _chaos_nodes() -> list[str]:
    """The nodes of the live chaos actors (the pool keeps one between experiments)."""
    from ray._private import state

    return sorted(
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and "Chaos" in a["ActorClassName"]
    )


def main(argv: list[str]) -> int:
    from ray.cluster_utils import Cluster

    from failbench_ray.runtime import loopback_only

    out = Path(argv[0])
    local = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    with loopback_only():  # every node this process starts, replacements included
        return _run(Cluster, out, local, argv[1:])


def _run(cluster_cls: Any, out: Path, local: dict[str, Any], specs: list[str]) -> int:
    import ray

    from failbench_ray.runner import run_experiment
    from failbench_ray.spec import load_spec
    from failbench_ray.storage.db import Database

    cluster = cluster_cls(
        initialize_head=True,
        head_node_args={**local, "num_cpus": 0, "_system_config": HEALTH},
    )
    try:
        for _ in range(NODES):
            cluster.add_node(**local, num_cpus=CPUS_PER_NODE)
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        _wait_alive(NODES + 1)
        db = Database(f"sqlite:///{out / 'multinode.db'}")
        for path in specs:
            result = run_experiment(load_spec(path), db=db, out_dir=out / "runs")
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
            line = {"result": result.model_dump(mode="json"), "alive": nodes}
            line["head"], line["chaos_nodes"] = cluster.head_node.node_id, _chaos_nodes()
            print(json.dumps(line))
            sys.stdout.flush()
            # The next experiment starts from the same cluster: replace a node that died (its
            # raylet exited; Ray may not have noticed yet), and only that one.
            gone = set()
            for node in list(cluster.worker_nodes):
                if node.node_id not in nodes or _raylet_exited(node):
                    gone.add(node.node_id)
                    cluster.remove_node(node, allow_graceful=False)  # what is left of it
                    cluster.add_node(**local, num_cpus=CPUS_PER_NODE)
            _wait_alive(NODES + 1, gone)
        db.dispose()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
