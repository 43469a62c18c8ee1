"""The cross-replica digest check (pure): every `detectors.digest_every` steps each rank
reports a checksum of its parameters; the replicas of a shard must agree. Replicas that
disagree are corrupt: the minority, or every one of them when no checksum has a majority (two
replicas cannot say which is right). `verified` is the last step at which every shard's live
replicas agreed: the newest state a rollback may trust."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Mismatch:
    step: int
    ranks: frozenset[int]  # the replicas found corrupt
    detail: str


class DigestAudit:
    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        # Only shards held by two or more ranks can be compared.
        self.groups = [list(g) for g in groups if len(g) >= 2]
        self._sums: dict[int, dict[int, str]] = {}  # step -> rank -> checksum
        self.verified = 0

    def add(self, rank: int, sums: Mapping[int, str]) -> None:
        for step, checksum in sums.items():
            if step > self.verified:
                self._sums.setdefault(step, {})[rank] = checksum

    def check(self, live: Collection[int]) -> Mismatch | None:
        """Compare every step that all live replicas have reported, oldest first."""
        for step in sorted(self._sums):
            got = self._sums[step]
            groups = [[r for r in g if r in live] for g in self.groups]
            groups = [g for g in groups if len(g) >= 2]
            if not groups or any(r not in got for g in groups for r in g):
                continue  # a replica has not reported this step (yet)
            for g in groups:
                counts = Counter(got[r] for r in g)
                if len(counts) == 1:
                    continue
                top, n = counts.most_common(1)[0]
                bad = frozenset(r for r in g if n * 2 <= len(g) or got[r] != top)
                return Mismatch(
                    step,
                    bad,
                    f"replicas {g} disagree at step {step}: "
                    + ("no majority" if n * 2 <= len(g) else f"rank(s) {sorted(bad)} differ"),
                )
            self.verified = step
            self._sums = {s: v for s, v in self._sums.items() if s > step}
        return None

    def rolled_back(self, step: int) -> None:
        """Training went back to `step`: what was reported after it is of another timeline."""
        self._sums = {s: v for s, v in self._sums.items() if s <= step}
        self.verified = min(self.verified, step)
