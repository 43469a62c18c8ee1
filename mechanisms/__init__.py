"""Fault-tolerance mechanisms, one module each, registered by name."""

from __future__ import annotations

from failbench_ray.registry import Registry
from mechanisms.base import Mechanism

MECHANISMS: Registry[type[Mechanism]] = Registry("mechanism")

# Each module registers itself; the order is the order `failbench list` shows.
from mechanisms import (  # noqa: E402
    async_ckpt,
    disk_ckpt,
    elastic,
    hot_spare,
    inmem_replica,
    jit_ckpt,
    live_recovery,
    none,
    redundant,
)

__all__ = [
    "MECHANISMS",
    "Mechanism",
    "async_ckpt",
    "disk_ckpt",
    "elastic",
    "hot_spare",
    "inmem_replica",
    "jit_ckpt",
    "live_recovery",
    "none",
    "redundant",
]
