"""Training architectures, one module each, registered by name."""

from __future__ import annotations

from architectures.base import Architecture, StateLayout, Trainer
from failbench_ray.registry import Registry

ARCHITECTURES: Registry[type[Architecture]] = Registry("architecture")

from architectures import ddp, fsdp, gossip, hybrid, pipeline, ps, tensor  # noqa: E402  (each module registers itself)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "StateLayout",
    "Trainer",
    "ddp",
    "fsdp",
    "gossip",
    "hybrid",
    "pipeline",
    "ps",
    "tensor",
]
