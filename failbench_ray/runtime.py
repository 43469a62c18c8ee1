"""Connecting to Ray: a local, loopback-only cluster by default, or an existing one."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

log = logging.getLogger("failbench.runtime")

DASHBOARD_PORT = 8265


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
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ctx = ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
        if dashboard:
            log.warning("Ray dashboard of the cluster joined: http://%s", ctx.dashboard_url)
        return False
    ctx = ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        log_to_driver=log_to_driver,
        configure_logging=False,
    )
    if dashboard:
        log.warning(
            "Ray dashboard: http://%s (it asks for the token that `ray get-auth-token` prints)",
            ctx.dashboard_url,
        )
    return True


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
