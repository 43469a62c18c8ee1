"""Connecting to Ray: a local, loopback-only cluster by default, or an existing one."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray

from failbench_ray import banners, network
from failbench_ray.errors import ClusterError

log = logging.getLogger("failbench.runtime")

DASHBOARD_PORT = 8265
LOOPBACK = "127.0.0.1"
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect(
    address: str | None = None,
    *,
    log_to_driver: bool = False,
    dashboard: bool = False,
    dashboard_port: int = DASHBOARD_PORT,
) -> bool:
    """Join `address` (or RAY_ADDRESS), else start a local cluster. True if started here.

    Never the cluster that Ray's `ray_current_cluster` file names: `ray.init()` without an
    address joins it, and a `ray start` or test cluster killed before it could clean up leaves
    it behind, naming a dead GCS that `ray.init()` then waits for (CI once lost every Ray test
    that way).

    `dashboard`: the local cluster runs Ray's dashboard on loopback (Ray's token authentication
    stays on: `ray get-auth-token` prints the token it asks for)."""
    if ray.is_initialized():
        return False
    banners.install()  # Ray's crash banners only for deaths we did not cause
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ctx = ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
        if dashboard:
            log.warning("Ray dashboard of the cluster joined: http://%s", ctx.dashboard_url)
        return False
    before = _RunningBefore.now()
    with loopback_only():
        ctx = ray.init(
            address="local",
            _node_ip_address=LOOPBACK,
            include_dashboard=dashboard,
            dashboard_host=LOOPBACK,
            dashboard_port=dashboard_port,
            log_to_driver=log_to_driver,
            configure_logging=False,
        )
    try:
        check_loopback(ctx.address_info.get("node_ip_address", ""), before)
    except ClusterError:
        ray.shutdown()
        raise
    if dashboard:
        log.warning(
            "Ray dashboard: http://%s (it asks for the token that `ray get-auth-token` prints)",
            ctx.dashboard_url,
        )
    return True


@contextmanager
def loopback_only() -> Iterator[None]:
    """While a local cluster starts: every Ray process binds and advertises 127.0.0.1.

    Ray resolves `_node_ip_address="127.0.0.1"` to the machine's external address unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is "0", a setting it reads once, when `ray` is first
    imported; the node's address then decides where its GCS, raylet, agents and workers listen.
    So the setting is applied here, where the cluster starts, whatever imported Ray first: the
    environment (for the processes the cluster starts) and the value Ray read at import (for
    this one). Both are put back afterwards: a later `connect()` to a remote cluster must
    advertise the real address."""
    from ray._private import ray_constants

    env_before = os.environ.get(_RAY_CLUSTER_ENV)
    const_before = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = const_before
        if env_before is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = env_before


@dataclass(frozen=True)
class _RunningBefore:
    """What this process ran and listened on before it started a cluster (not the cluster's)."""

    children: frozenset[int]
    listening: frozenset[network.Listener]

    @classmethod
    def now(cls) -> _RunningBefore:
        tree = network.process_tree()
        return cls(frozenset(p.pid for p in tree[1:]), frozenset(network.listeners(tree[:1])))

    def cluster_listeners(self) -> list[network.Listener]:
        """What the cluster started since listens on: the processes it started (GCS, raylet,
        agents, workers) and the sockets Ray opened in this one (the driver's own)."""
        tree = network.process_tree()
        started = [p for p in tree[1:] if p.pid not in self.children]
        return [
            *network.listeners(started),
            *(x for x in network.listeners(tree[:1]) if x not in self.listening),
        ]


def check_loopback(node_ip_address: str, before: _RunningBefore) -> None:
    """Raise ClusterError unless a local cluster just started keeps to loopback: its node
    advertises 127.0.0.1 and nothing it started listens wider."""
    if not network.is_loopback(node_ip_address or "0.0.0.0"):
        raise ClusterError(
            f"the local Ray cluster advertises {node_ip_address!r}, not {LOOPBACK}: another "
            f"machine could reach it. Unset {_RAY_CLUSTER_ENV} if you set it to 1, or join a "
            "cluster you started yourself with RAY_ADDRESS (see the README's Networking section)"
        )
    wide = [x for x in before.cluster_listeners() if not network.is_loopback(x.ip)]
    if wide:
        raise ClusterError(
            "the local Ray cluster listens beyond loopback: "
            + "; ".join(str(x) for x in wide[:5])
            + ". Report this with your Ray version; meanwhile join a cluster you started "
            "yourself with RAY_ADDRESS (see the README's Networking section)"
        )


def node_ip() -> str:
    """Address the workers use to reach the driver's rendezvous store."""
    ip: str = ray.util.get_node_ip_address()
    return ip


def metrics_targets() -> list[str]:
    """host:port of each live Ray node's metrics endpoint (where `ray_failbench_*` appear)."""
    return sorted(
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    )


def write_prometheus_sd(path: Path) -> None:
    """Write the Ray nodes' metrics endpoints as a Prometheus file service discovery list
    (Ray writes one only while its dashboard runs; this one works without it)."""
    entry = {"labels": {"job": "ray"}, "targets": metrics_targets()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([entry]))
    tmp.replace(path)  # Prometheus never reads a half-written file


@contextmanager
def prometheus_sd(path: Path | None, every_s: float = 5.0) -> Iterator[None]:
    """Keep `path` current (nodes join and leave) while the block runs; None: do nothing."""
    if path is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                write_prometheus_sd(path)
            except OSError as err:
                log.warning("cannot write the Prometheus targets file %s: %s", path, err)
            if stop.wait(every_s):
                return

    t = threading.Thread(target=loop, name="prometheus-sd", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
