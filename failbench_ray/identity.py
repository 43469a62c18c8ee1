"""Who is who among a trial's actors: a rank, a replica holder, a hot spare. Small frozen
types, so no part of the engine or a mechanism parses a name (`int(name[4:])`) to find out.
`str()` gives the name people read in plans, logs and actor names: `rank3`, `holder0`, `spare1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ActorId:
    index: int
    role: ClassVar[str]

    def __str__(self) -> str:
        return f"{self.role}{self.index}"


@dataclass(frozen=True)
class RankId(ActorId):
    """A training rank (its process may change: a replacement, a hot spare that took it)."""

    role = "rank"


@dataclass(frozen=True)
class HolderId(ActorId):
    """A dedicated replica holder: keeps copies of ranks' state in the object store."""

    role = "holder"


@dataclass(frozen=True)
class SpareId(ActorId):
    """A hot spare: a started worker that mirrors state until it takes a dead rank's place."""

    role = "spare"
