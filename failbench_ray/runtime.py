"""Connecting to Ray: a local, loopback-only cluster by default, or an existing one."""

from __future__ import annotations

import os

import ray


def connect(address: str | None = None, *, log_to_driver: bool = False) -> bool:
    """Join `address` (or RAY_ADDRESS), else start a local cluster. True if started here."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)
        return False
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=log_to_driver,
        configure_logging=False,
    )
    return True


def node_ip() -> str:
    """Address the workers use to reach the driver's rendezvous store."""
    ip: str = ray.util.get_node_ip_address()
    return ip
