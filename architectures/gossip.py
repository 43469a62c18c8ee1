"""Decentralized SGD: local steps, parameters averaged with neighbours, no global barrier.

Each rank trains its own replica on its own data shard and, every `period` steps, averages its
parameters with its neighbours' (a ring, or a seeded random matching) through point-to-point
messages that go through the worker's abort handle. When a worker dies, the others go on
without it (no rollback) unless `replace` asks for the dead to be replaced.
"""

from __future__ import annotations

import random
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from architectures import ARCHITECTURES
from architectures.base import (
    Architecture,
    StateLayout,
    StepOutput,
    Trainer,
    WorkerContext,
    check_batch_splits,
)
from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model
from failbench_ray.optim import build_optimizer


class GossipParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    topology: Literal["ring", "random"] = Field("ring", description="Who averages with whom.")
    period: int = Field(1, ge=1, description="Average with neighbours every this many steps.")
    replace: bool = Field(
        False,
        description="Replace dead workers (state from the mechanism) instead of going on "
        "without them.",
    )


def peers(topology: str, members: int, me: int, seed: int, step: int) -> list[int]:
    """Group ranks this rank averages with at `step` (the same answer on every rank)."""
    if members < 2:
        return []
    if topology == "ring":
        return sorted({(me - 1) % members, (me + 1) % members} - {me})
    order = list(range(members))
    random.Random(seed * 1_000_003 + step).shuffle(order)
    for i in range(0, members - 1, 2):
        if me in (order[i], order[i + 1]):
            return [order[i + 1] if order[i] == me else order[i]]
    return []  # the odd one out sits this round out


class GossipTrainer(Trainer):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        spec = ctx.spec
        self.module = build_model(spec.model, spec.seed).to(ctx.device)
        self.optimizer = build_optimizer(spec.optimizer, self.module.parameters())
        self.data = SyntheticData(spec.model, spec.seed)

    def train_step(self, step: int) -> StepOutput:
        loss, samples = self.backward_on_shard(step, self.module)
        if step % self.ctx.params.period == 0:
            self._average_with_neighbours(step)  # raises before the update if a peer died
        self.optimizer.step()
        return StepOutput(loss=float(loss), samples=samples)

    def _average_with_neighbours(self, step: int) -> None:
        ctx = self.ctx
        group = peers(ctx.params.topology, len(ctx.members), ctx.group_rank, ctx.spec.seed, step)
        if not group:
            return
        params = list(self.module.parameters())
        mine = torch.cat([p.detach().reshape(-1) for p in params])
        theirs = {g: torch.empty_like(mine) for g in group}
        works = [dist.isend(mine, dst=g) for g in group]
        works += [dist.irecv(theirs[g], src=g) for g in group]
        for w in works:
            ctx.abort.wait(w)
        avg = (mine + sum(theirs.values())) / (1 + len(group))
        pos = 0
        with torch.no_grad():
            for p in params:
                p.copy_(avg[pos : pos + p.numel()].view_as(p))
                pos += p.numel()


@ARCHITECTURES.register("gossip")
class Gossip(Architecture):
    name = "gossip"
    summary = "decentralized SGD: neighbour averaging, no global barrier, goes on without the dead"
    Params = GossipParams
    trainer_cls = GossipTrainer
    abortable = True
    independent_replicas = True

    def check(self) -> None:
        w = self.spec.world_size
        check_batch_splits(self.spec.batch_size, w, f"world_size={w} ranks")

    def layout(self) -> StateLayout:
        w = self.spec.world_size
        return StateLayout(shard_of_rank=tuple(range(w)), holds=("own replica (converging)",) * w)

    def continues_without_dead(self) -> bool:
        assert isinstance(self.params, GossipParams)
        return not self.params.replace

    def exact_replay(self) -> bool:
        # With replacements every rank rolls back together and replays exactly; going on
        # without the dead changes who averages with whom, so no exact match is expected.
        assert isinstance(self.params, GossipParams)
        return self.params.replace
