"""Fault-tolerance mechanisms, one module each, registered by name."""

from __future__ import annotations

from failbench_ray.registry import Registry
from mechanisms.base import Mechanism

MECHANISMS: Registry[type[Mechanism]] = Registry("mechanism")

from mechanisms import disk_ckpt, none  # noqa: E402  (each module registers itself)

__all__ = ["MECHANISMS", "Mechanism", "disk_ckpt", "none"]
