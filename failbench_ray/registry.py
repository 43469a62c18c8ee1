"""A registry of named parts (architectures, mechanisms, trace kinds, kill kinds).

Adding a part is one new module plus one `register` call; duplicates are refused and an unknown
name lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from failbench_ray.errors import SpecError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return add

    def add(self, name: str, item: T) -> T:
        return self.register(name)(item)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            raise SpecError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())
