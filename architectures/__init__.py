"""Training architectures, one module each, registered by name.

A module is imported when its architecture is first used (`ARCHITECTURES.get(name)`), so a
worker process loads only the one it trains (the others pull in parts of torch that cost seconds
of CPU per process). Adding an architecture is one module named after it that registers itself.
"""

from __future__ import annotations

import pkgutil

from architectures.base import Architecture, StateLayout, Trainer
from failbench_ray.registry import Registry

_HELPERS = {"base", "state"}  # modules of this package that are not architectures
_MODULES = {
    m.name: f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if m.name not in _HELPERS
}

ARCHITECTURES: Registry[type[Architecture]] = Registry("architecture", _MODULES)

__all__ = ["ARCHITECTURES", "Architecture", "StateLayout", "Trainer"]
