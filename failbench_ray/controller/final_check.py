"""The final-state check: one digest of the whole model, with the replicas of every shard
checked against each other (a recovered model must be right, not just running)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from architectures.base import StateLayout
from failbench_ray import results


@dataclass
class FinalState:
    digest: str
    error: str | None = None
    state_bytes_per_rank: int = 0  # the largest rank's
    arch_metrics: dict[str, float] = field(default_factory=dict)  # mean over the ranks
    replica_spread: float | None = None  # where every rank is its own replica


def check(
    layout: StateLayout, answers: dict[int, Any], *, independent_replicas: bool
) -> FinalState:
    """Pure: `answers` is each live rank's `digest()` (digest, state bytes, parameter sample,
    architecture metrics)."""
    final = FinalState(
        digest="",
        state_bytes_per_rank=max(v[1] for v in answers.values()),
        arch_metrics=results.mean_by_key([v[3] for v in answers.values()]),
    )
    if independent_replicas:  # every rank its own replica (gossip): how far apart did they end?
        final.replica_spread = results.replica_spread([v[2] for v in answers.values()])
    h = hashlib.sha256()
    for shard, group in zip(layout.shard_ids(), layout.replica_groups(), strict=True):
        digests = {answers[r][0] for r in group if r in answers}
        if not digests:
            continue  # every holder left the group (training went on without them)
        if len(digests) != 1:
            final.digest = "diverged"
            final.error = f"replicas of shard {shard} diverged across ranks {group}"
            return final
        h.update(digests.pop().encode())
    final.digest = h.hexdigest()
    return final
