"""A registry of named parts (architectures, mechanisms, trace kinds, kill kinds).

Adding a part is one new module plus one `register` call; duplicates are refused and an unknown
name lists the valid ones.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from failbench_ray.errors import SpecError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, modules: Mapping[str, str] | None = None) -> None:
        """`modules`: name -> the module that registers it, imported on first use of the name
        (a training worker imports only its own architecture: the others pull in parts of
        torch that cost seconds of CPU per process)."""
        self.kind = kind
        self._items: dict[str, T] = {}
        self._modules: dict[str, str] = dict(modules or {})
        # Several threads (a service's dispatchers) may use a name first at the same moment:
        # none may see it half-loaded. Re-entrant: a module may use the registry as it loads.
        self._loading = threading.RLock()

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return add

    def _load(self, name: str) -> None:
        if name not in self._modules:
            return
        with self._loading:
            module = self._modules.get(name)
            if module is None:  # another thread loaded it meanwhile
                return
            importlib.import_module(module)
            del self._modules[name]  # only now: until here, other threads wait above
            if name not in self._items:
                raise ValueError(f"module {module} did not register {self.kind} {name!r}")

    def _load_all(self) -> None:
        for name in list(self._modules):
            self._load(name)

    def add(self, name: str, item: T) -> T:
        return self.register(name)(item)

    def get(self, name: str) -> T:
        self._load(name)
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(self.names())
            raise SpecError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        return sorted({*self._items, *self._modules})

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, T]]:
        self._load_all()
        return sorted(self._items.items())
